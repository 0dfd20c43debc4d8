"""The ``skip_exited`` pass: an adaptive-depth step stops looping once every row has exited.

It runs on the ``adaptive_depth`` path (after ``grouped_attention``, the last rewrite of that
path's attention). ``adaptive_depth`` runs every step (ELR loop ``i``, or the second pass of
repeated window layer ``i`` for fixed-prefix looping) up to the batch's deepest budget and masks
it per row: the state or second pass merges as ``where(active_i, new, old)``, each last-loop KV
write as ``where(active_i, new, old)``. This pass lifts each masked step into a segment, a
sub-``GraphModule``, called through one node of the path: :class:`SkipSegment` runs it when
``active_i.any()`` and otherwise returns what the masked merges would have selected.

A segment of step ``i`` is found from the marks ``adaptive_depth`` leaves, never from names:
its roots are step ``i``'s merges (:data:`~looptool.passes.adaptive_depth.MERGE_KEY`), the
cache writes storing them, and the activity of step ``i + 1`` (the stop test after step ``i``,
:data:`~looptool.passes.adaptive_depth.STEP_KEY`); its members are the roots and every node
after the last side effect before them whose users are all members (the step's layers, its
loop conditioning, its exit criterion, the KL rule's logit lens). What leaves the segment and
what it is when no row runs step ``i``:

* a merge ``where(active_i, new, old)``: ``old`` (the previous state, the first pass);
* the activity of step ``i + 1``: ``active_i`` itself, all false (a row runs step ``i + 1`` only
  if it ran step ``i`` or ``i + 1 <= min_budget``, which implies ``i <= min_budget``);
* a cache write ``index_copy_(cache, ...)``: ``cache``, unchanged (a masked write stores the
  entries it read, ``where(active, new, old)`` with ``old`` the cache's own);
* the gate rule's running log-survival after the stop test
  (:data:`~looptool.passes.adaptive_depth.CARRY_KEY`, ``add(previous, -softplus(z))``):
  ``previous`` (no row goes on, so no later test reads it for a running row).

So a skipped segment leaves logits, realised depths and caches bit-identical to the masked
path, and once step ``i`` is skipped every later step is too. Route replay (MoE routing of
loop 1 read by later loops) and the per-loop conditioning lookups stay outside: they are read
from before the segment. The path is then no longer one straight-line graph (one Python
branch per step, a device-to-host read of ``active_i.any()``): only the PyTorch runtime's
adaptive path gets it, never an exported or row-wise path. Not recorded in the recipe.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from looptool.core.errors import PassError
from looptool.core.graph import (
    ROLE_INPUT,
    ROLE_OUTPUT,
    ROLE_STATE,
    LayerGraph,
    annotate,
    annotation,
    copy_graph,
    subgraph,
)
from looptool.passes.adaptive_depth import CARRY_KEY, MERGE_KEY, STEP_KEY
from looptool.passes.manager import register_pass

_PART = "skip"


class SkipSegment:
    """One lifted step: ``segment(active, *inputs)`` is ``module(*inputs)`` when some row of
    ``active`` (bool ``[batch]``) runs the step, else the inputs at ``fallbacks`` (what the
    masked merges select). ``runs`` counts the executions (tests, benchmarks)."""

    def __init__(self, step: int, module: fx.GraphModule, fallbacks: tuple[int, ...]):
        self.step, self.module, self.fallbacks, self.runs = step, module, fallbacks, 0
        self.__name__ = f"skip_step_{step}"  # how the path's generated code names it
        self.__module__ = __name__

    def __call__(self, active: torch.Tensor, *inputs):
        if bool(active.any()):
            self.runs += 1
            return self.module(*inputs)
        return tuple(inputs[k] for k in self.fallbacks)

    def __repr__(self) -> str:
        return f"SkipSegment(step={self.step}, runs={self.runs})"


def segments(module: fx.GraphModule) -> list[SkipSegment]:
    """The lifted steps of a path built with this pass, in step order."""
    return [n.target for n in module.graph.nodes if n.op == "call_function" and isinstance(n.target, SkipSegment)]


@register_pass(
    "skip_exited",
    replayable=False,
    requires=("adaptive_depth",),
    after=("adaptive_depth", "grouped_attention"),
)
def skip_exited(lg: LayerGraph, config: dict) -> LayerGraph:
    """Every adaptive-depth path of ``lg`` with its masked steps lifted into
    :class:`SkipSegment` calls (``config`` is unused)."""
    return lg.replace(paths={k: skip_graph(g) for k, g in lg.paths.items()})


def skip_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of an adaptive-depth path whose masked steps run only when some row runs them."""
    graph = copy_graph(graph)
    activity = {annotation(n)[STEP_KEY]: n for n in graph.nodes if STEP_KEY in annotation(n)}
    merges: dict[int, list[fx.Node]] = {}
    carries: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if MERGE_KEY in annotation(node):
            merges.setdefault(annotation(node)[MERGE_KEY], []).append(node)
        if CARRY_KEY in annotation(node):
            carries.setdefault(annotation(node)[CARRY_KEY], []).append(node)
    if not activity or not merges:
        raise PassError("skip_exited: the graph has no adaptive-depth steps; run adaptive_depth first.")
    for step in sorted(merges):
        if step not in activity:
            raise PassError(f"skip_exited: step {step} is masked but has no activity node.")
        replaced = _lift(graph, step, activity[step], merges[step], activity.get(step + 1), carries.get(step + 1, []))
        activity = {k: replaced.get(v, v) for k, v in activity.items()}
        carries = {k: [replaced.get(v, v) for v in vs] for k, vs in carries.items()}
    graph.lint()
    return graph


