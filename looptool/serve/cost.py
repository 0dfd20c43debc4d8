"""The ``cost`` a response carries: the cost-table entry of the budget that ran (Accordion Eq. 6:
``budget``, ``layer_executions``, ``kv_bytes_per_token``), or for a ``budget: "auto"`` request
what its generated tokens realised: ``mean_depth`` (loops or repeated window layers per token)
and ``layer_executions`` (mean per token), beside its settings.

A depth between two budgets of the menu has no cost-table entry; its layer executions are
interpolated linearly between them, which is exact for both schemes (fixed-prefix looping
costs ``L + k`` layers at depth ``k``, ELR ``input + k * recurrent + output``). KV bytes per token
are ``max_budget``'s: under last-loop KV a token holds the deepest slots whatever depth it ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from looptool.engine.budgets import AutoRow


def request_cost(costs: Mapping[int, dict], budget: int | AutoRow, depths: Sequence[int]) -> dict:
    """The ``cost`` of a request run at ``budget`` (a fixed budget: its entry of ``costs``;
    adaptive settings: the mean over ``depths``, one per generated token)."""
    if not isinstance(budget, AutoRow):
        return costs[budget]
    n = len(depths)
    mean_depth = sum(depths) / n if n else None
    layers = sum(layer_executions(costs, d) for d in depths) / n if n else None
    return {
        "budget": "auto",
        "min_budget": budget.min_budget,
        "max_budget": budget.max_budget,
        "exit_threshold": budget.exit_threshold,
        "tokens": n,
        "mean_depth": None if mean_depth is None else round(mean_depth, 4),
        "layer_executions": None if layers is None else round(layers, 4),
        "kv_bytes_per_token": costs[budget.max_budget]["kv_bytes_per_token"],
    }


def layer_executions(costs: Mapping[int, dict], depth: int) -> float:
    """Layer executions per token at ``depth``: its cost-table entry, or the linear
    interpolation between the menu budgets around it (exact: both schemes cost affine in depth)."""
    if depth in costs:
        return float(costs[depth]["layer_executions"])
    below = max(k for k in costs if k < depth)
    above = min(k for k in costs if k > depth)
    lo, hi = costs[below]["layer_executions"], costs[above]["layer_executions"]
    return lo + (hi - lo) * (depth - below) / (above - below)
