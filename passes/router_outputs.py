"""The ``router_outputs`` pass: budget paths also return every MoE router's logits.

A load-balancing auxiliary loss needs the router logits of every router evaluation of a
path (one per execution of an MoE layer, in execution order); capture marks those nodes
``router_logits``. The pass appends them to each path's outputs: ``(logits, *router_logits)``.
Not recorded in the recipe: it changes what a path returns while training, not the model.
"""

from __future__ import annotations

import torch.fx as fx

from looptool.core.errors import PassError
from looptool.core.graph import LayerGraph, annotation, copy_graph
from looptool.passes.manager import LOOPING_PASSES, register_pass


def router_logit_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The router-logit nodes of ``graph`` (marked ``router_logits`` by capture), in graph order."""
    return [n for n in graph.nodes if annotation(n).get("router_logits")]


def with_router_outputs(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` that returns ``(logits, *router_logits)``."""
    new = copy_graph(graph)
    output = next(n for n in new.nodes if n.op == "output")
    output.args = ((output.args[0], *router_logit_nodes(new)),)
    return new


# before checkpoint (the marked nodes must be visible, not outlined) and before exit_outputs
# (which puts the exit logits right after the LM logits and keeps later outputs after them)
@register_pass("router_outputs", replayable=False, requires=LOOPING_PASSES, before=("checkpoint", "exit_outputs"))
def router_outputs(lg: LayerGraph, config: dict) -> LayerGraph:
    """Make every budget path return its router logits after the LM logits (``config`` is unused)."""
    if not lg.paths:
        raise PassError("router_outputs: the graph has no budget paths; run a looping pass first.")
    return lg.replace(paths={k: with_router_outputs(g) for k, g in lg.paths.items()})
