"""``looptool eval``, ``analyze``, ``lm-eval`` and ``plot``: measure a looped model per budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from looptool.cli.application import app, console, friendly, out
from looptool.cli.options import (
    Batch,
    Compile,
    Device,
    HeldOut,
    Kv,
    ModelDir,
    Overwrite,
    SeqLen,
    check_sizes,
    parse_count,
    parse_device,
)
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError
from looptool.core.words import counted


@app.command(name="eval")
@friendly
def eval_(
    model_dir: ModelDir,
    data: HeldOut,
    source: Annotated[
        str | None, typer.Option(help="Also evaluate this source model (directory, Hub model id, .gguf or smollm2).")
    ] = None,
    seq_len: SeqLen = 512,
    max_tokens: Annotated[str, typer.Option(help="Evaluate at most this many tokens.")] = "64k",
    batch: Batch = 4,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Folder for eval.json and frontier.png (default: MODEL_DIR).")
    ] = None,
    device: Device = "auto",
    compile: Compile = False,
) -> None:
    """Held-out loss, perplexity, gain share and measured cost of every budget."""
    from looptool.capture.sources import load_source
    from looptool.eval.evaluate import evaluate, format_share
    from looptool.eval.results import write_eval
    from looptool.runtime.convert import load
    from looptool.train.data import find_files

    count = parse_count(max_tokens, "--max-tokens")  # these before the slow load
    check_sizes(seq_len=seq_len, batch=batch)
    find_files(data)
    with progress() as steps:
        target = parse_device(device)
        with steps.stage(f"loading {model_dir}"):
            model = load(model_dir, device=str(target))
        if compile:
            model.compile()
        src = None
        if source is not None:
            with steps.stage(f"loading source {source}"):
                src = load_source(source, device=str(target), say=console.print).model
        with steps.stage("evaluating", done="evaluated") as step:
            result = evaluate(
                model,
                data,
                seq_len=seq_len,
                max_tokens=count,
                batch=batch,
                source=src,
                on_progress=lambda text: step.update(text=text),
            )
    written = write_eval(result, output or model_dir, title=f"{model_dir.name}: loss vs cost")
    table = Table(
        title=f"{counted(result['tokens'], 'held-out token', grouped=True)} · {result['sequences']} × {result['seq_len']}",
        title_justify="left",
    )
    for col in (
        "budget",
        "loss",
        "ppl",
        "Δ vs shallowest",
        "% of endpoint gain",
        "×FLOPs",
        "ideal ×layers",
        "ms min/med/max",
        "×time",
        "tok/s",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result["budgets"]:
        lat = r["latency"]
        table.add_row(
            str(r["budget"]),
            f"{r['loss']:.4f}",
            f"{r['ppl']:.2f}",
            f"{r['delta_vs_shallowest']:+.4f}",
            format_share(r["share_of_endpoint_gain"]),
            f"{r['ideal_flops_ratio']:.3f}",
            f"{r['ideal_layer_ratio']:.3f}",
            f"{lat['min_ms']:.0f}/{lat['median_ms']:.0f}/{lat['max_ms']:.0f}",
            f"{r['latency_ratio']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    out.print(table)
    if result["budgets"][0]["share_of_endpoint_gain"] is None:
        out.print(
            f"no endpoint gain: the deepest budget's loss is {-result['endpoint_gain']:+.4f} nats from the "
            "shallowest's, so deeper budgets do not improve on it here"
        )
    if result["source_loss"] is not None:
        out.print(f"source model: loss {result['source_loss']:.4f}, ppl {result['source_ppl']:.2f}")
    out.print(f"wrote {written[0]} and {written[1]}")


@app.command()
@friendly
def analyze(
    model_dir: ModelDir,
    data: HeldOut,
    budget: Annotated[
        int | None,
        typer.Option(
            help="Analyse this budget only (default: per-layer statistics at the deepest, logit lens at every budget)."
        ),
    ] = None,
    tokens: Annotated[str, typer.Option(help="Analyse at most this many tokens.")] = "4k",
    seq_len: SeqLen = 256,
    batch: Batch = 4,
    spacing: Annotated[int, typer.Option(help="Hydra effect: layers between the repetitions of a spaced triplet.")] = 3,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Folder for analysis.json and the plots (default: MODEL_DIR/analysis)."),
    ] = None,
    overwrite: Overwrite = False,
    device: Device = "auto",
) -> None:
    """Second-pass writes, expert overlap, residual cosines, Hydra effect, ELR states and logit lens."""
    from looptool.eval.analyze import analyze as run_analysis
    from looptool.eval.results import write_analysis
    from looptool.runtime.convert import load
    from looptool.storage.files import check_output_dir
    from looptool.train.data import find_files

    count = parse_count(tokens, "--tokens")  # these before the slow load
    check_sizes(seq_len=seq_len, batch=batch, spacing=spacing)
    find_files(data)
    folder = check_output_dir(output or model_dir / "analysis", overwrite)
    with progress() as steps, steps.stage(f"loading {model_dir}", done="analysed") as step:
        model = load(model_dir, device=str(parse_device(device)))
        result = run_analysis(
            model,
            data,
            budget=budget,
            seq_len=seq_len,
            max_tokens=count,
            batch=batch,
            spacing=spacing,
            on_progress=lambda done, total, text: step.update(completed=done, total=total, text=text),
        )
    written = write_analysis(result, folder, overwrite=overwrite)
    _print_analysis(result)
    out.print(f"wrote {written[0]} and {', '.join(p.name for p in written[1:])}")


def _print_analysis(result: dict) -> None:
    """Compact tables of an analysis: per repeated layer, Hydra ratios, ELR loops, lens."""

    def f(value, spec: str = ".3f") -> str:
        return "" if value is None else format(value, spec)

    out.print(
        f"{counted(result['tokens'], 'token', grouped=True)} · budget {result['budget']} · loss {result['loss']:.4f}"
    )
    if result.get("repeats"):
        kinds = sorted({k for r in result["repeats"] for k in r["writes"]})
        table = Table(title="second pass vs first pass, per repeated layer", title_justify="left")
        cols = ["layer", "experts kept", *(f"{k} ‖w2‖/‖w1‖ · cos · gated" for k in kinds), "res. cos 1st · 2nd"]
        for col in cols:
            table.add_column(col, justify="right", no_wrap=True)
        for r in result["repeats"]:
            e = r["experts"]
            cells = [str(r["layer"]), "" if e is None else f"{e['kept_mean']:.2f} of {e['top_k']}"]
            cells += [
                f"{f(w.get('norm_ratio'), '.2f')} · {f(w.get('cosine'), '.2f')} · {f(w.get('gated_norm_ratio'), '.2f')}"
                for w in (r["writes"].get(k, {}) for k in kinds)
            ]
            rc = r["residual_cosine"]
            cells.append(f"{f(rc['first_pass'])} · {f(rc['second_pass'])}")
            table.add_row(*cells)
        out.print(table)
        hydra = result["hydra"]
        for family in ("adjacent_pairs", "spaced_triplets"):
            ratios = [r["ratio"] for r in hydra[family] if r["ratio"] is not None]
            if ratios:
                out.print(
                    f"Hydra {family.replace('_', ' ')}: Δ(together) ÷ ΣΔ(alone) {min(ratios):.2f}–{max(ratios):.2f} "
                    f"(median {sorted(ratios)[len(ratios) // 2]:.2f}, {len(ratios)} sets)"
                )
    if result.get("elr"):
        table = Table(title="ELR loops", title_justify="left")
        for col in ("loop", "‖s_i−s_i−1‖", "÷‖s_i−1‖", "mean β", "exit factor", "experts kept vs loop 1"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in result["elr"]["loops"]:
            table.add_row(
                str(r["loop"]),
                f(r["update_norm"]),
                f(r["relative_update"]),
                f(r["beta_mean"]),
                f(r["exit_factor_mean"]),
                f(r["kept_mean_vs_loop1"], ".2f"),
            )
        out.print(table)
    for row in result["logit_lens"]:
        losses = [a["loss"] for a in row["applications"]]
        out.print(
            f"logit lens, budget {row['budget']}: {losses[0]:.3f} after the first application → "
            f"{min(losses):.3f} at best → {row['loss']:.3f} at the output"
        )


@app.command()
@friendly
def plot(
    log_file: Annotated[Path, typer.Argument(help="A train_log.jsonl (or the training output directory).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path("train_loss.png"),
) -> None:
    """Plot training loss per budget over steps."""
    from looptool.report.plots import plot_training
    from looptool.train.trainer import LOG_FILE

    path = log_file / LOG_FILE if log_file.is_dir() else log_file
    if not path.exists():
        raise LooptoolError(f"'{path}' does not exist; pass a train_log.jsonl or a training output directory.")
    out.print(f"wrote {plot_training(path, output)}")


@app.command(name="lm-eval")
@friendly
def lm_eval_cmd(
    model_dir: ModelDir,
    tasks: Annotated[str, typer.Option(help="lm-eval task names, comma-separated (e.g. hellaswag,arc_easy).")],
    budgets: Annotated[str, typer.Option(help="Budgets to evaluate: 'all' or a comma-separated list.")] = "all",
    include_path: Annotated[
        list[Path] | None, typer.Option(help="Folder of extra lm-eval task YAMLs (repeatable).")
    ] = None,
    limit: Annotated[
        float | None, typer.Option(help="Documents per task (a fraction below 1: that share of each task).")
    ] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples per prompt (default: the task's).")] = None,
    batch_size: Annotated[int, typer.Option(help="Requests per forward / generation batch.")] = 1,
    kv: Kv = "per-loop",
    max_length: Annotated[
        int | None, typer.Option(help="Longest input in tokens (default: from the config, as lm-eval's hf).")
    ] = None,
    bootstrap_iters: Annotated[
        int, typer.Option(help="Bootstrap draws for standard errors (0: none), as lm-eval.")
    ] = 100000,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Folder for lm_eval.json, lm_eval.md and lm_eval.png (default: MODEL_DIR)."
        ),
    ] = None,
    device: Device = "auto",
) -> None:
    """lm-evaluation-harness tasks at every budget: one table, one JSON and one quality-vs-cost plot."""
    from looptool.core.plan import parse_budgets
    from looptool.eval.results import quality_series, write_lm_eval

    task_names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_names:
        raise LooptoolError("--tasks is empty; give lm-eval task names, e.g. --tasks hellaswag,arc_easy.")
    chosen = None if budgets.strip() == "all" else list(parse_budgets(budgets))
    limit = int(limit) if limit is not None and limit >= 1 else limit  # lm-eval: a count, or a share below 1
    from looptool.eval.lm_eval_budgets import evaluate_budgets

    with progress() as steps, steps.stage(f"loading {model_dir}", done="evaluated") as step:
        result = evaluate_budgets(
            str(model_dir),
            task_names,
            budgets=chosen,
            include_path=[str(p) for p in include_path or []],
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            kv=kv,
            device=str(parse_device(device)),
            max_length=max_length,
            bootstrap_iters=bootstrap_iters,
            on_budget=lambda k, done, total: step.update(
                total=total, completed=done, text=f"budget {k}: {', '.join(task_names)}"
            ),
        )
    written = write_lm_eval(result, output or model_dir, title=f"{model_dir.name}: lm-eval quality vs cost")
    series = quality_series(result)
    table = Table(
        title=f"lm-eval {result['lm_eval_version']} · {', '.join(task_names)}"
        f"{f' · limit {limit}' if limit is not None else ''} · kv {kv}",
        title_justify="left",
    )
    for col in ("budget", "×FLOPs", *series, "s"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, row in enumerate(result["budgets"]):
        values = [points[i][1] for points in series.values()]
        table.add_row(
            str(row["budget"]),
            f"{row['cost']['relative_flops']:.3f}",
            *("" if v is None else f"{v:.4g}" for v in values),
            f"{row['seconds']:.1f}",
        )
    out.print(table)
    out.print(f"wrote {written[0]}, {written[1]} and {written[2]}")
