"""Every plot looptool draws (matplotlib, Agg backend, PNG): quality against cost, training
curves, lm-eval quality, and the analysis figures."""

from __future__ import annotations

import json
from pathlib import Path

from looptool.train.trainer import record_budgets


def frontier_points(result: dict, x: str = "ideal_flops_ratio") -> list[tuple[float, float, int]]:
    """``(cost, loss, budget)`` of each row of an :func:`evaluate` result, in budget order;
    the cost is the row's ``x`` entry (default: FLOPs per token relative to the shallowest
    budget, from the plan's cost table: deterministic, unlike a latency measurement)."""
    return [(r[x], r["loss"], r["budget"]) for r in result["budgets"]]


def plot_frontier(
    result: dict,
    path: str | Path,
    title: str = "",
    *,
    reference_label: str = "source model",
    x: str = "ideal_flops_ratio",
    xlabel: str = "×FLOPs per token (cost model)",
) -> Path:
    """Loss against the cost table (:func:`frontier_points`), one point per budget; when the
    rows carry measured latencies, a second panel shows them (median, min–max bars) against
    the same cost; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["budgets"]
    timed = all("latency" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4), dpi=120, squeeze=False)
    ax = axes[0][0]
    points = frontier_points(result, x)
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="looped model")
    for cost, loss, budget in points:
        ax.annotate(f"k={budget}", (cost, loss), textcoords="offset points", xytext=(4, 4))
    if result.get("source_loss") is not None:
        ax.axhline(result["source_loss"], color="gray", linestyle="--", label=reference_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title or "quality against cost")
    ax.legend()
    if timed:
        lat = axes[0][1]
        med = [r["latency"]["median_ms"] for r in rows]
        spread = [
            [m - r["latency"]["min_ms"] for m, r in zip(med, rows)],
            [r["latency"]["max_ms"] - m for m, r in zip(med, rows)],
        ]
        lat.errorbar([p[0] for p in points], med, yerr=spread, fmt="o", capsize=3)
        lat.set_xlabel(xlabel)
        lat.set_ylabel("measured latency, ms (median, min–max)")
        lat.set_title(f"measured, {rows[0]['latency'].get('n', '?')} rounds per budget", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_training(log_path: str | Path, path: str | Path) -> Path:
    """Training loss per budget over steps from a ``train_log.jsonl``; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[int, list[tuple[int, float]]] = {}
    for line in Path(log_path).read_text().splitlines():
        rec = json.loads(line)
        for k, loss in zip(record_budgets(rec), rec["loss"], strict=False):
            series.setdefault(k, []).append((rec["step"], loss))
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for k in sorted(series):
        pts = series[k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", alpha=0.5, label=f"budget {k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_quality_cost(
    series: dict[str, list[tuple[float, float, str]]],
    path,
    *,
    title: str = "",
    xlabel: str = "×FLOPs per token (cost model)",
):
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
    for ax in list(axes.flat)[len(series) :]:
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
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker,
                linestyle="",
                label="first / only pass" if execution == 1 else "second pass / later loop",
            )
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
            axes[1].bar(
                ["+".join(map(str, r["layers"])) for r in rows],
                [r["ratio"] for r in rows],
                color=color,
                label=family.replace("_", " "),
            )
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
            ax.plot(
                range(len(row["applications"])),
                [a["loss"] for a in row["applications"]],
                ".-",
                label=f"budget {row['budget']} (final {row['loss']:.3f})",
            )
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
        axes[2].set_title(
            "routed experts kept from loop 1" + (" (route replay)" if elr["route_replay"] else ""), fontsize=9
        )
        for ax in axes:
            ax.set_xlabel("loop", fontsize=8)
        save(fig, "elr_states.png")
    return written
