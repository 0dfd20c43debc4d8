"""Triton kernels for looptool's fused ops: the CUDA implementations of
``looptool::gated_residual``, ``looptool::adaptive_delta``, ``looptool::modulate`` and
``looptool::moe``.

Each launcher takes the op's arguments and returns its result, so the same function serves
torch's CUDA dispatch (registered in :mod:`looptool.ops.fused`), tests under
``TRITON_INTERPRET=1`` on CPU tensors, and the TensorRT plugins (whose AOT PTX comes from
the very ``@triton.jit`` functions defined here, see :mod:`looptool.backends.tensorrt.plugins`).

Numerics: every kernel loads its inputs in their storage dtype, computes in fp32 and stores
in the output dtype. Elementwise kernels therefore equal the fp32 reference to a few ulp,
and in bf16/fp16 they are *more* precise than the reference (which rounds after each op).
Why hand-written: torch.compile would generate equivalent elementwise code, but not a
plugin for TensorRT, and no kept library has a routed MoE grouped GEMM that takes looptool's
``[E, 2I, d]`` / ``[E, d, I]`` weights in place and runs under Triton's interpreter.

Import cost: this module imports ``triton``; :mod:`looptool.ops.fused` imports it lazily,
on the first CUDA call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ELEMENTWISE_BLOCK = 1024


def _grid_1d(n: int, block: int) -> tuple[int]:
    return (triton.cdiv(n, block),)


def _trailing(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` as a contiguous tensor that broadcasts over ``shape``'s leading dims only, so
    element ``i`` of the output reads ``t[i % t.numel()]``; expanded when it does not."""
    dims = list(t.shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    if tuple(dims) == tuple(shape[len(shape) - len(dims) :]):
        return t.contiguous()
    return t.expand(shape).contiguous()


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact fp32 products for fp32 data (as torch.mm by default),
    not TF32; tensor-core precision for 16-bit data."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------- math helpers
@triton.jit
def _tanh(x):
    """tanh(x) = 2σ(2x) − 1 (Triton's core language has no tanh)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _softplus(x):
    """torch's softplus (β = 1, threshold 20): x above 20, log(1 + eˣ) below."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


# ---------------------------------------------------------------------------- gated residual
@triton.jit
def gated_residual_kernel(x_ptr, gate_ptr, f_ptr, n, gate_n, out_ptr, BLOCK: tl.constexpr):
    """``out = x + tanh(gate) ⊙ f`` (Accordion Eq. 5); ``gate`` repeats every ``gate_n``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(gate_ptr + offs % gate_n, mask=mask).to(tl.float32)
    f = tl.load(f_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x + _tanh(g) * f).to(out_ptr.dtype.element_ty), mask=mask)


def gated_residual(x: Tensor, gate: Tensor, f: Tensor) -> Tensor:
    """Launch :func:`gated_residual_kernel` (shapes as ``looptool::gated_residual``)."""
    shape = torch.broadcast_shapes(x.shape, gate.shape, f.shape)
    x, f = x.expand(shape).contiguous(), f.expand(shape).contiguous()
    gate = _trailing(gate, shape)
    out = torch.empty(shape, dtype=torch.result_type(x, f), device=x.device)
    n = out.numel()
    if n:
        gated_residual_kernel[_grid_1d(n, ELEMENTWISE_BLOCK)](x, gate, f, n, gate.numel(), out, BLOCK=ELEMENTWISE_BLOCK)
    return out


# ---------------------------------------------------------------------------- adaptive delta
@triton.jit
def adaptive_delta_kernel(
    s_ptr, r_ptr, z_ptr, gamma_ptr, exit_ptr, n, gamma_n, exit_n, out_ptr, HAS_EXIT: tl.constexpr, BLOCK: tl.constexpr
):
    """The state update around the gate GEMM's output ``z = W s̃ + b`` (ELR Eq. 2):
    ``out = s + e ⊙ σ(z) ⊙ softplus(γ) ⊙ (r − s)``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask).to(tl.float32)
    gamma = tl.load(gamma_ptr + offs % gamma_n, mask=mask).to(tl.float32)
    step = tl.sigmoid(z) * _softplus(gamma) * (r - s)
    if HAS_EXIT:
        step = step * tl.load(exit_ptr + offs % exit_n, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (s + step).to(out_ptr.dtype.element_ty), mask=mask)