def _mutates(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
    )


def _fresh(node) -> bool:
    """Whether ``node`` makes a new tensor (``empty_like``, not a view or an input): an MoE
    layer's scatter buffer, which the in-place writes into it leave local to the step."""
    if (
        not isinstance(node, fx.Node)
        or node.op != "call_function"
        or not isinstance(node.target, torch._ops.OpOverload)
    ):
        return False
    schema = node.target._schema
    return not schema.is_mutable and not any(r.alias_info for r in schema.returns)


def _side_effect(node: fx.Node) -> bool:
    """A write outside the step's own fresh tensors (a cache), or an earlier lifted step."""
    if node.op == "call_function" and isinstance(node.target, SkipSegment):
        return True
    return _mutates(node) and not _fresh(node.args[0])


def _held(node: fx.Node, roots: set[fx.Node], members: set[fx.Node]) -> bool:
    """Whether a segment may hold ``node``: no write, a write into a fresh tensor of the
    segment, or a masked cache write (a root storing a merge of the step)."""
    if _mutates(node) and _fresh(node.args[0]):
        return node.args[0] in members
    return not _side_effect(node) or (node in roots and MERGE_KEY in annotation(node.args[-1]))


def _lift(
    graph: fx.Graph,
    step: int,
    active: fx.Node,
    merges: list[fx.Node],
    decision: fx.Node | None,
    carries: list[fx.Node],
) -> dict[fx.Node, fx.Node]:
    """Replace step ``step``'s segment by one :class:`SkipSegment` call; returns, for each
    node that left the segment, the parent-graph node now holding its value. ``carries``: the
    values the decision after the step hands to later decisions (the gate rule's running
    survival), held by the segment and, when it is skipped, their first argument."""
    nodes = list(graph.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    roots = set(merges) | {u for m in merges for u in m.users if _mutates(u)}
    if decision is not None:
        roots.add(decision)
    roots.update(carries)
    last = max(order[r] for r in roots)
    fence = max((order[n] for n in nodes[:last] if _side_effect(n) and n not in roots), default=-1)
    # what a skipped step hands on (the old state, the first pass, the activity) runs regardless
    kept = _upstream([m.args[2] for m in merges if not all(_mutates(u) for u in m.users)] + [active], order, fence)
    members = set(roots)
    for node in reversed(nodes[fence + 1 : last]):
        if node.op == "call_function" and node not in kept and node.users and all(u in members for u in node.users):
            members.add(node)
    stray = [n.name for n in members if not _held(n, roots, members)]
    stray += [r.name for r in roots if order[r] <= fence]
    if stray:
        raise PassError(f"skip_exited: step {step} writes state that its masks do not cover ({stray[0]}).")
    inside = sorted(members, key=order.__getitem__)
    outputs = [m for m in inside if any(u not in members for u in m.users)]
    inputs = sorted({i for m in inside for i in m.all_input_nodes if i not in members}, key=order.__getitem__)
    fallbacks = []
    for out in outputs:
        held = _fallback(out, active, decision)
        if held in members:
            raise PassError(f"skip_exited: what step {step} leaves in '{out.name}' when skipped is computed inside it.")
        if held not in inputs:
            inputs.append(held)
        fallbacks.append(inputs.index(held))
    segment = SkipSegment(step, _segment_module(inside, inputs, outputs), tuple(fallbacks))
    anchor = inside[-1]
    with graph.inserting_after(anchor):
        call = graph.call_function(segment, (active, *inputs))
    annotate(call, ROLE_STATE, None, part=_PART, step=step)
    replaced, after = {}, call
    for k, out in enumerate(outputs):
        with graph.inserting_after(after):
            after = graph.call_function(operator.getitem, (call, k))
        after.meta = dict(out.meta)
        annotate(after, annotation(out)["role"], annotation(out)["layer"], part=_PART)
        out.replace_all_uses_with(after, delete_user_cb=lambda u: u not in members)
        replaced[out] = after
    _move_after(graph, nodes[fence + 1 : order[anchor]], members, set(replaced.values()), after)
    for node in reversed(inside):
        graph.erase_node(node)
    return replaced


def _upstream(starts: list, order: dict[fx.Node, int], fence: int) -> set[fx.Node]:
    """``starts`` and the nodes they read, back to the ``fence`` (graph position)."""
    found: set[fx.Node] = set()
    todo = [n for n in starts if isinstance(n, fx.Node)]
    while todo:
        node = todo.pop()
        if node not in found and order[node] > fence:
            found.add(node)
            todo.extend(node.all_input_nodes)
    return found


def _fallback(out: fx.Node, active: fx.Node, decision: fx.Node | None) -> fx.Node:
    """What ``out`` holds when no row runs the step (see the module docstring)."""
    if out is decision:
        return active
    if CARRY_KEY in annotation(out):  # a skipped step leaves the running value as it was
        return out.args[0]
    if MERGE_KEY in annotation(out) and out.target is torch.ops.aten.where.self:
        return out.args[2]
    if _mutates(out):
        return out.args[0]
    raise PassError(f"skip_exited: cannot tell what '{out.name}' holds when no row runs its step.")


def _move_after(graph: fx.Graph, span: list[fx.Node], members: set, results: set, anchor: fx.Node) -> None:
    """Move the nodes of ``span`` outside the segment that read its results to after
    ``anchor`` (in order); a segment member reading one of them cannot be lifted."""
    moved: set[fx.Node] = set()
    for node in span:
        if node in members or not any(i in results or i in moved for i in node.all_input_nodes):
            continue
        if any(u in members for u in node.users):
            raise PassError(f"skip_exited: '{node.name}' reads the step it feeds; the step cannot be lifted.")
        moved.add(node)
        anchor.append(node)
        anchor = node


def _segment_module(inside: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """``inside`` as a GraphModule of ``inputs`` returning ``outputs`` (a tuple)."""
    sub = subgraph(inside, inputs, outputs)
    for node in sub.nodes:
        if node.op in ("placeholder", "output"):
            annotate(node, ROLE_INPUT if node.op == "placeholder" else ROLE_OUTPUT, None)
    sub.lint()
    return fx.GraphModule(torch.nn.Module(), sub)
