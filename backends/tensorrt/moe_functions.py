"""ONNX function bodies of the four ``looptool`` MoE step ops of a TensorRT variant
(:mod:`looptool.backends.tensorrt.moe`): ``MoeAlign``, ``MoeGateUp``, ``MoeDown``, ``MoeCombine``.

Each computes what its Triton kernel (:mod:`looptool.ops.moe_kernels`) computes, with the
same output shapes (static functions of the input shapes) and dtypes, so onnxruntime runs a
TensorRT variant exactly as TensorRT would run its plugins: routing in integers, the GEMMs per
block of ``block_m`` rows of one expert on fp32 copies of the operands (the kernels accumulate
in fp32), the activation rounded to the graph's float type where the kernel stores it, the
down projection kept in fp32 and the weighted sum over the top-k rounded once. Rows past the
rows in use, which the kernels never write, are zeros here.
"""

from __future__ import annotations

import onnxscript
from onnxscript import FLOAT, INT32, INT64
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.tensor_typing import TFloat

from looptool.backends.onnx.functions import DOMAIN, DOMAIN_VERSION

_looptool = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)


@onnxscript.script(_looptool, default_opset=op)
def MoeAlign(expert_ids: INT64, num_experts: int, block_m: int):
    """Token-expert pairs (``expert_ids`` [T, k], pair p = t·k + j) into per-expert blocks of
    ``block_m`` rows: ``rows`` [B·block_m] (the token of each row, −1: padding), ``block_expert``
    [B], ``used`` [1] (rows in use) and ``pair_row`` [T, k] (each pair's row), all int32, with
    ``B = ⌈T·k / block_m⌉ + num_experts``. Expert e's pairs, in pair order, fill
    ``⌈count_e / block_m⌉`` blocks after those of experts 0 … e−1."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    bm = op.Constant(value_int=block_m)
    experts = op.Constant(value_int=num_experts)
    flat = op.Reshape(expert_ids, op.Constant(value_ints=[-1]))
    pairs = op.Size(flat)
    hit = op.Cast(op.Equal(op.Unsqueeze(flat, [1]), op.Range(zero, experts, one)), to=INT64.dtype)  # [P, E]
    counts = op.ReduceSum(hit, [0], keepdims=0)
    padded = op.Mul(op.Div(op.Add(counts, op.Sub(bm, one)), bm), bm)
    end = op.CumSum(padded, zero)
    start = op.Sub(end, padded)
    rank = op.ReduceSum(op.Mul(hit, op.Sub(op.CumSum(hit, zero), hit)), [1], keepdims=0)  # among its expert's pairs
    row = op.Add(op.Gather(start, flat), rank)
    blocks = op.Add(op.Div(op.Add(pairs, op.Sub(bm, one)), bm), experts)
    padding = op.Expand(op.Constant(value_int=-1), op.Reshape(op.Mul(blocks, bm), [1]))
    tokens = op.Div(op.Range(zero, pairs, one), op.Shape(expert_ids, start=1, end=2))
    rows = op.ScatterElements(padding, row, tokens)
    starts = op.Mul(op.Range(zero, blocks, one), bm)
    before = op.Cast(op.LessOrEqual(op.Unsqueeze(end, [0]), op.Unsqueeze(starts, [1])), to=INT64.dtype)  # [B, E]
    block_expert = op.Min(op.ReduceSum(before, [1], keepdims=0), op.Sub(experts, one))
    used = op.ReduceSum(padded, [0], keepdims=1)
    pair_row = op.Reshape(row, op.Shape(expert_ids))
    rows_out = op.Cast(rows, to=INT32.dtype)
    block_expert_out = op.Cast(block_expert, to=INT32.dtype)
    used_out = op.Cast(used, to=INT32.dtype)
    pair_row_out = op.Cast(pair_row, to=INT32.dtype)
    return rows_out, block_expert_out, used_out, pair_row_out


@onnxscript.script(_looptool, default_opset=op)
def MoeGateUp(x: TFloat, gate_up_proj: TFloat, rows: INT32, block_expert: INT32, used: INT32, block_m: int) -> TFloat:
    """Grouped GEMM 1 with the gated SiLU: for each row in use, ``act = silu(x_t W_gate,eᵀ) ⊙
    (x_t W_up,eᵀ)`` (t its token, e its block's expert; 0 for padding rows), [R, I] in ``x``'s
    type; ``gate_up_proj`` [E, 2I, d], gate rows first."""
    bm = op.Reshape(op.Constant(value_int=block_m), [1])
    in_use = op.Cast(used, to=INT64.dtype)
    r = op.Slice(op.Cast(rows, to=INT64.dtype), [0], in_use)
    token = op.Unsqueeze(op.GreaterOrEqual(r, 0), [1])
    xs = op.Where(token, op.Cast(op.Gather(x, op.Max(r, 0)), to=FLOAT.dtype), op.Constant(value_float=0.0))
    blocks = op.Div(in_use, bm)
    xs = op.Reshape(xs, op.Concat(blocks, bm, [-1], axis=0))  # [nb, bm, d]
    weights = op.Cast(
        op.Gather(gate_up_proj, op.Slice(op.Cast(block_expert, to=INT64.dtype), [0], blocks)), to=FLOAT.dtype
    )
    hidden = op.MatMul(xs, op.Transpose(weights, perm=[0, 2, 1]))  # [nb, bm, 2I]
    gate, up = op.Split(hidden, axis=-1, num_outputs=2)
    act = op.CastLike(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), x)
    act = op.Reshape(act, op.Concat([-1], op.Shape(act, start=2), axis=0))
    return op.Pad(act, op.Concat([0, 0], op.Sub(op.Shape(rows), in_use), [0], axis=0))


@onnxscript.script(_looptool, default_opset=op)
def MoeDown(act: TFloat, down_proj: TFloat, block_expert: INT32, used: INT32, block_m: int) -> FLOAT:
    """Grouped GEMM 2 in row order: ``out = act W_down,eᵀ`` for each row in use, [R, d] in
    fp32; ``down_proj`` [E, d, I]."""
    bm = op.Reshape(op.Constant(value_int=block_m), [1])
    in_use = op.Cast(used, to=INT64.dtype)
    blocks = op.Div(in_use, bm)
    a = op.Reshape(op.Cast(op.Slice(act, [0], in_use), to=FLOAT.dtype), op.Concat(blocks, bm, [-1], axis=0))
    weights = op.Cast(
        op.Gather(down_proj, op.Slice(op.Cast(block_expert, to=INT64.dtype), [0], blocks)), to=FLOAT.dtype
    )
    out = op.MatMul(a, op.Transpose(weights, perm=[0, 2, 1]))  # [nb, bm, d]
    out = op.Reshape(out, op.Concat([-1], op.Shape(down_proj, start=1, end=2), axis=0))
    return op.Pad(out, op.Concat([0, 0], op.Sub(op.Shape(act, start=0, end=1), in_use), [0], axis=0))


@onnxscript.script(_looptool, default_opset=op)
def MoeCombine(out: FLOAT, pair_row: INT32, routing_weights: TFloat) -> TFloat:
    """``y_t = Σ_j w_tj · out[pair_row[t, j]]`` in fp32, rounded once to the routing weights'
    type (the graph's float type): [T, d]."""
    picked = op.Gather(out, op.Cast(pair_row, to=INT64.dtype))  # [T, k, d]
    weights = op.Unsqueeze(op.Cast(routing_weights, to=FLOAT.dtype), [-1])
    return op.CastLike(op.ReduceSum(op.Mul(picked, weights), [1], keepdims=0), routing_weights)


FUNCTIONS = (MoeAlign, MoeGateUp, MoeDown, MoeCombine)
