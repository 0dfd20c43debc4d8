"""The ``ablate_repetitions`` pass: remove the second pass of chosen repeated layers.

Accordion's Hydra-effect analysis measures what a repetition contributes by *removing* it
from a complete budget path and comparing losses: removing each repetition alone, and
several together. Removing the repetition of layer ``i`` here means that every gated write
of its second pass (the ``tanh(g) * branch`` that :mod:`looptool.passes.prefix_loop` adds
into the residual stream, Eq. 5) is replaced by zero, so the second pass leaves the stream
unchanged — exactly, not approximately: the residual add becomes ``stream + 0``, and the
second-pass branch, now unread, is dropped from the graph. Removing every repetition of a
budget therefore computes what budget 0 computes, bit for bit.

The writes are found by annotation alone (role ``gate`` feeding a ``residual`` add of a
``repeat=2`` application of the layer), so the edit works for every architecture the
capture supports::

    graph = ablate_repetitions(model.layer_graph.paths[k], [9, 10])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from looptool.core.errors import PassError
from looptool.core.graph import ROLE_GATE, ROLE_RESIDUAL, LayerGraph, annotation, copy_graph
from looptool.passes.manager import register_pass

_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def gated_writes(graph: fx.Graph, layers: Iterable[int] | None = None) -> list[tuple[fx.Node, fx.Node]]:
    """``(residual add, gated write)`` of every second-pass write in ``graph`` (of ``layers``
    only, if given), in graph order."""
    wanted = None if layers is None else set(layers)
    found = []
    for node in graph.nodes:
        ann = annotation(node)
        if ann.get("role") != ROLE_RESIDUAL or ann.get("repeat") != 2:
            continue
        if wanted is not None and ann.get("layer") not in wanted:
            continue
        found += [(node, a) for a in node.args if isinstance(a, fx.Node) and annotation(a).get("role") == ROLE_GATE]
    return found


def ablate_repetitions(graph: fx.Graph, layers: Iterable[int]) -> fx.Graph:
    """A copy of one budget path with the gated second-pass writes of ``layers`` set to zero
    (the repetition of each of those layers removed); ``graph`` is not modified.

    Refuses layers the path does not repeat, naming the ones it does.
    """
    layers = sorted(set(layers))
    new = copy_graph(graph)
    writes = gated_writes(new, layers)
    missing = sorted(set(layers) - {annotation(add)["layer"] for add, _ in writes})
    if missing:
        repeated = sorted({annotation(add)["layer"] for add, _ in gated_writes(new)})
        raise PassError(
            f"ablate_repetitions: this budget path does not repeat layer(s) {missing}; it repeats "
            f"{repeated or 'no layer'}."
        )
    for add, write in writes:
        add.args = tuple(0.0 if a is write else a for a in add.args)  # stream + 0: the write removed
    _drop_dead(new)  # the second-pass branches nothing reads any more
    return new


def _mutated(node: fx.Node) -> list[fx.Node]:
    """The graph values an in-place op writes into (from its schema's alias annotations)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return [
        values[a.name]
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and isinstance(values.get(a.name), fx.Node)
    ]


def _drop_dead(graph: fx.Graph) -> None:
    """Erase the nodes no output depends on. Unlike ``Graph.eliminate_dead_code``, which
    keeps every op it cannot prove pure (seeded attention, dtype assertions, an MoE
    dispatch's ``index_put_`` into its own buffer) and with it a whole dead branch, the only
    side effects kept are writes into tensors that outlive the graph (inputs, parameters:
    KV caches), writes into tensors something live reads, and assertions on live values."""
    internal = {n for n in graph.nodes if n.op == "call_function"}
    writes = {n: _mutated(n) for n in graph.nodes}
    roots = [n for n in graph.nodes if n.op in ("output", "placeholder") or any(m not in internal for m in writes[n])]
    live: set[fx.Node] = set()
    while roots:
        stack = roots
        while stack:
            node = stack.pop()
            if node not in live:
                live.add(node)
                stack.extend(node.all_input_nodes)
        roots = [n for n, written in writes.items() if n not in live and any(m in live for m in written)]
    live |= {n for n in graph.nodes if n.target is _ASSERT and all(i in live for i in n.all_input_nodes)}
    for node in reversed(list(graph.nodes)):
        if node not in live:
            graph.erase_node(node)


# before fuse and checkpoint: both hide the gated writes (fused into one op, outlined into a region)
@register_pass("ablate_repetitions", requires=("prefix_loop",), before=("fuse", "checkpoint"))
def ablate_repetitions_pass(lg: LayerGraph, config: dict) -> LayerGraph:
    """``config = {"layers": [i, ...]}``: remove those layers' repetitions from every budget
    path that repeats them (paths that do not repeat a layer are left as they are)."""
    layers = config.get("layers")
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise PassError("ablate_repetitions needs config {'layers': [layer indices]}.")
    if not lg.paths:
        raise PassError("ablate_repetitions: the graph has no budget paths; run prefix_loop first.")
    repeated = {k: {annotation(add)["layer"] for add, _ in gated_writes(g)} for k, g in lg.paths.items()}
    unknown = sorted(set(layers) - set().union(*repeated.values()))
    if unknown:
        raise PassError(
            f"ablate_repetitions: no budget path repeats layer(s) {unknown}; the repeated layers are "
            f"{sorted(set().union(*repeated.values())) or 'none'}."
        )
    paths = {k: ablate_repetitions(g, repeated[k] & set(layers)) for k, g in lg.paths.items()}
    return lg.replace(paths=paths)
