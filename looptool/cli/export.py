"""``looptool export``: budget paths lowered to ONNX (and TensorRT) serving engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from looptool.cli.application import app, friendly, out
from looptool.cli.options import ModelDir, Overwrite, check_backend, check_kv_names, parse_device
from looptool.cli.progress import progress
from looptool.core.errors import LooptoolError
from looptool.core.words import counted

# what the "layer calls" column counts (the table's caption; examples/README.md explains it too)
LAYER_CALLS = (
    "layer calls: N of M bodies = the graph is N calls of ONNX functions (one per layer application and one per "
    "run of glue between layers: embedding and masks, loop-state updates, norm and head) over M distinct function "
    "bodies, each exported once and shared by every graph that calls it; flat = traced as one graph; loops: = "
    "its window layers run as ONNX Loops whose trip counts follow the batch's budgets (one graph serves every "
    "budget at that budget's cost)."
)


@app.command(name="export")
@friendly
def export_cmd(
    model_dir: ModelDir,
    output: Annotated[Path, typer.Option("--output", "-o", help="Engine directory to write.")],
    backend: Annotated[
        str,
        typer.Option(help="Lowering target: onnx (onnxruntime) or tensorrt (ONNX + TensorRT variants and engines)."),
    ] = "onnx",
    budget: Annotated[
        str | None,
        typer.Option(
            help="Per-budget graphs (every pass unrolled): a budget, a comma-separated list, 'all', or 'none' "
            "(only the row-wise graph). Default: none where the row-wise graph runs the window as loops (one "
            "graph for every budget), else all.",
            show_default=False,
        ),
    ] = None,
    validate: Annotated[
        bool, typer.Option("--validate/--no-validate", help="Compare every graph with the PyTorch path.")
    ] = True,
    overwrite: Overwrite = False,
    device: Annotated[str, typer.Option(help="Device to trace on; the onnx backend traces on cpu.")] = "cpu",
    kv: Annotated[
        str, typer.Option(help="KV cache policies to export: per-loop, last-loop, per-loop,last-loop or all.")
    ] = "per-loop",
    compose: Annotated[
        bool,
        typer.Option(
            "--compose/--no-compose", help="Build graphs from layer functions (each distinct layer exported once)."
        ),
    ] = True,
    ort_fusions: Annotated[
        bool,
        typer.Option(
            "--ort-fusions",
            help="Apply onnxruntime's transformer fusions (com.microsoft ops; onnxruntime-only graphs).",
        ),
    ] = False,
    rowwise: Annotated[
        bool,
        typer.Option(
            "--rowwise/--no-rowwise",
            help="Also write the row-wise-budget graph per policy (rows of one batch at different budgets).",
        ),
    ] = True,
    loop: Annotated[
        bool,
        typer.Option(
            "--loop/--no-loop",
            help="onnx: write a fixed-prefix window as ONNX Loops in the row-wise graph, so that one graph and one "
            "session serve every budget at that budget's cost (--no-loop: the row-wise graph masks rows and costs "
            "the deepest budget).",
        ),
    ] = True,
    speculative: Annotated[
        bool,
        typer.Option(
            "--speculative",
            help="onnx: also write verify graphs (every budget but the shallowest, per-loop KV) so that "
            "looptool run --draft-budget decodes speculatively.",
        ),
    ] = False,
    adaptive: Annotated[
        bool,
        typer.Option(
            "--adaptive",
            help="onnx: also write the adaptive-depth graph (of --exit-rule, last-loop KV: add --kv last-loop or all) "
            "so that looptool run --budget auto and a served budget 'auto' decide each token's depth.",
        ),
    ] = False,
    exit_rule: Annotated[
        str,
        typer.Option(
            help="With --adaptive: the exit rule(s) of the adaptive-depth graphs, comma-separated: state (relative "
            "state change), kl (next-token KL) or gate (the learned exits, see looptool train --exit-gate).",
        ),
    ] = "state",
    precision: Annotated[
        str,
        typer.Option(
            help="tensorrt: engine dtype, fp16, bf16 or fp32; onnx: int8 or int4 quantizes the linears' "
            "weights (MatMulNBits, one copy for all budgets), a float name keeps the model's dtype."
        ),
    ] = "fp16",
    accuracy_level: Annotated[
        int,
        typer.Option(
            help="onnx int8/int4: how MatMulNBits computes. 1: float activations, each request's answer "
            "independent of the other requests in its batch. 4: int8 activations (onnxruntime-genai's CPU "
            "setting), faster, and a request's greedy answer then depends on the batch it runs in.",
        ),
    ] = 1,
    build_on_target: Annotated[
        bool,
        typer.Option(
            "--build-on-target",
            help="tensorrt: write everything but the engines, plus build.py to build them on the GPU machine.",
        ),
    ] = False,
    max_batch: Annotated[int, typer.Option(help="tensorrt: largest batch the engines accept.")] = 8,
    max_prefill: Annotated[int, typer.Option(help="tensorrt: longest prompt step the prefill profile accepts.")] = 2048,
    max_capacity: Annotated[int, typer.Option(help="tensorrt: largest KV cache capacity in tokens.")] = 4096,
) -> None:
    """Lower budget paths to ONNX serving engines (prefill + KV-cached decode) sharing one weights.bin.

    The engine directory holds one graph per budget plus one row-wise graph (every row at its own
    budget); --backend tensorrt adds TensorRT graphs with looptool plugins and builds their
    engines."""
    from looptool.backends.engines import export_engines, export_options
    from looptool.backends.onnx.quantize import ACTIVATIONS, BLOCK_SIZE, QUANTIZED
    from looptool.backends.onnx.selection import looped_by_default, resolve_budgets, resolve_policies
    from looptool.backends.onnx.validate import QUANTIZED_BOUNDS
    from looptool.report.tables import human_bytes
    from looptool.runtime.convert import load
    from looptool.storage.files import check_output_dir

    check_backend(backend)
    check_kv_names(kv, allow_all=True)
    if budget is not None and budget.strip() == "none" and not rowwise:
        raise LooptoolError("--budget none with --no-rowwise leaves no graph to export; drop one of them.")
    if budget is not None and budget.strip() not in ("all", "none"):
        from looptool.core.plan import parse_budgets

        parse_budgets(budget)  # the syntax now; whether the model has them once it is loaded
    if parse_device(device).type != "cpu":
        raise LooptoolError(
            f"export traces and validates on the CPU; drop --device {device} (the runtime picks "
            "its device when the engine runs)."
        )
    options = export_options(
        backend,
        kv=kv,
        compose=compose,
        ort_fusions=ort_fusions,
        rowwise=rowwise,
        loop=loop,
        speculative=speculative,
        adaptive=exit_rule if adaptive else False,
        precision=precision,
        accuracy_level=accuracy_level,
        build_on_target=build_on_target,
        max_batch=max_batch,
        max_prefill=max_prefill,
        max_capacity=max_capacity,
    )  # fail before the slow load
    check_output_dir(output, overwrite)
    with progress() as steps:
        with steps.stage(f"loading {model_dir}"):
            model = load(model_dir)
        policies = resolve_policies(model, kv)
        if budget is None:  # one looped graph where it can be, else every budget's own
            looped = backend == "onnx" and looped_by_default(
                model.plan, policies, loop=loop, rowwise=rowwise, compose=compose, speculative=speculative
            )
            chosen = () if looped else resolve_budgets(model, "all")
        else:
            chosen = resolve_budgets(model, budget.strip())
        graphs = (len(chosen) + int(rowwise)) * len(policies)
        if speculative:
            from looptool.backends.onnx.speculative import verify_targets

            graphs += len(verify_targets(chosen, policies))
        if adaptive:
            from looptool.backends.onnx.adaptive import adaptive_rules, adaptive_targets

            graphs += len(adaptive_targets(adaptive_rules(exit_rule), policies))
        with steps.stage("exporting", total=graphs + int(validate), done="exported") as step:
            ticks = iter(range(graphs + 1))

            def on_progress(text: str) -> None:
                if next(ticks, 1):  # the tensorrt backend reports a few more stages than graphs
                    step.advance()
                step.update(text=text)

            report = export_engines(
                model,
                output,
                backend,
                None if budget is None else chosen,
                options={**options, "kv": policies},
                overwrite=overwrite,
                validate=validate,
                on_progress=on_progress,
            )
    out.print(engine_table(report, f"{output} · onnx · opset 18 + looptool domain · prefill + KV-cached decode"))
    if report.layer_functions:
        out.print(
            f"{counted(report.layer_functions, 'distinct body', 'distinct bodies')} exported once each ({report.layer_seconds:.1f} s); "
            f"validation {report.validation_seconds:.1f} s; total {report.seconds:.1f} s"
        )
    if backend == "onnx" and precision in QUANTIZED:
        out.print(
            f"weights {precision}: every linear a MatMulNBits over blocks of {BLOCK_SIZE} stored once, "
            f"{ACTIVATIONS[accuracy_level]}; "
            f"'max |Δ|' is the relative logit error against PyTorch's float path (bound "
            f"{QUANTIZED_BOUNDS[precision]})"
        )
    if backend == "tensorrt":
        built = (
            "engines built"
            if not build_on_target
            else f"run python {output / 'build.py'} on the GPU machine to build the engines"
        )
        out.print(f"TensorRT variants (*.trt.onnx, {precision}, weights as inputs, looptool plugins) written; {built}.")
    out.print(
        f"weights.bin {human_bytes(report.weights_bytes)} + graphs/manifest {human_bytes(report.graph_bytes)} = "
        f"{human_bytes(report.total_bytes)}; {report.disk_ratio:.3f} × the parameter bytes ({human_bytes(report.parameter_bytes)})"
    )


def layer_calls(graph) -> str:
    """The "layer calls" cell of one exported graph: ``N of M bodies``, or ``flat``."""
    if not graph.composed:
        return "flat"
    calls = f"{sum(graph.layer_calls.values())} of {counted(len(graph.layer_calls), 'body', 'bodies')}"
    return f"loops: {calls}" if getattr(graph, "form", "unrolled") == "loop" else calls


def engine_table(report, title: str) -> Table:
    """One row per graph ``report`` (an export report) lists, captioned with what its counts mean."""
    from looptool.report.tables import human_bytes

    table = Table(title=title, title_justify="left", caption=LAYER_CALLS, caption_justify="left")
    for col in (
        "budget",
        "kv",
        "file",
        "size",
        "layer calls",
        "fused ops",
        "max |Δ| random",
        "max |Δ| real",
        "export s",
    ):
        table.add_column(col, justify="right")
    labelled = [(str(b.budget), b) for b in [*report.budgets, *report.rowwise]]
    labelled += [(f"{b.budget} verify", b) for b in getattr(report, "verify", [])]
    labelled += [(str(b.budget), b) for b in getattr(report, "adaptive", [])]
    for label, b in labelled:
        fused = ", ".join(f"{k}×{v}" for k, v in b.fused.items() if v) or "-"
        diff = b.max_abs_diff
        table.add_row(
            label,
            b.kv,
            b.file,
            human_bytes(b.bytes),
            layer_calls(b),
            fused,
            *(_worst(diff, k) for k in ("random", "real")),
            f"{b.seconds:.1f}",
        )
    return table


def _worst(diff: dict[str, float], prompt: str) -> str:
    """The worst difference validation recorded on ``prompt`` (a looped graph's per-budget runs
    are keyed ``prompt@k``), or ``not validated``."""
    values = [v for key, v in diff.items() if key == prompt or key.startswith(prompt + "@") and "." not in key]
    return f"{max(values):.2e}" if values else "not validated"
