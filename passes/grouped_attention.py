"""The ``grouped_attention`` pass: attention reads the grouped KV cache as it is.

A captured grouped-query attention (transformers' ``repeat_kv``) repeats every key/value head
for its query heads before ``scaled_dot_product_attention``: ``reshape(expand(k[:, :, None]))``
materialises a ``[batch, heads, length, head_dim]`` copy of the whole cache, keys and values,
in every layer of every decode step, so a step's memory traffic grows with the cache a second
time. The pass feeds the cache itself (``[batch, kv_heads, length, head_dim]``, a view) to the
attention op with ``enable_gqa=True``, which computes the same grouped attention without the
copy: each group of ``heads / kv_heads`` query heads reads its one key/value head. On torch's
CPU kernels the outputs are bit-identical (a test checks it on a looped model's decode).

It runs on the PyTorch runtime's cached paths only (the exported graphs keep their own
lowering). Not recorded in the recipe: it changes how a model is run, not what it is.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import LayerGraph, copy_graph
from looptool.passes.manager import register_pass

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


# after the passes that copy layers and route cache writes: it rewrites each attention execution
@register_pass("grouped_attention", replayable=False, requires=("kv_cache",), after=("kv_cache", "rowwise_budget"))
def grouped_attention(lg: LayerGraph, config: dict) -> LayerGraph:
    """Every path of ``lg`` with its repeated key/value heads fed to attention ungrouped
    (``config`` is unused)."""
    if not lg.paths:
        raise PassError("grouped_attention: the graph has no budget paths; run a looping pass and kv_cache first.")
    return lg.replace(paths={k: grouped_path(g) for k, g in lg.paths.items()})


def grouped_path(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose attention ops read ``[batch, kv_heads, length, head_dim]``
    keys and values with ``enable_gqa=True`` wherever they read them repeated per query head."""
    new = copy_graph(graph)
    for node in list(new.nodes):
        if node.op != "call_function" or node.target is not _SDPA or node.kwargs.get("enable_gqa"):
            continue
        q, k, v = node.args[:3]
        k_grouped, v_grouped = _grouped(new, k), _grouped(new, v)
        if k_grouped is None or v_grouped is None:
            continue
        node.args = (q, k_grouped, v_grouped, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
    new.eliminate_dead_code()
    return new


def _grouped(graph: fx.Graph, repeated: fx.Node) -> fx.Node | None:
    """For ``repeated = reshape(expand(x))`` with ``x [B, G, 1, S, D]`` expanded to ``[B, G, R,
    S, D]`` and reshaped to ``[B, G*R, S, D]`` (transformers' ``repeat_kv``), a new node
    ``x.squeeze(2)`` (``[B, G, S, D]``, a view); None for anything else."""
    if not (isinstance(repeated, fx.Node) and repeated.op == "call_function" and repeated.target in _RESHAPES):
        return None
    expand = repeated.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is _aten.expand.default):
        return None
    x = expand.args[0]
    shapes = [_shape(n) for n in (x, expand, repeated)]
    if any(s is None for s in shapes):
        return None
    (b, g, one, s, d), (b2, g2, r, s2, d2), out = shapes
    if not (isinstance(g, int) and isinstance(r, int)) or one != 1 or len(out) != 4:
        return None
    if (b, g, s, d) != (b2, g2, s2, d2) or out != (b, g * r, s, d):
        return None
    with graph.inserting_before(repeated):
        grouped = graph.call_function(_aten.squeeze.dim, (x, 2))
    grouped.meta = {k: v for k, v in x.meta.items() if k != "val"}
    if isinstance(x.meta.get("val"), torch.Tensor):
        grouped.meta["val"] = x.meta["val"].squeeze(2)
    return grouped


def _shape(node) -> tuple | None:
    """The shape recorded for ``node``, symbolic sizes as their expressions' text (compared
    without evaluating them), or None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() not in (4, 5):
        return None
    return tuple(d if isinstance(d, int) else str(d) for d in val.shape)
