"""The ``checkpoint`` pass: activation checkpointing per layer application.

A budget path's activation memory grows with its effective depth, because every
execution of a layer (a repeated layer's second pass, loop ``i`` of a recurrent block)
keeps its own intermediates for backward. This pass outlines each *layer application* —
the nodes of one layer annotated with one execution (``repeat`` / ``loop``, see
:func:`looptool.passes.kv_cache.execution_of`) — into a region that runs under
``torch.utils.checkpoint`` (non-reentrant): forward keeps only the region's inputs and
outputs, backward recomputes the rest. The recomputation runs the very same ops in the
same order, so losses and gradients equal the uncheckpointed path bit for bit.

Parameters enter a region as inputs (their ``get_attr`` nodes stay outside it), so a layer
applied twice reads one tensor twice and nothing is copied. Not recorded in the recipe: it
changes how a path trains, not what it computes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils.checkpoint

from looptool.errors import PassError
from looptool.graph import META_KEY, ROLE_LAYER, LayerGraph, annotation
from looptool.passes.kv_cache import execution_of
from looptool.passes.manager import register_pass


class Region:
    """One outlined layer application: calls its body under non-reentrant checkpointing
    while autograd records (and plainly otherwise). FX calls it as a function target."""

    def __init__(self, body: fx.GraphModule, name: str, layer: int, execution: int):
        self.body = body
        self.layer = layer
        self.execution = execution
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args):
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)
        return self.body(*args)

    def __repr__(self) -> str:
        return f"Region(layer={self.layer}, execution={self.execution})"


@register_pass("checkpoint", replayable=False)
def checkpoint(lg: LayerGraph, config: dict) -> LayerGraph:
    """Outline every layer application of every budget path (``config`` is unused)."""
    if not lg.paths:
        raise PassError("checkpoint: the graph has no budget paths; run a looping pass first.")
    return lg.replace(paths={k: checkpoint_regions(g) for k, g in lg.paths.items()})


def application_of(node: fx.Node) -> tuple[int, int] | None:
    """``(layer, execution)`` of a node computed inside a layer application, else None.
    Parameters, placeholders and shape arithmetic belong to no application."""
    if node.op != "call_function":
        return None
    layer = annotation(node).get("layer")
    if not isinstance(layer, int):
        return None
    val = node.meta.get("val")
    if val is not None and not isinstance(val, (torch.Tensor, tuple, list)):
        return None  # a SymInt
    return layer, execution_of(node)


def regions_of(graph: fx.Graph) -> list[list[fx.Node]]:
    """The layer applications of ``graph``, each as its member nodes in graph order.

    A node of no application that sits inside an application's span and reads one of its
    members is absorbed into it (so the region's outputs are all read after it ends); an
    application whose members are interleaved with another's is refused.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key: dict[tuple[int, int], list[fx.Node]] = {}
    for node in graph.nodes:
        key = application_of(node)
        if key is not None:
            by_key.setdefault(key, []).append(node)
    regions = []
    for key, members in by_key.items():
        member_set = set(members)
        first, last = order[members[0]], order[members[-1]]
        nodes = list(graph.nodes)[first:last + 1]
        for node in nodes:
            if node in member_set:
                continue
            other = application_of(node)
            if other is not None:
                raise PassError(
                    f"checkpoint: layer {key[0]} (execution {key[1]}) is interleaved with layer "
                    f"{other[0]} (execution {other[1]}); its application cannot be outlined."
                )
            if node.op == "call_function" and any(i in member_set for i in node.all_input_nodes):
                member_set.add(node)
        regions.append([n for n in nodes if n in member_set])
    return regions


def checkpoint_regions(graph: fx.Graph) -> fx.Graph:
    """A copy of one budget path in which every layer application is one ``Region`` call."""
    regions = regions_of(graph)
    owner = {n: i for i, region in enumerate(regions) for n in region}
    last_of = {region[-1]: i for i, region in enumerate(regions)}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in owner and node not in last_of:
            continue
        if node in last_of:
            region = regions[last_of[node]]
            members = set(region)
            inputs = list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in members))
            outputs = [n for n in region if any(u not in members for u in n.users)]
            body = _body(region, inputs, outputs)
            key = application_of(region[0])
            ann = annotation(region[0])
            fn = Region(body, f"layer{key[0]}_x{key[1]}", *key)
            call = new.call_function(fn, tuple(env[i] for i in inputs))
            call.meta[META_KEY] = {"role": ROLE_LAYER, "layer": key[0], "region": key[1],
                                   **{k: ann[k] for k in ("repeat", "loop") if k in ann}}
            for j, out in enumerate(outputs):
                item = new.call_function(operator.getitem, (call, j))
                item.meta = dict(out.meta)
                env[out] = item
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    return new


def _body(region: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """The region's nodes as a GraphModule of its inputs returning a tuple of its outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}")
        env[node].meta = dict(node.meta)
    for node in region:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)
