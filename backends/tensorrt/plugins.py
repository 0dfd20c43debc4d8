"""TensorRT plugin definitions (``tensorrt.plugin``, "quickly deployable plugins") for the
``looptool`` nodes of the TensorRT graph variants.

* ``looptool::GatedResidual``, ``looptool::AdaptiveDeltaUpdate``, ``looptool::Modulate``:
  AOT plugins. Their PTX is compiled from the Triton kernels of :mod:`looptool.ops.kernels`
  when the engine is built (:func:`looptool.backends.tensorrt.kernels.aot_compile`) and stored in the
  engine, so a built engine runs without Python.
* ``looptool::Moe``: a Python plugin (``tensorrt.plugin.impl``): routing and the two grouped
  GEMMs are several launches, and an AOT plugin carries one kernel. It calls the same
  launcher as torch's CUDA dispatch of ``looptool::moe``, so engines with MoE need Python
  and looptool at run time (:class:`looptool.backends.tensorrt.runtime.Runtime` registers it).

Nothing here runs without TensorRT; :func:`register` imports it. (No ``from __future__
import annotations`` here: TensorRT reads the ``trtp.TensorDesc`` annotations as classes.)
"""

_REGISTERED: list[bool] = []
_FLOATS = ("fp32", "fp16", "bf16")  # the float types every plugin takes (names of looptool.core.dtypes)


def _combos(pattern: str) -> list:
    """One ``AutoTuneCombination`` per float type: ``pattern`` with ``F`` replaced by it."""
    import tensorrt.plugin as trtp

    return [trtp.AutoTuneCombination(pattern.replace("F", t.upper()).replace("I64", "INT64")) for t in _FLOATS]


def _dtype_name(desc) -> str:
    """The short name (``fp16``) of a plugin tensor's TensorRT dtype."""
    import tensorrt as trt

    from looptool.core.dtypes import named

    return next(t for t in _FLOATS if getattr(trt, named(t).tensorrt) == desc.dtype)


def _launch(kernel, work, extra):
    """``(name, ptx, launch params, scalar args)`` as TensorRT's AOT interface wants them."""
    import tensorrt.plugin as trtp

    params = trtp.KernelLaunchParams()
    params.grid_x = trtp.cdiv(work, kernel.block)
    params.block_x = kernel.threads
    params.shared_mem = kernel.shared
    return (
        kernel.name.encode(),
        kernel.ptx.encode(),
        params,
        trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extra]),
    )


def register() -> None:
    """Register the four plugins with TensorRT's plugin registry (once per process)."""
    if _REGISTERED:
        return
    import tensorrt.plugin as trtp

    from looptool.backends.tensorrt.kernels import aot_compile

    @trtp.register("looptool::GatedResidual")
    def gated_residual_desc(x: trtp.TensorDesc, gate: trtp.TensorDesc, f: trtp.TensorDesc) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune("looptool::GatedResidual")
    def gated_residual_tune(x, gate, f, outputs):
        return _combos("F, F, F, F")

    @trtp.aot_impl("looptool::GatedResidual")
    def gated_residual_aot(x, gate, f, outputs, tactic):
        n = x.shape_expr.numel()
        return _launch(aot_compile("GatedResidual", _dtype_name(x)), n, [n, gate.shape_expr.numel()])

    @trtp.register("looptool::AdaptiveDeltaUpdate")
    def adaptive_delta_desc(
        s_prev: trtp.TensorDesc, r: trtp.TensorDesc, z: trtp.TensorDesc, gamma: trtp.TensorDesc, exit: trtp.TensorDesc
    ) -> trtp.TensorDesc:
        return s_prev.like()

    @trtp.autotune("looptool::AdaptiveDeltaUpdate")
    def adaptive_delta_tune(s_prev, r, z, gamma, exit, outputs):
        return _combos("F, F, F, F, F, F")

    @trtp.aot_impl("looptool::AdaptiveDeltaUpdate")
    def adaptive_delta_aot(s_prev, r, z, gamma, exit, outputs, tactic):
        n = s_prev.shape_expr.numel()
        kernel = aot_compile("AdaptiveDeltaUpdate", _dtype_name(s_prev))
        return _launch(kernel, n, [n, gamma.shape_expr.numel(), exit.shape_expr.numel()])

    @trtp.register("looptool::Modulate")
    def modulate_desc(
        x: trtp.TensorDesc, scale: trtp.TensorDesc, shift: trtp.TensorDesc, down: trtp.TensorDesc, up: trtp.TensorDesc
    ) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune("looptool::Modulate")
    def modulate_tune(x, scale, shift, down, up, outputs):
        return _combos("F, F, F, F, F, F")

    @trtp.aot_impl("looptool::Modulate")
    def modulate_aot(x, scale, shift, down, up, outputs, tactic):
        d = x.shape_expr[-1]
        rank = down.shape_expr[0]  # a weight's dimension: a build-time constant
        kernel = aot_compile("Modulate", _dtype_name(x), rank=rank.constant_value)
        rows = x.shape_expr.numel() // d
        return _launch(kernel, rows, [rows, d, rank])

    @trtp.register("looptool::Moe")
    def moe_desc(
        x: trtp.TensorDesc,
        routing_weights: trtp.TensorDesc,
        expert_ids: trtp.TensorDesc,
        gate_up_proj: trtp.TensorDesc,
        down_proj: trtp.TensorDesc,
    ) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune("looptool::Moe")
    def moe_tune(x, routing_weights, expert_ids, gate_up_proj, down_proj, outputs):
        return _combos("F, F, I64, F, F, F")

    @trtp.impl("looptool::Moe")
    def moe_impl(x, routing_weights, expert_ids, gate_up_proj, down_proj, outputs, stream):
        import torch

        from looptool.ops import kernels

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [
                torch.as_tensor(t, device="cuda") for t in (x, routing_weights, expert_ids, gate_up_proj, down_proj)
            ]
            torch.as_tensor(outputs[0], device="cuda").copy_(kernels.moe(*args))

    _REGISTERED.append(True)
