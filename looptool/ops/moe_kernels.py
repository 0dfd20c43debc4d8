"""``looptool::moe`` as four one-kernel steps, the kernels of the TensorRT ``looptool::Moe*``
AOT plugins (one kernel each, so an engine with MoE runs without Python):

1. :func:`moe_align_kernel` (``MoeAlign``): the pairs' expert ids → per-expert row blocks of
   ``BLOCK_M`` rows (token index per row, −1 for padding), each block's expert, the rows in
   use and each pair's row. One program: counts, padded offsets and a stable rank per pair
   in registers, every output element stored once (no atomics, no scratch memory).
2. :func:`looptool.ops.kernels.moe_gate_up_kernel` (``MoeGateUp``): grouped GEMM 1 with the
   gated SiLU fused; the rows hold token indices, so it runs with ``top_k = 1``.
3. :func:`moe_down_rows_kernel` (``MoeDown``): grouped GEMM 2, fp32, in row order.
4. :func:`moe_combine_kernel` (``MoeCombine``): ``y_t = Σ_j w_tj · out[row(t, j)]`` over
   ``j = 0 … k−1`` in that order, in fp32, rounded once.

The combine is its own kernel rather than folded into the down GEMM: a token's ``k`` pairs
lie in ``k`` different experts' blocks, i.e. different programs, so summing them there needs
atomic adds (whose float order, hence the result, varies run to run) or a token-major GEMM
whose tiles mix experts (no shared weight tile). Every output shape is a static function of
the input shapes: ``R = B · BLOCK_M`` rows with ``B = ⌈T·k / BLOCK_M⌉ + E`` blocks bounds the
padded rows whatever the routing (as :func:`looptool.ops.kernels.moe_blocks`).

The launchers below run the same kernels on torch tensors (on CPU under ``TRITON_INTERPRET=1``);
:func:`moe_steps` chains the four, which is what a TensorRT engine runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from looptool.ops.kernels import ELEMENTWISE_BLOCK, INTERPRET, _precision, moe_gate_up_kernel


def experts_block(num_experts: int) -> int:
    """The align kernel's ``EXPERTS``: ``num_experts`` rounded up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(num_experts))


