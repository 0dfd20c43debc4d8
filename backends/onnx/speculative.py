"""Speculative decoding's verify graphs in an ONNX engine (``export_onnx(..., speculative=True)``).

Self-speculative decoding (:mod:`looptool.engine.rounds`) drafts tokens on a shallow
budget's graph and scores them on budget ``k``'s *verify graph*: budget ``k``'s serving graph
with the same inputs and cache pairs, but ``logits [batch, step, vocab]`` at every position of
the step (:func:`~looptool.backends.interface.verify_serving_graph`, lowered from
:func:`~looptool.runtime.decode_graphs.verify_layer_graph` exactly as a budget's graph is from
:func:`~looptool.runtime.decode_graphs.cached_layer_graph`). A verify graph is written for every
exported budget that a shallower exported budget can draft for (each but the shallowest), per
KV policy that speculation takes (per-loop: under last-loop caching a step of several tokens
does not compute what one-token steps compute, see
:meth:`~looptool.engine.speculation.Speculation.check`), as ``verify_<k>.<policy>.onnx``. Its
weights are the store's (composed from the same layer functions, so no body is exported
twice and no weight is written twice); the manifest lists them under ``verify``.
"""

from __future__ import annotations

from collections.abc import Callable

from looptool.backends.errors import ExportError
from looptool.backends.manifest import GraphEntry
from looptool.backends.onnx.format import verify_file
from looptool.backends.onnx.report import BudgetExport

SPECULATIVE_KV = ("per-loop",)  # the KV policies speculative decoding runs under


def verify_targets(budgets: tuple[int, ...], policies: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(budget, policy)`` of each verify graph an export of ``budgets`` under ``policies``
    writes: every budget but the shallowest (a verify graph needs a shallower budget's graph to
    draft with), under the policies speculation takes; one sentence where that leaves none."""
    targets = [(k, p) for p in policies if p in SPECULATIVE_KV for k in sorted(budgets)[1:]]
    if not targets:
        raise ExportError(
            f"speculative=True writes verify graphs for budgets a shallower exported budget drafts for, under "
            f"kv {' or '.join(SPECULATIVE_KV)}; this export has budgets {list(budgets)} and kv {list(policies)}, "
            "so there is none: export two budgets or more with kv='per-loop', or drop speculative.",
            parameter="speculative",
        )
    return targets


def export_verify_graphs(
    model,
    targets: list[tuple[int, str]],
    export_graph: Callable,
    *,
    compose: bool,
    say: Callable[[str], None],
) -> tuple[list[BudgetExport], dict[tuple[int, str], GraphEntry]]:
    """Export the verify graph of each ``(budget, policy)`` of ``targets`` with ``export_graph(sg, budget, policy, file=...)`` (the exporter's own routine for one
    graph, bound to its weight store and layer library); returns the reports and the manifest
    entries."""
    from looptool.backends.interface import verify_serving_graph

    results: list[BudgetExport] = []
    entries: dict[tuple[int, str], GraphEntry] = {}
    for budget, policy in targets:
        say(f"exporting the verify graph of budget {budget} ({policy})")
        sg = verify_serving_graph(model, budget, policy, unflatten=compose)
        result, entry = export_graph(sg, budget, policy, file=verify_file(budget, policy))
        results.append(result)
        entries[budget, policy] = entry
    return results, entries
