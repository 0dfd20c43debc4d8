"""Human-readable summaries of looped models (rich tables) and their JSON twins."""

from __future__ import annotations

import collections

from rich.table import Table

from looptool.core.plan import LoopPlan, plan_from_dict
from looptool.core.words import counted
from looptool.runtime.model import LoopedModel


def execution_path(plan: LoopPlan, budget: int, num_layers: int) -> str:
    """Compact layer schedule of a budget, e.g. ``0-7, 8-10×2, 11-29`` (how many times
    each run of layers executes)."""
    counts = collections.Counter(plan.executed_layers(budget, num_layers))
    runs: list[tuple[int, int, int]] = []
    for i in range(num_layers):
        if runs and runs[-1][2] == counts[i] and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, counts[i])
        else:
            runs.append((i, i, counts[i]))
    parts = []
    for a, b, n in runs:
        span = f"{a}" if a == b else f"{a}-{b}"
        parts.append(f"{span}×{n}" if n > 1 else span)
    return ", ".join(parts)


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def summary(model: LoopedModel) -> dict:
    """Plan, parameter counts and the per-budget cost table as a JSON-ready dict."""
    dims = model.dims()
    rows = []
    for cost in model.cost_table():
        row = cost.as_dict()
        row["path"] = execution_path(model.plan, cost.budget, dims.num_layers)
        rows.append(row)
    return {
        "model_type": model.layer_graph.source.model_type,
        "num_layers": dims.num_layers,
        "hidden_size": model.layer_graph.source.hidden_size,
        "dtype": model.layer_graph.source.dtype,
        "plan": model.plan.to_dict(),
        "recipe": [[n, c] for n, c in model.recipe],
        "params_added": model.added_parameter_count(),
        "source_params": sum(p.numel() for n, p in model.named_parameters() if not n.startswith("loop.")),
        "param_bytes": dims.param_bytes,
        "budgets": rows,
    }


# The cost columns of :func:`plan_table`, in the order it shows them.
COST_COLUMNS = ("path", "MFLOP/tok", "×FLOPs", "KV/tok per-loop", "×KV", "KV/tok last-loop")


def plan_table(
    info: dict,
    extra: dict[int, dict[str, str]] | None = None,
    extra_columns: tuple[str, ...] = (),
    columns: tuple[str, ...] = COST_COLUMNS,
) -> Table:
    """The per-budget table ``looptool inspect`` and ``demo`` print: the plan's budget columns,
    then ``columns`` (of :data:`COST_COLUMNS`, default all), then ``extra_columns`` from ``extra``."""
    plan = plan_from_dict(info["plan"])
    title = (
        f"{info['model_type']} · {counted(info['num_layers'], 'layer')} · d={info['hidden_size']} · "
        f"{plan.caption()} · {info['source_params']:,} + {info['params_added']:,} params"
    )
    table = Table(title=title, title_justify="left")
    for col in [*plan.budget_columns, *columns]:
        table.add_column(col, justify="left" if col == "path" else "right", no_wrap=True)
    for col in extra_columns:
        table.add_column(col, justify="right", no_wrap=True)
    for row in info["budgets"]:
        cost = {
            "path": row["path"],
            "MFLOP/tok": f"{row['flops_per_token'] / 1e6:,.1f}",
            "×FLOPs": f"{row['relative_flops']:.3f}",
            "KV/tok per-loop": human_bytes(row["kv_bytes_per_token"]),
            "×KV": f"{row['relative_kv']:.3f}",
            "KV/tok last-loop": human_bytes(row["kv_bytes_per_token_last_loop"]),
        }
        cells = [str(row["budget"]), str(row["layer_executions"]), *(cost[c] for c in columns)]
        cells += [(extra or {}).get(row["budget"], {}).get(c, "") for c in extra_columns]
        table.add_row(*cells)
    return table
