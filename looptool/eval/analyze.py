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
from typing import Any

import torch
import torch.fx as fx

from looptool.core.graph import (
    ROLE_GATE,
    ROLE_RESIDUAL,
    ROLE_ROUTER,
    WRITE_KINDS,
    annotation,
    dtype_from_str,
    shared_graph_module,
)
from looptool.eval.evaluate import mean_loss
from looptool.eval.statistics import (
    AnalysisError,
    Mean,
    Overlap,
    Recorder,
    WriteStats,
    exit_factor,
    gated_write_parts,
    layer_applications,
    lens_graph,
    next_token_loss,
    predicted_tokens,
    repeated_layers_of,
    state_update,
    token_cosines,
    token_norms,
)
from looptool.passes import PassManager
from looptool.passes.checkpoint import bind_regions
from looptool.passes.recurrent_loop import EXIT_KEY
from looptool.runtime.devices import device_of
from looptool.runtime.model import LoopedModel
from looptool.train.data import PackedTokens, find_files, tokenize_files

__all__ = ["AnalysisError", "analysis_units", "analyze", "hydra_effect", "hydra_sets"]

log = logging.getLogger(__name__)

_TOPK = torch.ops.aten.topk.default
Progress = Callable[[int, int, str], None]  # (units done, units in all, what runs now)


