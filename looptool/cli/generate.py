"""``looptool generate`` (PyTorch, KV-cached) and ``run`` (an exported engine): text from a
looped model at one budget, streamed or not, with what it cost."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from looptool.cli.application import app, console, friendly
from looptool.cli.options import (
    Device,
    MaxNewTokens,
    ModelDir,
    Prepack,
    Prompt,
    SamplingSeed,
    Spin,
    Stream,
    Temperature,
    Threads,
    Tokenizer,
    TopK,
    TopP,
    check_backend,
    check_kv_names,
    check_prompts,
    parse_device,
)
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError
from looptool.core.words import counted

RowBudgets = Annotated[
    str | None,
    typer.Option(
        "--budget",
        help="Budget to run, one per --prompt (e.g. 0,6,12), or auto: depth per token (default: the deepest).",
    ),
]
MinBudget = Annotated[int | None, typer.Option(help="With --budget auto: the shallowest depth (default: the menu's).")]
MaxBudget = Annotated[int | None, typer.Option(help="With --budget auto: the deepest depth (default: the menu's).")]
ExitThreshold = Annotated[
    float | None,
    typer.Option(
        help="With --budget auto: a token stops looping when its change falls under this (0: --max-budget); with "
        "--exit-rule gate, once its cumulative exit probability reaches this q in [0, 1] (default 0.5)."
    ),
]
ExitRule = Annotated[
    str | None,
    typer.Option(
        help="With --budget auto: state (relative state change), kl (next-token KL) or gate (the learned exits of "
        "looptool train --exit-gate)."
    ),
]
DraftBudget = Annotated[
    int | None,
    typer.Option(
        help="Decode speculatively: this shallower budget drafts, --budget verifies (same output as --budget alone)."
    ),
]
GenerateKv = Annotated[
    str | None,
    typer.Option(help="KV cache policy: per-loop or last-loop (default: per-loop; last-loop with --budget auto)."),
]
DraftTokens = Annotated[int, typer.Option(help="Tokens drafted per verify step with --draft-budget.")]


def parse_row_budgets(text: str | None, prompts: int) -> int | list[int] | str | None:
    """``--budget``: one budget (an int), one per prompt (``0,6,12``: a list), ``"auto"``, or None."""
    if text is None:
        return None
    if text.strip() == "auto":
        return "auto"
    parts = [p.strip() for p in text.split(",")]
    for part in parts:
        if not part.lstrip("-").isdigit():
            raise LooptoolError(f"--budget {text!r}: {part!r} is not an integer; give whole numbers such as 0,6,12.")
    if len(parts) == 1:
        return int(parts[0])
    if len(parts) != prompts:
        raise LooptoolError(
            f"--budget gives {counted(len(parts), 'budget')} for {counted(prompts, '--prompt')}; give one budget, or one "
            "per --prompt."
        )
    return [int(p) for p in parts]


@app.command()
@friendly
def generate(
    model_dir: ModelDir,
    prompt: Prompt,
    budget: RowBudgets = None,
    max_new_tokens: MaxNewTokens = 64,
    kv: GenerateKv = None,
    temperature: Temperature = 0.0,
    top_k: TopK = None,
    top_p: TopP = None,
    seed: SamplingSeed = None,
    stream: Stream = False,
    tokenizer: Tokenizer = None,
    device: Device = "auto",
    draft_budget: DraftBudget = None,
    draft_tokens: DraftTokens = 4,
    min_budget: MinBudget = None,
    max_budget: MaxBudget = None,
    exit_threshold: ExitThreshold = None,
    exit_rule: ExitRule = None,
) -> None:
    """Generate text with a KV cache at one budget, or one budget per prompt.

    --budget 0,6,12 runs the prompts together, each at its own budget; the report gives tokens/s,
    KV bytes and each row's cost. --draft-budget J decodes speculatively: budget J drafts
    --draft-tokens tokens and --budget keeps what it agrees with (its own output, token for token
    when greedy). --budget auto picks the depth of every token (it stops looping once its state
    stops changing; needs --kv last-loop)."""
    from looptool.engine.budgets import EXIT_THRESHOLDS, wants_auto
    from looptool.engine.sampling import SamplingParams
    from looptool.engine.speculation import Speculation
    from looptool.runtime import text
    from looptool.runtime.adaptive import AutoDepth, check_auto_policy
    from looptool.runtime.convert import load
    from looptool.runtime.decode_graphs import adaptive_path, cached_paths, rowwise_path, verify_paths
    from looptool.runtime.generation import check_max_new_tokens, row_budgets
    from looptool.runtime.generation import generate as run_generate

    check_prompts(prompt, stream)
    budgets = parse_row_budgets(budget, len(prompt))
    if kv is not None:
        check_kv_names(kv)
    check_max_new_tokens(max_new_tokens)  # all before the slow load
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    device = str(parse_device(device))
    auto = dict(min_budget=min_budget, max_budget=max_budget, exit_threshold=exit_threshold, exit_rule=exit_rule)
    if budgets == "auto" and draft_budget is not None:
        raise LooptoolError("--draft-budget needs a fixed --budget, not --budget auto.")
    with progress() as steps:
        with steps.stage(f"loading {model_dir}"):
            model = load(model_dir, device=device)
        tok = text.model_tokenizer(model, tokenizer)
        if wants_auto(budgets, **auto):  # depth per token: the adaptive path, checked and built
            settings = AutoDepth.resolve(model, **auto)
            kv = check_auto_policy(model, kv)
            with steps.stage(f"building the adaptive-depth path ({kv})"):
                adaptive_path(model, kv, settings.exit_rule)
            choice = dict(budget="auto", **auto)
            stops = EXIT_THRESHOLDS[settings.exit_rule].stops  # how a token stops
            shown = (
                f"budget auto {settings.min_budget}..{settings.max_budget} · {settings.exit_rule} {stops} "
                f"{settings.exit_threshold:g}"
            )
        else:
            kv = kv or "per-loop"
            rows = row_budgets(model, budgets, len(prompt))  # resolved once; generate takes it as it is
            if draft_budget is not None:  # checked before the paths are built
                if not rows.uniform:
                    raise LooptoolError("--draft-budget takes one --budget for every prompt.")
                Speculation(draft_budget, draft_tokens).check(rows.rows[0], model.budgets, kv)
            with steps.stage(f"building cached budget paths ({kv})"):
                if not rows.uniform:  # the rows run together through the row-wise path
                    rowwise_path(model, kv)
                elif draft_budget is None:  # the one budget asked for: its path alone is built
                    cached_paths(model, kv, rows.rows[:1])
                else:  # the draft's path, the budget's, and its verify path (logits at every position)
                    cached_paths(model, kv, [draft_budget, rows.rows[0]])
                    verify_paths(model, kv, rows.rows[:1])
            choice = dict(budget=rows, draft_budget=draft_budget, draft_tokens=draft_tokens)
            shown = f"budget {rows.rows[0]}" if rows.uniform else f"budgets {','.join(map(str, rows.rows))}"
    enc = text.encode_prompts(tok, prompt)
    result = _stream_generation(
        tok,
        prompt,
        stream,
        lambda on_step: run_generate(
            model,
            enc["input_ids"].to(device),
            attention_mask=enc["attention_mask"].to(device),
            max_new_tokens=max_new_tokens,
            kv=kv,
            sampling=sampling,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            on_step=on_step,
            **choice,
        ),
    )
    if result.speculation is not None:
        stats = result.speculation
        shown += f" · drafted at {draft_budget} ({stats.accepted}/{stats.proposed} drafts kept)"
    _print_generation(tok, prompt, enc, result, stream, f"{shown} · kv {kv} · batch {len(prompt)}")
    if result.depths is not None:
        _print_depths(result.depths)


def _print_depths(depths) -> None:
    """Each row's realised depth per token (``budget="auto"``): mean, min and max."""
    table = Table(title="realised depth per token", title_justify="left")
    for col in ("row", "mean", "min", "max"):
        table.add_column(col, justify="right")
    for row, per_token in enumerate(depths.float()):
        table.add_row(str(row), f"{per_token.mean():.2f}", f"{per_token.min():.0f}", f"{per_token.max():.0f}")
    console.print(table)


