"""Human-readable summaries of looped models (rich tables) and their JSON twins."""

from __future__ import annotations

import collections

from rich.table import Table

from looptool.runtime.model import LoopedModel
from looptool.core.plan import LoopPlan


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


def _plan_caption(info: dict) -> str:
    plan = info["plan"]
    if plan["kind"] == "prefix":
        return f"window {plan['window'][0]}:{plan['window'][1]}"
    extras = [plan["update"], f"init {plan['init']}"]
    extras += ["re-injection"] if plan["reinject"] else ["no re-injection"]
    extras += [f"conditioning d={plan['cond_dim']} r={plan['rank']}"] if plan["conditioning"] else []
    extras += ["route replay"] if plan["route_replay"] else []
    return f"recurrent {plan['recurrent'][0]}:{plan['recurrent'][1]} ({', '.join(extras)})"


def plan_table(info: dict, extra: dict[int, dict[str, str]] | None = None, extra_columns: tuple[str, ...] = ()) -> Table:
    """The per-budget table ``looptool inspect`` and ``demo`` print."""
    recurrent = info["plan"]["kind"] == "recurrent"
    title = (
        f"{info['model_type']} · {info['num_layers']} layers · d={info['hidden_size']} · "
        f"{_plan_caption(info)} · {info['source_params']:,} + {info['params_added']:,} params"
    )
    table = Table(title=title, title_justify="left")
    columns = [("loops" if recurrent else "budget"), ("D_eff" if recurrent else "layers"), "path",
               "MFLOP/tok", "×FLOPs", "KV/tok per-loop", "×KV", "KV/tok last-loop"]
    for col in columns:
        table.add_column(col, justify="left" if col == "path" else "right", no_wrap=True)
    for col in extra_columns:
        table.add_column(col, justify="right", no_wrap=True)
    for row in info["budgets"]:
        cells = [
            str(row["budget"]),
            str(row["layer_executions"]),
            row["path"],
            f"{row['flops_per_token'] / 1e6:,.1f}",
            f"{row['relative_flops']:.3f}",
            human_bytes(row["kv_bytes_per_token"]),
            f"{row['relative_kv']:.3f}",
        ]
        cells += [human_bytes(row["kv_bytes_per_token_last_loop"])]
        cells += [(extra or {}).get(row["budget"], {}).get(c, "") for c in extra_columns]
        table.add_row(*cells)
    return table


