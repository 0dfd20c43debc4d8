"""The ``recurrent_loop`` pass: elastic latent recurrence (ELR, Sec. 3.1, 3.4).

Layers ``[start, stop)`` form the recurrent block R, run ``k`` times per budget path; the
layers before form the input block (``h_in`` is their output) and the layers after the
output block. Per loop ``i`` (Sec. 3.1, Eq. 2)::

    s~_i = s_{i-1} + h_in                   (input re-injection; s~_i = s_{i-1} with reinject=False)
    r_i  = R(s~_i)
    s_i  = s_{i-1} + e * step_i             step_i by the update rule:
        adaptive-delta: beta_i * (r_i - s_{i-1}),  beta_i = sigmoid(W_b s~_i + b_b) * softplus(gamma)
        delta:          alpha * (r_i - s_{i-1})    (alpha per channel, init 0.05, Sec. 6.1)
        replace:        r_i - s_{i-1}
        residual:       r_i

``init="exact"`` (a pretrained, non-recurrent source): loop 1 is the source block itself,
``s_1 = R(h_in)`` — no re-injection (``s_0 = 0``) and a full step (the exit factor
``pi_1 = 1`` of Sec. 3.3), because the source was trained on exactly that. Loops ``i >= 2``
re-inject and step with ``e`` = a per-channel *exit gate* initialised to zero (the paper's
``pi_{i>1} + g_exit = 0`` grafting at the switch), so every budget reproduces the source
bit for bit until training moves ``e``. ``init="paper"``: ``s_0 = h_in``, every loop as
above with ``e = 1``, ``W_b = b_b = gamma = 0`` (step 0.5 * softplus(0) ~ 0.35).

Each loop's state ``s_i`` is annotated ``exit=i``: the trainer's intermediate-exit loss reads
the output block at every ``s_i`` through those annotations (:func:`with_exit_outputs`).

Cross-loop route replay (Sec. 3.4): the MoE routers of the recurrent block run on loop 1
only; later loops read loop 1's expert indices and routing weights.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from looptool.core.errors import PassError, PlanError
from looptool.core.graph import (
    META_KEY,
    ROLE_MOE,
    ROLE_ROUTER,
    ROLE_STATE,
    LayerGraph,
    NewParam,
    annotate,
    annotation,
    copy_graph,
)
from looptool.core.plan import RecurrentLoop
from looptool.passes.conditioning import Conditioner, conditioned_layers, conditioning_params
from looptool.passes.emit import emit_layers, last_node, resolve_plan
from looptool.passes.manager import register_pass

_aten = torch.ops.aten
PREFIX = "loop.recurrent."
EXIT_KEY = "exit"  # annotation of the state s_i after loop i (read by the intermediate-exit loss)


def recurrent_params(plan: RecurrentLoop, hidden: int) -> tuple[NewParam, ...]:
    """The parameters the state update adds (shared across loops)."""
    d = hidden
    params: list[NewParam] = []
    if plan.update == "adaptive-delta":  # d^2 + 2d (Sec. 3.1)
        params += [
            NewParam(PREFIX + "beta_weight", (d, d)),
            NewParam(PREFIX + "beta_bias", (d,), no_decay=True),
            NewParam(PREFIX + "beta_gamma", (d,), no_decay=True),
        ]
    elif plan.update == "delta":
        params.append(NewParam(PREFIX + "delta_rate", (d,), init="fill", value=0.05, no_decay=True))
    if plan.init == "exact" and not plan.conditioning:  # with conditioning, g_exit(c_i) plays this role
        params.append(NewParam(PREFIX + "exit_gate", (d,), no_decay=True, gate=True))
    return tuple(params)


@register_pass("recurrent_loop")
def recurrent_loop(lg: LayerGraph, config: dict) -> LayerGraph:
    """Build one budget path per loop count ``1..max_loops`` of the RecurrentLoop plan."""
    plan = resolve_plan(lg, RecurrentLoop, config, "recurrent_loop")
    start, stop = plan.recurrent
    block = lg.layers[start:stop]
    if plan.route_replay and not any(w.kind == ROLE_MOE for info in block for w in info.writes):
        raise PlanError(
            f"route replay needs MoE layers in the recurrent block, but layers {start}:{stop} of "
            f"this {lg.source.model_type} model are dense; set route_replay=False.",
            parameter="route_replay",
            rerun="convert",
        )
    new_params = recurrent_params(plan, lg.source.hidden_size)
    if plan.conditioning:
        new_params += conditioning_params(lg, plan, conditioned_layers(lg, start, stop))
    paths = {k: build_path(lg, plan, k) for k in plan.budgets}
    return lg.replace(new_params=lg.new_params + new_params, paths=paths, plan=plan)


def router_nodes(lg: LayerGraph, layers) -> tuple[frozenset[fx.Node], frozenset[fx.Node]]:
    """(all router nodes, the router outputs read by the experts) of the given layers."""
    nodes = lg.node_map()
    router: set[fx.Node] = set()
    for info in layers:
        found = {nodes[n] for n in info.nodes if annotation(nodes[n]).get("role") == ROLE_ROUTER}
        if any(w.kind == ROLE_MOE for w in info.writes) and not found:
            raise PassError(
                f"route replay: the router of MoE layer {info.index} could not be told apart "
                "from its experts; convert with route_replay=False.",
                parameter="route_replay",
                rerun="convert",
            )
        router |= found
    frontier = {n for n in router if any(u not in router for u in n.users)}
    return frozenset(router), frozenset(frontier)


class _State:
    """Emits the state-update arithmetic of one budget path (params read once per path)."""

    def __init__(self, graph: fx.Graph, plan: RecurrentLoop):
        self.graph, self.plan = graph, plan
        self._attrs: dict[str, fx.Node] = {}

    def attr(self, name: str) -> fx.Node:
        if name not in self._attrs:
            node = self.graph.get_attr(PREFIX + name)
            annotate(node, ROLE_STATE, None)
            self._attrs[name] = node
        return self._attrs[name]

    def op(self, target, *args, loop: int, name: str | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        annotate(node, ROLE_STATE, None, loop=loop, **({"name": name} if name else {}))
        return node

    def update(self, s_prev: fx.Node, r: fx.Node, s_tilde: fx.Node, loop: int, exit: fx.Node | None = None) -> fx.Node:
        """``s_i = s_{i-1} + e * step_i`` (Eq. 2 and the update rules of Sec. 6.1); ``e`` is
        ``exit`` (conditioning's ``pi_i + g_exit(c_i)``), else the exit gate under exact
        init, else 1."""
        rule = self.plan.update
        if rule == "residual":
            step = r
        else:
            step = self.op(_aten.sub.Tensor, r, s_prev, loop=loop)
            if rule == "adaptive-delta":
                logits = self.op(
                    _aten.linear.default, s_tilde, self.attr("beta_weight"), self.attr("beta_bias"), loop=loop
                )
                rate = self.op(_aten.softplus.default, self.attr("beta_gamma"), loop=loop)
                beta = self.op(
                    _aten.mul.Tensor, self.op(_aten.sigmoid.default, logits, loop=loop), rate, loop=loop, name="beta"
                )
                step = self.op(_aten.mul.Tensor, beta, step, loop=loop)
            elif rule == "delta":
                step = self.op(_aten.mul.Tensor, self.attr("delta_rate"), step, loop=loop)
        if exit is None and self.plan.init == "exact":
            exit = self.attr("exit_gate")
        if exit is not None:
            step = self.op(_aten.mul.Tensor, exit, step, loop=loop, name="exit")
        return self.op(_aten.add.Tensor, s_prev, step, loop=loop, name="state")


def build_path(lg: LayerGraph, plan: RecurrentLoop, loops: int) -> fx.Graph:
    """The captured graph with the recurrent block unrolled ``loops`` times (and, with
    conditioning, the output block modulated)."""
    start, stop = plan.recurrent
    block = lg.layers[start:stop]
    nodes = lg.node_map()
    order = {n: i for i, n in enumerate(lg.graph.nodes)}
    graph = fx.Graph()
    state = _State(graph, plan)
    cond = Conditioner(graph, lg, plan, loops) if plan.conditioning else None
    router, frontier = router_nodes(lg, block) if plan.route_replay else (frozenset(), frozenset())
    env: dict[fx.Node, fx.Node] = {}

    def rec_block() -> fx.Node:
        return _unroll(graph, env, nodes, block, plan, loops, state, cond, router, frontier)

    def out_block() -> fx.Node:
        norm_hook, write_hook = cond.hooks(cond.output_vector())
        local = emit_layers(
            graph,
            env,
            nodes,
            lg.layers[stop:],
            env[nodes[lg.layers[stop].input]],
            tags={"loop": "output"},
            norm_hook=norm_hook,
            write_hook=write_hook,
        )
        return local[nodes[lg.layers[-1].output]]

    blocks = [(block, rec_block)]
    if cond is not None and stop < len(lg.layers):
        blocks.append((lg.layers[stop:], out_block))
    emit_at: dict[fx.Node, tuple] = {}
    members: set[fx.Node] = set()
    for infos, emit in blocks:
        emit_at[last_node(lg, infos, order)] = (nodes[infos[-1].output], emit)
        members |= {nodes[n] for info in infos for n in info.nodes}

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            raise PassError(f"recurrent_loop: node '{n.name}' of a looped block is read from outside it.")
        return env[n]

    for node in lg.graph.nodes:
        if node in members:
            if node in emit_at:
                out, emit = emit_at[node]
                env[out] = emit()
            continue
        env[node] = graph.node_copy(node, lookup)
    return graph


def _unroll(graph, env, nodes, block, plan, loops, state, cond, router, frontier) -> fx.Node:
    h_in = env[nodes[block[0].input]]
    out = nodes[block[-1].output]
    s = h_in  # s_0 (paper init); with exact init loop 1 ignores it
    first: dict[fx.Node, fx.Node] = {}
    for i in range(1, loops + 1):
        exact_first = plan.init == "exact" and i == 1
        if exact_first:
            s_tilde = h_in  # loop 1 is the source block: z_1 = h_in
        elif plan.reinject:
            s_tilde = state.op(_aten.add.Tensor, s, h_in, loop=i, name="reinject")
        else:
            s_tilde = s
        c = cond.loop_vector(i) if cond is not None else None
        z = cond.entry(c, s_tilde, h_in) if cond is not None and i >= 2 else s_tilde
        norm_hook, write_hook = cond.hooks(c) if cond is not None else (None, None)
        replay = plan.route_replay and i > 1
        local = emit_layers(
            graph,
            env,
            nodes,
            block,
            z,
            tags={"loop": i},
            norm_hook=norm_hook,
            write_hook=write_hook,
            skip=router if replay else frozenset(),
            reuse={f: first[f] for f in frontier} if replay else None,
        )
        if i == 1:
            first = local
        r = local[out]
        if exact_first:
            s = r
        else:
            exit = cond.exit_factor(c, first=i == 1) if cond is not None else None
            s = state.update(s, r, s_tilde, loop=i, exit=exit)
        s.meta[META_KEY] = {**annotation(s), EXIT_KEY: i}  # the state s_i: an exit point (intermediate-exit loss)
    return s


# after checkpoint: an exit re-runs the output block's outlined layer applications as whole
# regions (run before it, the copies would join those applications and break outlining); after
# router_outputs: the exit logits go right after the LM logits, before the router logits
@register_pass("exit_outputs", replayable=False, requires=("recurrent_loop",), after=("checkpoint", "router_outputs"))
def exit_outputs(lg: LayerGraph, config: dict) -> LayerGraph:
    """Make every budget path also return the logits at its earlier loop exits
    (:func:`with_exit_outputs`; ``config`` is unused)."""
    return lg.replace(paths={k: with_exit_outputs(g) for k, g in lg.paths.items()})


def with_exit_outputs(graph: fx.Graph) -> fx.Graph:
    """A copy of one budget path that also returns the logits at every earlier loop exit:
    ``(logits, exit_1, ..., exit_{k-1}, *rest)``.

    Exit ``i`` runs the nodes downstream of the last state ``s_k`` (the output block, final
    norm and head, with the budget's own conditioning) on ``s_i`` instead, so deep supervision
    reads the same output block the budget does. Works on paths already outlined into
    checkpoint regions (the annotations survive outlining).
    """
    new = copy_graph(graph)
    exits = {annotation(n)[EXIT_KEY]: n for n in new.nodes if EXIT_KEY in annotation(n)}
    if not exits:
        raise PassError("intermediate exits need an ELR budget path (recurrent_loop); this path has no loop states.")
    final = exits[max(exits)]
    output = next(n for n in new.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    downstream: list[fx.Node] = []
    reached = {final}
    for node in new.nodes:
        if node.op != "output" and any(a in reached for a in node.all_input_nodes):
            reached.add(node)
            downstream.append(node)
    if outs[0] not in reached:
        raise PassError("intermediate exits: the logits do not depend on the last loop state.")
    exit_logits = []
    for i in sorted(exits)[:-1]:
        env = {final: exits[i]}
        with new.inserting_before(output):
            for node in downstream:
                env[node] = new.node_copy(node, lambda a, env=env: env.get(a, a))
                ann = {k: v for k, v in annotation(node).items() if k != "router_logits"}
                env[node].meta[META_KEY] = {**ann, "exit_copy": i}
        exit_logits.append(env[outs[0]])
    output.args = ((outs[0], *exit_logits, *outs[1:]),)
    return new
