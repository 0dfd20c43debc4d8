"""TensorRT plugin definitions (``tensorrt.plugin``, "quickly deployable plugins") for the
``looptool`` nodes of the TensorRT graph variants.

Every plugin is an AOT plugin: its PTX is compiled from a Triton kernel when the engine is
built (:func:`looptool.backends.tensorrt.kernels.aot_compile`) and stored in the engine, so a built
engine runs without Python.

* ``looptool::GatedResidual``, ``looptool::AdaptiveDeltaUpdate``, ``looptool::Modulate``: the
  kernels of :mod:`looptool.ops.kernels`.
* ``looptool::MoeAlign``, ``MoeGateUp``, ``MoeDown``, ``MoeCombine``: a mixture of experts as
  four one-kernel steps (:mod:`looptool.backends.tensorrt.moe`, kernels in
  :mod:`looptool.ops.moe_kernels`): routing into per-expert row blocks, the two grouped GEMMs
  and the weighted sum over the top-k, every output shape static in the input shapes.

Nothing here runs without TensorRT; :func:`register` imports it. (No ``from __future__
import annotations`` here: TensorRT reads the ``trtp.TensorDesc`` annotations as classes.)
"""

import functools

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


def _launch(kernel, work, extra, columns=None):
    """``(name, ptx, launch params, scalar args)`` as TensorRT's AOT interface wants them:
    ``work`` rows or elements along the grid's x axis (None: one program), ``columns`` along
    its y axis (None: a 1-D grid)."""
    import tensorrt.plugin as trtp

    params = trtp.KernelLaunchParams()
    params.grid_x = 1 if work is None else trtp.cdiv(work, kernel.block)
    if columns is not None:
        params.grid_y = trtp.cdiv(columns, kernel.columns)
    params.block_x = kernel.threads
    params.shared_mem = kernel.shared
    return (
        kernel.name.encode(),
        kernel.ptx.encode(),
        params,
        trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extra]),
    )


