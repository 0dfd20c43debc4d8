"""Lower an exported serving graph to onnxruntime's fused ops, without copying a weight.

The exporter writes every op of a decoder layer as plain ONNX: a linear is ``Reshape → Gemm →
Shape/Concat → Reshape``, RMSNorm seven elementwise ops, attention a ``repeat_kv`` copy of the
whole cache and a dozen ops of scaled dot-product attention. onnxruntime runs each as its own
kernel (about 90 per layer on a llama; its own builder's graphs have about 10), and decode at
batch 1 is dominated by that per-node cost. :func:`fuse_for_ort` rewrites a graph (a layer
body before it becomes a function, or a flat graph) with onnxscript's pattern rewriter:

* ``linear``: ``Reshape(x, [-1, in]) → Gemm(·, W, transB=1) → Reshape(·, x.shape[:-1] + [out])``
  over a weight ⇒ ``com.microsoft.FusedMatMul(x, W, transB=1)`` on the N-D input. It reads
  the ``[out, in]`` weight as stored (a ``MatMul`` would need a transposed second copy).
  q/k/v and gate/up are not merged: that needs their weights concatenated, a second copy.
* ``rms_norm`` / ``skip_rms_norm``: onnxscript's own rules (``SimplifiedLayerNormalization``,
  ``com.microsoft.SkipSimplifiedLayerNormalization``).
* ``attention``: ``repeat_kv`` of both caches plus the decomposed SDPA (``MatMul``, additive
  mask, ``Softmax``, the NaN guard, ``MatMul``) ⇒ one ONNX opset-23 ``Attention`` with
  ``q_num_heads``/``kv_num_heads``, which reads the grouped ``[B, kv_heads, capacity, d]``
  caches directly (no per-step copy of the cache) and takes the additive mask the graph
  already computes (from the glue's boolean mask, once per layer). The caches stay as they
  are: written in place at ``cache_position`` by ``ScatterElements``, left-padded rows masked.
* ``rotary``: ``x·cos + rotate_half(x)·sin`` ⇒ ONNX opset-23 ``RotaryEmbedding`` with the
  ``[B, T, d/2]`` first halves of the glue's ``[B, T, d]`` tables (one ``Slice`` each per
  layer). Hugging Face tables are ``cat(freqs, freqs)``, so both halves are equal; a model
  whose are not would fail validation, not export a wrong graph.

A body that uses an opset-23 op is raised to opset 23, and the composed graph takes the
newest opset of its bodies (onnxruntime resolves inlined ops at the model's opset).

Each rule matches op types and constant values only, never names; a graph whose patterns do
not match (an MoE expert block, gpt2's fused-QKV attention) is left as it is. The results are
onnxruntime-only graphs (TensorRT cannot parse ``com.microsoft`` ops), so TensorRT exports do
not run this.

Numerics (float32): the fused ops compute the same expressions in another order (RMSNorm's
mean and rsqrt in one kernel, attention's ``scale`` applied once to ``q·kᵀ`` where the
exporter scales q and k by ``√scale`` each, its softmax in onnxruntime's kernel), so they
need only float32 rounding's tolerance: ~1e-6 relative per op, ~2e-7 on the tiny models'
logits, 5e-5 to 7e-5 absolute on SmolLM2's (unfused: 4e-5 to 5e-5), inside validation's
1e-4 × max(1, max |logits|).
A query row whose every key is masked (a left-padded row's pad positions in a prefill)
differs: the exporter's graph averages all values there, onnxruntime's ``Attention`` gives
another finite result. Such rows only write cache slots that every later query masks out,
so no kept token or logit depends on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

ATTENTION_OPSET = 23  # the first opset with Attention (q_num_heads / kv_num_heads) and RotaryEmbedding
MS_DOMAIN = "com.microsoft"
FUSE_PREFIX = "ort."  # the key prefix of these rules' counts among a body's fusions


def rule_counts(counts: dict[str, int]) -> dict[str, int]:
    """These rules' counts among a body's fusions (keys ``ort.<rule>``), matched ones only."""
    return {k.removeprefix(FUSE_PREFIX): v for k, v in counts.items() if k.startswith(FUSE_PREFIX) and v}


# ---------------------------------------------------------------------------- helpers
def _const(value) -> np.ndarray | None:
    """The constant array a value holds (an initializer or a ``Constant`` node's), else None."""
    import onnx_ir as ir

    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _is_weight(value) -> bool:
    """A model tensor: a graph input or initializer (no producer) of a static rank-2 shape."""
    if value is None or value.producer() is not None or value.shape is None or len(value.shape) != 2:
        return False
    return all(isinstance(d, int) for d in value.shape)


# ---------------------------------------------------------------------------- linear
def _linear_pattern(op, x, w, flat_shape, out_dim):
    # the exporter writes every attribute; a Gemm with a bias (a third input) does not match
    flat = op.Reshape(x, flat_shape, allowzero=0)
    y = op.Gemm(flat, w, alpha=1.0, transA=0, transB=1, _allow_other_attributes=True)
    lead = op.Shape(x, start=0, end=-1)
    return op.Reshape(y, op.Concat(lead, out_dim, axis=0), allowzero=0)


def _linear_check(context, x, w, flat_shape, out_dim, **_):
    from onnxscript.rewriter import pattern

    result = pattern.MatchResult()
    if not _is_weight(w):
        return result.fail("the Gemm's B is not a weight", w)
    out_features, in_features = w.shape
    flat, out = _const(flat_shape), _const(out_dim)
    if flat is None or flat.tolist() != [-1, in_features]:
        return result.fail("the first Reshape is not to [-1, in]", flat_shape)
    if out is None or out.tolist() != [out_features]:
        return result.fail("the last Reshape does not end in [out]", out_dim)
    return result


def _linear_rewrite(op, x, w, **_):
    return op.FusedMatMul(x, w, transB=1, alpha=1.0, _domain=MS_DOMAIN)


# ---------------------------------------------------------------------------- attention
def _repeat_kv(op, cache, axis, expanded, merged):
    """HF ``repeat_kv``: ``[B, kv, S, d] → [B, kv, 1, S, d] → [B, kv, n, S, d] → [B, kv·n, S, d]``."""
    return op.Reshape(op.Expand(op.Unsqueeze(cache, axis), expanded), merged, _allow_other_attributes=True)


def _attention_pattern(
    op,
    q,
    k_cache,
    v_cache,
    bias,
    k_axis,
    k_expanded,
    k_merged,
    v_axis,
    v_expanded,
    v_merged,
    k3,
    kt,
    q_scale,
    k_scale,
    zero,
):
    k = _repeat_kv(op, k_cache, k_axis, k_expanded, k_merged)
    v = _repeat_kv(op, v_cache, v_axis, v_expanded, v_merged)
    # the exporter's kᵀ of a 4-D tensor: through 3-D [B·H, S, d] and back
    k_t = op.Reshape(op.Transpose(op.Reshape(k, k3, _allow_other_attributes=True), perm=[0, 2, 1]), kt)
    scores = op.MatMul(op.Mul(q, q_scale), op.Mul(k_t, k_scale))
    probs = op.Softmax(op.Add(scores, bias), axis=-1)
    probs = op.Where(op.IsNaN(probs), zero, probs)
    return op.MatMul(probs, v)


def _scalar(value) -> float | None:
    array = _const(value)
    return float(array.reshape(())) if array is not None and array.size == 1 else None


def _attention_check(context, q, k_cache, v_cache, bias, k_axis, v_axis, q_scale, k_scale, zero, **_):
    from onnxscript.rewriter import pattern

    result = pattern.MatchResult()
    for axis in (k_axis, v_axis):
        a = _const(axis)
        if a is None or a.reshape(-1).tolist() != [2]:
            return result.fail("the cache is not unsqueezed at axis 2 (not repeat_kv)", axis)
    if _scalar(zero) != 0.0:
        return result.fail("the NaN guard does not write zeros", zero)
    if _scalar(q_scale) is None or _scalar(k_scale) is None:
        return result.fail("q or k is not scaled by a constant", q_scale)
    heads = _attention_heads(q, k_cache, v_cache)
    if heads is None:
        return result.fail("the head counts are not static", q)
    if bias.dtype is not None and q.dtype is not None and bias.dtype != q.dtype:
        return result.fail("the mask is not additive in q's dtype", bias)
    return result


def _attention_heads(q, k_cache, v_cache) -> tuple[int, int] | None:
    """``(q_num_heads, kv_num_heads)`` from the value shapes (static in a layer body), or None."""
    shapes = [v.shape for v in (q, k_cache, v_cache)]
    if any(s is None or len(s) != 4 for s in shapes):
        return None
    q_heads, kv_heads, v_heads = (s[1] for s in shapes)
    # the exporter may name a static head count as a symbolic dimension ("4"); read its value
    q_heads, kv_heads, v_heads = (_static(d) for d in (q_heads, kv_heads, v_heads))
    if None in (q_heads, kv_heads, v_heads) or kv_heads != v_heads or q_heads % kv_heads:
        return None
    return q_heads, kv_heads


def _static(dim) -> int | None:
    if isinstance(dim, int):
        return dim
    value = getattr(dim, "value", None)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _attention_rewrite(op, q, k_cache, v_cache, bias, q_scale, k_scale, **_):
    q_heads, kv_heads = _attention_heads(q, k_cache, v_cache)
    scale = float(np.float32(_scalar(q_scale)) * np.float32(_scalar(k_scale)))
    return op.Attention(q, k_cache, v_cache, bias, q_num_heads=q_heads, kv_num_heads=kv_heads, scale=scale)


# ---------------------------------------------------------------------------- rotary
def _rotary_pattern(op, x, cos, sin, cos_axis, sin_axis, start1, end1, axis1, step1, start2, end2, axis2, step2):
    first = op.Slice(x, start1, end1, axis1, step1)
    second = op.Slice(x, start2, end2, axis2, step2)
    rotated = op.Concat(op.Neg(second), first, axis=-1)  # HF rotate_half
    return op.Add(op.Mul(x, op.Unsqueeze(cos, cos_axis)), op.Mul(rotated, op.Unsqueeze(sin, sin_axis)))


def _rotary_check(
    context, x, cos, sin, cos_axis, sin_axis, start1, end1, axis1, step1, start2, end2, axis2, step2, **_
):
    from onnxscript.rewriter import pattern

    result = pattern.MatchResult()
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int) or x.shape[3] % 2:
        return result.fail("x is not [B, heads, T, d] with a static even d", x)
    half = x.shape[3] // 2
    wanted = {
        cos_axis: [1],
        sin_axis: [1],
        start1: [0],
        end1: [half],
        step1: [1],
        start2: [half],
        step2: [1],
    }
    for value, expected in wanted.items():
        array = _const(value)
        if array is None or array.reshape(-1).tolist() != expected:
            return result.fail("not rotate_half over the last axis", value)
    for axis in (axis1, axis2):
        array = _const(axis)
        if array is None or array.reshape(-1).tolist() not in ([3], [-1]):
            return result.fail("the halves are not cut on the last axis", axis)
    end = _const(end2)
    if end is None or end.reshape(-1).tolist()[0] < 2 * half:
        return result.fail("the second half does not run to the end", end2)
    for table in (cos, sin):
        if table.shape is not None and len(table.shape) != 3:
            return result.fail("the rotary table is not [B, T, d]", table)
    return result