@app.command(name="run")
@friendly
def run_cmd(
    engine_dir: Annotated[Path, typer.Argument(help="An engine directory (from looptool export).")],
    prompt: Prompt,
    budget: RowBudgets = None,
    max_new_tokens: MaxNewTokens = 64,
    kv: GenerateKv = None,
    capacity: Annotated[
        int | None, typer.Option(help="Cache capacity in tokens (default: prompt + new tokens).")
    ] = None,
    temperature: Temperature = 0.0,
    top_k: TopK = None,
    top_p: TopP = None,
    seed: SamplingSeed = None,
    stream: Stream = False,
    threads: Threads = None,
    prepack: Prepack = None,
    spin: Spin = None,
    tokenizer: Tokenizer = None,
    backend: Annotated[
        str, typer.Option(help="onnx (onnxruntime) or tensorrt (the built engines, on a GPU).")
    ] = "onnx",
    draft_budget: DraftBudget = None,
    draft_tokens: DraftTokens = 4,
    min_budget: MinBudget = None,
    max_budget: MaxBudget = None,
    exit_threshold: ExitThreshold = None,
    exit_rule: ExitRule = None,
) -> None:
    """Generate with onnxruntime or TensorRT from an exported engine, with its KV cache (like generate).

    --budget 0,6,12 runs one budget per prompt through the engine's row-wise graph (onnx).
    --draft-budget J decodes speculatively (onnx, an engine exported with --speculative).
    --budget auto picks each token's depth (onnx, an engine exported with --adaptive and --kv
    last-loop)."""
    from looptool.backends.engines import engine_name, open_runtime
    from looptool.engine.budgets import wants_auto
    from looptool.engine.sampling import SamplingParams
    from looptool.runtime import text

    check_prompts(prompt, stream)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    budgets = parse_row_budgets(budget, len(prompt))
    auto = dict(min_budget=min_budget, max_budget=max_budget, exit_threshold=exit_threshold, exit_rule=exit_rule)
    if wants_auto(budgets, **auto) and (backend != "onnx" or draft_budget is not None):
        raise LooptoolError("--budget auto runs on --backend onnx, without --draft-budget.")
    if isinstance(budgets, list) and backend == "tensorrt":
        raise LooptoolError("--budget with one budget per prompt runs on --backend onnx; TensorRT runs one budget.")
    if capacity is not None and capacity < 1:
        raise LooptoolError("--capacity must be at least 1.")
    check_backend(backend)
    if draft_budget is not None and backend != "onnx":
        raise LooptoolError(
            "--draft-budget runs on --backend onnx (onnxruntime); TensorRT engines have no verify graph."
        )
    if draft_budget is not None and isinstance(budgets, list):
        raise LooptoolError("--draft-budget takes one --budget for every prompt.")
    rt = open_runtime(engine_dir, backend, threads=threads, prepack=prepack, spin=spin)  # None: the runtime decides
    source = tokenizer if tokenizer is not None else (engine_dir if rt.manifest.tokenizer else None)
    if source is None:
        raise LooptoolError(
            "this engine was exported without a tokenizer; pass --tokenizer PATH (a Hugging Face tokenizer folder)."
        )
    tok = text.load_tokenizer(source)
    budget = (rt.budgets or rt.rowwise_menu())[-1] if budgets is None else budgets  # deepest: the default
    graph, rows = budget, budget
    if budgets == "auto":
        from looptool.backends.ort.runtime import auto_policy

        kv = auto_policy(kv)
        rt.adaptive_session(exit_rule or "state", kv)  # no adaptive-depth graph: fail before tokenising
        graph, rows = "adaptive", "auto"
    else:
        kv = kv or "per-loop"
    if backend == "onnx" and rows != "auto":
        graph, rows = rt.resolve_budget(budget, len(prompt), kv)  # resolved once, here
        rt.session(graph, kv)  # bad budget or policy, no row-wise graph: fail before tokenising
        if draft_budget is not None:
            from looptool.engine.speculation import Speculation

            Speculation(draft_budget, draft_tokens).check(graph, rt.budgets, kv)
            if not rt.has_verify(graph, kv):
                raise LooptoolError(
                    f"{engine_dir} has no verify graph for budget {graph} ({kv}), which --draft-budget needs; "
                    "export the engine again with looptool export --speculative."
                )
    enc = text.encode_prompts(tok, prompt)
    result = _stream_generation(
        tok,
        prompt,
        stream,
        lambda on_step: rt.generate(
            enc["input_ids"],
            attention_mask=enc["attention_mask"],
            budget=rows,
            max_new_tokens=max_new_tokens,
            kv=kv,
            capacity=capacity,
            sampling=sampling,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            on_step=on_step,
            **({} if draft_budget is None else {"draft_budget": draft_budget, "draft_tokens": draft_tokens}),
            **({k: v for k, v in auto.items() if v is not None} if rows == "auto" else {}),
        ),
    )
    session = None  # TensorRT's engines are named without one
    if backend == "onnx":
        session = rt.adaptive_session(exit_rule or "state", kv) if rows == "auto" else rt.session(graph, kv)
    engine = engine_name(backend, session)
    shown = f"budgets {','.join(map(str, budget))}" if isinstance(budget, list) else f"budget {budget}"
    if getattr(result, "speculation", None) is not None:
        stats = result.speculation
        shown += f" · drafted at {draft_budget} ({stats.accepted}/{stats.proposed} drafts kept)"
    _print_generation(tok, prompt, enc, result, stream, f"{shown} · kv {kv} · {engine} · batch {len(prompt)}")
    if getattr(result, "depths", None) is not None:
        _print_depths(result.depths)


