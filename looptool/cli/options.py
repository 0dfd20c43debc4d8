"""The options several commands share, each defined once (``Annotated`` types: the flag comes
from the parameter's name, the default from the command's signature), and the parsing of
option values that needs no model (so a bad value fails before a slow load, naming its flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from looptool.core.errors import LooptoolError

# ---------------------------------------------------------------------- models and outputs
ModelDir = Annotated[Path, typer.Argument(help="A looped model directory.")]
Overwrite = Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")]
Device = Annotated[str, typer.Option(help="cpu, cuda or cuda:N (default: cuda when available, else cpu).")]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
Tokenizer = Annotated[Path | None, typer.Option(help="Tokenizer folder, for a model saved without one.")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile each budget path on first use.")]
Threads = Annotated[
    int | None,
    typer.Option(
        help="onnxruntime intra-op threads per session, for an engine directory (default: onnxruntime's own, one per "
        "physical core)."
    ),
]

Prepack = Annotated[
    bool | None,
    typer.Option(
        "--prepack/--no-prepack",
        help="onnxruntime pre-packs weights for its matrix kernels (faster). Default: on for an engine of one "
        "looped graph (one session, one packed copy) and for int8/int4 engines; off for an engine of a graph "
        "per budget, where each budget's session would hold its own packed copy.",
        show_default=False,
    ),
]
Spin = Annotated[
    bool | None,
    typer.Option(
        "--spin/--no-spin",
        help="onnxruntime's idle threads spin between ops instead of sleeping (faster). Default: on for an "
        "engine of one looped graph (one session), off for an engine of a graph per budget.",
        show_default=False,
    ),
]

# ---------------------------------------------------------------------- data and sizes
HeldOut = Annotated[list[str], typer.Option(help="Held-out text: files, folders, globs or .jsonl (repeatable).")]
SeqLen = Annotated[int, typer.Option(help="Tokens per sequence.")]
Batch = Annotated[int, typer.Option(help="Sequences per forward.")]

# ---------------------------------------------------------------------- budgets and KV cache
Budget = Annotated[int | None, typer.Option(help="Budget to run (default: the deepest).")]
BudgetMenu = Annotated[
    str | None,
    typer.Option(help="Budgets to sample from, e.g. 0 for plain fine-tuning (default: the model's whole menu)."),
]
Kv = Annotated[str, typer.Option(help="KV cache policy: per-loop (exact) or last-loop (one slot per layer).")]

# ---------------------------------------------------------------------- generation
Prompt = Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch (left-padded).")]
MaxNewTokens = Annotated[int, typer.Option(help="Tokens to generate per prompt.")]
Temperature = Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")]
TopK = Annotated[int | None, typer.Option(help="Sample from the k most likely tokens.")]
TopP = Annotated[float | None, typer.Option(help="Nucleus sampling mass.")]
SamplingSeed = Annotated[int | None, typer.Option(help="Seed for sampling.")]
Stream = Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated (one prompt).")]

# ---------------------------------------------------------------------- training runs
LearningRate = Annotated[float, typer.Option(help="Learning rate of the source weights (the peak, under a schedule).")]
NewLr = Annotated[float | None, typer.Option(help="Learning rate of the new loop.* parameters (default: --lr).")]
Steps = Annotated[int, typer.Option(help="Optimizer steps.")]
Prompts = Annotated[int, typer.Option(help="Prompts per step.")]
RolloutTokens = Annotated[int, typer.Option(help="Tokens per rollout at most.")]
RolloutTemperature = Annotated[float, typer.Option(help="Sampling temperature of the rollouts.")]
Chat = Annotated[bool, typer.Option(help="Render each 'prompt' as a user turn with the tokenizer's chat template.")]
RunSeed = Annotated[int, typer.Option(help="Seed of data order, budget draws and sampling.")]
SaveEvery = Annotated[int, typer.Option(help="Checkpoint every N optimizer steps (0: only at the end).")]
Resume = Annotated[bool, typer.Option(help="Continue the interrupted run checkpointed in OUTPUT.")]


# ---------------------------------------------------------------------- parsing
DTYPES = ("float32", "bfloat16", "float16")


def parse_dtype(name: str):
    """``--dtype`` as a torch dtype: float32, bfloat16 or float16."""
    from looptool.core.graph import float_dtype

    if name.removeprefix("torch.") not in DTYPES:
        raise LooptoolError(f"--dtype {name!r} is not supported; use float32, bfloat16 or float16.")
    return float_dtype(name.removeprefix("torch."))


def parse_device(name: str, dtype=None):
    """``--device`` as a checked ``torch.device`` (``auto``: cuda when available), able to run ``dtype``."""
    from looptool.runtime.devices import check_dtype, resolve_device

    device = resolve_device(name)
    if dtype is not None:
        check_dtype(device, dtype)
    return device


def parse_count(text: str, option: str = "--tokens") -> int:
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


def parse_floats(text: str | None, option: str) -> list[float] | None:
    """``4:1:1`` or ``0.2,5`` as numbers (None stays None)."""
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(":", ",").split(",") if x.strip()]
    except ValueError:
        raise LooptoolError(f"{option} {text!r} is not a list of numbers like 4:1:1:1.") from None


def parse_menu(budgets: str | None) -> list[int] | None:
    """A comma-separated budget list (None: the model's menu)."""
    from looptool.core.plan import parse_budgets

    return list(parse_budgets(budgets)) if budgets else None


def make_plan(mode: str, window: str | None = None, budgets: str | None = None, **recurrent):
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
            raise LooptoolError(
                "--window and --budgets apply to --mode prefix; use --recurrent START:STOP and --max-loops."
            )
        if "recurrent" in rec_given:
            rec_given["recurrent"] = parse_window(rec_given["recurrent"])
        return RecurrentLoop(**rec_given)
    raise LooptoolError(f"--mode {mode!r} is not available; use --mode prefix or --mode recurrent.")


def check_kv_names(kv: str, allow_all: bool = False) -> None:
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


def check_sizes(**sizes: int) -> None:
    """Positive size options (``--seq-len``, ``--batch``, ...), checked before a slow load."""
    for name, value in sizes.items():
        least = 2 if name == "seq_len" else 1
        if value is not None and value < least:
            raise LooptoolError(f"--{name.replace('_', '-')} must be at least {least}, got {value}.")


def check_prompts(prompt: list[str], stream: bool) -> None:
    if stream and len(prompt) != 1:
        raise LooptoolError("--stream prints one continuation; give a single --prompt.")
    if any(not p.strip() for p in prompt):
        raise LooptoolError("a --prompt is empty; give some text to continue.")


def check_backend(backend: str) -> None:
    if backend not in ("onnx", "tensorrt"):
        raise LooptoolError(f"--backend {backend!r} is not available; use --backend onnx or --backend tensorrt.")
