"""ONNX lowering of looptool's fused ops: functions of the ``looptool`` domain.

Each fused op becomes one node of domain ``looptool`` whose ONNX *function body* (standard
opset-18 ops) ships inside the model, so onnxruntime runs it as is and a TensorRT plugin
can claim the node by domain and name instead. The translation table also lowers
``aten.linear`` so that weights are read in their stored ``[out, in]`` layout
(``Gemm(transB=1)``) rather than through a ``Transpose`` that a runtime would fold into a
second, per-session copy of every weight matrix, and the four ops of looptool's graphs that
torchlib has no translation for (``index_copy`` of the KV cache writes, ``__and__`` of
masks, ``to.dtype`` / ``to.device``), so a graph of only translatable ops skips the
exporter's decomposition retrace (:func:`looptool.core.compat.decompose_only_what_onnx_lacks`).
"""

from __future__ import annotations

import onnxscript
import torch
from onnxscript import INT64
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops.core import aten__to_copy, aten_bitwise_and
from onnxscript.function_libs.torch_lib.tensor_typing import TFloat

import looptool.ops  # noqa: F401  (registers torch.ops.looptool.*)

DOMAIN = "looptool"
DOMAIN_VERSION = 1
OPSET = 18
_looptool = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)


@onnxscript.script(_looptool, default_opset=op)
def GatedResidual(x: TFloat, gate: TFloat, f: TFloat) -> TFloat:
    """``x + tanh(gate) * f`` (Accordion Eq. 5)."""
    return op.Add(x, op.Mul(op.Tanh(gate), f))


@onnxscript.script(_looptool, default_opset=op)
def AdaptiveDelta(
    s_prev: TFloat, r: TFloat, s_tilde: TFloat, weight: TFloat, bias: TFloat, gamma: TFloat, exit: TFloat
) -> TFloat:
    """``s_prev + exit * sigmoid(s_tilde W^T + b) * softplus(gamma) * (r - s_prev)`` (ELR Eq. 2)."""
    logits = op.Add(op.MatMul(s_tilde, op.Transpose(weight, perm=[1, 0])), bias)
    beta = op.Mul(op.Sigmoid(logits), op.Softplus(gamma))
    return op.Add(s_prev, op.Mul(exit, op.Mul(beta, op.Sub(r, s_prev))))


@onnxscript.script(_looptool, default_opset=op)
def AdaptiveDeltaUpdate(s_prev: TFloat, r: TFloat, z: TFloat, gamma: TFloat, exit: TFloat) -> TFloat:
    """The state update around the gate GEMM's output ``z = s_tilde W^T + b`` (ELR Eq. 2):
    ``s_prev + exit * sigmoid(z) * softplus(gamma) * (r - s_prev)``. The TensorRT variant of
    a graph splits ``AdaptiveDelta`` into a GEMM (TensorRT's) and this node (a plugin)."""
    beta = op.Mul(op.Sigmoid(z), op.Softplus(gamma))
    return op.Add(s_prev, op.Mul(exit, op.Mul(beta, op.Sub(r, s_prev))))


@onnxscript.script(_looptool, default_opset=op)
def Moe(x: TFloat, routing_weights: TFloat, expert_ids: INT64, gate_up_proj: TFloat, down_proj: TFloat) -> TFloat:
    """Top-k mixture of experts with gated-SiLU experts, as a dense reference body.

    Every expert runs on every token and the results are combined with the routing
    matrix (zero outside each token's top-k): exact, static-shaped and portable; a
    runtime kernel for the ``looptool.Moe`` node can skip the unrouted pairs.
    """
    num_experts = op.Shape(gate_up_proj, start=0, end=1)
    experts = op.Range(op.Constant(value_int=0), op.Squeeze(num_experts), op.Constant(value_int=1))
    # the routing matrix in the graph's float type (fp32, fp16, bf16), not a fixed fp32
    onehot = op.CastLike(op.Equal(op.Unsqueeze(expert_ids, [-1]), experts), routing_weights)  # [T, k, E]
    routing = op.ReduceSum(op.Mul(onehot, op.Unsqueeze(routing_weights, [-1])), [1], keepdims=0)  # [T, E]
    hidden = op.MatMul(op.Unsqueeze(x, [0]), op.Transpose(gate_up_proj, perm=[0, 2, 1]))  # [E, T, 2I]
    gate, up = op.Split(hidden, axis=-1, num_outputs=2)
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    out = op.MatMul(act, op.Transpose(down_proj, perm=[0, 2, 1]))  # [E, T, d]
    weights = op.Unsqueeze(op.Transpose(routing, perm=[1, 0]), [-1])  # [E, T, 1]
    return op.ReduceSum(op.Mul(out, weights), [0], keepdims=0)