def _stream_generation(tok, prompt: list[str], stream: bool, run):
    """Call ``run(on_step)``; with ``stream`` print each token of the one prompt as it comes."""
    from looptool.runtime.text import IncrementalDecoder

    decoder = IncrementalDecoder(tok)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if stream:
        write(prompt[0])
    result = run((lambda tokens: write(decoder.push(int(tokens[0])))) if stream else None)
    if stream:
        write(decoder.flush() + "\n")
    return result


def _print_generation(tok, prompt: list[str], enc, result, stream: bool, title: str) -> None:
    """The continuations (unless streamed) and a table of what generation cost. Each prompt,
    its continuation and a newline go to stdout exactly as decoded, terminal or not: no
    wrapping, no markup, emoji or highlighting (a generated ``[bold]`` or ``:smile:`` stays as is)."""
    from looptool.report.tables import human_bytes
    from looptool.runtime.text import continuations

    width = enc["input_ids"].shape[1]
    if not stream:
        for text, continuation in zip(prompt, continuations(tok, result.sequences, width)):
            sys.stdout.write(text + continuation + "\n")
        sys.stdout.flush()
    steps = max(result.new_tokens - 1, 1)
    table = Table(title=title, title_justify="left")
    for col in ("prompt tok", "new tok", "prefill ms", "decode ms/tok", "tok/s", "KV/tok", "KV allocated"):
        table.add_column(col, justify="right")
    table.add_row(
        str(width),
        str(result.new_tokens),
        f"{result.prefill_seconds * 1e3:.1f}",
        f"{result.decode_seconds * 1e3 / steps:.1f}",
        f"{result.tokens_per_second:.1f}",
        human_bytes(result.kv_bytes_per_token),
        human_bytes(result.kv_bytes),
    )
    console.print(table)
    budgets = getattr(result, "budgets", ())
    if len(budgets) > 1:
        _print_row_costs(budgets, getattr(result, "row_costs", ()))


def _print_row_costs(budgets, costs) -> None:
    """Each row's budget and per-token cost (its budget's cost-table row, when known)."""
    from looptool.report.tables import human_bytes

    table = Table(title="per row", title_justify="left")
    for col in ("row", "budget", "layers/tok", "FLOPs/tok (rel.)", "KV/tok (per-loop)"):
        table.add_column(col, justify="right")
    for row, budget in enumerate(budgets):
        cost = costs[row] if row < len(costs) else None
        table.add_row(
            str(row),
            str(budget),
            str(cost.layer_executions) if cost else "-",
            f"{cost.relative_flops:.2f}x" if cost else "-",
            human_bytes(cost.kv_bytes_per_token) if cost else "-",
        )
    console.print(table)
