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
applied twice reads one tensor twice and nothing is copied; for FSDP2 the same regions can
instead read their layer's parameters inside and run as calls of the layer module
(``layers_path``, see :class:`Region`). Not recorded in the recipe: it changes how a path
trains, not what it computes.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
import torch.utils.checkpoint

from looptool.core.errors import PassError
from looptool.core.graph import META_KEY, ROLE_LAYER, LayerGraph, annotation, shared_graph_module, subgraph
from looptool.passes.kv_cache import execution_of
from looptool.passes.manager import LOOPING_PASSES, register_pass


class Region:
    """One outlined layer application, called by FX as a function target.

    ``checkpoint``: run the body under non-reentrant ``torch.utils.checkpoint`` while
    autograd records. ``module_path``: run the body *as a call of that source layer module*
    (its instance ``forward`` swapped for the body for the duration), so the module's hooks
    fire for every application — FSDP2 all-gathers the layer before each application and
    reduce-scatters its gradients after each application's backward. Bodies that read the
    layer's parameters resolve them at call time, after those hooks ran.
    """

    def __init__(
        self,
        graph: fx.Graph,
        name: str,
        layer: int,
        execution: int,
        *,
        checkpoint: bool = True,
        module_path: str | None = None,
    ):
        self.graph = graph
        self.layer = layer
        self.execution = execution
        self.checkpoint = checkpoint
        self.module_path = module_path
        self.body: fx.GraphModule | None = None
        self.module: torch.nn.Module | None = None
        self.__name__ = self.__qualname__ = name

    def bind(self, owner: torch.nn.Module) -> Region:
        """A copy of this region whose body reads ``owner``'s tensors (one per built path)."""
        bound = copy.copy(self)
        bound.body = shared_graph_module(owner, self.graph)
        bound.module = owner.get_submodule(self.module_path) if self.module_path else None
        return bound

    def __call__(self, *args):
        if self.body is None:
            raise PassError(f"region {self.__name__} was called before being bound to a model (Region.bind).")
        run = self._checkpointed if self.checkpoint and torch.is_grad_enabled() else self.body
        if self.module is None:
            return run(*args)
        self.module.__dict__["forward"] = run  # shadows the class forward for this one call
        try:
            return self.module(*args)
        finally:
            del self.module.__dict__["forward"]

    def _checkpointed(self, *args):
        return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)

    def __repr__(self) -> str:
        return f"Region(layer={self.layer}, execution={self.execution})"


@register_pass("checkpoint", replayable=False, requires=LOOPING_PASSES)
def checkpoint(lg: LayerGraph, config: dict) -> LayerGraph:
    """Outline every layer application of every budget path. ``config``: ``checkpoint``
    (default True: recompute in backward) and ``shard_layers`` (default False: run each
    region as a call of its source layer module, for FSDP2; see :class:`Region`)."""
    if not lg.paths:
        raise PassError("checkpoint: the graph has no budget paths; run a looping pass first.")
    layers_path = lg.source.layers_path if config.get("shard_layers", False) else None
    return lg.replace(
        paths={
            k: checkpoint_regions(g, checkpoint=config.get("checkpoint", True), layers_path=layers_path)
            for k, g in lg.paths.items()
        }
    )


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


def application_members(graph: fx.Graph) -> dict[tuple[int, int], list[fx.Node]]:
    """The member nodes of every layer application of ``graph``, in graph order, keyed by
    ``(layer, execution)`` (:func:`application_of`), applications in order of first node."""
    groups: dict[tuple[int, int], list[fx.Node]] = {}
    for node in graph.nodes:
        key = application_of(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    return groups


def regions_of(graph: fx.Graph) -> list[list[fx.Node]]:
    """The layer applications of ``graph``, each as its member nodes in graph order.

    A node of no application that sits inside an application's span and reads one of its
    members is absorbed into it (so the region's outputs are all read after it ends); an
    application whose members are interleaved with another's is refused.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    regions = []
    for key, members in application_members(graph).items():
        member_set = set(members)
        first, last = order[members[0]], order[members[-1]]
        nodes = list(graph.nodes)[first : last + 1]
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


def checkpoint_regions(graph: fx.Graph, *, checkpoint: bool = True, layers_path: str | None = None) -> fx.Graph:
    """A copy of one budget path in which every layer application is one ``Region`` call.

    With ``layers_path`` (the captured source's decoder-layer list, e.g. ``model.layers``)
    each region reads its layer's parameters itself and runs as a call of that layer module
    (see :class:`Region`); otherwise parameters enter as inputs. Regions must be bound
    (:func:`bind_regions`) before the graph runs.
    """
    regions = regions_of(graph)
    owner = {n: i for i, region in enumerate(regions) for n in region}
    last_of = {region[-1]: i for i, region in enumerate(regions)}

    def own_param(node: fx.Node, layer: int) -> bool:
        return (
            layers_path is not None and node.op == "get_attr" and str(node.target).startswith(f"{layers_path}.{layer}.")
        )

    pulled: set[fx.Node] = set()
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in owner and node not in last_of:
            continue
        if node in last_of:
            region = regions[last_of[node]]
            members = set(region)
            key = application_of(region[0])
            reads = list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in members))
            params = [i for i in reads if own_param(i, key[0])]
            pulled.update(params)
            inputs = [i for i in reads if i not in params]
            outputs = [n for n in region if any(u not in members for u in n.users)]
            ann = annotation(region[0])
            fn = Region(
                subgraph(params + region, inputs, outputs),
                f"layer{key[0]}_x{key[1]}",
                *key,
                checkpoint=checkpoint,
                module_path=f"{layers_path}.{key[0]}" if layers_path else None,
            )
            call = new.call_function(fn, tuple(env[i] for i in inputs))
            call.meta[META_KEY] = {
                "role": ROLE_LAYER,
                "layer": key[0],
                "region": key[1],
                **{k: ann[k] for k in ("repeat", "loop") if k in ann},
            }
            for j, out in enumerate(outputs):
                item = new.call_function(operator.getitem, (call, j))
                item.meta = dict(out.meta)
                env[out] = item
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    for node in pulled:  # read inside the regions only: drop the outer read
        copy_ = env[node]
        if not copy_.users:
            new.erase_node(copy_)
    return new


def bind_regions(gm: fx.GraphModule, owner: torch.nn.Module) -> fx.GraphModule:
    """Bind every ``Region`` call of ``gm``'s graph to ``owner`` (in place); returns ``gm``."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, Region):
            node.target = node.target.bind(owner)
            changed = True
    if changed:
        gm.recompile()
    return gm
