"""``looptool train``, ``rl`` and ``distill``: checkpointed training runs, and their resume
and Ctrl-C handling (:func:`resumable`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.markup import escape

from looptool.cli.application import app, console, friendly, out
from looptool.cli.options import (
    BudgetMenu,
    Chat,
    Compile,
    Device,
    Kv,
    LearningRate,
    NewLr,
    Overwrite,
    Prompts,
    Resume,
    RolloutTemperature,
    RolloutTokens,
    RunSeed,
    SaveEvery,
    SeqLen,
    Steps,
    Tokenizer,
    parse_count,
    parse_floats,
    parse_menu,
)
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError
from looptool.core.words import counted

Output = Annotated[
    Path, typer.Option("--output", "-o", help="Output directory: checkpoints and the final model (and the run's log).")
]


@app.command()
@friendly
def train(
    model_dir: Annotated[Path, typer.Argument(help="A looped model directory (from looptool convert).")],
    data: Annotated[list[str], typer.Option(help="Training text: files, folders, globs or .jsonl (repeatable).")],
    output: Output,
    tokens: Annotated[
        str | None, typer.Option(help="Training tokens, e.g. 2M (default 2M unless --steps is given).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps, instead of --tokens.")] = None,
    seq_len: SeqLen = 512,
    batch: Annotated[int, typer.Option(help="Sequences per micro-batch (per rank).")] = 8,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step.")] = 1,
    lr: LearningRate = 3e-5,
    new_lr: NewLr = None,
    weight_decay: Annotated[
        float, typer.Option(help="AdamW weight decay (never on gates and other no-decay tensors).")
    ] = 0.1,
    override: Annotated[
        float, typer.Option(help="Fraction of micro-batches (or DDP ranks) forced to the shallowest budget.")
    ] = 0.0,
    delay: Annotated[
        float, typer.Option(help="Fraction of steps trained at the shallowest budget before mixed depth.")
    ] = 0.0,
    warmup: Annotated[float, typer.Option(help="Fraction of steps of linear LR warmup.")] = 0.05,
    schedule: Annotated[str, typer.Option(help="constant | cosine | sqrt (1-sqrt decay).")] = "constant",
    bf16: Annotated[bool, typer.Option(help="bf16 autocast.")] = False,
    freeze_below_window: Annotated[
        bool, typer.Option(help="Freeze layers below the looped block (faster backward).")
    ] = False,
    save_every: SaveEvery = 0,
    save_optimizer: Annotated[
        bool,
        typer.Option(
            help="Keep the optimizer state (trainer_state.pt, about twice the weights) beside the model, which "
            "--resume continues from; --no-save-optimizer: the model alone, final (not resumable)."
        ),
    ] = True,
    progress_every: Annotated[
        float,
        typer.Option(
            envvar="LOOPTOOL_PROGRESS_EVERY",
            help="Seconds between plain progress lines on stdout when stdout or stderr is not a terminal "
            "(nohup, a job scheduler, a pipe), the first after the first step (0: every step).",
        ),
    ] = 30.0,
    seed: RunSeed = 0,
    resume: Resume = False,
    tokenizer: Tokenizer = None,
    budgets: BudgetMenu = None,
    device: Device = "auto",
    checkpoint: Annotated[
        bool, typer.Option(help="Activation checkpointing per layer application (exact; recomputes in backward).")
    ] = False,
    compile: Compile = False,
    strategy: Annotated[
        str, typer.Option(help="Under torchrun: ddp (replicate) or fsdp (FSDP2, one shard unit per source layer).")
    ] = "ddp",
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="text (packed; every token a target), completion (JSONL 'prompt'/'completion'; loss on the completion only) or chat (JSONL 'messages' rendered with the tokenizer's chat template; loss on the assistant turns only).",
        ),
    ] = "text",
    depth_curriculum: Annotated[
        float,
        typer.Option(
            help="Fraction of steps over which the budget menu grows from the shallowest budget to all (0: off)."
        ),
    ] = 0.0,
    gate_floor: Annotated[
        float, typer.Option(help="Lower bound on the new gates while training (0: off): keeps the loop path open.")
    ] = 0.0,
    gate_floor_until: Annotated[
        float, typer.Option(help="Fraction of steps the gate floor holds before it is released.")
    ] = 0.5,
    exit_loss: Annotated[
        float, typer.Option(help="ELR: weight of the loss at every earlier loop exit, relative to the last (0: off).")
    ] = 0.0,
    exit_gate: Annotated[
        bool,
        typer.Option(
            "--exit-gate",
            help="Train learned exits with the loops (adds them if missing): expected loss over every depth of the "
            "menu under the exit distribution, minus --exit-beta x its entropy. budget auto reads them with "
            "--exit-rule gate.",
        ),
    ] = False,
    exit_gate_only: Annotated[
        bool,
        typer.Option(
            "--exit-gate-only",
            help="Fit the learned exits alone, the model frozen (adds them if missing): each learns whether the next "
            "depth lowers a token's loss by more than --exit-gamma nats.",
        ),
    ] = False,
    exit_beta: Annotated[float, typer.Option(help="--exit-gate: weight of the exit distribution's entropy.")] = 0.1,
    exit_gamma: Annotated[
        float, typer.Option(help="--exit-gate-only: nats the next depth must gain for a token to go on.")
    ] = 0.005,
) -> None:
    """Mixed-depth training: one budget per micro-batch, shallowest-budget overrides."""
    from looptool.runtime.text import load_tokenizer
    from looptool.train.summary import write_train_summary
    from looptool.train.trainer import TrainConfig, Trainer

    if tokens is not None and steps is not None:
        raise LooptoolError("--tokens and --steps both set the length of the run; give one of them.")
    if not progress_every >= 0:
        raise LooptoolError(f"--progress-every {progress_every} must be at least 0 seconds (0: a line every step).")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    config = TrainConfig(
        data=list(data),
        output=str(output),
        tokens=parse_count(tokens) if tokens is not None else None,
        steps=steps,
        seq_len=seq_len,
        batch=batch,
        grad_accum=grad_accum,
        lr=lr,
        new_lr=new_lr,
        weight_decay=weight_decay,
        override=override,
        delay=delay,
        warmup=warmup,
        schedule=schedule,
        bf16=bf16,
        freeze_below_window=freeze_below_window,
        save_every=save_every,
        save_optimizer=save_optimizer,
        seed=seed,
        resume=resume,
        budgets=parse_menu(budgets),
        device=device,
        checkpoint=checkpoint,
        compile=compile,
        strategy=strategy,
        format=format,
        depth_curriculum=depth_curriculum,
        gate_floor=gate_floor,
        gate_floor_until=gate_floor_until,
        exit_loss=exit_loss,
        exit_gate=exit_gate,
        exit_gate_only=exit_gate_only,
        exit_beta=exit_beta,
        exit_gamma=exit_gamma,
    )
    is_main = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    log_to = plain_stream() if is_main else None  # taken before the live display redirects stdout
    summary = None
    with (
        resumable(output, report=is_main, saves_state=save_optimizer),
        progress(disable=not is_main) as bar,
        bar.stage("preparing") as step,
    ):
        trainer = Trainer(model_dir, config, tokenizer=tok)
        step.update(total=trainer.total_steps, completed=trainer.start_step, text="training")
        lines = None if log_to is None else ProgressLines(log_to, trainer.total_steps, progress_every)

        def on_step(rec: dict) -> None:
            losses = rec["loss"]
            step.advance(
                text=f"step {rec['step'] + 1} loss {sum(losses) / len(losses):.3f} {rec['tokens_per_s']:,.0f} tok/s"
            )
            if lines is not None:
                lines(rec)

        trainer.on_step = on_step
        summary = trainer.run()
    if summary is None:  # resumed a run that was already complete
        return
    trainer.close()
    if is_main:
        write_train_summary(output, summary)
        exp, real = summary["expected"], summary.get("realised", {})
        if "exit" in summary:  # learned exits: every depth at each step, no budget draws to report
            ex = summary["exit"]
            terms = ", ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in ex.items() if isinstance(v, float))
            drawn = f"{ex['stage'].replace('_', '-')} over depths {ex['depths']}: last step {terms}"
        else:
            drawn = (
                f"p(shallowest) {real.get('p_shallowest', float('nan')):.3f} (Eq. 3: {exp['p_shallowest']:.3f}), "
                f"mean budget {real.get('mean_budget', float('nan')):.2f} (Eq. 3: {exp['mean_budget']:.2f})"
            )
        out.print(
            f"trained {counted(summary['steps'], 'step')} × {counted(summary['tokens_per_step'], 'token', grouped=True)}; "
            f"{drawn}; model saved in [bold]{output}[/]"
        )
        out.print(optimizer_state_note(output), highlight=False, soft_wrap=True)


def plain_stream() -> TextIO | None:
    """Where a run's plain progress lines go: stdout, unless both stdout and stderr are
    terminals (the live display on stderr draws only on a terminal, and nohup, job schedulers
    and pipes keep stdout); None then. Call it before :func:`progress` starts: on a terminal
    the live display redirects ``sys.stdout`` to itself."""
    return None if sys.stdout.isatty() and console.is_terminal else sys.stdout


class ProgressLines:
    """Plain progress lines of a training run, for logs: one after the first step, then one
    when ``every`` seconds have passed since the last (0: every step), and one after the last
    step. Called with each step's log record; each line gives the step of the total, the
    tokens so far, the mean loss of each budget drawn since the last line, the tokens/s of
    those steps and the time left at that rate (ETA)."""

    def __init__(self, stream: TextIO, total_steps: int, every: float, clock: Callable[[], float] = time.monotonic):
        self.stream, self.total, self.every, self.clock = stream, total_steps, every, clock
        self.since = clock()  # the steps since the last line, and when they started
        self.window: list[dict] = []
        self.printed = False

    def __call__(self, record: dict) -> None:
        self.window.append(record)
        now, done = self.clock(), record["step"] + 1
        if self.printed and done < self.total and now - self.since < self.every:
            return
        self.stream.write(self.line(record, now - self.since) + "\n")
        self.stream.flush()
        self.window, self.since, self.printed = [], now, True

    def line(self, record: dict, seconds: float) -> str:
        """The line for the steps in the window, which took ``seconds``, up to ``record``."""
        from looptool.train.trainer import record_budgets

        losses: dict[int, list[float]] = {}
        for r in self.window:
            for k, loss in zip(record_budgets(r), r["loss"], strict=True):
                losses.setdefault(k, []).append(loss)
        per_budget = ", ".join(f"k={k}: {sum(v) / len(v):.3f}" for k, v in sorted(losses.items()))
        done, seconds = record["step"] + 1, max(seconds, 1e-9)
        tokens_per_step = record["tokens"] // done
        eta = timedelta(seconds=round((self.total - done) * seconds / len(self.window)))
        return (
            f"step {done}/{self.total} · tokens {record['tokens']:,}/{self.total * tokens_per_step:,} · "
            f"loss {per_budget} · {len(self.window) * tokens_per_step / seconds:,.0f} tok/s · ETA {eta}"
        )


def optimizer_state_note(output: Path) -> str:
    """What a finished run keeps beside its model for ``--resume``: the state file, its size
    and what it holds, or that it was left out (``--no-save-optimizer``)."""
    from looptool.report.tables import human_bytes
    from looptool.storage.resume import STATE_FILE
    from looptool.storage.save import WEIGHTS

    state = output / STATE_FILE
    if not state.exists():
        return f"no {STATE_FILE} (--no-save-optimizer): the model is final; --resume cannot continue this run."
    size = state.stat().st_size
    return (
        f"{STATE_FILE} ({human_bytes(size)}, {size / (output / WEIGHTS).stat().st_size:.1f}× the weights) holds "
        "the optimizer state (AdamW's two moments per trained weight), step and RNG states that --resume continues "
        "from; delete it once the run is final, or train with --no-save-optimizer to leave it out."
    )


@contextmanager
def resumable(output: Path, report: bool = True, saves_state: bool = True) -> Iterator[None]:
    """Around a checkpointing run (``report``: this process prints). Ctrl-C: say where the
    last checkpoint is and that ``--resume`` continues it, then exit 130 (as an interrupted
    command does); ``saves_state=False`` (``train --no-save-optimizer``): say that the model
    it saved cannot be resumed. A resume of a run that is already complete: say so, and end
    the ``with`` block without error (exit 0)."""
    from looptool.storage.resume import RunComplete

    try:
        yield
    except RunComplete as exc:
        if report:
            out.print(escape(str(exc)), highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        if report:
            from looptool.storage.resume import checkpoint_step
            from looptool.storage.save import LOOPTOOL_JSON

            step = checkpoint_step(output)
            if step is None and not saves_state and (output / LOOPTOOL_JSON).exists():
                text = (
                    f"interrupted; the model of the last checkpoint is in '{output}', without the optimizer state "
                    "(--no-save-optimizer), so --resume cannot continue it."
                )
            elif step is None:
                text = f"interrupted before the first checkpoint; nothing was saved in '{output}'."
            else:
                text = (
                    f"interrupted; the last checkpoint (after step {step}) is in '{output}': rerun the same command "
                    "with --resume to continue from it."
                )
            console.print(text, highlight=False, soft_wrap=True)
        raise typer.Exit(code=130) from None


def run_steps(runner, describe: Callable[[dict], str]) -> dict:
    """Run a post-training runner (:class:`~looptool.posttrain.rollout.PostTrainingRun`) under a
    progress bar (from its first step, or the one it resumes at), one line per step."""
    with progress() as bar, bar.stage("sampling", total=runner.config.steps, completed=runner.start_step) as step:

        def on_step(rec: dict) -> None:
            step.advance(text=describe(rec))
            step.print(describe(rec))

        runner.on_step = on_step
        return runner.run()


@app.command()
@friendly
def rl(
    model_dir: Annotated[
        Path, typer.Argument(help="A looped model directory (e.g. after looptool train --format chat).")
    ],
    data: Annotated[
        list[str],
        typer.Option(
            help="Prompts: JSONL lines with 'prompt' (or 'messages') and the fields the reward reads (repeatable)."
        ),
    ],
    output: Output,
    reward: Annotated[
        str,
        typer.Option(
            help="exact_match, numeric (vs the 'answer' field), module:function or file.py:function taking (prompt, completion, example)."
        ),
    ] = "exact_match",
    steps: Steps = 50,
    prompts: Prompts = 8,
    rollouts: Annotated[int, typer.Option(help="Rollouts per prompt, all at the prompt's budget.")] = 16,
    budgets: BudgetMenu = None,
    ratio: Annotated[
        str | None,
        typer.Option(help="Split of each step's prompts over the menu, shallowest first (default 4:1:...:1)."),
    ] = None,
    curriculum: Annotated[
        bool, typer.Option(help="Pass-rate curriculum: the prompts solved least often go to the deepest budgets.")
    ] = True,
    pass_threshold: Annotated[float, typer.Option(help="A rollout passes when its reward is at least this.")] = 1.0,
    normalize: Annotated[
        bool, typer.Option(help="Divide advantages by the prompt's reward standard deviation.")
    ] = True,
    is_clip: Annotated[
        str, typer.Option(help="Truncated importance-weight range LOW,HIGH (sampler vs trainer probabilities).")
    ] = "0.2,5",
    max_mismatch: Annotated[
        float,
        typer.Option(
            help="Mask rollouts whose sampling and training probabilities differ by more than this factor on average."
        ),
    ] = 2.0,
    lr: LearningRate = 1e-6,
    new_lr: NewLr = None,
    temperature: RolloutTemperature = 1.0,
    max_new_tokens: RolloutTokens = 32,
    chat: Chat = False,
    kv: Kv = "per-loop",
    seed: RunSeed = 0,
    device: Device = "auto",
    overwrite: Overwrite = False,
    save_every: SaveEvery = 0,
    resume: Resume = False,
) -> None:
    """RL from verifiable rewards: GRPO with every prompt's rollouts at one loop count."""
    from looptool.posttrain.rl import GRPO, RLConfig

    bounds = parse_floats(is_clip, "--is-clip")
    if len(bounds) != 2:
        raise LooptoolError(f"--is-clip {is_clip!r} needs two numbers, LOW,HIGH.")
    config = RLConfig.from_options(
        locals(),
        data=list(data),
        output=str(output),
        budgets=parse_menu(budgets),
        ratio=parse_floats(ratio, "--ratio"),
        is_clip=tuple(bounds),
    )

    def describe(rec: dict) -> str:
        per = " ".join(f"k={k}: reward {b['reward']:.2f} pass {b['pass_rate']:.2f}" for k, b in rec["budgets"].items())
        return f"step {rec['step'] + 1}  {per}  masked {rec['masked_rollouts']}"

    summary = None
    with resumable(output):
        summary = run_steps(GRPO(model_dir, config), describe)
    if summary is None:  # resumed a run that was already complete
        return
    for k, row in summary.items():
        if row["reward_first"] is not None:
            out.print(
                f"budget {k}: reward {row['reward_first']:.3f} → {row['reward_last']:.3f} "
                f"(first → last quarter of the steps)"
            )
    out.print(f"model saved in [bold]{output}[/]")