@onnxscript.script(_looptool, default_opset=op)
def Modulate(x: TFloat, scale: TFloat, shift: TFloat, down: TFloat, up: TFloat) -> TFloat:
    """``x~ + (x~ B'^T) A^T`` with ``x~ = shift + scale * x`` (ELR Sec. 3.3, Eq. 4)."""
    x_t = op.Add(shift, op.Mul(scale, x))
    low = op.MatMul(x_t, op.Transpose(down, perm=[1, 0]))
    return op.Add(x_t, op.MatMul(low, op.Transpose(up, perm=[1, 0])))


def _gated_residual(x, gate, f):
    return GatedResidual(x, gate, f)


def _adaptive_delta(s_prev, r, s_tilde, weight, bias, gamma, exit=None):
    if exit is None:  # multiplying by exactly 1 keeps the update bit-identical
        exit = op.CastLike(op.Constant(value_float=1.0), s_prev)
    return AdaptiveDelta(s_prev, r, s_tilde, weight, bias, gamma, exit)


def _moe(x, routing_weights, expert_ids, gate_up_proj, down_proj):
    return Moe(x, op.CastLike(routing_weights, x), expert_ids, gate_up_proj, down_proj)


def _linear(input, weight, bias=None):
    """``input @ weight^T + bias`` reading ``weight`` as stored: ``Gemm(transB=1)`` on a
    2-D view of ``input``."""
    features = op.Shape(weight, start=1, end=2)
    flat = op.Reshape(input, op.Concat(op.Constant(value_ints=[-1]), features, axis=0))
    out = op.Gemm(flat, weight, bias, transB=1) if bias is not None else op.Gemm(flat, weight, transB=1)
    shape = op.Concat(op.Shape(input, start=0, end=-1), op.Shape(weight, start=0, end=1), axis=0)
    return op.Reshape(out, shape)


def _modulate(x, scale, shift, down, up):
    return Modulate(x, scale, shift, down, up)


FUNCTIONS = {"gated_residual": GatedResidual, "adaptive_delta": AdaptiveDelta, "modulate": Modulate, "moe": Moe}


def _index_copy(self, dim: int, index, source):
    """``self`` with ``self.select(dim, index[i]) = source.select(dim, i)`` (``aten.index_copy``,
    the KV cache writes): ``ScatterElements`` along ``dim`` with ``index`` broadcast to
    ``source``'s shape."""
    rank = len(source.shape)
    dim = dim % rank
    along = op.Reshape(index, op.Constant(value_ints=[1] * dim + [-1] + [1] * (rank - dim - 1)))
    return op.ScatterElements(self, op.Expand(along, op.Shape(source)), source, axis=dim)


def _to_dtype(self, dtype, non_blocking=False, copy=False, memory_format=None):
    """``aten.to.dtype``: a cast (``aten._to_copy``'s translation)."""
    return aten__to_copy(self, dtype=dtype)


def _to_device(self, device, dtype, non_blocking=False, copy=False, memory_format=None):
    """``aten.to.device``: a cast; an ONNX graph has no devices."""
    return aten__to_copy(self, dtype=dtype)


def translation_table() -> dict:
    """The ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``."""
    return {
        torch.ops.looptool.gated_residual.default: _gated_residual,
        torch.ops.looptool.adaptive_delta.default: _adaptive_delta,
        torch.ops.looptool.modulate.default: _modulate,
        torch.ops.looptool.moe.default: _moe,
        torch.ops.aten.linear.default: _linear,
        torch.ops.aten.index_copy.default: _index_copy,
        torch.ops.aten.__and__.Tensor: aten_bitwise_and,  # bool masks: And; integers: BitwiseAnd
        torch.ops.aten.to.dtype: _to_dtype,
        torch.ops.aten.to.device: _to_device,
    }