# --------------------------------------------------------------------------- path statistics
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
        self.cosines = [Mean() for _ in self.apps]
        self.final_total = 0.0
        for i, app in enumerate(self.apps):
            self._probe(app.output, lambda v, env, i=i: self._application(i, v, env))
        for node in extras:  # symbolic sizes the head reads: keep this batch's values
            self._probe(node, lambda v, env, node=node: self.batch.__setitem__(("extra", node), v))
        self.writes: dict[tuple[int, str], WriteStats] = {}
        self.experts: dict[int, Overlap] = {}
        self.loops: dict[int, dict[str, Mean]] = {}
        self.loop_experts: dict[tuple[int, int], Overlap] = {}
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
            self.cosines[i].add(token_cosines(prev, value))
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
            self.lens_total[i] += float(next_token_loss(logits, self.ids)) * predicted_tokens(self.ids)
        self.pending = []

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Run the path on one batch, feeding every probe."""
        self.ids, self.batch = ids, {}
        logits = Recorder(self.gm, self.probes).run(ids, mask)
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        self._lens()
        if self.pending:
            raise AnalysisError("the logit lens never received the head's size inputs; it cannot run on this path.")
        self.final_total += float(next_token_loss(logits, ids)) * predicted_tokens(ids)
        self.lens_count += predicted_tokens(ids)
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
        stats = self.writes.setdefault((layer, kind), WriteStats())
        tanh, raw = gated_write_parts(gated)

        def on_raw(value: torch.Tensor, env: dict) -> None:
            first = self.batch[("write", (layer, kind))]
            stats.first_norm.add(token_norms(first))
            stats.second_norm.add(token_norms(value))
            stats.cosine.add(token_cosines(first, value))

        def on_gated(value: torch.Tensor, env: dict) -> None:
            first = self.batch[("write", (layer, kind))]
            stats.gated_norm.add(token_norms(value))
            stats.gated_cosine.add(token_cosines(first, value))
            stats.gate_abs.add(env[tanh].abs())

        self._probe(raw, on_raw)
        self._probe(gated, on_gated)

    def _prefix_route(self, layer: int, execution: int, indices: torch.Tensor) -> None:
        if execution == 1:
            self.batch[("route", layer)] = indices
        elif ("route", layer) in self.batch:
            self.experts.setdefault(layer, Overlap()).add(self.batch[("route", layer)], indices)

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
                    self._probe(node, lambda v, env, s=stats, prev=node.args[0]: state_update(s, env[prev], v))
                else:  # loop 1 under exact init: s_1 is the source block's output, no update node
                    self._probe(node, lambda v, env, s=stats: s.setdefault("state_norm", Mean()).add(token_norms(v)))
            if not isinstance(loop, int):
                continue
            if ann.get("name") == "beta":
                self._probe(node, lambda v, env, i=loop: self.loops.setdefault(i, {}).setdefault("beta", Mean()).add(v))
            elif ann.get("name") == "exit":  # e * step: args[0] is the exit factor e
                self._probe(
                    node, lambda v, env, i=loop, f=node.args[0]: exit_factor(self.loops.setdefault(i, {}), env[f])
                )
            elif node.target is _TOPK and ann.get("role") == ROLE_ROUTER:
                self._probe(node, lambda v, env, layer=ann["layer"], i=loop: self._loop_route(layer, i, v[1]))
        if self.recurrent:
            routed = {
                annotation(n)["layer"]
                for n in graph.nodes
                if n.target is _TOPK and isinstance(annotation(n).get("loop"), int)
            }
            later = {
                annotation(n)["layer"]
                for n in graph.nodes
                if n.target is _TOPK and isinstance(annotation(n).get("loop"), int) and annotation(n)["loop"] > 1
            }
            self.route_replay = bool(routed) and len(self.loops) > 1 and not later

    def _loop_route(self, layer: int, loop: int, indices: torch.Tensor) -> None:
        if loop == 1:
            self.batch[("route", layer)] = indices
        elif ("route", layer) in self.batch:
            self.loop_experts.setdefault((layer, loop), Overlap()).add(self.batch[("route", layer)], indices)

    # ----------------------------------------------------------------- results
    def lens_result(self) -> dict:
        n = self.lens_count
        return {
            "loss": self.final_total / n,
            "applications": [{**app.as_dict(), "loss": self.lens_total[i] / n} for i, app in enumerate(self.apps)],
        }

    def cosine_result(self) -> list[dict]:
        return [{**app.as_dict(), "cosine": self.cosines[i].value} for i, app in enumerate(self.apps)]


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


def hydra_effect(
    model: LoopedModel,
    budget: int,
    data: PackedTokens,
    *,
    batch: int = 4,
    spacing: int = 3,
    on_step: Callable[[str], None] | None = None,
) -> dict:
    """Accordion's Hydra effect: the loss increase from removing repetitions of the budget
    path (the ``ablate_repetitions`` pass, :mod:`looptool.passes.ablate`), alone and together.

    For every set ``S`` of :func:`hydra_sets`: ``delta(S) = loss(path without S) − loss(path)``;
    for pairs and triplets also ``sum_of_single = Σ_{i∈S} delta({i})`` and
    ``ratio = delta(S) / sum_of_single`` (the share of the summed individual effects that
    removing them together costs; 1 = additive, < 1 = the Hydra effect).
    """
    budget = model.check_budget(budget)
    graph = model.layer_graph.paths[budget]
    gm = model.path(budget)
    one_path = model.layer_graph.replace(paths={budget: graph})  # the ablation pass rewrites this path alone
    device = device_of(model)
    mask_dtype = dtype_from_str(model.layer_graph.source.mask_dtype)

    def loss_of(path: fx.GraphModule) -> float:
        def forward(ids: torch.Tensor) -> torch.Tensor:
            out = path(ids, torch.ones_like(ids, dtype=mask_dtype))
            return next_token_loss(out[0] if isinstance(out, (tuple, list)) else out, ids)

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
            ablated_lg = PassManager([("ablate_repetitions", {"layers": list(layers)})])(one_path)
            ablated = bind_regions(shared_graph_module(model, ablated_lg.paths[budget]), model)
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


def analyze(
    model: LoopedModel,
    data: str | Sequence[str] | PackedTokens,
    *,
    budget: int | None = None,
    seq_len: int = 256,
    max_tokens: int = 4096,
    batch: int = 4,
    spacing: int = 3,
    on_progress: Progress | None = None,
) -> dict:
    """Every statistic of the module docstring for ``model`` on ``data`` (text specs as
    ``looptool eval`` reads them, or ready rows).

    The per-layer and per-loop statistics and the Hydra effect are measured on the path of
    ``budget`` (default: the deepest); the logit lens on every budget, or on ``budget``
    alone when one is given.
    """
    k = model.check_budget(budget)
    if spacing < 1:
        raise AnalysisError(
            f"spacing={spacing} is too small; spaced triplets need layers at least 1 apart.", parameter="spacing"
        )
    if isinstance(data, PackedTokens):
        rows = data
    else:
        rows = PackedTokens(tokenize_files(find_files(data), model.tokenizer)[:max_tokens], seq_len)
    lens_budgets = [k] if budget is not None else list(model.budgets)
    device = device_of(model)
    mask_dtype = dtype_from_str(model.layer_graph.source.mask_dtype)
    batches = [
        torch.stack([rows.row(i) for i in range(s, min(s + batch, len(rows)))]).to(device)
        for s in range(0, len(rows), batch)
    ]
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
        rows.append(
            {
                "layer": layer,
                "writes": {kind: stats.writes[(layer, kind)].as_dict() for kind in kinds},
                "experts": overlap.as_dict() if overlap else None,
                "residual_cosine": {"first_pass": cos.get((layer, 1)), "second_pass": cos.get((layer, 2))},
            }
        )
    return rows


def _window_cosines(stats: _PathStats) -> dict:
    """Accordion's "residual-stream cosines across the repeated window": min and mean, over
    the applications of the repeated layers, of the cosine with the previous application."""
    values = [
        stats.cosines[i].value
        for i, a in enumerate(stats.apps)
        if a.layer in set(stats.repeated) and stats.cosines[i].value is not None
    ]
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
        loops.append(
            {
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
            }
        )
    return {"route_replay": stats.route_replay, "loops": loops}
