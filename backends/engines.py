"""Export and run engines by backend name: ``onnx`` (onnxruntime) or ``tensorrt``.

:func:`export_options` checks a backend's settings before any slow work and returns the
keyword arguments of its exporter; :func:`export_engines` runs that exporter;
:func:`open_runtime` opens an exported engine directory with the backend's runtime.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from looptool.backends.errors import ExportError

BACKENDS = ("onnx", "tensorrt")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ExportError(
            f"backend {backend!r} is not available; use backend='onnx' or backend='tensorrt'.", parameter="backend"
        )
    return backend


EXPORTER_TORCH = (2, 13)  # the first torch whose ONNX exporter traces looptool's serving graphs


def check_exporter() -> None:
    """Refuse, in one sentence, a torch whose ONNX exporter cannot trace the serving graphs
    (torch 2.11 fails in the exporter's own re-export of the graph, checked)."""
    from looptool.core.compat import installed_version

    have = installed_version("torch")
    if have is not None and have < EXPORTER_TORCH:
        raise ExportError(
            f"exporting engines needs torch {EXPORTER_TORCH[0]}.{EXPORTER_TORCH[1]} or newer, and torch here is "
            f"{have[0]}.{have[1]}: export on a machine with a newer torch (the engines it writes run anywhere)."
        )


def export_options(
    backend: str = "onnx",
    *,
    kv: str | Iterable[str] = "per-loop",
    compose: bool = True,
    ort_fusions: bool = False,
    rowwise: bool = True,
    speculative: bool = False,
    adaptive: bool | str = False,
    precision: str = "fp16",
    build_on_target: bool = False,
    max_batch: int = 8,
    max_prefill: int = 2048,
    max_capacity: int = 4096,
) -> dict:
    """The keyword arguments of ``backend``'s exporter (:func:`looptool.backends.onnx.export.export_onnx`
    or :func:`looptool.backends.tensorrt.export.export_tensorrt`), checked now, before a model is
    loaded: the TensorRT settings (``max_*``, ``build_on_target``) apply to ``tensorrt`` only,
    ``ort_fusions`` to ``onnx`` only; building engines (``tensorrt`` without
    ``build_on_target``) needs TensorRT installed. ``rowwise`` adds the row-wise-budget graph
    per policy (both backends); ``speculative`` the verify graphs of speculative decoding
    (``onnx`` only: onnxruntime runs them), ``adaptive`` the adaptive-depth graph of ``budget="auto"``
    (``onnx`` only, last-loop KV). ``precision``: for ``tensorrt`` the engines' dtype (fp16, bf16
    or fp32); for ``onnx``, ``int8`` or ``int4`` quantizes the linears' weights
    (:mod:`looptool.backends.onnx.quantize`) and a float name keeps the model's own dtype, as
    before (the default, fp16, is TensorRT's)."""
    from looptool.backends.onnx.quantize import QUANTIZED

    check_backend(backend)
    check_exporter()
    if backend == "onnx":
        quantize = precision if precision in QUANTIZED else None
        return dict(
            kv=kv,
            compose=compose,
            ort_fusions=ort_fusions,
            rowwise=rowwise,
            speculative=speculative,
            adaptive=adaptive,
            quantize=quantize,
        )
    for name, wanted, what in (
        ("speculative", speculative, "speculative verify"),
        ("adaptive", adaptive, "adaptive-depth"),
    ):
        if wanted:
            raise ExportError(
                f"{what} graphs run on onnxruntime; export them with backend='onnx', or drop {name} for "
                "backend='tensorrt'.",
                parameter=name,
            )
    if precision in QUANTIZED:
        raise ExportError(
            f"precision {precision!r} is weight-only quantization for onnxruntime (MatMulNBits), which TensorRT "
            "engines here do not use; export it with backend='onnx', or pick fp16, bf16 or fp32 for TensorRT.",
            parameter="precision",
        )
    from looptool.backends.tensorrt.export import check_precision, require_tensorrt

    check_precision(precision)
    if ort_fusions:
        raise ExportError(
            "ort_fusions writes onnxruntime-only ops, which TensorRT cannot parse; drop ort_fusions "
            "for backend='tensorrt'.",
            parameter="ort_fusions",
        )
    if not build_on_target:
        require_tensorrt("building TensorRT engines")
    return dict(
        kv=kv,
        compose=compose,
        rowwise=rowwise,
        precision=precision,
        build_on_target=build_on_target,
        max_batch=max_batch,
        max_prefill=max_prefill,
        max_capacity=max_capacity,
    )


def export_engines(
    model,
    output: str | os.PathLike,
    backend: str = "onnx",
    budgets: int | str | Iterable[int] | None = "all",
    *,
    options: dict | None = None,
    overwrite: bool = False,
    validate: bool = True,
    on_progress: Callable[[str], None] | None = None,
):
    """Export ``budgets`` of ``model`` into the engine directory ``output`` with ``backend``'s
    exporter and ``options`` (from :func:`export_options`; default: its defaults); returns
    the exporter's :class:`~looptool.backends.onnx.export.ExportReport`."""
    check_exporter()
    options = dict(options) if options is not None else export_options(backend)
    if check_backend(backend) == "tensorrt":
        from looptool.backends.tensorrt.export import export_tensorrt

        return export_tensorrt(
            model, output, budgets, **options, overwrite=overwrite, validate=validate, on_progress=on_progress
        )
    from looptool.backends.onnx.export import export_onnx

    return export_onnx(
        model, output, budgets, **options, overwrite=overwrite, validate=validate, on_progress=on_progress
    )


def open_runtime(
    engine_dir: str | os.PathLike,
    backend: str = "onnx",
    *,
    threads: int | None = None,
    prepack: bool | None = None,
):
    """The runtime of an exported engine directory: onnxruntime sessions
    (:class:`looptool.backends.ort.runtime.Runtime`, with ``threads`` and ``prepack``: None
    pre-packs only weight-quantized engines) or the built
    TensorRT engines (:class:`looptool.backends.tensorrt.runtime.Runtime`)."""
    if check_backend(backend) == "tensorrt":
        from looptool.backends.tensorrt.runtime import Runtime

        return Runtime(engine_dir)
    from looptool.backends.ort.runtime import Runtime

    return Runtime(engine_dir, threads=threads, prepack=prepack)


def engine_name(backend: str, session=None) -> str:
    """What runs the engine, for a report: ``onnxruntime CPU`` (the first execution provider of
    ``session``, the onnxruntime session that ran) or ``TensorRT``."""
    if backend == "tensorrt":
        return "TensorRT"
    return "onnxruntime " + session.get_providers()[0].removesuffix("ExecutionProvider")


SOURCE_STAMP = "source.json"  # in an engine directory made by exported_engine: the model files it came from


def _source_of(model_dir: Path) -> dict:
    """What identifies a looped model directory's content: the sha256 of its plan and weights."""
    from looptool.cache import file_sha256
    from looptool.storage.save import LOOPTOOL_JSON, WEIGHTS

    # remembered per process by path, size and modification time (the load hashes these files too)
    return {name: file_sha256(model_dir / name) for name in (LOOPTOOL_JSON, WEIGHTS) if (model_dir / name).is_file()}


def exported_engine(
    model_dir: str | os.PathLike,
    engine_dir: str | os.PathLike,
    *,
    kv: str | Iterable[str] = "per-loop",
    validate: bool = True,
    speculative: bool = False,
    adaptive: bool | str = False,
    on_progress: Callable[[str], None] | None = None,
) -> Path:
    """The onnxruntime engine directory of the looped model directory ``model_dir``, kept at
    ``engine_dir``: exported there (every budget and the row-wise graph, validated; with
    ``speculative``, the verify graphs too; with ``adaptive``, an exit rule, its adaptive-depth
    graph) unless it already holds such an engine of the same
    model files (their sha256, recorded beside the manifest), so a second call costs two file
    hashes. A directory at ``engine_dir`` that this function did not write is never overwritten."""
    import json

    from looptool.backends.manifest import MANIFEST, Manifest
    from looptool.backends.onnx.adaptive import adaptive_rules

    model_dir, engine_dir = Path(model_dir), Path(engine_dir)
    source = _source_of(model_dir)
    stamp = engine_dir / SOURCE_STAMP
    if engine_dir.exists():
        if not stamp.is_file():
            raise ExportError(
                f"'{engine_dir}' exists and was not written by exported_engine; give another engine directory "
                "or remove it.",
                parameter="engine_dir",
            )
        if json.loads(stamp.read_text()) == source and (engine_dir / MANIFEST).is_file():
            kept = Manifest.read(engine_dir)
            rules = adaptive_rules(adaptive)  # True: the state rule, as the export reads it
            if (not speculative or kept.verify_graphs) and all(r in kept.adaptive_graphs for r in rules):
                return engine_dir
    from looptool.runtime.convert import load

    model = load(model_dir)
    options = export_options("onnx", kv=kv, speculative=speculative, adaptive=adaptive)
    export_engines(
        model, engine_dir, "onnx", "all", options=options, overwrite=True, validate=validate, on_progress=on_progress
    )
    stamp.write_text(json.dumps(source, indent=1) + "\n")
    return engine_dir
