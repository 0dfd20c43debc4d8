"""The result files of the evaluations, each set written atomically (all of it or none).

* :func:`write_eval`: ``eval.json`` and ``frontier.png`` of :func:`looptool.eval.evaluate.evaluate`;
* :func:`write_lm_eval`: ``lm_eval.json``, ``lm_eval.md`` and ``lm_eval.png`` of
  :func:`looptool.eval.lm_eval_budgets.evaluate_budgets` (needs no lm-eval: the tables and plot
  series of a result are here too);
* :func:`write_analysis`: a folder with ``analysis.json`` and the plots of
  :func:`looptool.eval.analyze.analyze`.

``eval`` and ``lm-eval`` results often go into the model directory itself, so they are
written through :func:`looptool.storage.files.result_files` (the files appear together, the
model's own files are left alone).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from looptool.storage.files import commit_output_dir, prepare_output_dir, result_files

EVAL_FILES = ("eval.json", "frontier.png")
LM_EVAL_FILES = ("lm_eval.json", "lm_eval.md", "lm_eval.png")
ANALYSIS_FILE = "analysis.json"


def write_eval(result: dict, directory: str | os.PathLike, *, title: str = "") -> list[Path]:
    """``eval.json`` (the result) and ``frontier.png`` (loss against cost) in ``directory``,
    together; returns their paths."""
    from looptool.report import plots  # looked up at call time: the plot can be replaced

    with result_files(directory) as staging:
        (staging / EVAL_FILES[0]).write_text(json.dumps(result, indent=2))
        plots.plot_frontier(result, staging / EVAL_FILES[1], title=title)
    return [Path(directory) / name for name in EVAL_FILES]


def write_lm_eval(result: dict, directory: str | os.PathLike, *, title: str = "") -> list[Path]:
    """``lm_eval.json`` (the result), ``lm_eval.md`` (:func:`markdown_table`) and ``lm_eval.png``
    (each task metric against cost) in ``directory``, together; returns their paths."""
    from looptool.report import plots  # looked up at call time: the plot can be replaced

    json_file, md_file, png_file = LM_EVAL_FILES
    with result_files(directory) as staging:
        (staging / json_file).write_text(json.dumps(result, indent=2))
        (staging / md_file).write_text(markdown_table(result))
        plots.plot_quality_cost(quality_series(result), staging / png_file, title=title)
    return [Path(directory) / name for name in LM_EVAL_FILES]


def write_analysis(result: dict, directory: str | os.PathLike, *, overwrite: bool = False) -> list[Path]:
    """The folder ``directory`` with ``analysis.json`` and the plots of an analysis
    (:func:`looptool.report.plots.plot_analysis`), written whole or not at all; an existing
    folder is replaced only with ``overwrite``. Returns the paths written, the JSON first."""
    from looptool.report import plots

    final, temp = prepare_output_dir(directory, overwrite)
    try:
        (temp / ANALYSIS_FILE).write_text(json.dumps(result, indent=2))
        pngs = plots.plot_analysis(result, temp)
        commit_output_dir(final, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return [final / ANALYSIS_FILE, *(final / Path(p).name for p in pngs)]


# ---------------------------------------------------------------------- lm-eval tables
def metric_columns(result: dict) -> list[tuple[str, str]]:
    """``(task, metric)`` pairs of an :func:`~looptool.eval.lm_eval_budgets.evaluate_budgets` result,
    in first-seen order."""
    columns: dict[tuple[str, str], None] = {}
    for row in result["budgets"]:
        for task, metrics in row["results"].items():
            columns.update(dict.fromkeys((task, m) for m in metrics))
    return list(columns)


def quality_series(result: dict) -> dict[str, list[tuple[float, float | None, str]]]:
    """Per ``"task metric"`` of an :func:`~looptool.eval.lm_eval_budgets.evaluate_budgets` result, one
    ``(×FLOPs, value, "k=..")`` point per budget, in budget order (for the quality-vs-cost plot
    and tables)."""
    return {
        f"{task} {metric}": [
            (
                row["cost"]["relative_flops"],
                row["results"].get(task, {}).get(metric, {}).get("value"),
                f"k={row['budget']}",
            )
            for row in result["budgets"]
        ]
        for task, metric in metric_columns(result)
    }


def markdown_table(result: dict) -> str:
    """The result of :func:`~looptool.eval.lm_eval_budgets.evaluate_budgets` as a markdown table: one
    row per budget, its cost, then one column per task and metric (value ± stderr; ↑/↓:
    higher/lower is better). KV/token is the cost model's for the KV policy the generation
    tasks ran with."""
    columns = metric_columns(result)
    better = result.get("higher_is_better", {})

    def arrow(task: str, metric: str) -> str:
        flag = better.get(task, {}).get(metric.split(",")[0])
        return "" if flag is None else (" ↑" if flag else " ↓")

    header = [
        "budget",
        "layers",
        "×FLOPs",
        f"KV/tok {result['kv']}",
        *(f"{t} {m}{arrow(t, m)}" for t, m in columns),
        "seconds",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in result["budgets"]:
        cost = row["cost"]
        kv_bytes = cost["kv_bytes_per_token_last_loop" if result["kv"] == "last-loop" else "kv_bytes_per_token"]
        cells = [
            str(row["budget"]),
            str(cost["layer_executions"]),
            f"{cost['relative_flops']:.3f}",
            f"{kv_bytes:,.0f} B",
        ]
        for task, metric in columns:
            entry = row["results"].get(task, {}).get(metric)
            if entry is None or entry["value"] is None:
                cells.append("")
            else:
                cells.append(
                    f"{entry['value']:.4g}" + (f" ± {entry['stderr']:.2g}" if entry["stderr"] is not None else "")
                )
        cells.append(f"{row['seconds']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    title = (
        f"lm-eval {result['lm_eval_version']} · {result.get('model') or 'model'} · tasks {', '.join(result['tasks'])}"
        f" · limit {result['limit']} · kv {result['kv']}"
    )
    return f"{title}\n\n" + "\n".join(lines) + "\n"