@app.command()
@friendly
def distill(
    student: Annotated[Path, typer.Argument(help="The looped student model directory.")],
    teacher: Annotated[
        list[str], typer.Option(help="DOMAIN=PATH: the teacher of prompts whose 'domain' field is DOMAIN (repeatable).")
    ],
    data: Annotated[
        list[str], typer.Option(help="Prompts: JSONL lines with 'prompt' (or 'messages') and 'domain' (repeatable).")
    ],
    output: Output,
    steps: Steps = 50,
    prompts: Prompts = 8,
    rollouts: Annotated[int, typer.Option(help="Student samples per prompt.")] = 1,
    budgets: BudgetMenu = None,
    override: Annotated[float, typer.Option(help="Fraction of steps forced to the shallowest budget.")] = 0.0,
    lr: LearningRate = 1e-5,
    new_lr: NewLr = None,
    temperature: RolloutTemperature = 1.0,
    max_new_tokens: RolloutTokens = 32,
    chat: Chat = False,
    kv: Kv = "per-loop",
    seed: RunSeed = 0,
    device: Device = "auto",
    overwrite: Overwrite = False,
    save_every: SaveEvery = 0,
    resume: Resume = False,
) -> None:
    """Budget-matched multi-teacher on-policy distillation (reverse KL on the student's samples)."""
    from looptool.posttrain.distill import DistillConfig, Distiller, parse_teachers

    config = DistillConfig.from_options(
        locals(), data=list(data), teachers=parse_teachers(teacher), output=str(output), budgets=parse_menu(budgets)
    )
    summary = None
    with resumable(output):
        summary = run_steps(
            Distiller(student, config),
            lambda rec: f"step {rec['step'] + 1}  budget {rec['budget']}  reverse KL {rec['loss']:.4f}",
        )
    if summary is None:  # resumed a run that was already complete
        return
    per = ", ".join(
        f"budget {k}: {v:.4f}" for k, v in sorted(summary["loss_by_budget"].items(), key=lambda kv: int(kv[0]))
    )
    out.print(
        f"distilled {counted(summary['steps'], 'step')} (mean reverse KL {per}); student saved in [bold]{output}[/]"
    )
