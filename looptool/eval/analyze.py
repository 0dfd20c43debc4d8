"""Mechanistic statistics of a looped model's budget paths (``looptool analyze``).

Everything is read from the budget path's own node annotations (role, layer, ``repeat`` /
``loop``, ``kind``, ``name``, ``exit``) while an :class:`fx.Interpreter` runs the path on
held-out text, so the same code serves every architecture the capture supports:

* **fixed-prefix looping** (Accordion's second-pass analysis), per repeated layer: how many
  routed experts the second pass keeps from the first, the size of second-pass writes
  relative to first-pass writes and their cosine, residual-stream cosines across the
  repeated window, and the Hydra effect (removing adjacent repetitions together costs less
  than the sum of removing each alone);
* **elastic latent recurrence**: per loop, the state-update size ``‖s_i − s_{i−1}‖``, the
  mean adaptive-delta rate ``β_i`` (Eq. 2), the exit factor, and how many routed experts
  each loop keeps from loop 1 (with route replay off);
* **every budget**: the logit-lens loss after every layer application (the path's own final
  norm and LM head applied to the residual stream there).

Conventions (the numbers in ``analysis.json``): a *per-token* quantity is computed for
every position of every row and averaged over all of them; ``‖·‖`` is the L2 norm over
the hidden dimension; a *cosine* is the mean over tokens of the per-token cosine
(``torch.nn.functional.cosine_similarity``, eps 1e-8); a *norm ratio* is the ratio of the
mean per-token norms; a *loss* is the token-weighted mean next-token cross-entropy, as
``looptool eval`` computes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from looptool.train.data import PackedTokens, find_files, tokenize_files
from looptool.runtime.devices import device_of
from looptool.core.errors import LooptoolError
from looptool.eval.evaluate import mean_loss
from looptool.core.graph import (
    ROLE_FINAL_NORM, ROLE_GATE, ROLE_HEAD, ROLE_RESIDUAL, ROLE_ROUTER, ROLE_SHAPE, WRITE_KINDS, annotation,
    dtype_from_str, shared_graph_module,
)
from looptool.runtime.model import LoopedModel
from looptool.passes.ablate import ablate_repetitions
from looptool.passes.checkpoint import application_members, bind_regions
from looptool.passes.recurrent_loop import EXIT_KEY

log = logging.getLogger(__name__)

_TOPK = torch.ops.aten.topk.default
Progress = Callable[[int, int, str], None]  # (units done, units in all, what runs now)


class AnalysisError(LooptoolError):
    """A path whose annotations do not support the requested statistic."""


# --------------------------------------------------------------------------- graph reading
@dataclass(frozen=True)
class Application:
    """One execution of a decoder layer in a budget path: ``execution`` is 2 for a repeated
    layer's second pass, ``i`` for loop ``i`` of a recurrent block, else 1; ``output`` is
    the residual-stream value it leaves (the layer's last residual add)."""

    layer: int
    execution: int
    output: fx.Node

    def as_dict(self) -> dict:
        return {"layer": self.layer, "execution": self.execution}


def layer_applications(graph: fx.Graph) -> list[Application]:
    """Every layer application of ``graph`` in execution order, found by annotation: the
    nodes of one ``(layer, execution)`` and the residual add among them that something
    outside the application reads."""
    apps = []
    for (layer, execution), members in application_members(graph).items():
        inside = set(members)
        outs = [n for n in members if annotation(n).get("role") == ROLE_RESIDUAL and any(u not in inside for u in n.users)]
        if len(outs) != 1:
            raise AnalysisError(f"layer {layer} (execution {execution}) of this path leaves {len(outs)} residual values "
                                "instead of one; its residual stream cannot be read.")
        apps.append(Application(layer, execution, outs[0]))
    return apps


def lens_graph(graph: fx.Graph) -> tuple[fx.Graph, fx.Node, list[fx.Node]]:
    """The path's own final norm and LM head as a graph of the residual stream (the
    logit lens): ``(lens, stream, extras)`` where ``lens(stream_value, *extra_values)``
    returns the logits, ``stream`` is the node the head reads in ``graph`` and ``extras``
    are the other values it reads there (symbolic sizes), passed in as they were."""
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    members = {n for n in graph.nodes if annotation(n).get("role") in (ROLE_FINAL_NORM, ROLE_HEAD)}
    if outs[0] not in members:
        raise AnalysisError("this path's logits are not computed by nodes annotated as the final norm and head; "
                            "the logit lens needs them.")
    needed: set[fx.Node] = set()
    stack = [outs[0]]
    while stack:
        node = stack.pop()
        if node in members and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    reads = list(dict.fromkeys(i for n in graph.nodes if n in needed for i in n.all_input_nodes if i not in needed))
    extras = [n for n in reads if n.op == "placeholder" or annotation(n).get("role") == ROLE_SHAPE]
    streams = [n for n in reads if n.op != "get_attr" and n not in extras]
    if len(streams) != 1:
        raise AnalysisError(f"the final norm reads {len(streams)} residual-stream values instead of one; "
                            "the logit lens cannot be built for this path.")
    lens = fx.Graph()
    env = {streams[0]: lens.placeholder("stream")}
    env.update({n: lens.placeholder(f"extra{i}") for i, n in enumerate(extras)})
    for node in graph.nodes:
        if node in needed or (node.op == "get_attr" and node in reads):
            env[node] = lens.node_copy(node, lambda a: env[a])
    lens.output(env[outs[0]])
    return lens, streams[0], extras


def repeated_layers_of(graph: fx.Graph) -> list[int]:
    """The layers a budget path runs twice (annotated ``repeat=2``)."""
    return sorted({annotation(n)["layer"] for n in graph.nodes
                   if annotation(n).get("repeat") == 2 and isinstance(annotation(n).get("layer"), int)})


def _gated_write_parts(gated: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``(tanh(g), raw write)`` of a gated second-pass write ``tanh(g) * write``."""
    gate = [a for a in gated.args if isinstance(a, fx.Node) and annotation(a).get("role") == ROLE_GATE]
    raw = [a for a in gated.args if isinstance(a, fx.Node) and annotation(a).get("role") != ROLE_GATE]
    if len(gate) != 1 or len(raw) != 1:
        raise AnalysisError(f"the gated write '{gated.name}' is not tanh(g) * write; cannot split it.")
    return gate[0], raw[0]


# --------------------------------------------------------------------------- accumulation
class _Mean:
    """A running mean (float64 sums)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def add(self, values: torch.Tensor) -> None:
        self.total += float(values.double().sum())
        self.count += values.numel()

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


def _token_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-token L2 norm over the hidden (last) dimension."""
    return x.float().reshape(-1, x.shape[-1]).norm(dim=-1)


def _token_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token cosine over the hidden (last) dimension."""
    a, b = torch.broadcast_tensors(a.float(), b.float())
    return F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1, eps=1e-8)


def _kept_experts(first: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Per token, how many of its ``first`` top-k experts ``later`` selects again."""
    k = first.shape[-1]
    a, b = first.reshape(-1, k), later.reshape(-1, later.shape[-1])
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


@dataclass
class _Overlap:
    """Expert overlap between two executions of one router — Accordion's "routed experts the
    second pass keeps from the first" (and ELR's experts a later loop keeps from loop 1): per
    token ``|S_first ∩ S_later|`` of the top-k sets, accumulated as a histogram over 0..k."""

    top_k: int = 0
    counts: torch.Tensor | None = None

    def add(self, first: torch.Tensor, later: torch.Tensor) -> None:
        self.top_k = first.shape[-1]
        hist = torch.bincount(_kept_experts(first, later).cpu(), minlength=self.top_k + 1)
        self.counts = hist if self.counts is None else self.counts + hist

    def as_dict(self) -> dict | None:
        if self.counts is None:
            return None
        total = int(self.counts.sum())
        mean = float((self.counts * torch.arange(self.top_k + 1)).sum()) / total
        return {"top_k": self.top_k, "kept_mean": mean, "kept_fraction": mean / self.top_k,
                "kept_histogram": [float(c) / total for c in self.counts]}


@dataclass
class _WriteStats:
    """First- vs second-pass write of one kind in one repeated layer — Accordion's "second-pass
    writes are comparable in size to first-pass writes but nearly orthogonal": mean per-token
    norms of both (and of the gated write ``tanh(g) ⊙ w₂``, Eq. 5), their ratio, the mean
    per-token cosines, and the mean ``|tanh(g)|``."""

    first_norm: _Mean = field(default_factory=_Mean)
    second_norm: _Mean = field(default_factory=_Mean)
    gated_norm: _Mean = field(default_factory=_Mean)
    cosine: _Mean = field(default_factory=_Mean)
    gated_cosine: _Mean = field(default_factory=_Mean)
    gate_abs: _Mean = field(default_factory=_Mean)

    def as_dict(self) -> dict:
        n1, n2, ng = self.first_norm.value, self.second_norm.value, self.gated_norm.value
        return {"first_norm": n1, "second_norm": n2, "gated_norm": ng,
                "norm_ratio": n2 / n1 if n1 else None, "gated_norm_ratio": ng / n1 if n1 else None,
                "cosine": self.cosine.value, "gated_cosine": self.gated_cosine.value,
                "gate_mean_abs": self.gate_abs.value}


class _Recorder(fx.Interpreter):
    """Runs a budget path node by node and hands chosen values to probes:
    ``probes[node]`` are called as ``probe(value, env)`` right after ``node`` ran (``env``
    still holds the node's inputs)."""

    def __init__(self, gm: fx.GraphModule, probes: dict[fx.Node, list[Callable[[Any, dict], None]]]):
        super().__init__(gm)
        self.probes = probes

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        for probe in self.probes.get(n, ()):
            probe(value, self.env)
        return value


# --------------------------------------------------------------------------- statistics
class _PathStats:
    """The probes of one budget path and what they accumulate over the batches."""

    def __init__(self, model: LoopedModel, gm: fx.GraphModule, *, mechanistic: bool):
        self.gm = gm
        graph = gm.graph
        self.apps = layer_applications(graph)
        lens, stream, extras = lens_graph(graph)
        self.lens = bind_regions(shared_graph_module(model, lens), model)
        self.lens_inputs = [stream, *extras]
        self.probes: dict[fx.Node, list[Callable]] = {}
        self.batch: dict[Any, Any] = {}  # values kept within one batch (first-pass writes, routes)
        self.pending: list[tuple[int, torch.Tensor]] = []  # outputs whose lens waits for a head input
        self.ids: torch.Tensor | None = None
        self.lens_total = [0.0 for _ in self.apps]
        self.lens_count = 0
        self.cosines = [_Mean() for _ in self.apps]
        self.final_total = 0.0
        for i, app in enumerate(self.apps):
            self._probe(app.output, lambda v, env, i=i: self._application(i, v, env))
        for node in extras:  # symbolic sizes the head reads: keep this batch's values
            self._probe(node, lambda v, env, node=node: self.batch.__setitem__(("extra", node), v))
        self.writes: dict[tuple[int, str], _WriteStats] = {}
        self.experts: dict[int, _Overlap] = {}
        self.loops: dict[int, dict[str, _Mean]] = {}
        self.loop_experts: dict[tuple[int, int], _Overlap] = {}
        self.repeated: list[int] = []
        self.recurrent = False
        self.route_replay = False
        if mechanistic:
            self._prefix_probes(graph)
            self._recurrent_probes(graph)

    def _probe(self, node: fx.Node, fn: Callable) -> None:
        self.probes.setdefault(node, []).append(fn)

    # ----------------------------------------------------------------- every path
    def _application(self, i: int, value: torch.Tensor, env: dict) -> None:
        """Residual cosine with the previous application's output, and the logit lens."""
        prev = self.batch.get("prev_output")
        if prev is not None:
            self.cosines[i].add(_token_cosines(prev, value))
        self.batch["prev_output"] = value
        self.pending.append((i, value))
        self._lens()

    def _lens(self) -> None:
        """Logit-lens loss of the pending outputs, once the head's other inputs are known."""
        if not all(("extra", n) in self.batch for n in self.lens_inputs[1:]):
            return
        extras = [self.batch[("extra", n)] for n in self.lens_inputs[1:]]
        for i, value in self.pending:
            logits = self.lens(value, *extras)
            self.lens_total[i] += float(_loss(logits, self.ids)) * _predicted(self.ids)
        self.pending = []

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Run the path on one batch, feeding every probe."""
        self.ids, self.batch = ids, {}
        logits = _Recorder(self.gm, self.probes).run(ids, mask)
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        self._lens()
        if self.pending:
            raise AnalysisError("the logit lens never received the head's size inputs; it cannot run on this path.")
        self.final_total += float(_loss(logits, ids)) * _predicted(ids)
        self.lens_count += _predicted(ids)
        self.batch = {}

    # ----------------------------------------------------------------- prefix looping
    def _prefix_probes(self, graph: fx.Graph) -> None:
        """First- and second-pass writes, gates and routes of every repeated layer."""
        self.repeated = repeated_layers_of(graph)
        repeated = set(self.repeated)
        for node in graph.nodes:
            ann = annotation(node)
            layer = ann.get("layer")
            if layer not in repeated:
                continue
            if ann.get("role") == ROLE_RESIDUAL:
                for arg in node.args:
                    role = annotation(arg).get("role") if isinstance(arg, fx.Node) else None
                    if ann.get("repeat") is None and role in WRITE_KINDS:
                        self._probe(arg, lambda v, env, key=(layer, role): self.batch.__setitem__(("write", key), v))
                    elif ann.get("repeat") == 2 and role == ROLE_GATE:
                        self._second_write_probes(layer, arg)
            elif node.target is _TOPK and ann.get("role") == ROLE_ROUTER:
                execution = 2 if ann.get("repeat") == 2 else 1
                self._probe(node, lambda v, env, layer=layer, ex=execution: self._prefix_route(layer, ex, v[1]))

    def _second_write_probes(self, layer: int, gated: fx.Node) -> None:
        kind = annotation(gated).get("kind")
        stats = self.writes.setdefault((layer, kind), _WriteStats())
        tanh, raw = _gated_write_parts(gated)

        def on_raw(value: torch.Tensor, env: dict) -> None:
            first = self.batch[("write", (layer, kind))]
            stats.first_norm.add(_token_norms(first))
            stats.second_norm.add(_token_norms(value))
            stats.cosine.add(_token_cosines(first, value))

        def on_gated(value: torch.Tensor, env: dict) -> None:
            first = self.batch[("write", (layer, kind))]
            stats.gated_norm.add(_token_norms(value))
            stats.gated_cosine.add(_token_cosines(first, value))
            stats.gate_abs.add(env[tanh].abs())

        self._probe(raw, on_raw)
        self._probe(gated, on_gated)

    def _prefix_route(self, layer: int, execution: int, indices: torch.Tensor) -> None:
        if execution == 1:
            self.batch[("route", layer)] = indices
        elif ("route", layer) in self.batch:
            self.experts.setdefault(layer, _Overlap()).add(self.batch[("route", layer)], indices)

    # ----------------------------------------------------------------- recurrence
    def _recurrent_probes(self, graph: fx.Graph) -> None:
        """States ``s_i`` (and the ``s_{i-1}`` each update reads), ``β_i``, exit factors and
        the routes of every loop."""
        for node in graph.nodes:
            ann = annotation(node)
            loop = ann.get("loop")
            if EXIT_KEY in ann and "exit_copy" not in ann:
                self.recurrent = True
                stats = self.loops.setdefault(ann[EXIT_KEY], {})
                if ann.get("name") == "state":  # s_i = s_{i-1} + step: args[0] is s_{i-1}
                    self._probe(node, lambda v, env, s=stats, prev=node.args[0]: _state_update(s, env[prev], v))
                else:  # loop 1 under exact init: s_1 is the source block's output, no update node
                    self._probe(node, lambda v, env, s=stats: s.setdefault("state_norm", _Mean()).add(_token_norms(v)))
            if not isinstance(loop, int):
                continue
            if ann.get("name") == "beta":
                self._probe(node, lambda v, env, i=loop: self.loops.setdefault(i, {}).setdefault("beta", _Mean()).add(v))
            elif ann.get("name") == "exit":  # e * step: args[0] is the exit factor e
                self._probe(node, lambda v, env, i=loop, f=node.args[0]: _exit_factor(self.loops.setdefault(i, {}), env[f]))
            elif node.target is _TOPK and ann.get("role") == ROLE_ROUTER:
                self._probe(node, lambda v, env, layer=ann["layer"], i=loop: self._loop_route(layer, i, v[1]))
        if self.recurrent:
            routed = {annotation(n)["layer"] for n in graph.nodes if n.target is _TOPK and isinstance(annotation(n).get("loop"), int)}
            later = {annotation(n)["layer"] for n in graph.nodes if n.target is _TOPK
                     and isinstance(annotation(n).get("loop"), int) and annotation(n)["loop"] > 1}
            self.route_replay = bool(routed) and len(self.loops) > 1 and not later

    def _loop_route(self, layer: int, loop: int, indices: torch.Tensor) -> None:
        if loop == 1:
            self.batch[("route", layer)] = indices
        elif ("route", layer) in self.batch:
            self.loop_experts.setdefault((layer, loop), _Overlap()).add(self.batch[("route", layer)], indices)

    # ----------------------------------------------------------------- results
    def lens_result(self) -> dict:
        n = self.lens_count
        return {"loss": self.final_total / n,
                "applications": [{**app.as_dict(), "loss": self.lens_total[i] / n} for i, app in enumerate(self.apps)]}

    def cosine_result(self) -> list[dict]:
        return [{**app.as_dict(), "cosine": self.cosines[i].value} for i, app in enumerate(self.apps)]


def _state_update(stats: dict, prev: torch.Tensor, state: torch.Tensor) -> None:
    """``‖s_i − s_{i−1}‖`` and ``‖s_{i−1}‖`` per token (ELR Eq. 2's state update)."""
    stats.setdefault("update_norm", _Mean()).add(_token_norms(state - prev))
    stats.setdefault("prev_norm", _Mean()).add(_token_norms(prev))
    stats.setdefault("state_norm", _Mean()).add(_token_norms(state))


def _exit_factor(stats: dict, factor: torch.Tensor) -> None:
    stats.setdefault("exit", _Mean()).add(factor)
    stats.setdefault("exit_abs", _Mean()).add(factor.abs())


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` against ``ids`` (as ``LoopedModel``)."""
    return ForCausalLMLoss(logits, ids, vocab_size=logits.shape[-1])


def _predicted(ids: torch.Tensor) -> int:
    return ids.numel() - ids.shape[0]


# --------------------------------------------------------------------------- Hydra effect
def hydra_sets(repeated: Sequence[int], spacing: int = 3) -> dict[str, list[tuple[int, ...]]]:
    """The repetitions the Hydra analysis removes: each alone, each adjacent pair, and each
    triplet ``(r_j, r_{j+s}, r_{j+2s})`` of repeated layers ``spacing`` apart."""
    r = list(repeated)
    return {
        "single": [(i,) for i in r],
        "adjacent_pairs": [(a, b) for a, b in zip(r, r[1:]) if b == a + 1],
        "spaced_triplets": [(r[j], r[j + spacing], r[j + 2 * spacing]) for j in range(len(r) - 2 * spacing)],
    }


def hydra_effect(model: LoopedModel, budget: int, data: PackedTokens, *, batch: int = 4, spacing: int = 3,
                 on_step: Callable[[str], None] | None = None) -> dict:
    """Accordion's Hydra effect: the loss increase from removing repetitions of the budget
    path (:func:`~looptool.passes.ablate.ablate_repetitions`), alone and together.

    For every set ``S`` of :func:`hydra_sets`: ``delta(S) = loss(path without S) − loss(path)``;
    for pairs and triplets also ``sum_of_single = Σ_{i∈S} delta({i})`` and
    ``ratio = delta(S) / sum_of_single`` (the share of the summed individual effects that
    removing them together costs; 1 = additive, < 1 = the Hydra effect).
    """
    graph = model.layer_graph.paths[model.check_budget(budget)]
    gm = model.path(budget)
    device = device_of(model)
    mask_dtype = dtype_from_str(model.layer_graph.source.mask_dtype)

    def loss_of(path: fx.GraphModule) -> float:
        def forward(ids: torch.Tensor) -> torch.Tensor:
            out = path(ids, torch.ones_like(ids, dtype=mask_dtype))
            return _loss(out[0] if isinstance(out, (tuple, list)) else out, ids)
        return mean_loss(forward, data, batch, device)

    base = loss_of(gm)
    if on_step:
        on_step("Hydra: the unablated path")
    repeated = repeated_layers_of(graph)
    result: dict[str, Any] = {"budget": budget, "base_loss": base, "spacing": spacing}
    single: dict[int, float] = {}
    for family, sets in hydra_sets(repeated, spacing).items():
        rows = []
        for layers in sets:
            ablated = bind_regions(shared_graph_module(model, ablate_repetitions(graph, layers)), model)
            delta = loss_of(ablated) - base
            row = {"layers": list(layers), "delta": delta}
            if family == "single":
                single[layers[0]] = delta
            else:
                total = sum(single[i] for i in layers)
                row.update(sum_of_single=total, ratio=delta / total if abs(total) > 1e-12 else None)
            rows.append(row)
            if on_step:
                on_step(f"Hydra: without the repetition of layer(s) {', '.join(map(str, layers))}")
        result[family] = rows
    return result


# --------------------------------------------------------------------------- the analysis
def analysis_units(model: LoopedModel, budget: int | None, batches: int, spacing: int = 3) -> int:
    """How many progress units :func:`analyze` reports (batches of path runs plus one per
    Hydra ablation)."""
    k = model.check_budget(budget)
    lens = 1 if budget is not None else len(model.budgets)
    repeated = repeated_layers_of(model.layer_graph.paths[k])
    hydra = 1 + sum(len(s) for s in hydra_sets(repeated, spacing).values()) if repeated else 0
    return lens * batches + hydra


def analyze(model: LoopedModel, data: str | Sequence[str] | PackedTokens, *, budget: int | None = None,
            seq_len: int = 256, max_tokens: int = 4096, batch: int = 4, spacing: int = 3,
            on_progress: Progress | None = None) -> dict:
    """Every statistic of the module docstring for ``model`` on ``data`` (text specs as
    ``looptool eval`` reads them, or ready rows).

    The per-layer and per-loop statistics and the Hydra effect are measured on the path of
    ``budget`` (default: the deepest); the logit lens on every budget, or on ``budget``
    alone when one is given.
    """
    k = model.check_budget(budget)
    if spacing < 1:
        raise AnalysisError(f"--spacing {spacing} is too small; spaced triplets need layers at least 1 apart.")
    if isinstance(data, PackedTokens):
        rows = data
    else:
        rows = PackedTokens(tokenize_files(find_files(data), model.tokenizer)[:max_tokens], seq_len)
    lens_budgets = [k] if budget is not None else list(model.budgets)
    device = device_of(model)
    mask_dtype = dtype_from_str(model.layer_graph.source.mask_dtype)
    batches = [torch.stack([rows.row(i) for i in range(s, min(s + batch, len(rows)))]).to(device)
               for s in range(0, len(rows), batch)]
    total = analysis_units(model, budget, len(batches), spacing)
    done = 0

    def step(text: str) -> None:
        nonlocal done
        done += 1
        if on_progress:
            on_progress(done, total, text)

    was_checkpointing = model.activation_checkpointing
    model.activation_checkpointing = False  # the probes read nodes inside layer applications
    try:
        stats_by_budget: dict[int, _PathStats] = {}
        with torch.inference_mode():
            for b in lens_budgets:
                stats = _PathStats(model, model.path(b), mechanistic=b == k)
                for i, ids in enumerate(batches):
                    stats.run(ids, torch.ones_like(ids, dtype=mask_dtype))
                    step(f"budget {b}: batch {i + 1}/{len(batches)}")
                stats_by_budget[b] = stats
        main = stats_by_budget[k]
        result: dict[str, Any] = {
            "model_type": model.layer_graph.source.model_type,
            "plan": model.plan.to_dict(),
            "budget": k,
            "tokens": len(rows) * rows.seq_len,
            "sequences": len(rows),
            "seq_len": rows.seq_len,
            "loss": main.final_total / main.lens_count,
            "residual_cosines": main.cosine_result(),
            "logit_lens": [{"budget": b, **stats_by_budget[b].lens_result()} for b in lens_budgets],
        }
        if main.repeated:
            result["repeats"] = _repeat_rows(main)
            result["window_residual_cosine"] = _window_cosines(main)
            result["hydra"] = hydra_effect(model, k, rows, batch=batch, spacing=spacing, on_step=step)
        if main.recurrent:
            result["elr"] = _loop_rows(main)
    finally:
        model.activation_checkpointing = was_checkpointing
    return result


def _repeat_rows(stats: _PathStats) -> list[dict]:
    """Per repeated layer: writes per kind, expert overlap, residual cosines of both passes."""
    cos = {(a.layer, a.execution): stats.cosines[i].value for i, a in enumerate(stats.apps)}
    rows = []
    for layer in stats.repeated:
        kinds = sorted(kind for (lay, kind) in stats.writes if lay == layer)
        overlap = stats.experts.get(layer)
        rows.append({
            "layer": layer,
            "writes": {kind: stats.writes[(layer, kind)].as_dict() for kind in kinds},
            "experts": overlap.as_dict() if overlap else None,
            "residual_cosine": {"first_pass": cos.get((layer, 1)), "second_pass": cos.get((layer, 2))},
        })
    return rows


def _window_cosines(stats: _PathStats) -> dict:
    """Accordion's "residual-stream cosines across the repeated window": min and mean, over
    the applications of the repeated layers, of the cosine with the previous application."""
    values = [stats.cosines[i].value for i, a in enumerate(stats.apps)
              if a.layer in set(stats.repeated) and stats.cosines[i].value is not None]
    return {"min": min(values), "mean": sum(values) / len(values)} if values else {"min": None, "mean": None}


def _loop_rows(stats: _PathStats) -> dict:
    """Per loop ``i``: ELR's state-update size ``‖s_i − s_{i−1}‖`` (Eq. 2; also ÷ ‖s_{i−1}‖ as a
    ratio of means), mean adaptive-delta rate β_i, the exit factor ``e`` that scales the step
    (the exit gate, or conditioning's ``π_i + g_exit(c_i)``, Sec. 3.3; absent where e = 1) and the
    routed experts each MoE layer keeps from loop 1 (Sec. 4.3's retained experts; absent under
    route replay, where later loops reuse loop 1's routes)."""
    loops = []
    for i in sorted(stats.loops):
        s = stats.loops[i]
        value = {name: m.value for name, m in s.items()}
        update, prev = value.get("update_norm"), value.get("prev_norm")
        experts = {str(layer): o.as_dict() for (layer, loop), o in sorted(stats.loop_experts.items()) if loop == i}
        kept = [e["kept_mean"] for e in experts.values()]
        loops.append({
            "loop": i,
            "update_norm": update,
            "prev_state_norm": prev,
            "relative_update": update / prev if update is not None and prev else None,
            "state_norm": value.get("state_norm"),
            "beta_mean": value.get("beta"),
            "exit_factor_mean": value.get("exit"),
            "exit_factor_mean_abs": value.get("exit_abs"),
            "experts_vs_loop1": experts or None,
            "kept_mean_vs_loop1": sum(kept) / len(kept) if kept else None,
        })
    return {"route_replay": stats.route_replay, "loops": loops}
