"""The ``exit_gate`` pass: a learned exit per decision depth, and the graph pieces that read it.

A looped model decides its depth per token under ``budget="auto"``. The hand-made rules of
:mod:`looptool.passes.adaptive_depth` (state change, KL) read a convergence signal; this pass
adds one the model learns (as Ouro, arXiv 2510.25741, trains one exit gate per loop). For every
budget ``d`` of the menu but the deepest it adds an exit head: ``loop.exit.<d>.weight``
(``[hidden]``) and ``loop.exit.<d>.bias`` (``[1]``), tagged no-decay. At depth ``d`` the head
reads the state ``h_d`` (ELR: the state after loop ``d``; fixed-prefix looping: the residual
stream after window layer ``d``'s second pass, and for ``d = 0`` after the first window
layer's first pass, the same points the state rule compares) and gives the exit probability

    lambda_d = sigmoid(z_d),   z_d = w_d . rms(h_d) + b_d,   rms(h) = h / sqrt(mean(h^2) + 1e-6)

(the parameter-free RMS normalisation makes one head serve every scale the residual stream
takes). Over the gated depths ``d_1 < ... < d_n`` and the deepest budget ``d_{n+1}`` this is the
exit distribution

    p(d_i) = lambda_{d_i} * prod_{j<i} (1 - lambda_{d_j}),   p(d_{n+1}) = prod_{j<=n} (1 - lambda_{d_j})

and at inference a token stops at the first depth whose cumulative exit probability
``1 - prod_{j<=i} (1 - lambda_{d_j})`` reaches ``q`` (``exit_rule="gate"``, ``exit_threshold=q``).
The biases start at the uniform distribution over the menu (``lambda_{d_i} = 1 / (n + 2 - i)``)
and the weights at zero; no budget path reads a head, so every budget computes exactly what it
did before the pass (conversion stays exact, and a model without ``budget="auto"`` pays nothing).

Training reads the gate logits ``z_d`` at every position through the non-replayable
``exit_gate_outputs`` pass (:func:`with_gate_outputs`); the adaptive-depth graph reads them at
each row's last position (:func:`emit_gate_logit`).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import ROLE_STATE, LayerGraph, NewParam, annotate, annotation, copy_graph
from looptool.core.plan import PrefixLoop, RecurrentLoop
from looptool.passes.manager import register_pass
from looptool.passes.recurrent_loop import EXIT_KEY
from looptool.passes.rowwise_budget import repeated_layers, second_pass_ends

_aten = torch.ops.aten

EXIT_GATE = "exit_gate"  # the pass's name, as recorded in a model's recipe
EXIT_PREFIX = "loop.exit."  # the exit heads' parameter names start so
GATE_EPS = 1e-6  # the RMS normalisation's epsilon
_PART = "exit_gate"


def gate_names(depth: int) -> tuple[str, str]:
    """The ``(weight, bias)`` parameter names of the exit head at ``depth``."""
    return f"{EXIT_PREFIX}{depth}.weight", f"{EXIT_PREFIX}{depth}.bias"


def gated_depths(lg: LayerGraph) -> tuple[int, ...]:
    """The depths that have an exit head (empty: the model has no exit gates)."""
    names = {p.name for p in lg.new_params}
    return tuple(d for d in lg.plan.budgets if gate_names(d)[0] in names) if lg.plan is not None else ()


@register_pass(EXIT_GATE, requires=("prefix_loop", "recurrent_loop"), after=("prefix_loop", "recurrent_loop"))
def exit_gate(lg: LayerGraph, config: dict) -> LayerGraph:
    """Add one exit head per budget but the deepest (``config`` is unused); paths are unchanged."""
    if not isinstance(lg.plan, (PrefixLoop, RecurrentLoop)):
        raise PassError("exit_gate: the graph has no loop plan; run prefix_loop or recurrent_loop first.")
    if gated_depths(lg):
        raise PassError("exit_gate: this model already has exit gates.")
    depths = lg.plan.budgets[:-1]
    if not depths:
        raise PassError("exit_gate: a one-budget menu has no depth to exit at.")
    width = lg.source.hidden_size
    params = []
    for i, d in enumerate(depths):
        weight, bias = gate_names(d)
        prior = 1.0 / (len(depths) + 1 - i)  # the uniform exit distribution over the menu
        params.append(NewParam(weight, (width,), init="zeros", no_decay=True))
        params.append(NewParam(bias, (1,), init="fill", value=math.log(prior / (1 - prior)), no_decay=True))
    return lg.replace(new_params=lg.new_params + tuple(params))


def decision_states(graph: fx.Graph, plan) -> dict[int, fx.Node]:
    """The state each exit head reads, by depth, in one budget path: ELR's loop states ``s_d``;
    under fixed-prefix looping the first window layer's first-pass output (depth 0) and each
    repeated layer's second-pass output (depth ``j``), the states the adaptive-depth pass hands
    its stop tests (:meth:`looptool.passes.adaptive_depth._Active.decide`)."""
    if isinstance(plan, RecurrentLoop):
        return {
            annotation(n)[EXIT_KEY]: n
            for n in graph.nodes
            if EXIT_KEY in annotation(n) and "exit_copy" not in annotation(n)
        }
    states: dict[int, fx.Node] = {}
    for j, layer in enumerate(repeated_layers(graph), start=1):
        out, inp = second_pass_ends(graph, layer)
        if j == 1:
            states[0] = inp
        states[j] = out
    return states


def emit_gate_logit(graph: fx.Graph, state: fx.Node, depth: int, *, last: bool) -> fx.Node:
    """Nodes computing ``z_depth`` (float32) from ``state`` (``[batch, T, hidden]``), inserted
    at the graph's current insertion point: ``[batch]`` at the last position with ``last``,
    else ``[batch, T]``."""

    def op(target, *args) -> fx.Node:
        node = graph.call_function(target, args)
        annotate(node, ROLE_STATE, None, part=_PART)
        return node

    x = op(_aten.select.int, state, 1, -1) if last else state
    x = graph.call_function(_aten._to_copy.default, (x,), {"dtype": torch.float32})
    annotate(x, ROLE_STATE, None, part=_PART)
    mean_square = op(_aten.mean.dim, op(_aten.mul.Tensor, x, x), [-1], True)
    x = op(_aten.mul.Tensor, x, op(_aten.rsqrt.default, op(_aten.add.Tensor, mean_square, GATE_EPS)))
    weight, bias = (graph.get_attr(name) for name in gate_names(depth))
    for node in (weight, bias):
        annotate(node, ROLE_STATE, None, part=_PART)
    weight, bias = (graph.call_function(_aten._to_copy.default, (p,), {"dtype": torch.float32}) for p in (weight, bias))
    for node in (weight, bias):
        annotate(node, ROLE_STATE, None, part=_PART)
    return op(_aten.add.Tensor, op(_aten.sum.dim_IntList, op(_aten.mul.Tensor, x, weight), [-1]), bias)


def gate_logit(state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``z = w . rms(h) + b`` in float32 over the last dimension of ``state``: the formula
    :func:`emit_gate_logit` writes into a graph, for code that holds the tensors."""
    x = state.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + GATE_EPS)
    return (x * weight.float()).sum(-1) + bias.float()


