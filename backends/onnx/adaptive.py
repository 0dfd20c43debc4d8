"""Per-token adaptive depth in an ONNX engine (``export_onnx(..., adaptive=True)``).

``budget="auto"`` (:mod:`looptool.runtime.adaptive`) runs one graph whose rows decide their own
depth token by token: the *adaptive-depth graph*
(:func:`~looptool.backends.interface.adaptive_serving_graph`, lowered from
:func:`~looptool.runtime.decode_graphs.adaptive_layer_graph` exactly as a budget's graph is from
its cached path). Its inputs are the step inputs, then ``min_budget``, ``max_budget`` (int64
``[batch]``) and ``exit_threshold`` (float32 ``[batch]``), then the deepest budget's cache pairs;
its outputs the logits, ``depth`` (int64 ``[batch]``, each row's realised depth) and the
presents. Every loop up to the batch's deepest ``max_budget`` runs, rows that stopped masked
(``where`` on the row dimension): the graph saves depth, not time.

One graph is written per exit rule asked for (``"state"``, ``"kl"``), under the last-loop KV
policy (a token that stops early leaves a consistent cache only there), as
``adaptive.<rule>.<policy>.onnx``. Its weights are the store's (composed from the same layer
functions: no weight is written twice); the manifest lists it under ``adaptive``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from looptool.backends.errors import ExportError
from looptool.backends.manifest import GraphEntry
from looptool.backends.onnx.format import adaptive_file
from looptool.backends.onnx.report import BudgetExport
from looptool.passes.adaptive_depth import EXIT_RULES

ADAPTIVE_KV = ("last-loop",)  # the KV policies adaptive depth runs under


def adaptive_rules(adaptive: bool | str | Iterable[str]) -> tuple[str, ...]:
    """The exit rules ``adaptive`` asks for: False → none, True → ``("state",)``, a rule, a
    comma-separated list or an iterable of rules; one sentence for an unknown rule."""
    if adaptive is False or adaptive is None:
        return ()
    if adaptive is True:
        return ("state",)
    rules = [r.strip() for r in adaptive.split(",")] if isinstance(adaptive, str) else list(adaptive)
    unknown = [r for r in rules if r not in EXIT_RULES]
    if unknown or not rules:
        raise ExportError(
            f"adaptive={adaptive!r} names no exit rule; pass True or one of {list(EXIT_RULES)}.",
            parameter="adaptive",
        )
    return tuple(dict.fromkeys(rules))


def adaptive_targets(rules: tuple[str, ...], policies: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(exit rule, policy)`` of each adaptive-depth graph an export under ``policies`` writes;
    one sentence where none of them is a policy adaptive depth runs under."""
    if not rules:
        return []
    chosen = [p for p in policies if p in ADAPTIVE_KV]
    if not chosen:
        raise ExportError(
            f"adaptive=True writes the adaptive-depth graph under kv {' or '.join(ADAPTIVE_KV)} (a token that stops "
            f"early leaves a consistent cache only there); this export has kv {list(policies)}: add "
            "kv='last-loop' (or kv='all'), or drop adaptive.",
            parameter="adaptive",
        )
    return [(rule, p) for p in chosen for rule in rules]


def export_adaptive_graphs(
    model,
    targets: list[tuple[str, str]],
    export_graph: Callable,
    *,
    compose: bool,
    say: Callable[[str], None],
) -> tuple[list[BudgetExport], dict[tuple[str, str], GraphEntry]]:
    """Export the adaptive-depth graph of each ``(exit rule, policy)`` of ``targets`` with
    ``export_graph(sg, budget, policy, file=...)`` (the exporter's own routine for one graph,
    bound to its weight store and layer library); returns the reports (``budget``
    ``"adaptive.<rule>"``) and the manifest entries."""
    from looptool.backends.interface import adaptive_serving_graph

    results: list[BudgetExport] = []
    entries: dict[tuple[str, str], GraphEntry] = {}
    for rule, policy in targets:
        say(f"exporting the adaptive-depth graph ({rule} rule, {policy})")
        sg = adaptive_serving_graph(model, rule, policy, unflatten=compose)
        result, entry = export_graph(sg, f"adaptive.{rule}", policy, file=adaptive_file(rule, policy))
        results.append(result)
        entries[rule, policy] = entry
    return results, entries