def _rotary_rewrite(op, x, cos, sin, **_):
    half = x.shape[3] // 2
    # cos/sin are HF tables cat(freqs, freqs): the op reads the first half
    starts, ends, axes = op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), op.Constant(value_ints=[-1])
    return op.RotaryEmbedding(x, op.Slice(cos, starts, ends, axes), op.Slice(sin, starts, ends, axes))


# ---------------------------------------------------------------------------- driver
def _rules() -> dict[str, Callable]:
    """Name → rule set, in the order they apply."""
    from onnxscript.rewriter import pattern

    return {
        "linear": pattern.RewriteRuleSet(
            [pattern.RewriteRule(_linear_pattern, _linear_rewrite, _linear_check, name="linear", remove_nodes=False)]
        ),
        "rotary": pattern.RewriteRuleSet(
            [pattern.RewriteRule(_rotary_pattern, _rotary_rewrite, _rotary_check, name="rotary", remove_nodes=False)]
        ),
        "attention": pattern.RewriteRuleSet(
            [
                pattern.RewriteRule(
                    _attention_pattern, _attention_rewrite, _attention_check, name="attention", remove_nodes=False
                )
            ]
        ),
    }


def fuse_for_ort(model) -> dict[str, int]:
    """Rewrite ``model`` (an ``onnx_ir`` model: a layer body or a flat serving graph) in place
    into onnxruntime's fused ops; returns how many of each it got (zeros where nothing
    matched, and then the graph is unchanged)."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_ruleset
    from onnxscript.rewriter.ort_fusions.skip_normalization import skip_rms_normalization_ruleset

    # the exporter leaves Identity nodes inside the spans the patterns match
    common_passes.IdentityEliminationPass()(model)
    rules = _rules()
    counts: dict[str, int] = {}
    counts["linear"] = rules["linear"].apply_to_model(model)
    counts["rms_norm"] = rms_normalization_ruleset.apply_to_model(model)
    counts["skip_rms_norm"] = skip_rms_normalization_ruleset.apply_to_model(model)  # needs rms_norm's nodes
    counts["attention"] = rules["attention"].apply_to_model(model)
    counts["rotary"] = rules["rotary"].apply_to_model(model)
    if counts["attention"] or counts["rotary"]:
        model.graph.opset_imports[""] = max(model.graph.opset_imports.get("", 0), ATTENTION_OPSET)
    if counts["linear"] or counts["skip_rms_norm"]:
        model.graph.opset_imports.setdefault(MS_DOMAIN, 1)
    if any(counts.values()):
        common_passes.RemoveUnusedNodesPass()(model)
        # one Slice of the rotary tables per layer, not one per rotated tensor
        common_passes.CommonSubexpressionEliminationPass()(model)
    return counts
