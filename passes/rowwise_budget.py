"""The ``rowwise_budget`` pass: one cached decode graph in which every row runs its own budget.

It runs on the cached decode LayerGraph (after ``kv_cache`` and ``last_position``) and turns
the deepest budget's cached path into one graph with an extra input ``budgets`` (int64
``[batch]``, placed right after ``cache_position``) over the deepest path's cache slots, a
superset of every budget's ``(layer, execution)`` pairs. Every row gets exactly its own
budget's computation, by *masking* (``where`` on the row dimension), never by gathering:

* fixed-prefix looping (Accordion Eq. 1, 5): the output of the second pass of window layer
  ``j`` is ``where(k > j, second pass, first pass)``, so a second pass beyond a row's budget
  contributes nothing to that row (the gated residual writes stay fusable);
* ELR (Eq. 2): the state after loop ``i`` is ``where(k >= i, s_i, s_{i-1})``: a row's state
  stops updating after its own loop count; with loop conditioning (Sec. 3.3) every
  conditioning vector is looked up per row, ``c(i/k, k/K)`` for loop ``i`` and ``c(1, k/K)``
  for the output block, and the per-path gate fold ``diag(g) B`` becomes ``g ⊙ (B x~)``;
* last-loop KV (ELR Sec. 3.4): an execution ``e >= 2`` that shares its layer's slot writes
  ``where(active, new, old)``, so a row's cache holds what its own last loop wrote;
  per-loop KV: a row's output never depends on a slot its budget does not use (the
  executions beyond its budget are discarded by the masks above);
* MoE route replay and the fused ops are untouched (loop 1, which every row runs, routes).

Why masking: a gathered row subset would need the matching rows of every cache (a copy of
``[rows, heads, capacity, dim]`` per step unless the rows happen to be contiguous), and a
batch of decode rows is weight-bandwidth bound on CPU, so fewer rows save little; masking
costs the deepest budget in the batch plus one ``where`` per masked tensor. A uniform batch
is best served by that budget's own cached path (the callers dispatch it).

Not recorded in the recipe: it changes how a model is run, not what it is.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import (
    BUDGETS,
    ROLE_INPUT,
    ROLE_STATE,
    ROWWISE,
    LayerGraph,
    annotate,
    annotation,
    copy_graph,
)
from looptool.core.plan import PrefixLoop, RecurrentLoop
from looptool.passes.conditioning import Conditioner
from looptool.passes.kv_cache import execution_of
from looptool.passes.manager import register_pass
from looptool.passes.recurrent_loop import EXIT_KEY

_aten = torch.ops.aten


# after kv_cache and last_position: it masks the routed cache writes and reuses the cut head
@register_pass("rowwise_budget", replayable=False, requires=("kv_cache",), after=("kv_cache", "last_position"))
def rowwise_budget(lg: LayerGraph, config: dict) -> LayerGraph:
    """Replace the budget paths by one row-wise path under key :data:`ROWWISE` (``config`` is unused)."""
    if not lg.paths or ROWWISE in lg.paths:
        raise PassError("rowwise_budget: the graph has no per-budget cached paths to merge.")
    if not isinstance(lg.plan, (PrefixLoop, RecurrentLoop)):
        raise PassError(f"rowwise_budget: no row-wise rule for plan {type(lg.plan).__name__}.")
    deepest = max(lg.paths)
    return lg.replace(paths={ROWWISE: rowwise_graph(lg, lg.paths[deepest])})


def rowwise_graph(lg: LayerGraph, deepest: fx.Graph) -> fx.Graph:
    """A copy of the deepest cached path in which each row runs its own budget."""
    graph = copy_graph(deepest)
    menu = tuple(sorted(lg.paths))
    anchor = next((n for n in graph.nodes if n.op == "placeholder" and n.target == "cache_position"), None)
    if anchor is None:
        raise PassError("rowwise_budget needs a cached decode path (input 'cache_position').")
    with graph.inserting_after(anchor):
        budgets = graph.placeholder(BUDGETS)
    annotate(budgets, ROLE_INPUT, None)
    masks = _Masks(graph, budgets)
    if isinstance(lg.plan, PrefixLoop):
        _mask_second_passes(graph, lg, menu, masks)
    else:
        _mask_states(graph, menu, masks)
        if lg.plan.conditioning:
            _rowwise_conditioning(graph, lg, menu, budgets)
    _mask_shared_cache_writes(graph, lg, menu, masks)
    graph.lint()
    return graph


def threshold(lg: LayerGraph, menu: tuple[int, ...], layer: int, execution: int) -> int:
    """The smallest budget of ``menu`` that runs ``layer`` at least ``execution`` times; every
    deeper budget must run it too (budgets nest), else one sentence refuses the plan."""
    n = len(lg.layers)
    runs = [k for k in menu if lg.plan.executed_layers(k, n).count(layer) >= execution]
    if not runs or runs != [k for k in menu if k >= runs[0]]:
        raise PassError(
            f"rowwise_budget: execution {execution} of layer {layer} is not run by a nested set of budgets."
        )
    return runs[0]


class _Masks:
    """Emits ``budgets >= t`` once per threshold and rank (broadcast over the row dimension)."""

    def __init__(self, graph: fx.Graph, budgets: fx.Node):
        self.graph, self.budgets = graph, budgets
        self.first = after_inputs(graph)
        self._done: dict[tuple[int, int], fx.Node] = {}

    def at_least(self, t: int, rank: int) -> fx.Node:
        key = (t, rank)
        if key not in self._done:
            with self.graph.inserting_before(self.first):
                ge = self.graph.call_function(_aten.ge.Scalar, (self.budgets, t))
                view = self.graph.call_function(_aten.view.default, (ge, [-1] + [1] * (rank - 1)))
            for n in (ge, view):
                annotate(n, ROLE_INPUT, None, part="rowwise")
            self._done[key] = view
        return self._done[key]


def after_inputs(graph: fx.Graph) -> fx.Node:
    """The node right after the last input (new nodes that read ``budgets`` go before it)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    return last.next