# after checkpoint / router_outputs / exit_outputs: the gate logits go last among the outputs
@register_pass(
    "exit_gate_outputs",
    replayable=False,
    requires=(EXIT_GATE,),
    after=("checkpoint", "router_outputs", "exit_outputs"),
)
def exit_gate_outputs(lg: LayerGraph, config: dict) -> LayerGraph:
    """Make every budget path also return the gate logits ``z_d`` (``[batch, T]``) of each
    gated depth it passes (:func:`with_gate_outputs`; ``config`` is unused)."""
    depths = gated_depths(lg)
    return lg.replace(paths={k: with_gate_outputs(g, lg.plan, depths, k) for k, g in lg.paths.items()})


def with_gate_outputs(graph: fx.Graph, plan, depths: tuple[int, ...], budget: int) -> fx.Graph:
    """A copy of budget ``budget``'s path returning, after its outputs, ``z_d`` at every
    position for each gated depth ``d < budget``, in increasing ``d``."""
    new = copy_graph(graph)
    states = decision_states(new, plan)
    wanted = [d for d in depths if d < budget]
    missing = [d for d in wanted if d not in states]
    if missing:
        raise PassError(f"exit_gate_outputs: budget {budget}'s path has no state at depth {missing[0]}.")
    output = next(n for n in new.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    logits = []
    for d in wanted:
        with new.inserting_before(output):
            logits.append(emit_gate_logit(new, states[d], d, last=False))
    output.args = ((*outs, *logits),)
    return new