def plot_quality_cost(series: dict[str, list[tuple[float, float, str]]], path, *, title: str = "",
                      xlabel: str = "×FLOPs per token (cost model)"):
    """One PNG with a panel per quality series (e.g. ``"task metric"``): each point is one
    budget's ``(cost, value, label)``, joined in cost order and labelled."""
    import math
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, max(1, len(series)))
    rows = math.ceil(len(series) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=110, squeeze=False)
    for ax, (name, points) in zip(axes.flat, series.items()):
        points = sorted(p for p in points if p[1] is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-")
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    fig.suptitle(title or "quality against cost")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_analysis(result: dict, directory) -> list:
    """The PNGs of a ``looptool analyze`` result (:func:`looptool.eval.analyze.analyze`), one per
    family of statistics present: ``writes.png`` (second- vs first-pass writes, expert
    overlap), ``residual_cosines.png``, ``hydra.png``, ``logit_lens.png`` and
    ``elr_states.png``. Returns the paths written."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name)
        plt.close(fig)
        written.append(directory / name)

    def app_label(app: dict) -> str:
        return f"{app['layer']}" if app["execution"] == 1 else f"{app['layer']}×{app['execution']}"

    repeats = result.get("repeats")
    if repeats:
        layers = [r["layer"] for r in repeats]
        kinds = sorted({k for r in repeats for k in r["writes"]})
        experts = [r["experts"] for r in repeats]
        panels = 3 if any(experts) else 2
        fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.4), dpi=110)
        for kind in kinds:
            w = [r["writes"].get(kind, {}) for r in repeats]
            axes[0].plot(layers, [x.get("norm_ratio") for x in w], "o-", label=f"{kind}")
            axes[0].plot(layers, [x.get("gated_norm_ratio") for x in w], "x--", label=f"{kind}, gated")
            axes[1].plot(layers, [x.get("cosine") for x in w], "o-", label=f"{kind}")
            axes[1].plot(layers, [x.get("gated_cosine") for x in w], "x--", label=f"{kind}, gated")
        axes[0].set_title("‖second write‖ ÷ ‖first write‖", fontsize=9)
        axes[1].set_title("cosine(first write, second write)", fontsize=9)
        axes[1].axhline(0, color="gray", lw=0.5)
        if panels == 3:
            axes[2].bar([lay for lay, e in zip(layers, experts) if e], [e["kept_mean"] for e in experts if e])
            top_k = next(e["top_k"] for e in experts if e)
            axes[2].axhline(top_k, color="gray", linestyle="--", label=f"top-k = {top_k}")
            axes[2].set_title("routed experts the second pass keeps", fontsize=9)
            axes[2].legend(fontsize=7)
        for ax in axes:
            ax.set_xlabel("repeated layer", fontsize=8)
        axes[0].legend(fontsize=7)
        save(fig, "writes.png")

    cosines = [c for c in result.get("residual_cosines", []) if c["cosine"] is not None]
    if cosines:
        fig, ax = plt.subplots(figsize=(max(6, 0.18 * len(cosines)), 3.4), dpi=110)
        xs = range(len(cosines))
        ax.plot(xs, [c["cosine"] for c in cosines], "-", color="C0")
        for execution, marker in ((1, "o"), (2, "s")):
            pts = [(x, c["cosine"]) for x, c in zip(xs, cosines) if (c["execution"] > 1) == (execution == 2)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, linestyle="",
                    label="first / only pass" if execution == 1 else "second pass / later loop")
        ax.set_xticks(list(xs), [app_label(c) for c in cosines], fontsize=6, rotation=90)
        ax.set_xlabel("layer application (×2: second pass or loop 2+)", fontsize=8)
        ax.set_title(f"residual-stream cosine with the previous application (budget {result['budget']})", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "residual_cosines.png")

    hydra = result.get("hydra")
    if hydra:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=110)
        single = hydra["single"]
        axes[0].bar([str(r["layers"][0]) for r in single], [r["delta"] for r in single])
        axes[0].set_title("Δloss from removing one repetition", fontsize=9)
        axes[0].set_xlabel("repeated layer", fontsize=8)
        for family, color in (("adjacent_pairs", "C1"), ("spaced_triplets", "C2")):
            rows = [r for r in hydra[family] if r["ratio"] is not None]
            if not rows:
                continue
            axes[1].bar(["+".join(map(str, r["layers"])) for r in rows], [r["ratio"] for r in rows], color=color,
                        label=family.replace("_", " "))
        axes[1].axhline(1, color="gray", linestyle="--")
        axes[1].set_title("Δ(together) ÷ Σ Δ(alone)  (1 = additive)", fontsize=9)
        axes[1].tick_params(axis="x", labelsize=6, rotation=90)
        if axes[1].get_legend_handles_labels()[0]:  # no ratio is defined when every single effect is zero
            axes[1].legend(fontsize=7)
        save(fig, "hydra.png")

    lens = result.get("logit_lens")
    if lens:
        fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
        for row in lens:
            ax.plot(range(len(row["applications"])), [a["loss"] for a in row["applications"]], ".-",
                    label=f"budget {row['budget']} (final {row['loss']:.3f})")
        ax.set_xlabel("layer application", fontsize=8)
        ax.set_ylabel("logit-lens loss (nats/token)", fontsize=8)
        ax.set_title("final norm + LM head after every layer application", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "logit_lens.png")

    elr = result.get("elr")
    if elr:
        loops = elr["loops"]
        xs = [r["loop"] for r in loops]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=110)
        axes[0].plot(xs, [r["update_norm"] for r in loops], "o-", label="‖s_i − s_{i−1}‖")
        axes[0].plot(xs, [r["relative_update"] for r in loops], "x--", label="÷ ‖s_{i−1}‖")
        axes[0].set_title("state-update size", fontsize=9)
        axes[0].legend(fontsize=7)
        axes[1].plot(xs, [r["beta_mean"] for r in loops], "o-", label="mean β")
        axes[1].plot(xs, [r["exit_factor_mean"] for r in loops], "s-", label="mean exit factor")
        axes[1].plot(xs, [r["exit_factor_mean_abs"] for r in loops], "x--", label="mean |exit factor|")
        axes[1].set_title("update rate and exit factor", fontsize=9)
        axes[1].legend(fontsize=7)
        axes[2].plot(xs, [r["kept_mean_vs_loop1"] for r in loops], "o-")
        axes[2].set_title("routed experts kept from loop 1" + (" (route replay)" if elr["route_replay"] else ""),
                          fontsize=9)
        for ax in axes:
            ax.set_xlabel("loop", fontsize=8)
        save(fig, "elr_states.png")
    return written