def _select(graph: fx.Graph, mask: fx.Node, new: fx.Node, old: fx.Node, users_of: fx.Node | None = None) -> fx.Node:
    """``where(mask, new, old)`` right after ``new``; with ``users_of``, every other user of
    that node reads the selection instead."""
    with graph.inserting_after(new):
        sel = graph.call_function(_aten.where.self, (mask, new, old))
    sel.meta = {k: v for k, v in new.meta.items() if k != "looptool"}
    # the selection joins the execution it selects from (a layer application stays contiguous for checkpoint/compose)
    execution = {k: v for k, v in annotation(new).items() if k in ("repeat", "loop")}
    annotate(sel, annotation(new).get("role", ROLE_STATE), annotation(new).get("layer"), part="rowwise", **execution)
    if users_of is not None:
        users_of.replace_all_uses_with(sel, delete_user_cb=lambda u: u is not sel)
    return sel


def _rank(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 3


def _mask_second_passes(graph: fx.Graph, lg: LayerGraph, menu: tuple[int, ...], masks: _Masks) -> None:
    """Second pass of window layer ``l``: its output becomes ``where(k runs l twice, out, in)``."""
    for layer in repeated_layers(graph):
        out, inp = second_pass_ends(graph, layer)
        mask = masks.at_least(threshold(lg, menu, layer, 2), _rank(out))
        _select(graph, mask, out, inp, users_of=out)


def repeated_layers(graph: fx.Graph) -> list[int]:
    """The layers whose second pass (Accordion Eq. 1) ``graph`` runs, in order."""
    return sorted({annotation(n)["layer"] for n in graph.nodes if annotation(n).get("repeat") == 2})


def second_pass_ends(graph: fx.Graph, layer: int) -> tuple[fx.Node, fx.Node]:
    """``(output, input)`` of the second pass of ``layer``: its input is the first pass's output."""
    members = {n for n in graph.nodes if annotation(n).get("repeat") == 2 and annotation(n).get("layer") == layer}
    outs = [n for n in members if any(u not in members for u in n.users) and n.op == "call_function"]
    outs = [n for n in outs if "kv" not in annotation(n)]  # cache writes are not the layer output
    ins = {
        i
        for n in members
        for i in n.all_input_nodes
        if i not in members
        and i.op == "call_function"
        and annotation(i).get("layer") == layer
        and "kv" not in annotation(i)
    }
    if len(outs) != 1 or len(ins) != 1:
        raise PassError(f"cannot tell the second pass of layer {layer} apart (its output/input).")
    (out,), (inp,) = outs, ins
    return out, inp


def _mask_states(graph: fx.Graph, menu: tuple[int, ...], masks: _Masks) -> None:
    """ELR state after loop ``i >= 2``: ``where(k >= i, s_i, s_{i-1})`` (Eq. 2 stops at loop k)."""
    states = {annotation(n)[EXIT_KEY]: n for n in graph.nodes if EXIT_KEY in annotation(n)}
    prev = states.get(1)
    for i in sorted(states):
        t = next((k for k in menu if k >= i), None)
        if i < 2 or t is None or t <= min(menu):
            prev = states[i]  # every row runs loop i
            continue
        prev = _select(graph, masks.at_least(t, _rank(states[i])), states[i], prev, users_of=states[i])


def _mask_shared_cache_writes(graph: fx.Graph, lg: LayerGraph, menu: tuple[int, ...], masks: _Masks) -> None:
    """A write of execution ``e >= 2`` into its layer's shared slot (last-loop KV) keeps the old
    entries of rows whose budget does not run that execution (ELR Sec. 3.4)."""
    for node in list(graph.nodes):
        ann = annotation(node)
        if node.op != "call_function" or node.target is not _aten.index_copy_.default or "kv" not in ann:
            continue
        execution, cache = execution_of(node), node.args[0]
        if execution < 2 or annotation(cache).get("kv", {}).get("execution", 1) == execution:
            continue  # its own slot (per-loop): rows beyond their budget write entries nobody reads
        t = threshold(lg, menu, ann["layer"], execution)
        if t <= min(menu):
            continue
        dim, index, new = node.args[1], node.args[2], node.args[3]
        with graph.inserting_before(node):
            old = graph.call_function(_aten.index_select.default, (cache, dim, index))
            execution_keys = {k: v for k, v in ann.items() if k in ("repeat", "loop")}  # stay in this execution
            annotate(old, ann["role"], ann["layer"], part="rowwise", **execution_keys)
            sel = graph.call_function(_aten.where.self, (masks.at_least(t, 4), new, old))
            annotate(sel, ann["role"], ann["layer"], part="rowwise", **execution_keys)
        node.args = (cache, dim, index, sel, *node.args[4:])


def _rowwise_conditioning(graph: fx.Graph, lg: LayerGraph, menu: tuple[int, ...], budgets: fx.Node) -> None:
    """Each conditioning vector becomes a per-row lookup ``[batch, 1, cond_dim]`` (ELR Sec. 3.3):
    loop ``i`` reads ``c(i/k, k/K)`` and the output block ``c(1, k/K)`` for the row's ``k``."""
    plan = lg.plan
    vectors = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target is _aten.linear.default
        and getattr(n.args[1], "target", None) == "loop.cond.mlp_out_weight"
    ]
    deepest = max(menu)
    if len(vectors) not in (deepest, deepest + 1):
        raise PassError(f"rowwise_budget: found {len(vectors)} loop-conditioning vectors for {deepest} loops.")
    first = after_inputs(graph)
    for index, old in enumerate(vectors):
        loop = index + 1 if index < deepest else None  # None: the output block
        with graph.inserting_before(first):
            table = []
            for k in range(deepest + 1):  # indexed by the budget value; unused values hold a neighbour
                kk = min(max(k, loop or 1, min(menu)), deepest)
                cond = Conditioner(graph, lg, plan, kk)
                table.append(cond.loop_vector(loop) if loop is not None else cond.output_vector())
            stacked = graph.call_function(_aten.stack.default, (table,))
            rows = graph.call_function(_aten.index_select.default, (stacked, 0, budgets))
            per_row = graph.call_function(_aten.unsqueeze.default, (rows, 1))
        for n in (stacked, rows, per_row):
            annotate(n, ROLE_STATE, None, part="conditioning")
        old.replace_all_uses_with(per_row)
    _unfold_gates(graph)
    _erase_unused(graph)


