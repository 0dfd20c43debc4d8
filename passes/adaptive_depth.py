"""The ``adaptive_depth`` pass: one cached decode graph in which every row decides its own depth,
token by token (``generate(budget="auto")``).

It runs on the cached decode LayerGraph (after ``kv_cache`` and ``last_position``), a sibling of
``rowwise_budget``: it turns the deepest budget's cached path into one path, key
:data:`ADAPTIVE`, with three extra inputs right after ``cache_position`` (:data:`AUTO_INPUTS`):
``min_budget`` and ``max_budget`` (int64 ``[batch]``) and ``exit_threshold`` (float32
``[batch]``), and one extra output after the logits: the realised depth of each row (int64
``[batch]``: loops for ELR, repeated window layers for fixed-prefix looping).

The rule. After each loop ``i`` (ELR) or each repeated window layer's second pass (fixed-prefix
looping) the graph measures, per row, the relative change of the state

    c_i = ||s_i - s_{i-1}|| / ||s_i||

with ``s_i`` the state after loop ``i`` and ``s_{i-1}`` the state it updated (ELR Eq. 2; ``s_0 =
h_in``, the input block's output), or, for window layer ``j``, ``s_{j-1}`` its first-pass output
and ``s_j`` its second-pass output (Accordion Eq. 1, 5). Before the first repeated window layer
the change is that of the first window layer's own first pass (its output against its input),
so a row with ``min_budget = 0`` exits at once when even that step was small. A row runs step
``i`` (loop ``i``, or the second pass of window layer ``i``) iff

    i <= min_budget  or  (it ran step i-1  and  c_{i-1} >= exit_threshold  and  i <= max_budget)

so threshold 0 runs every row to its ``max_budget`` and an infinite threshold stops it at its
``min_budget``. Steps a row does not run are masked exactly as ``rowwise_budget`` masks them
(``where`` on the row dimension, never a gather): the ELR state after loop ``i`` is
``where(active_i, s_i, s_{i-1})``, a window layer's second pass ``where(active_j, second,
first)``, and a last-loop KV write ``where(active, new, old)`` (ELR Sec. 3.4: each layer keeps
one slot per token, holding its last executed pass). Per-loop KV is refused: a token that exits
early writes no keys and values for the loops it skips, which a later token running those loops
would read.

This graph runs every step up to the batch's deepest ``max_budget`` and masks it: it saves
depth, not time. It marks what a follow-up pass needs to stop there instead: each activity
``active_i`` (:data:`STEP_KEY`) and each ``where(active_i, new, old)`` merge (:data:`MERGE_KEY`).
``skip_exited`` (:mod:`looptool.passes.skip_exited`, run on the PyTorch runtime's path after
``grouped_attention``) lifts each masked step into a segment that runs only while some row is
active, bit-identical to this masked graph.

Prefill (``T > 1`` positions): a row's criterion is read at its last position. That position
predicts the token the step emits, it is never padding under left padding (so a row's depth does
not depend on how much padding the batch gave it: a row in a batch decides exactly as alone), and
the decode step (``T = 1``) reads the same position. All positions of a row share its depth.

Loop conditioning (ELR Sec. 3.3) needs the loop count ``k`` before the first loop: loop ``i`` is
conditioned on ``(tau, kappa) = (i / max_budget, max_budget / K)`` and the output block on ``(1,
max_budget / K)``, looked up per row as ``rowwise_budget`` does, and a row may stop early. That
is the only choice under which threshold 0 computes exactly what ``max_budget`` computes;
conditioned on ``min_budget`` or on the realised depth, the early loops would be conditioned on a
count not known when they run.

``exit_rule="kl"`` replaces the state change by the KL divergence ``KL(p_i || p_{i-1})`` between
the next-token distributions read from successive states through the final norm and the LM head
(a logit lens, at the last position). It costs one final norm and one LM head per loop or
repeated layer, for the whole vocabulary, on top of the step's own.

``exit_rule="gate"`` reads the learned exits of :mod:`looptool.passes.exit_gate` instead (the
model needs them: the ``exit_gate`` pass, trained by ``looptool train --exit-gate``): at each
gated depth ``d`` (the menu's budgets but the deepest) a row continues while its cumulative exit
probability ``1 - prod_{d' <= d} (1 - lambda_d')`` is below ``q = exit_threshold`` (in [0, 1]:
0 stops at ``min_budget``, 1 runs to ``max_budget``); between gated depths it continues. It
costs one RMS normalisation and one dot product per gated depth, at the last position.

Not recorded in the recipe: it changes how a model is run, not what it is.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.errors import LooptoolError, PassError
from looptool.core.graph import (
    ADAPTIVE,
    ROLE_EMBEDDING,
    ROLE_FINAL_NORM,
    ROLE_HEAD,
    ROLE_INPUT,
    ROLE_LAYER,
    ROLE_RESIDUAL,
    ROLE_STATE,
    STEP_INPUTS,
    LayerGraph,
    annotate,
    annotation,
    copy_graph,
)
from looptool.core.plan import PrefixLoop, RecurrentLoop
from looptool.passes.exit_gate import emit_gate_logit, gated_depths
from looptool.passes.kv_cache import execution_of
from looptool.passes.manager import register_pass
from looptool.passes.recurrent_loop import EXIT_KEY
from looptool.passes.rowwise_budget import (
    _rank,
    _rowwise_conditioning,
    _select,
    repeated_layers,
    second_pass_ends,
    threshold,
)

_aten = torch.ops.aten

MIN_BUDGET, MAX_BUDGET, EXIT_THRESHOLD = "min_budget", "max_budget", "exit_threshold"
AUTO_INPUTS = (*STEP_INPUTS, MIN_BUDGET, MAX_BUDGET, EXIT_THRESHOLD)  # the adaptive path's inputs before the caches
EXIT_RULES = ("state", "kl", "gate")


def check_exit_rule(rule: str, error: type[LooptoolError] = LooptoolError) -> str:
    """``rule`` when it is an exit rule of :data:`EXIT_RULES`; else one sentence (an ``error``
    naming ``exit_rule``): the one check of every place that takes a rule."""
    if rule not in EXIT_RULES:
        raise error(f"unknown exit_rule {rule!r}; use one of {list(EXIT_RULES)}.", parameter="exit_rule")
    return rule


# annotation keys read by the ``skip_exited`` pass: the activity of step i (bool [batch]), and
# each ``where(active_i, new, old)`` merge of step i (the state, a second pass, a KV write)
STEP_KEY, MERGE_KEY = "active_step", "merge_step"
# the gate rule's running log-survival after the decision of step i (read by the next gated
# decision): a value carried across steps, which a skipped step leaves as it found it
CARRY_KEY = "carry_step"
_PART = "adaptive"
_TINY = torch.finfo(torch.float32).tiny


# after kv_cache and last_position: it masks the routed cache writes and reuses the cut head
@register_pass("adaptive_depth", replayable=False, requires=("kv_cache",), after=("kv_cache", "last_position"))
def adaptive_depth(lg: LayerGraph, config: dict) -> LayerGraph:
    """Replace the budget paths by one adaptive-depth path under key :data:`ADAPTIVE`;
    ``config["exit_rule"]`` is ``"state"`` (default: relative state change) or ``"kl"``."""
    rule = config.get("exit_rule", "state")
    if rule not in EXIT_RULES:
        raise PassError(f"adaptive_depth: unknown exit_rule {rule!r}; use one of {list(EXIT_RULES)}.")
    if not lg.paths or any(isinstance(k, str) for k in lg.paths):
        raise PassError("adaptive_depth: the graph has no per-budget cached paths to merge.")
    if not isinstance(lg.plan, (PrefixLoop, RecurrentLoop)):
        raise PassError(f"adaptive_depth: no adaptive-depth rule for plan {type(lg.plan).__name__}.")
    return lg.replace(paths={ADAPTIVE: adaptive_graph(lg, lg.paths[max(lg.paths)], rule)})


def adaptive_graph(lg: LayerGraph, deepest: fx.Graph, rule: str = "state") -> fx.Graph:
    """A copy of the deepest cached path in which each row decides its own depth in-graph."""
    graph = copy_graph(deepest)
    per_loop = [n for n in graph.nodes if n.op == "placeholder" and annotation(n).get("kv", {}).get("execution", 1) > 1]
    if per_loop:
        raise PassError(
            "adaptive_depth needs the last-loop KV policy: under per-loop KV a token that exits early leaves "
            "the slots of the loops it skips unwritten, and later tokens running those loops would read them."
        )
    anchor = next((n for n in graph.nodes if n.op == "placeholder" and n.target == "cache_position"), None)
    if anchor is None:
        raise PassError("adaptive_depth needs a cached decode path (input 'cache_position').")
    inputs = []
    for name in AUTO_INPUTS[len(STEP_INPUTS) :]:
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(name)
        annotate(anchor, ROLE_INPUT, None)
        inputs.append(anchor)
    menu = tuple(sorted(lg.paths))
    depths = tuple(range(min(menu), max(menu) + 1))  # every integer depth between the menu's ends
    if rule == "gate" and not gated_depths(lg):
        raise PassError(
            "adaptive_depth: exit_rule 'gate' reads the learned exit gates, and this model has none "
            "(the exit_gate pass; train them with exit_gate=True)."
        )
    active = _Active(graph, *inputs, _Lens(graph) if rule == "kl" else None)
    if rule == "gate":
        active.gates = _Gates(graph, inputs[2], gated_depths(lg))
    if isinstance(lg.plan, PrefixLoop):
        _adapt_second_passes(graph, active)
    else:
        _adapt_states(graph, active)
        if lg.plan.conditioning:
            _rowwise_conditioning(graph, lg, menu, inputs[1])  # conditioned on max_budget
    _mask_shared_cache_writes(graph, lg, depths, active)
    _add_depth_output(graph, active)
    graph.lint()
    return graph


class _Active:
    """Per-row activity of each step (``active[i]``, bool ``[batch]``) and the criterion that
    decides it; new nodes go where the criterion's inputs are known."""

    def __init__(self, graph: fx.Graph, lo: fx.Node, hi: fx.Node, thr: fx.Node, lens: _Lens | None):
        self.graph, self.lo, self.hi, self.thr, self.lens = graph, lo, hi, thr, lens
        self.gates: _Gates | None = None  # the learned exits (exit_rule "gate")
        self.steps: dict[int, fx.Node] = {}  # step -> bool [batch]; steps every row runs are absent
        self.base = 0  # steps every row runs (ELR: loop 1)
        self._views: dict[tuple[int, int], fx.Node] = {}

    def op(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        annotate(node, ROLE_STATE, None, part=_PART)
        return node

    def decide(self, step: int, new: fx.Node, old: fx.Node, after: fx.Node) -> None:
        """``active[step]`` from the change ``old -> new``, emitted right after ``after``:
        ``step <= min or (active[step-1] and c >= threshold and step <= max)``."""
        with self.graph.inserting_before(after.next):
            go = self.gates.go(self, step, new) if self.gates is not None else self._go(new, old)
            if go is None:  # no exit head at this depth: a row continues where it ran the step before
                go = self.steps.get(step - 1) or self.op(_aten.ge.Scalar, self.hi, 0)
            elif step - 1 in self.steps:
                go = self.op(_aten.logical_and.default, go, self.steps[step - 1])
            go = self.op(_aten.logical_and.default, go, self.op(_aten.ge.Scalar, self.hi, step))
            self.steps[step] = self.op(_aten.logical_or.default, self.op(_aten.ge.Scalar, self.lo, step), go)
        annotation(self.steps[step])[STEP_KEY] = step

    def _go(self, new: fx.Node, old: fx.Node) -> fx.Node:
        """The state and KL rules: continue while the change ``old -> new`` is at or above the threshold."""
        return self.op(_aten.ge.Tensor, self._criterion(new, old), self.thr)

    def _criterion(self, new: fx.Node, old: fx.Node) -> fx.Node:
        """float32 ``[batch]`` at each row's last position: ``||new - old|| / ||new||``, or with
        the KL rule ``KL(p_new || p_old)`` through the final norm and LM head."""
        if self.lens is not None:
            lp_new, lp_old = (self.lens.log_probs(self, x) for x in (new, old))
            kl = self.op(
                _aten.mul.Tensor, self.op(_aten.exp.default, lp_new), self.op(_aten.sub.Tensor, lp_new, lp_old)
            )
            return self.op(_aten.sum.dim_IntList, kl, [-1])
        new, old = (self.op(_aten.select.int, x, 1, -1) for x in (new, old))
        new, old = (self.op(_aten._to_copy.default, x, dtype=torch.float32) for x in (new, old))
        change = self.op(_aten.linalg_vector_norm.default, self.op(_aten.sub.Tensor, new, old), 2, [-1])
        size = self.op(_aten.clamp_min.default, self.op(_aten.linalg_vector_norm.default, new, 2, [-1]), _TINY)
        return self.op(_aten.div.Tensor, change, size)

    def view(self, step: int, rank: int) -> fx.Node | None:
        """``active[step]`` broadcast over a rank-``rank`` tensor (None: every row runs it)."""
        if step not in self.steps:
            return None
        if (step, rank) not in self._views:
            mask = self.steps[step]
            with self.graph.inserting_before(mask.next):
                self._views[step, rank] = self.op(_aten.view.default, mask, [-1] + [1] * (rank - 1))
        return self._views[step, rank]


def _adapt_states(graph: fx.Graph, active: _Active) -> None:
    """ELR: the state after loop ``i >= 2`` is ``where(active_i, s_i, s_{i-1})`` (Eq. 2 stops
    at the row's depth); ``c_i`` compares ``s_i`` with the state it updated (``s_0 = h_in``)."""
    states = {annotation(n)[EXIT_KEY]: n for n in graph.nodes if EXIT_KEY in annotation(n)}
    if not states:
        raise PassError("adaptive_depth: the ELR path has no loop states.")
    first = {n for n in graph.nodes if annotation(n).get("loop") == 1 and n.op == "call_function"}
    prev = _block_input(first, "the recurrent block")
    active.base = 1  # every row runs loop 1
    last = max(states)
    for i in sorted(states):
        s = states[i]
        mask = active.view(i, _rank(s))
        kept = s if mask is None else _merge(graph, i, mask, s, prev)
        if i < last:
            active.decide(i + 1, s, prev, after=kept)
        prev = kept


def _adapt_second_passes(graph: fx.Graph, active: _Active) -> None:
    """Fixed-prefix: the second pass of window layer ``j`` becomes ``where(active_j, second,
    first)``; ``c_j`` compares the second pass's output with the first pass's."""
    layers = repeated_layers(graph)
    for j, layer in enumerate(layers, start=1):
        out, inp = second_pass_ends(graph, layer)
        if j == 1:  # before the first repeat: the first window layer's own first pass
            first = {
                n
                for n in graph.nodes
                if annotation(n).get("layer") == layer
                and "repeat" not in annotation(n)
                and "kv" not in annotation(n)
                and n.op == "call_function"
            }
            active.decide(1, inp, _block_input(first, f"window layer {layer}"), after=inp)
        kept = _merge(graph, j, active.view(j, _rank(out)), out, inp)
        if j < len(layers):
            active.decide(j + 1, out, inp, after=kept)


def _merge(graph: fx.Graph, step: int, mask: fx.Node, new: fx.Node, old: fx.Node) -> fx.Node:
    """``where(active_step, new, old)`` read by every other user of ``new``, marked as a merge of ``step``."""
    kept = _select(graph, mask, new, old, users_of=new)
    annotation(kept)[MERGE_KEY] = step
    return kept


def _block_input(members: set[fx.Node], what: str) -> fx.Node:
    """The residual stream entering ``members`` (one layer application or loop): their one
    outside input that is the embedding or a layer's residual write."""
    found = {
        i
        for n in members
        for i in n.all_input_nodes
        if i not in members
        and i.op == "call_function"
        and annotation(i).get("role") in (ROLE_EMBEDDING, ROLE_RESIDUAL, ROLE_LAYER)
    }
    if len(found) != 1:
        raise PassError(f"adaptive_depth: cannot tell the residual stream entering {what} ({len(found)} candidates).")
    return next(iter(found))


def _mask_shared_cache_writes(graph: fx.Graph, lg: LayerGraph, depths: tuple[int, ...], active: _Active) -> None:
    """A write of execution ``e >= 2`` into its layer's shared slot (last-loop KV, ELR Sec. 3.4)
    keeps the old entries of rows that do not run that execution at this token."""
    for node in list(graph.nodes):
        ann = annotation(node)
        if node.op != "call_function" or node.target is not _aten.index_copy_.default or "kv" not in ann:
            continue
        execution = execution_of(node)
        if execution < 2:
            continue
        step = threshold(lg, depths, ann["layer"], execution)
        mask = active.view(step, 4)
        if mask is None:
            continue
        cache, dim, index, new = node.args[:4]
        execution_keys = {k: v for k, v in ann.items() if k in ("repeat", "loop")}  # stay in this execution
        with graph.inserting_before(node):
            old = graph.call_function(_aten.index_select.default, (cache, dim, index))
            sel = graph.call_function(_aten.where.self, (mask, new, old))
        for n in (old, sel):
            annotate(n, ann["role"], ann["layer"], part=_PART, **execution_keys)
        annotation(sel)[MERGE_KEY] = step
        node.args = (cache, dim, index, sel, *node.args[4:])


def _add_depth_output(graph: fx.Graph, active: _Active) -> None:
    """Append each row's realised depth (int64 ``[batch]``) to the path's outputs."""
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        depth = active.op(_aten.full_like.default, active.lo, active.base)
        for step in sorted(active.steps):
            ran = active.op(_aten._to_copy.default, active.steps[step], dtype=torch.int64)
            depth = active.op(_aten.add.Tensor, depth, ran)
    outs = output.args[0]
    output.args = ((*outs, depth) if isinstance(outs, (tuple, list)) else (outs, depth),)


class _Gates:
    """The learned exits (``exit_rule="gate"``): the running log-probability that a row has not
    exited, ``log S_d = sum_{gated d' <= d} log(1 - lambda_d')`` with ``log(1 - sigmoid(z)) =
    -softplus(z)``, and the rule's floor ``log(1 - q)`` for ``q`` the exit threshold. A row
    continues past a gated depth ``d`` while ``log S_d > log(1 - q)``, i.e. while its cumulative
    exit probability is below ``q``: ``q = 0`` stops every row at its ``min_budget`` (``log S_d
    <= 0``), ``q = 1`` never stops one (the floor is ``-inf``, ``log S_d`` finite)."""

    def __init__(self, graph: fx.Graph, thr: fx.Node, depths: tuple[int, ...]):
        self.depths = set(depths)
        with graph.inserting_after(thr):
            neg = graph.call_function(_aten.neg.default, (thr,))
        with graph.inserting_after(neg):
            self.floor = graph.call_function(_aten.log1p.default, (neg,))
        with graph.inserting_after(self.floor):
            self.log_survival = graph.call_function(_aten.zeros_like.default, (thr,))  # log S before any gate
        for node in (neg, self.floor, self.log_survival):
            annotate(node, ROLE_STATE, None, part=_PART)

    def go(self, active: _Active, step: int, state: fx.Node) -> fx.Node | None:
        """Whether each row continues to ``step`` by the gate at depth ``step - 1`` (None: no
        gate there). The running ``log S`` is marked :data:`CARRY_KEY` ``step``: ``add(previous,
        -softplus(z))``, so a skipped step hands its first argument on."""
        if step - 1 not in self.depths:
            return None
        z = emit_gate_logit(active.graph, state, step - 1, last=True)
        stay = active.op(_aten.neg.default, active.op(_aten.softplus.default, z, 1, 20))
        self.log_survival = active.op(_aten.add.Tensor, self.log_survival, stay)
        annotation(self.log_survival)[CARRY_KEY] = step
        return active.op(_aten.gt.Tensor, self.log_survival, self.floor)


class _Lens:
    """The final norm and LM head of a path, to re-run on another state (the KL rule)."""

    def __init__(self, graph: fx.Graph):
        self.nodes = [
            n
            for n in graph.nodes
            if n.op == "call_function" and annotation(n).get("role") in (ROLE_FINAL_NORM, ROLE_HEAD)
        ]
        if not any(annotation(n).get("role") == ROLE_HEAD for n in self.nodes):
            raise PassError("adaptive_depth: exit_rule 'kl' needs the path's final norm and LM head.")
        self.input = _block_input(set(self.nodes), "the final norm")

    def log_probs(self, active: _Active, state: fx.Node) -> fx.Node:
        """float32 log-probabilities ``[batch, vocab]`` at the last position of ``state``
        (``[batch, T, hidden]``: all positions, since the final norm's shape arithmetic reads
        ``T``; the path's own last-position cut keeps the LM head to one position)."""
        env = {self.input: state}
        for node in self.nodes:
            env[node] = active.graph.node_copy(node, lambda a: env.get(a, a))
            annotate(env[node], ROLE_STATE, None, part=_PART)
        logits = active.op(_aten.select.int, env[self.nodes[-1]], 1, -1)
        logits = active.op(_aten._to_copy.default, logits, dtype=torch.float32)
        return active.op(_aten._log_softmax.default, logits, -1, False)