@functools.cache  # once per process: TensorRT's plugin registry keeps them
def register() -> None:
    """Register the plugins with TensorRT's plugin registry (once per process)."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from looptool.backends.tensorrt.kernels import aot_compile

    aot = tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]  # TensorRT requires the annotation

    @trtp.register("looptool::GatedResidual")
    def gated_residual_desc(x: trtp.TensorDesc, gate: trtp.TensorDesc, f: trtp.TensorDesc) -> trtp.TensorDesc:
        return x.like()

    @trtp.autotune("looptool::GatedResidual")
    def gated_residual_tune(x, gate, f, outputs):
        return _combos("F, F, F, F")

    @trtp.aot_impl("looptool::GatedResidual")
    def gated_residual_aot(x, gate, f, outputs, tactic) -> aot:
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
    def adaptive_delta_aot(s_prev, r, z, gamma, exit, outputs, tactic) -> aot:
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
    def modulate_aot(x, scale, shift, down, up, outputs, tactic) -> aot:
        d = x.shape_expr[-1]
        rank = down.shape_expr[0]  # a weight's dimension: a build-time constant
        kernel = aot_compile("Modulate", _dtype_name(x), rank=rank.constant_value())
        rows = x.shape_expr.numel() // d
        return _launch(kernel, rows, [rows, d, rank])

    @trtp.register("looptool::MoeAlign")
    def moe_align_desc(
        expert_ids: trtp.TensorDesc, num_experts: int, block_m: int
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        blocks = trtp.cdiv(expert_ids.shape_expr.numel(), block_m) + num_experts  # bounds any routing's blocks
        pair_row = expert_ids.like()
        pair_row.dtype = trt.int32
        return (
            trtp.from_shape_expr((blocks * block_m,), trt.int32),
            trtp.from_shape_expr((blocks,), trt.int32),
            trtp.from_shape_expr((1,), trt.int32),
            pair_row,
        )

    @trtp.autotune("looptool::MoeAlign")
    def moe_align_tune(expert_ids, num_experts, block_m, outputs):
        return [trtp.AutoTuneCombination("INT64, INT32, INT32, INT32, INT32")]

    @trtp.aot_impl("looptool::MoeAlign")
    def moe_align_aot(expert_ids, num_experts, block_m, outputs, tactic) -> aot:
        kernel = aot_compile("MoeAlign", "fp32", num_experts=num_experts, block_m=block_m)  # no float tensors
        return _launch(kernel, None, [expert_ids.shape_expr.numel(), expert_ids.shape_expr[1]])

    @trtp.register("looptool::MoeGateUp")
    def moe_gate_up_desc(
        x: trtp.TensorDesc,
        gate_up_proj: trtp.TensorDesc,
        rows: trtp.TensorDesc,
        block_expert: trtp.TensorDesc,
        used: trtp.TensorDesc,
        block_m: int,
    ) -> trtp.TensorDesc:
        return trtp.from_shape_expr((rows.shape_expr[0], gate_up_proj.shape_expr[1] // 2), x.dtype)

    @trtp.autotune("looptool::MoeGateUp")
    def moe_gate_up_tune(x, gate_up_proj, rows, block_expert, used, block_m, outputs):
        return [trtp.AutoTuneCombination(f"{t}, {t}, INT32, INT32, INT32, {t}") for t in _FLOATS]

    @trtp.aot_impl("looptool::MoeGateUp")
    def moe_gate_up_aot(x, gate_up_proj, rows, block_expert, used, block_m, outputs, tactic) -> aot:
        d, inter = x.shape_expr[1], gate_up_proj.shape_expr[1] // 2
        kernel = aot_compile("MoeGateUp", _dtype_name(x), block_m=block_m)
        return _launch(kernel, rows.shape_expr[0], [d, inter], columns=inter)

    @trtp.register("looptool::MoeDown")
    def moe_down_desc(
        act: trtp.TensorDesc,
        down_proj: trtp.TensorDesc,
        block_expert: trtp.TensorDesc,
        used: trtp.TensorDesc,
        block_m: int,
    ) -> trtp.TensorDesc:
        return trtp.from_shape_expr((act.shape_expr[0], down_proj.shape_expr[1]), trt.float32)

    @trtp.autotune("looptool::MoeDown")
    def moe_down_tune(act, down_proj, block_expert, used, block_m, outputs):
        return [trtp.AutoTuneCombination(f"{t}, {t}, INT32, INT32, FP32") for t in _FLOATS]

    @trtp.aot_impl("looptool::MoeDown")
    def moe_down_aot(act, down_proj, block_expert, used, block_m, outputs, tactic) -> aot:
        d, inter = down_proj.shape_expr[1], down_proj.shape_expr[2]
        kernel = aot_compile("MoeDown", _dtype_name(act), block_m=block_m)
        return _launch(kernel, act.shape_expr[0], [d, inter], columns=d)

    @trtp.register("looptool::MoeCombine")
    def moe_combine_desc(
        out: trtp.TensorDesc, pair_row: trtp.TensorDesc, routing_weights: trtp.TensorDesc
    ) -> trtp.TensorDesc:
        return trtp.from_shape_expr((routing_weights.shape_expr[0], out.shape_expr[1]), routing_weights.dtype)

    @trtp.autotune("looptool::MoeCombine")
    def moe_combine_tune(out, pair_row, routing_weights, outputs):
        return [trtp.AutoTuneCombination(f"FP32, INT32, {t}, {t}") for t in _FLOATS]

    @trtp.aot_impl("looptool::MoeCombine")
    def moe_combine_aot(out, pair_row, routing_weights, outputs, tactic) -> aot:
        n = routing_weights.shape_expr[0] * out.shape_expr[1]
        kernel = aot_compile("MoeCombine", _dtype_name(routing_weights))
        return _launch(kernel, n, [n, out.shape_expr[1], routing_weights.shape_expr[1]])