def adaptive_delta(
    s_prev: Tensor, r: Tensor, s_tilde: Tensor, weight: Tensor, bias: Tensor, gamma: Tensor, exit: Tensor | None = None
) -> Tensor:
    """The gate GEMM (cuBLAS via ``F.linear``) + :func:`adaptive_delta_kernel`."""
    z = torch.nn.functional.linear(s_tilde, weight, bias)
    shapes = [s_prev.shape, r.shape, z.shape, gamma.shape] + ([exit.shape] if exit is not None else [])
    shape = torch.broadcast_shapes(*shapes)
    s, rr, zz = (t.expand(shape).contiguous() for t in (s_prev, r, z))
    g = _trailing(gamma, shape)
    e = _trailing(exit, shape) if exit is not None else g
    out = torch.empty(shape, dtype=s_prev.dtype, device=s_prev.device)
    n = out.numel()
    if n:
        adaptive_delta_kernel[_grid_1d(n, ELEMENTWISE_BLOCK)](
            s, rr, zz, g, e, n, g.numel(), e.numel(), out, HAS_EXIT=exit is not None, BLOCK=ELEMENTWISE_BLOCK
        )
    return out


# ---------------------------------------------------------------------------- conditioning modulation
@triton.jit
def modulate_kernel(
    x_ptr,
    scale_ptr,
    shift_ptr,
    down_ptr,
    up_ptr,
    rows,
    d,
    rank,
    out_ptr,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Loop-conditioned branch input (ELR Sec. 3.3, Eq. 4) for ``BLOCK_M`` rows:
    ``x~ = shift + scale ⊙ x`` then ``x^ = x~ + A (B' x~)``, with ``B' = diag(g) B`` [RANK, d]
    and ``A`` [d, rank]; the rank-``rank`` product stays in registers (``RANK`` ≥ rank, a
    power of two ≥ 16 for ``tl.dot``; the extra lanes are masked to zero), x~ is never stored."""
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = m < rows
    ranks = tl.arange(0, RANK)
    kmask = ranks < rank
    low = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for start in range(0, d, BLOCK_D):  # pass 1: low = x~ B'^T
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        x = tl.load(x_ptr + m[:, None] * d + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(
            tl.float32
        )
        sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        xt = sh[None, :] + sc[None, :] * x
        b_t = tl.load(
            down_ptr + ranks[None, :] * d + cols[:, None], mask=cmask[:, None] & kmask[None, :], other=0.0
        ).to(tl.float32)
        low = tl.dot(xt, b_t, low, input_precision=PRECISION)
    for start in range(0, d, BLOCK_D):  # pass 2: out = x~ + low A^T
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + m[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        a_t = tl.load(
            up_ptr + cols[None, :] * rank + ranks[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0
        ).to(tl.float32)
        out = tl.dot(low, a_t, sh[None, :] + sc[None, :] * x, input_precision=PRECISION)
        tl.store(out_ptr + m[:, None] * d + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def modulate_rank_block(rank: int) -> int:
    """The kernel's ``RANK``: ``rank`` rounded up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rank))


def modulate(x: Tensor, scale: Tensor, shift: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """Launch :func:`modulate_kernel` (shapes as ``looptool::modulate``)."""
    d, rank = x.shape[-1], down.shape[0]
    xs = x.contiguous().view(-1, d)
    rows = xs.shape[0]
    out = torch.empty_like(xs)
    block_m, block_d = (16, 32) if INTERPRET else (64, 64)
    if rows:
        modulate_kernel[_grid_1d(rows, block_m)](
            xs,
            scale.reshape(-1).contiguous(),
            shift.reshape(-1).contiguous(),
            down.contiguous(),
            up.contiguous(),
            rows,
            d,
            rank,
            out,
            RANK=modulate_rank_block(rank),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            PRECISION=_precision(x.dtype),
        )
    return out.view(x.shape)


# ---------------------------------------------------------------------------- mixture of experts
@triton.jit
def _block_pairs(block, rows_ptr, block_expert_ptr, BLOCK_M: tl.constexpr):
    """Block ``block``'s expert, its padded row indices and their pair indices (−1: padding)."""
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.load(block_expert_ptr + block).to(tl.int64), m, tl.load(rows_ptr + m)


@triton.jit
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    block_expert_ptr,
    used_ptr,
    d,
    inter,
    top_k,
    act_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grouped GEMM 1 + gated SiLU: for one block of ``BLOCK_M`` token-expert pairs of one
    expert ``e``, ``act = silu(x W_gate,eᵀ) ⊙ (x W_up,eᵀ)`` over ``BLOCK_N`` columns of ``I``.
    ``rows`` holds the pair index (token · k + j) of each padded row, −1 for padding."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    e, m, pair = _block_pairs(block, rows_ptr, block_expert_ptr, BLOCK_M)
    token = tl.where(pair >= 0, pair // top_k, 0).to(tl.int64)
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < inter
    base = w_ptr + e * (2 * inter) * d
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, d, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < d
        xa = tl.load(x_ptr + token[:, None] * d + kk[None, :], mask=(pair[:, None] >= 0) & kmask[None, :], other=0.0)
        wg = tl.load(base + n[None, :] * d + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        wu = tl.load(base + (inter + n[None, :]) * d + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        if UPCAST:
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(xa, wg, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(xa, wu, acc_up, input_precision=PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        act_ptr + m[:, None].to(tl.int64) * inter + n[None, :], act.to(act_ptr.dtype.element_ty), mask=nmask[None, :]
    )


@triton.jit
def moe_down_kernel(
    act_ptr,
    w_ptr,
    rows_ptr,
    block_expert_ptr,
    used_ptr,
    weights_ptr,
    d,
    inter,
    out_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grouped GEMM 2: ``out[pair] = w_pair · act W_down,eᵀ`` for one block of pairs of
    expert ``e`` over ``BLOCK_N`` columns of ``d``, written back in pair order."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    e, m, pair = _block_pairs(block, rows_ptr, block_expert_ptr, BLOCK_M)
    valid = pair >= 0
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < d
    base = w_ptr + e * d * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < inter
        a = tl.load(act_ptr + m[:, None].to(tl.int64) * inter + kk[None, :], mask=kmask[None, :], other=0.0)
        w = tl.load(base + n[None, :] * inter + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    rw = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    dest = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(
        out_ptr + dest[:, None] * d + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :]
    )


def moe_blocks(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Route token-expert pairs into per-expert blocks of ``block_m`` rows, with no host sync.

    Returns ``rows`` [max_rows] (pair index per padded row, −1 for padding), ``block_expert``
    [max_blocks] (the expert each block belongs to) and ``used`` [1] (rows in use). The grid
    is sized by the static bound ``cdiv(T·k, block_m) + E`` blocks, so nothing waits for the
    routing to be known on the host (a CUDA graph can capture it)."""
    flat = expert_ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    max_blocks = triton.cdiv(pairs, block_m) + num_experts
    sorted_ids, perm = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in sorted order
    rank = torch.arange(pairs, device=device) - first[sorted_ids]
    rows = torch.full((max_blocks * block_m,), -1, dtype=torch.int64, device=device)
    rows.scatter_(0, padded_start[sorted_ids] + rank, perm)
    starts = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return rows, block_expert, padded_end[-1:].contiguous()


def _moe_config(tokens: int) -> dict:
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    if tokens >= 1024:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def moe(x: Tensor, routing_weights: Tensor, expert_ids: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """Routed top-k MoE (shapes as ``looptool::moe``): only each token's ``k`` experts run,
    as two grouped GEMMs over per-expert blocks of pairs; no dense fallback."""
    tokens, top_k = expert_ids.shape
    num_experts, two_inter, d = gate_up_proj.shape
    inter = two_inter // 2
    # Triton's interpreter gets bf16 dot products wrong: it multiplies fp32 copies of the tiles
    cfg = _moe_config(tokens * top_k) | {"PRECISION": _precision(x.dtype), "UPCAST": INTERPRET}
    bm = cfg["BLOCK_M"]
    rows, block_expert, used = moe_blocks(expert_ids, num_experts, bm)
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    act = torch.empty(rows.numel(), inter, dtype=x.dtype, device=x.device)
    pair_out = torch.zeros(tokens * top_k, d, dtype=torch.float32, device=x.device)
    weights = routing_weights.reshape(-1).contiguous()
    blocks = block_expert.numel()
    if tokens:
        moe_gate_up_kernel[(blocks, triton.cdiv(inter, cfg["BLOCK_N"]))](
            x, gate_up_proj, rows, block_expert, used, d, inter, top_k, act, **cfg
        )
        moe_down_kernel[(blocks, triton.cdiv(d, cfg["BLOCK_N"]))](
            act, down_proj, rows, block_expert, used, weights, d, inter, pair_out, **cfg
        )
    return pair_out.view(tokens, top_k, d).sum(dim=1).to(x.dtype)


LAUNCHERS = {
    "gated_residual": gated_residual,
    "adaptive_delta": adaptive_delta,
    "modulate": modulate,
    "moe": moe,
}
