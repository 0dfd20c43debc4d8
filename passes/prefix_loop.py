"""The ``prefix_loop`` pass: fixed-prefix layer looping (Accordion).

For every budget ``k`` of a :class:`~looptool.core.plan.PrefixLoop` it builds one straight-line
FX graph from the captured graph in which each layer of the prefix ``S_k`` (Eq. 1) runs a
second time right after its first pass, reading the first pass's output, reusing the same
parameter nodes (weights, norms, MoE router), and writing each branch into the residual
stream through a per-channel gate (Eq. 5)::

    u2 = v  + tanh(g_A) * A(N_A(v))          # sequential layers (pre- or post-norm branch)
    v2 = u2 + tanh(g_M) * M(N_M(u2))
    v2 = v  + tanh(g_A) * A(v) + tanh(g_M) * M(v)   # parallel-residual layers (GPT-NeoX)

For branch-post-norm layers (OLMo2, Gemma3) the gated write is the *normed* branch output,
the value the layer adds to its residual. Gates are zero-initialised, one per write kind
per window layer, shared by all budgets, and take no weight decay, so each second pass is
exactly the identity at conversion.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from looptool.core.graph import ROLE_GATE, LayerGraph, LayerInfo, NewParam, Write, annotate, copy_node
from looptool.core.plan import PrefixLoop
from looptool.passes.emit import emit_layers, last_node, resolve_plan
from looptool.passes.manager import register_pass

_aten = torch.ops.aten


def gate_name(layer: int, kind: str) -> str:
    """Parameter name of the second-pass gate of ``kind`` writes in ``layer``."""
    return f"loop.prefix.{layer}.{kind}_gate"


@register_pass("prefix_loop")
def prefix_loop(lg: LayerGraph, config: dict) -> LayerGraph:
    """Build one budget path per budget of the PrefixLoop plan in ``config``."""
    plan = resolve_plan(lg, PrefixLoop, config, "prefix_loop")
    start, stop = plan.window
    width = lg.source.hidden_size
    new_params = tuple(
        NewParam(gate_name(info.index, w.kind), (width,), init="zeros", no_decay=True, gate=True)
        for info in lg.layers[start:stop]
        for w in info.writes
    )
    paths = {k: build_path(lg, plan.repeated_layers(k)) for k in plan.budgets}
    return lg.replace(new_params=lg.new_params + new_params, paths=paths, plan=plan)


def build_path(lg: LayerGraph, repeated: tuple[int, ...]) -> fx.Graph:
    """The captured graph with each layer in ``repeated`` run twice (second pass gated)."""
    nodes = lg.node_map()
    order = {n: i for i, n in enumerate(lg.graph.nodes)}
    after = {last_node(lg, [lg.layers[i]], order): lg.layers[i] for i in repeated}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in lg.graph.nodes:
        env[node] = copy_node(
            graph, node, fx.node.map_arg(node.args, env.__getitem__), fx.node.map_arg(node.kwargs, env.__getitem__)
        )
        if node in after:
            info = after[node]
            out = nodes[info.output]
            second = emit_layers(graph, env, nodes, [info], env[out], tags={"repeat": 2}, write_hook=_gate)
            env[out] = second[out]
    return graph


def _gate(graph: fx.Graph, info: LayerInfo, write: Write, value: fx.Node) -> fx.Node:
    """``tanh(g) * write`` with ``g`` the layer's zero-initialised gate (Eq. 5)."""
    g = graph.get_attr(gate_name(info.index, write.kind))
    t = graph.call_function(_aten.tanh.default, (g,))
    out = graph.call_function(_aten.mul.Tensor, (t, value))
    for n in (g, t, out):
        annotate(n, ROLE_GATE, info.index, repeat=2, kind=write.kind)
    return out