def _unfold_gates(graph: fx.Graph) -> None:
    """``linear(x~, diag(g) B)`` (a per-path fold) → ``g ⊙ linear(x~, B)`` for per-row ``g``;
    a fused ``modulate`` holding the fold is unfused the same way."""
    for fold in list(graph.nodes):
        if not (
            fold.op == "call_function"
            and fold.target is _aten.mul.Tensor
            and annotation(fold).get("part") == "conditioning"
            and getattr(fold.args[0], "target", None) is _aten.unsqueeze.default
            and getattr(fold.args[1], "op", None) == "get_attr"
        ):
            continue
        gate, down = fold.args[0].args[0], fold.args[1]
        for user in list(fold.users):
            with graph.inserting_before(user):
                if user.target is _aten.linear.default and user.args[1] is fold:
                    x_t = user.args[0]
                    low = _cond(graph, _aten.mul.Tensor, _cond(graph, _aten.linear.default, x_t, down), gate)
                    user.replace_all_uses_with(low)
                elif user.target is torch.ops.looptool.modulate.default:
                    x, scale, shift, _, up = user.args
                    x_t = _cond(graph, _aten.addcmul.default, shift, scale, x)
                    low = _cond(graph, _aten.mul.Tensor, _cond(graph, _aten.linear.default, x_t, down), gate)
                    out = _cond(graph, _aten.add.Tensor, x_t, _cond(graph, _aten.linear.default, low, up))
                    out.meta.update({k: v for k, v in user.meta.items() if k != "looptool"})
                    user.replace_all_uses_with(out)
                else:
                    raise PassError(f"rowwise_budget: unexpected reader '{user.name}' of a folded conditioning gate.")
            graph.erase_node(user)


def _cond(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    annotate(node, ROLE_STATE, None, part="conditioning")
    return node


def _erase_unused(graph: fx.Graph) -> None:
    """Erase conditioning nodes and ``loop.*`` parameter reads left without users."""
    for node in reversed(list(graph.nodes)):
        dead = not node.users and (
            (node.op == "call_function" and annotation(node).get("part") == "conditioning")
            or (node.op == "get_attr" and str(node.target).startswith("loop."))
        )
        if dead:
            graph.erase_node(node)