def pairs_block(num_experts: int) -> int:
    """Pairs per step of the align kernel: tiles of ``[PAIRS, EXPERTS]`` at most 4096 elements."""
    return max(16, 4096 // experts_block(num_experts))


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """``B = ⌈pairs / block_m⌉ + num_experts``: the row blocks any routing of ``pairs`` pairs needs
    at most (each expert's last block is the only one not full)."""
    return triton.cdiv(pairs, block_m) + num_experts


# ---------------------------------------------------------------------------- 1. routing
@triton.jit
def moe_align_kernel(
    ids_ptr,
    pairs,
    top_k,
    rows_ptr,
    block_expert_ptr,
    used_ptr,
    pair_row_ptr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Route ``pairs`` token-expert pairs (``ids`` [T·k], pair p = token p // k, choice p % k)
    into per-expert blocks of ``BLOCK_M`` rows; one program (grid 1).

    Expert ``e`` gets ``⌈count_e / BLOCK_M⌉`` blocks starting at row ``start_e`` (experts in
    order); its pairs fill them in pair order (a stable sort), the rest is padding. Writes
    ``rows`` [B·BLOCK_M] (token of each row, −1: padding), ``block_expert`` [B] (the expert of
    each block; blocks past the rows in use get the last expert), ``used`` [1] (rows in use,
    a multiple of ``BLOCK_M``) and ``pair_row`` [T·k] (each pair's row)."""
    experts = tl.arange(0, EXPERTS)
    real = experts < NUM_EXPERTS
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for first in range(0, pairs, PAIRS):  # pass 1: pairs per expert
        p = first + tl.arange(0, PAIRS)
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    tl.store(used_ptr, tl.sum(padded, axis=0))
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for first in range(0, pairs, PAIRS):  # pass 2: each pair's row, start + its rank among its expert's pairs
        p = first + tl.arange(0, PAIRS)
        valid = p < pairs
        ids = tl.load(ids_ptr + p, mask=valid, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit  # same-expert pairs before this one in this step
        row = tl.sum(hit * (start + seen)[None, :] + hit * earlier, axis=1)
        tl.store(pair_row_ptr + p, row, mask=valid)
        tl.store(rows_ptr + row, p // top_k, mask=valid)
        seen += tl.sum(hit, axis=0)
    blocks = tl.cdiv(pairs, BLOCK_M) + NUM_EXPERTS
    for first in range(0, blocks * BLOCK_M, PAIRS):  # pass 3: padding rows (the rows no pair took)
        r = first + tl.arange(0, PAIRS)
        taken = (start[None, :] <= r[:, None]) & (r[:, None] < (start + counts)[None, :]) & real[None, :]
        pad = tl.sum(taken.to(tl.int32), axis=1) == 0
        tl.store(rows_ptr + r, tl.full((PAIRS,), -1, tl.int32), mask=pad & (r < blocks * BLOCK_M))
    for first in range(0, blocks, PAIRS):  # each block's expert: the experts that end at or before it
        b = first + tl.arange(0, PAIRS)
        before = (end[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), NUM_EXPERTS - 1)
        tl.store(block_expert_ptr + b, expert, mask=b < blocks)


# ---------------------------------------------------------------------------- 3. down GEMM
@triton.jit
def moe_down_rows_kernel(
    act_ptr,
    w_ptr,
    block_expert_ptr,
    used_ptr,
    d,
    inter,
    out_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grouped GEMM 2 in row order: ``out[m] = act[m] W_down,eᵀ`` (fp32) for one block of
    ``BLOCK_M`` rows of expert ``e`` over ``BLOCK_N`` columns of ``d`` (padding rows: act 0,
    out 0; blocks past the rows in use: not written)."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    e = tl.load(block_expert_ptr + block).to(tl.int64)
    m = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < d
    base = w_ptr + e * d * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < inter
        a = tl.load(act_ptr + m[:, None] * inter + kk[None, :], mask=kmask[None, :], other=0.0)
        w = tl.load(base + n[None, :] * inter + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * d + n[None, :], acc, mask=nmask[None, :])


# ---------------------------------------------------------------------------- 4. combine
@triton.jit
def moe_combine_kernel(out_ptr, pair_row_ptr, weights_ptr, n, d, top_k, y_ptr, BLOCK: tl.constexpr):
    """``y[t, c] = Σ_j w[t, j] · out[pair_row[t, j], c]`` for ``j = 0 … top_k−1`` in order, in
    fp32 (``n = T·d`` outputs, ``BLOCK`` per program); deterministic, no atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    token = offs // d
    col = offs % d
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, top_k):
        pair = token * top_k + j
        row = tl.load(pair_row_ptr + pair, mask=mask, other=0).to(tl.int64)
        w = tl.load(weights_ptr + pair, mask=mask, other=0.0).to(tl.float32)
        acc += w * tl.load(out_ptr + row * d + col, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- launchers
def gemm_config(dtype: torch.dtype | str) -> dict:
    """Tile sizes of the two grouped GEMMs for the TensorRT plugins (one configuration: the
    plugin's launch is fixed when the engine is built). Kept within 48 KiB of shared memory,
    what a launch gets without opting in; fp32 tiles hold half the K depth."""
    fp32 = str(dtype).removeprefix("torch.") in ("float32", "fp32")
    return dict(BLOCK_N=64, BLOCK_K=32 if fp32 else 64, num_warps=4, num_stages=2)


def _config(dtype: torch.dtype) -> dict:
    if INTERPRET:  # small tiles: the interpreter's time grows with them
        return dict(BLOCK_N=32, BLOCK_K=32, num_warps=4)
    return gemm_config(dtype)


def moe_align(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch :func:`moe_align_kernel`: ``(rows, block_expert, used, pair_row)``, int32."""
    tokens, top_k = expert_ids.shape
    pairs = tokens * top_k
    blocks = max_blocks(pairs, num_experts, block_m)
    device = expert_ids.device
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    pair_row = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    moe_align_kernel[(1,)](
        expert_ids.contiguous(),
        pairs,
        top_k,
        rows,
        block_expert,
        used,
        pair_row,
        NUM_EXPERTS=num_experts,
        EXPERTS=experts_block(num_experts),
        BLOCK_M=block_m,
        PAIRS=pairs_block(num_experts),
    )
    return rows, block_expert, used, pair_row


def moe_gate_up(
    x: Tensor, gate_up_proj: Tensor, rows: Tensor, block_expert: Tensor, used: Tensor, block_m: int
) -> Tensor:
    """Launch :func:`looptool.ops.kernels.moe_gate_up_kernel` over the aligned rows:
    ``act`` [R, I] in ``x``'s dtype (rows past ``used`` are not written)."""
    _, two_inter, d = gate_up_proj.shape
    inter = two_inter // 2
    cfg = _config(x.dtype) | {"PRECISION": _precision(x.dtype), "UPCAST": INTERPRET}
    act = torch.empty(rows.numel(), inter, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(inter, cfg["BLOCK_N"]))
    moe_gate_up_kernel[grid](
        x.contiguous(), gate_up_proj.contiguous(), rows, block_expert, used, d, inter, 1, act, BLOCK_M=block_m, **cfg
    )
    return act


def moe_down(act: Tensor, down_proj: Tensor, block_expert: Tensor, used: Tensor, block_m: int) -> Tensor:
    """Launch :func:`moe_down_rows_kernel`: ``out`` [R, d], fp32, in row order."""
    _, d, inter = down_proj.shape
    cfg = _config(act.dtype) | {"PRECISION": _precision(act.dtype), "UPCAST": INTERPRET}
    out = torch.empty(act.shape[0], d, dtype=torch.float32, device=act.device)
    grid = (block_expert.numel(), triton.cdiv(d, cfg["BLOCK_N"]))
    moe_down_rows_kernel[grid](act, down_proj.contiguous(), block_expert, used, d, inter, out, BLOCK_M=block_m, **cfg)
    return out


def moe_combine(out: Tensor, pair_row: Tensor, routing_weights: Tensor) -> Tensor:
    """Launch :func:`moe_combine_kernel`: ``y`` [T, d] in the routing weights' dtype."""
    tokens, top_k = pair_row.shape
    d = out.shape[1]
    y = torch.empty(tokens, d, dtype=routing_weights.dtype, device=out.device)
    n = y.numel()
    if n:
        moe_combine_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
            out, pair_row.contiguous(), routing_weights.contiguous(), n, d, top_k, y, BLOCK=ELEMENTWISE_BLOCK
        )
    return y


def moe_steps(
    x: Tensor, routing_weights: Tensor, expert_ids: Tensor, gate_up_proj: Tensor, down_proj: Tensor, block_m: int = 16
) -> Tensor:
    """``looptool::moe`` (same arguments) as the four kernels a TensorRT engine runs."""
    rows, block_expert, used, pair_row = moe_align(expert_ids, gate_up_proj.shape[0], block_m)
    act = moe_gate_up(x, gate_up_proj, rows, block_expert, used, block_m)
    out = moe_down(act, down_proj, block_expert, used, block_m)
    return moe_combine(out, pair_row, routing_weights.to(x.dtype))
