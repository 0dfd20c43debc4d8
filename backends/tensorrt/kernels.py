"""Triton kernels compiled ahead of time (to PTX, no GPU needed) for looptool's TensorRT AOT
plugins: the engine embeds the PTX, so no Python runs at inference time."""

from __future__ import annotations

from dataclasses import dataclass

from looptool.backends.errors import ExportError
from looptool.backends.tensorrt.moe import BLOCK_M, MOE_OPS, aot_spec
from looptool.core.dtypes import named

AOT_OPS = ("GatedResidual", "AdaptiveDeltaUpdate", "Modulate", *MOE_OPS)  # one Triton kernel each, PTX in the engine


@dataclass(frozen=True)
class AOTKernel:
    """One Triton kernel compiled ahead of time for a TensorRT AOT plugin."""

    op: str
    name: str  # the PTX entry
    ptx: str
    threads: int  # block size: num_warps × 32
    shared: int  # bytes of shared memory
    block: int  # elements (or rows) per program
    scalars: tuple[str, ...]  # the i32 arguments TensorRT passes between inputs and outputs, in order
    columns: int = 1  # columns per program along the grid's y axis (the grouped GEMMs; 1: a 1-D grid)


def aot_compile(
    op: str,
    dtype: str,
    *,
    arch: int = 90,
    ptx_version: int = 87,
    rank: int = 16,
    num_experts: int = 8,
    block_m: int = BLOCK_M,
) -> AOTKernel:
    """Compile the Triton kernel behind plugin ``op`` to PTX for ``sm_<arch>`` (no GPU needed);
    ``rank`` specialises ``Modulate``, ``num_experts`` and ``block_m`` the MoE steps.

    Argument order is TensorRT's for AOT plugins: input pointers, the i32 scalars, output
    pointers. ``ptx_version`` 87 (PTX ISA 8.7) loads on drivers ≥ 570; Triton 3.9's
    default (9.4) needs a newer driver than the project's H200 has."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from looptool.ops import kernels

    if kernels.INTERPRET:
        raise ExportError(
            "AOT compilation needs Triton's compiler, but this process runs Triton's interpreter "
            "(TRITON_INTERPRET=1); unset it."
        )
    element = named(dtype).short  # Triton's name of the element type: fp32, fp16, bf16
    t = "*" + element
    options: dict = {"num_warps": 4}
    columns = 1
    if op == "GatedResidual":
        fn, scalars, block = kernels.gated_residual_kernel, ("n", "gate_n"), kernels.ELEMENTWISE_BLOCK
        signature = {
            "x_ptr": t,
            "gate_ptr": t,
            "f_ptr": t,
            "n": "i32",
            "gate_n": "i32",
            "out_ptr": t,
            "BLOCK": "constexpr",
        }
        constexprs = {"BLOCK": block}
    elif op == "AdaptiveDeltaUpdate":
        fn, scalars, block = kernels.adaptive_delta_kernel, ("n", "gamma_n", "exit_n"), kernels.ELEMENTWISE_BLOCK
        signature = {
            "s_ptr": t,
            "r_ptr": t,
            "z_ptr": t,
            "gamma_ptr": t,
            "exit_ptr": t,
            "n": "i32",
            "gamma_n": "i32",
            "exit_n": "i32",
            "out_ptr": t,
            "HAS_EXIT": "constexpr",
            "BLOCK": "constexpr",
        }
        constexprs = {"HAS_EXIT": True, "BLOCK": block}
    elif op == "Modulate":
        # fp32 tiles of 64 rows need 57 KiB of shared memory, over the 48 KiB a launch gets without opting in
        fn, scalars, block = (
            kernels.modulate_kernel,
            ("rows", "d", "rank"),
            32 if element == "fp32" else 64,
        )
        signature = {
            "x_ptr": t,
            "scale_ptr": t,
            "shift_ptr": t,
            "down_ptr": t,
            "up_ptr": t,
            "rows": "i32",
            "d": "i32",
            "rank": "i32",
            "out_ptr": t,
            "RANK": "constexpr",
            "BLOCK_M": "constexpr",
            "BLOCK_D": "constexpr",
            "PRECISION": "constexpr",
        }
        constexprs = {
            "RANK": kernels.modulate_rank_block(rank),
            "BLOCK_M": block,
            "BLOCK_D": 64,
            "PRECISION": "ieee" if element == "fp32" else "tf32",
        }
    elif op in MOE_OPS:
        spec = aot_spec(op, t, num_experts=num_experts, block_m=block_m)
        fn, signature, constexprs, scalars, block, columns, options = spec
    else:
        raise ExportError(f"no AOT kernel for {op!r}; AOT plugins are {', '.join(AOT_OPS)}.")
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"ptx_version": ptx_version, **options},
    )
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0):
        raise ExportError(f"the {op} kernel needs Triton global scratch memory, which TensorRT does not provide.")
    return AOTKernel(op, meta.name, compiled.asm["ptx"], meta.num_warps * 32, meta.shared, block, scalars, columns)
