"""``looptool serve``: an OpenAI-compatible server over a looped model directory (PyTorch) or
an exported engine directory (onnxruntime or TensorRT), each request at its own budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from looptool.cli.application import app, console, friendly
from looptool.cli.options import Device, Kv, Prepack, Spin, Threads, Tokenizer, check_kv_names, check_sizes
from looptool.cli.progress import progress


@app.command()
@friendly
def serve(
    model_dir: Annotated[
        Path,
        typer.Argument(
            help="A looped model directory (PyTorch) or an exported engine directory (onnxruntime, or TensorRT once built)."
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="Model id clients ask for (default: the directory's name); NAME@k picks budget k."),
    ] = None,
    default_budget: Annotated[
        int | None, typer.Option(help="Budget of the plain model id (default: the deepest).")
    ] = None,
    effort: Annotated[
        str | None,
        typer.Option(help="reasoning_effort ladder, e.g. low=0,medium=6,high=12 (default: spread over the menu)."),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Cache slots: requests decoded together.")] = 8,
    capacity: Annotated[
        int | None,
        typer.Option(help="Tokens per slot (prompt plus completion); default 1024, or the model's context if shorter."),
    ] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a slot; beyond it: 503.")] = 64,
    api_key: Annotated[
        str | None, typer.Option(envvar="LOOPTOOL_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.")
    ] = None,
    runtime: Annotated[
        str,
        typer.Option(
            help="auto, pytorch, onnxruntime or tensorrt (auto: TensorRT where the directory holds built engines "
            "and a CUDA GPU is present, onnxruntime for other engine directories, PyTorch for a looped model)."
        ),
    ] = "auto",
    device: Device = "auto",
    kv: Kv = "per-loop",
    exit_rule: Annotated[
        str,
        typer.Option(
            help='How the tokens of budget "auto" requests stop: state (relative state change), kl '
            "(next-token KL) or gate (the learned exits of looptool train --exit-gate); budget auto needs --kv "
            "last-loop, and PyTorch or an onnxruntime engine exported with --adaptive --exit-rule of that rule."
        ),
    ] = "state",
    speculative: Annotated[
        bool,
        typer.Option(
            "--speculative",
            help="Requests at a fixed budget deeper than the menu's shallowest decode speculatively by default: the "
            "shallowest budget drafts --draft-tokens tokens, the request's budget keeps what it agrees with (greedy "
            "output unchanged, sampled output distributed as the budget's own). A request's draft_budget overrides "
            "it; draft_budget null (or the request's own budget) turns it off. Needs --kv per-loop, and the PyTorch "
            "runtime (or --engine onnx) or an onnxruntime engine exported with --speculative.",
        ),
    ] = False,
    draft_tokens: Annotated[
        int, typer.Option(help="Tokens drafted per verify step by default (requests may send draft_tokens).")
    ] = 4,
    tokenizer: Tokenizer = None,
    threads: Threads = None,
    prepack: Prepack = None,
    spin: Spin = None,
    engine: Annotated[
        str,
        typer.Option(
            help="as-is: serve MODEL_DIR as it is; onnx: serve the onnxruntime engine of a looped model directory "
            "(faster on a CPU), exported on first use into the subfolder of --engine-dir named by the options that "
            "shape it (per-loop, per-loop-speculative, last-loop-adaptive-state, ...) and reused while the model "
            "is unchanged."
        ),
    ] = "as-is",
    engine_dir: Annotated[
        Path | None,
        typer.Option(
            help="The folder where --engine onnx keeps its engines, one subfolder per option set (default: "
            "MODEL_DIR-onnx, beside MODEL_DIR)."
        ),
    ] = None,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            help="Requests whose prompts begin alike (a system prompt, few-shot examples, a chat history) reuse the "
            "keys and values of the blocks of 16 tokens they share; those of the layers before the loop are shared "
            "across budgets."
        ),
    ] = True,
    prefix_cache_mb: Annotated[
        int, typer.Option(help="MiB the prefix cache may hold; the least recently used blocks go first.")
    ] = 1024,
    kv_memory: Annotated[
        int | None,
        typer.Option(
            help="MiB the KV cache of the running requests may hold (default: half the memory free at start); "
            "fewer than --max-batch requests then run at once where that many do not fit, and the rest wait."
        ),
    ] = None,
    tool_call_parser: Annotated[
        str,
        typer.Option(
            help="How tool calls are read from the model's output (and forced, for tool_choice required or a named "
            "function): hermes (Hermes 2 Pro, Qwen 2.5/3: <tool_call>{json}</tool_call>) or qwen (the same)."
        ),
    ] = "hermes",
    jump_forward: Annotated[
        bool,
        typer.Option(
            help="Under structured outputs, take the tokens the grammar forces (a JSON key, a closing brace) without "
            "a step of the model, fed together with the next step."
        ),
    ] = True,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Serve from this many engine replicas on Ray Serve (needs the ray extra), behind one ingress at "
            "--host:--port; the initial count when autoscaling. Default: one process, without Ray."
        ),
    ] = None,
    min_replicas: Annotated[
        int | None, typer.Option(help="Autoscale on Ray: the fewest replicas (default: --replicas).")
    ] = None,
    max_replicas: Annotated[
        int | None,
        typer.Option(help="Autoscale on Ray: the most replicas; Ray adds one when each holds more than a full batch."),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Join this Ray cluster (auto: the one 'ray start --head' runs here; or HOST:PORT) instead of "
            "starting one on this machine; MODEL_DIR must exist at the same path on every node."
        ),
    ] = None,
    router: Annotated[
        str,
        typer.Option(
            help="On Ray: depth (a replica whose batch runs the request's budget, else an idle one, else the batch "
            "it deepens least) or ray (Ray's default: the less loaded of two random replicas)."
        ),
    ] = "depth",
    replica_cpus: Annotated[
        float, typer.Option(help="On Ray: CPUs each replica reserves (its torch threads unless --threads).")
    ] = 1.0,
) -> None:
    """Serve a model over HTTP (OpenAI API): every request picks its own budget.

    Every option is checked and the port bound before the model loads; SIGTERM drains (new
    requests get 503) and exits 0 once the admitted requests finish."""
    from looptool.serve import ServeOptions, prepare
    from looptool.serve.server import bind

    check_kv_names(kv)
    check_sizes(max_batch=max_batch, capacity=capacity)
    if engine not in ("as-is", "onnx"):
        raise typer.BadParameter(f"unknown engine {engine!r}; use as-is or onnx.", param_hint="--engine")
    options = ServeOptions(
        host,
        port,
        max_batch,
        capacity,
        max_queue,
        default_budget,
        effort,
        api_key,
        log_level,
        speculative,
        draft_tokens,
        prefix_cache,
        prefix_cache_mb,
        kv_memory,
        tool_call_parser,
        jump_forward,
    )
    options.check()
    options.check_kv(kv)  # before an export
    on_ray = replicas is not None or min_replicas is not None or max_replicas is not None or ray_address is not None
    if on_ray:
        from looptool.serve.ray import RayOptions

        placement = RayOptions(
            replicas=replicas if replicas is not None else (min_replicas or 1),
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            router=router,
            replica_cpus=replica_cpus,
        )
        placement.check()
    sock = bind(host, port)  # a port in use is one sentence before any export or load
    try:
        if engine == "onnx":
            served_model_name = served_model_name or model_dir.resolve().name
            adaptive = exit_rule if kv == "last-loop" else False  # last-loop servers serve budget "auto"
            model_dir = onnx_engine_of(
                model_dir, engine_dir or default_engine_dir(model_dir), kv, speculative, adaptive
            )
    except BaseException:
        sock.close()
        raise
    if on_ray:
        sock.close()  # Ray's HTTP proxy binds it
        serve_on_ray(
            model_dir,
            options,
            placement,
            address=ray_address,
            name=served_model_name,
            runtime=runtime,
            device=device,
            kv=kv,
            tokenizer=tokenizer,
            threads=threads,
            exit_rule=exit_rule,
            prepack=prepack,
            spin=spin,
        )
        return
    with progress() as steps:
        with steps.stage(f"loading {model_dir}"):
            server = prepare(
                model_dir,
                options,
                name=served_model_name,
                runtime=runtime,
                device=device,
                kv=kv,
                tokenizer=tokenizer,
                threads=threads,
                exit_rule=exit_rule,
                sock=sock,
                prepack=prepack,  # None: the runtime's default (one-graph and quantized engines pack)
                spin=spin,
            )
    where = f"runtime {server.served.runtime}, device {server.served.device}"
    console.print(f"serving {', '.join(server.model_ids)} at {server.url} ({where})", highlight=False, soft_wrap=True)
    hint = faster_engine_hint(model_dir, server.served.runtime, server.served.device)
    if hint:
        console.print(hint, highlight=False, soft_wrap=True)
    server.run()
    console.print("server stopped", highlight=False)


def serve_on_ray(model_dir: Path, options, placement, *, address: str | None, **open_kwargs) -> None:
    """Serve ``model_dir`` from ``placement.replicas`` engine replicas on Ray Serve
    (:mod:`looptool.serve.ray`) until SIGTERM or Ctrl-C, then drain."""
    from looptool.serve.ray import app as ray_app
    from looptool.serve.ray import run as ray_run

    scale = placement.scale
    count = (
        f"{placement.replicas} replica{'s' if placement.replicas != 1 else ''}"
        if scale[0] is None
        else f"{scale[0]} to {scale[1]} replicas (autoscaling, starting with {placement.replicas})"
    )
    application = ray_app(model_dir, options, ray=placement, **open_kwargs)
    where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
    console.print(f"starting {count} of {model_dir} on {where} (router: {placement.router})", highlight=False)

    def ready(url: str) -> None:
        console.print(f"serving at {url} (Ray Serve, {count})", highlight=False, soft_wrap=True)

    ray_run(application, host=options.host, port=options.port, address=address, on_ready=ready)
    console.print("server stopped", highlight=False)


def default_engine_dir(model_dir: Path) -> Path:
    """Where ``--engine onnx`` keeps a looped model directory's engines: beside it, ``NAME-onnx``,
    one subfolder per option set (:func:`looptool.backends.engines.exported_engine`)."""
    return model_dir.parent / f"{model_dir.name}-onnx"


def onnx_engine_of(
    model_dir: Path, engines_dir: Path, kv: str, speculative: bool = False, adaptive: bool | str = False
) -> Path:
    """The onnxruntime engine of the looped model directory ``model_dir`` for these options,
    kept in its subfolder of ``engines_dir`` and exported there first unless it holds that
    engine of the same model files; a line says which folder, how big, and why it was exported
    (or that it was reused)."""
    from looptool.backends.engines import exported_engine
    from looptool.report.tables import human_bytes
    from looptool.runtime.directory import detect

    if not detect(model_dir):
        raise typer.BadParameter(
            f"'{model_dir}' is not a looped model directory; --engine onnx exports one (an engine directory is "
            "served as it is).",
            param_hint="--engine",
        )
    with progress() as steps, steps.stage(f"onnxruntime engine of {model_dir}") as step:
        kept = exported_engine(
            model_dir,
            engines_dir,
            kv=kv,
            speculative=speculative,
            adaptive=adaptive,
            on_progress=lambda text: step.update(text=text),
        )
        step.update(text=f"onnxruntime engine of {model_dir}")
    where = f"{kept.path} ({human_bytes(kept.bytes)})"
    said = (
        f"reused the engine in {where}" if kept.exported is None else f"exported the engine to {where}: {kept.exported}"
    )
    console.print(said, highlight=False, soft_wrap=True)
    return kept.path


def faster_engine_hint(model_dir: Path, runtime: str, device: str) -> str:
    """The start-up line that points a CPU server over a looped model directory (the PyTorch
    runtime) at the onnxruntime engine of the same model, which decodes faster on a CPU (see
    tests/bench/README.md); empty for any other runtime or device."""
    if runtime != "pytorch" or not str(device).startswith("cpu"):
        return ""
    engine = model_dir.parent / f"{model_dir.name}-engine"  # not the folder of --engine onnx's engines
    return (
        "hint: on a CPU the onnxruntime engine of this model decodes faster than PyTorch: "
        f"looptool serve {model_dir} --engine onnx (or looptool export {model_dir} -o {engine}, then "
        f"looptool serve {engine})"
    )
