"""Shared machinery of the looping passes: re-emitting captured layers into a new graph.

A looping pass walks the captured graph once, copying nodes into a budget path, and at
chosen points emits extra copies of one or more decoder layers that read a different
block input. Copies reuse the captured ``get_attr`` nodes, so every pass over a layer
reads the very same parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx as fx

from looptool.core.errors import PassError
from looptool.core.graph import META_KEY, LayerGraph, LayerInfo, Write, annotation

# Called for each write of an emitted layer with (graph, layer info, write, new write node);
# returns the node the residual add should use instead (e.g. a gated write).
WriteHook = Callable[[fx.Graph, LayerInfo, Write, fx.Node], fx.Node]
# Called after copying a write's normalised-input node (Write.norm); returns the node the
# branch should read instead (e.g. a modulated input).
NormHook = Callable[[fx.Graph, LayerInfo, Write, fx.Node], fx.Node]


def emit_layers(
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    nodes: dict[str, fx.Node],
    infos: Sequence[LayerInfo],
    block_input: fx.Node,
    *,
    tags: dict,
    write_hook: WriteHook | None = None,
    norm_hook: NormHook | None = None,
    skip: frozenset[fx.Node] = frozenset(),
    reuse: dict[fx.Node, fx.Node] | None = None,
) -> dict[fx.Node, fx.Node]:
    """Emit a copy of the consecutive layers ``infos`` reading ``block_input``.

    Nodes outside the layers resolve through ``env`` (the path built so far). ``skip``
    nodes are not emitted; ``reuse`` maps captured nodes to existing path nodes to read
    instead (route replay). Each copy is annotated with its original role plus ``tags``.
    Returns the captured-node → copy map (read the block output from it).
    """
    local: dict[fx.Node, fx.Node] = {nodes[infos[0].input]: block_input, **(reuse or {})}

    def lookup(n: fx.Node) -> fx.Node:
        return local[n] if n in local else env[n]

    for info in infos:
        writes = {nodes[w.node]: w for w in info.writes}
        adds = {w.add for w in info.writes}
        norms = {w.norm: w for w in info.writes if w.norm is not None} if norm_hook is not None else {}
        for name in info.nodes:
            node = nodes[name]
            if node in skip or node in local:
                continue
            replaced: dict[fx.Node, fx.Node] = {}
            if write_hook is not None and name in adds:
                for arg in node.args:
                    if arg in writes and writes[arg].add == name:
                        replaced[arg] = write_hook(graph, info, writes[arg], lookup(arg))
            copy = graph.node_copy(node, lookup)
            for original, replacement in replaced.items():
                copy.replace_input_with(lookup(original), replacement)
            copy.meta[META_KEY] = {**annotation(node), **tags}  # keep extra marks (router_logits)
            local[node] = norm_hook(graph, info, norms[name], copy) if name in norms else copy
    return local


def last_node(lg: LayerGraph, infos: Sequence[LayerInfo], order: dict[fx.Node, int]) -> fx.Node:
    """The captured node after which a copy of ``infos`` may be emitted, checking that no
    node outside the layers reads their output before that point (no interleaving)."""
    nodes = lg.node_map()
    members = {name for info in infos for name in info.nodes}
    last = max((nodes[n] for n in members), key=order.__getitem__)
    out = nodes[infos[-1].output]
    early = [u for u in out.users if u.name not in members and order[u] < order[last]]
    if early:
        raise PassError(
            f"layer {infos[-1].index}'s output is read by '{early[0].name}' before the layer "
            "ends; the captured graph interleaves layers and cannot be looped."
        )
    return last


def resolve_plan(lg: LayerGraph, plan_cls, config: dict, pass_name: str):
    """The resolved plan of a looping pass; refuses a graph another looping pass already
    rewrote (one looping scheme per model)."""
    if lg.paths:
        raise PassError(f"{pass_name}: this graph is already looped; apply one looping pass per model.")
    return plan_cls.from_dict(config).resolve(len(lg.layers))
