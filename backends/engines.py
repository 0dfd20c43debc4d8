"""Export and run engines by backend name: ``onnx`` (onnxruntime) or ``tensorrt``.

:func:`export_options` checks a backend's settings before any slow work and returns the
keyword arguments of its exporter; :func:`export_engines` runs that exporter;
:func:`open_runtime` opens an exported engine directory with the backend's runtime.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

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
    per policy (both backends). ``precision``: for ``tensorrt`` the engines' dtype (fp16, bf16
    or fp32); for ``onnx``, ``int8`` or ``int4`` quantizes the linears' weights
    (:mod:`looptool.backends.onnx.quantize`) and a float name keeps the model's own dtype, as
    before (the default, fp16, is TensorRT's)."""
    from looptool.backends.onnx.quantize import QUANTIZED

    check_backend(backend)
    check_exporter()
    if backend == "onnx":
        quantize = precision if precision in QUANTIZED else None
        return dict(kv=kv, compose=compose, ort_fusions=ort_fusions, rowwise=rowwise, quantize=quantize)
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


def engine_name(runtime, backend: str, budget: int, kv: str) -> str:
    """What runs the engine, for a report: ``onnxruntime CPU`` (its first execution provider) or ``TensorRT``."""
    if backend == "tensorrt":
        return "TensorRT"
    return "onnxruntime " + runtime.session(budget, kv).get_providers()[0].removesuffix("ExecutionProvider")
