"""The ``last_position`` pass: the LM head reads only the last position.

Generation (eager or exported) needs the next-token logits only, yet a captured path
applies the head to every position: for a 128-token SmolLM2 prefill that is a
128 × 576 × 49,152 matmul, about a tenth of the prefill's FLOPs. The pass slices every
hidden state entering a head node (role ``head``, marked by capture) to ``[:, -1:]``, so a
path returns ``logits [batch, 1, vocab]`` (like transformers' ``logits_to_keep=1``). The
head is per-position, so the last position's logits are the same computation. Not recorded
in the recipe: it changes what a path returns, not the model.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import ROLE_HEAD, LayerGraph, annotation, copy_graph
from looptool.passes.manager import LOOPING_PASSES, register_pass

_END = 9223372036854775807  # what torch.export records for an open slice end


@register_pass("last_position", replayable=False, requires=LOOPING_PASSES)
def last_position(lg: LayerGraph, config: dict) -> LayerGraph:
    """Cut the head of every budget path to the last position (``config`` is unused)."""
    if not lg.paths:
        raise PassError("last_position: the graph has no budget paths; run a looping pass first.")
    return lg.replace(paths={k: last_position_head(g) for k, g in lg.paths.items()})


def last_position_head(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose head nodes read ``[:, -1:]`` of the hidden states entering them."""
    new = copy_graph(graph)
    head = [n for n in new.nodes if annotation(n).get("role") == ROLE_HEAD]
    members = set(head)
    sliced = 0
    for node in head:
        for inp in node.all_input_nodes:
            if inp in members or inp.op == "get_attr":
                continue
            val = inp.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() != 3:
                continue
            with new.inserting_after(inp):
                cut = new.call_function(torch.ops.aten.slice.Tensor, (inp, 1, -1, _END))
            cut.meta = {k: v for k, v in inp.meta.items() if k != "val"}
            node.replace_input_with(inp, cut)
            sliced += 1
    if not sliced:
        raise PassError("last_position: found no hidden-state input of a node marked as the LM head.")
    return new
