"""The ``decode_interface`` pass: cached decode paths in the decode interface of exported engines.

A cached path (``kv_cache``, ``last_position``; maybe ``fuse``, ``rowwise_budget`` or
``adaptive_depth`` too) writes its KV caches in place (``index_copy_`` on a cache input) and
returns the logits (the adaptive-depth path: the logits, then each row's depth). An
exported engine returns the written caches instead (``present`` beside ``past``, see
:mod:`looptool.backends.interface`). The pass rewrites a copy of every path:

* every in-place cache write becomes the functional ``index_copy``, and later readers of
  that cache read the write's result;
* the path returns ``(logits, present...)``, present ``j`` the last write of cache pair ``j``
  (the adaptive-depth path: ``(logits, depth, present...)``);
* placeholders come in interface order: the step inputs (:data:`~looptool.core.graph.STEP_INPUTS`, then
  ``budgets`` in the row-wise path, or the adaptive-depth path's
  :data:`~looptool.passes.adaptive_depth.AUTO_INPUTS`), then the cache pairs by index, key before value.

Pair ``j`` is the ``j``-th attention execution (layer and execution, from the ``kv``
annotation of its cache inputs) to write a cache, in graph order. The arithmetic is the
path's, op for op. Not recorded in the recipe: it lowers paths, it does not change the model.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import (
    BUDGETS,
    ROWWISE,
    ROWWISE_STEP_INPUTS,
    STEP_INPUTS,
    LayerGraph,
    annotation,
    copy_graph,
)
from looptool.passes.adaptive_depth import AUTO_INPUTS, MIN_BUDGET
from looptool.passes.manager import register_pass

_aten = torch.ops.aten


# after the passes that rewrite a cached path's inputs, outputs or ops: they expect in-place writes and bare logits
@register_pass(
    "decode_interface",
    replayable=False,
    requires=("kv_cache",),
    after=("last_position", "rowwise_budget", "adaptive_depth", "fuse"),
)
def decode_interface(lg: LayerGraph, config: dict) -> LayerGraph:
    """Every cached path of ``lg`` in the decode interface (``config`` is unused)."""
    if not lg.paths:
        raise PassError("decode_interface: the graph has no budget paths; run a looping pass and kv_cache first.")
    return lg.replace(paths={k: interface_path(g, _what(k)) for k, g in lg.paths.items()})


def _what(key: int | str) -> str:
    return "the row-wise graph" if key == ROWWISE else f"budget {key}"


def interface_path(graph: fx.Graph, what: str) -> fx.Graph:
    """A copy of the cached path ``graph`` in the decode interface (``what`` names it in errors)."""
    new = copy_graph(graph)
    written = functional_cache_writes(new, what)
    pair_of: dict[tuple[int, int], int] = {}
    order: dict[fx.Node, tuple[int, int]] = {}  # cache input -> (pair, 0 for keys / 1 for values)
    for cache in written:
        kv = annotation(cache)["kv"]
        pair = pair_of.setdefault((kv["layer"], kv.get("execution", 1)), len(pair_of))
        order[cache] = (pair, 0 if kv["kind"] == "k" else 1)
    if sorted(order.values()) != [(pair, kind) for pair in range(len(pair_of)) for kind in (0, 1)]:
        raise PassError(
            f"decode_interface: {what}: the cached path's cache inputs do not form key/value pairs; "
            "please report this as a bug."
        )
    _order_inputs(new, order, what)
    _order_outputs(new, order, len(new.output_node().args[0]) - len(written))
    return new


def functional_cache_writes(graph: fx.Graph, what: str) -> list[fx.Node]:
    """Turn every in-place cache write of ``graph`` (``index_copy_`` on a cache input; ``graph``
    is the caller's own copy) into the functional ``index_copy``; later readers of the cache
    read the write's result, and the graph returns ``(logits, last write of each cache...)``.
    Returns the cache inputs in the order of their first write."""
    caches = {n for n in graph.nodes if n.op == "placeholder" and "kv" in annotation(n)}
    current: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.index_copy_.default and node.args[0] in caches:
            base = node.args[0]
            source = current.get(base, base)
            with graph.inserting_before(node):
                new = graph.call_function(_aten.index_copy.default, (source, *node.args[1:]), dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            current[base] = new  # first writes keep their place in the dict: the order of first writes
            continue
        if node.op == "output":
            continue
        for base, latest in current.items():  # a later read of a written cache reads the write
            if base in node.all_input_nodes and node is not latest:
                node.replace_input_with(base, latest)
    unwritten = sorted(str(c.target) for c in caches if c not in current)
    if unwritten:
        raise PassError(
            f"decode_interface: {what}: cache input(s) {unwritten} are never written; "
            "this graph is not a cached decode step."
        )
    output = graph.output_node()
    heads = _flatten(output.args[0])  # the logits (and the adaptive path's depths)
    output.args = ((*heads, *current.values()),)
    return list(current)


def _order_inputs(graph: fx.Graph, order: dict[fx.Node, tuple[int, int]], what: str) -> None:
    """Put the placeholders in interface order: the step inputs, then the cache pairs by
    index, key before value (FX placeholder names stay Python identifiers; the interface
    names are given to the exporter)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = interface_inputs({str(n.target) for n in placeholders})
    unknown = [n.target for n in placeholders if n.target not in inputs and n not in order]
    if unknown:
        raise PassError(
            f"decode_interface: {what}: the cached path has input(s) {unknown} outside the decode interface "
            f"{list(inputs)}."
        )
    interface = {
        n: (inputs.index(n.target), 0, 0) if n not in order else (len(inputs), *order[n]) for n in placeholders
    }
    first = placeholders[0]
    for node in sorted(placeholders, key=interface.__getitem__, reverse=True):
        if node is not first:
            first.prepend(node)
        first = node


def interface_inputs(names: set[str]) -> tuple[str, ...]:
    """The step inputs of a path whose placeholders are named ``names``: the row-wise path's,
    the adaptive-depth path's or the plain ones."""
    if BUDGETS in names:
        return ROWWISE_STEP_INPUTS
    return AUTO_INPUTS if MIN_BUDGET in names else STEP_INPUTS


def _order_outputs(graph: fx.Graph, order: dict[fx.Node, tuple[int, int]], heads: int = 1) -> None:
    """Return ``(logits, present...)`` (``heads`` outputs before the presents: the adaptive path's
    depths too), present in the order of the cache inputs they write."""
    output = graph.output_node()
    outs = list(output.args[0])
    writes = outs[heads:]

    def cache_of(write: fx.Node) -> fx.Node:
        while write.op != "placeholder":
            write = write.args[0]
        return write

    output.args = ((*outs[:heads], *sorted(writes, key=lambda w: order[cache_of(w)])),)


def _flatten(value) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]
