"""Export and run engines by backend name: ``onnx`` (onnxruntime) or ``tensorrt``.

:func:`export_options` checks a backend's settings before any slow work and returns the
keyword arguments of its exporter; :func:`export_engines` runs that exporter;
:func:`open_runtime` opens an exported engine directory with the backend's runtime;
:func:`exported_engine` keeps the onnxruntime engine of a looped model directory, one per
option set (:class:`EngineOptions`), exported on first use (``looptool serve --engine onnx``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from looptool.backends.errors import ExportError

if TYPE_CHECKING:
    from looptool.backends.manifest import Manifest

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
    loop: bool = True,
    speculative: bool = False,
    adaptive: bool | str = False,
    precision: str = "fp16",
    accuracy_level: int | None = None,
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
    per policy (both backends), with its fixed-prefix window as ONNX loops under ``loop`` (``onnx``
    only; TensorRT's graphs stay unrolled); ``speculative`` the verify graphs of speculative decoding
    (``onnx`` only: onnxruntime runs them), ``adaptive`` the adaptive-depth graph of ``budget="auto"``
    (``onnx`` only, last-loop KV). ``precision``: for ``tensorrt`` the engines' dtype (fp16, bf16
    or fp32); for ``onnx``, ``int8`` or ``int4`` quantizes the linears' weights
    (:mod:`looptool.backends.onnx.quantize`) and a float name keeps the model's own dtype, as
    before (the default, fp16, is TensorRT's); ``accuracy_level`` (int8/int4 only; None: 1, float
    activations, answers independent of the batch; 4: int8 activations, faster, answers depend on
    the batch) is how their ``MatMulNBits`` compute."""
    from looptool.backends.onnx.quantize import ACCURACY_LEVEL, QUANTIZED, check_activations

    check_backend(backend)
    quantize = precision if precision in QUANTIZED else None
    level = ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    check_activations(quantize, level)
    check_exporter()
    if backend == "onnx":
        return dict(
            kv=kv,
            compose=compose,
            ort_fusions=ort_fusions,
            rowwise=rowwise,
            loop=loop,
            speculative=speculative,
            adaptive=adaptive,
            quantize=quantize,
            accuracy_level=level,
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
    spin: bool | None = False,
):
    """The runtime of an exported engine directory: onnxruntime sessions
    (:class:`looptool.backends.ort.runtime.Runtime`, with ``threads``, ``prepack`` and ``spin``:
    None leaves them to the runtime, which packs and spins for an engine of one looped graph, as
    ``looptool run`` asks) or the built
    TensorRT engines (:class:`looptool.backends.tensorrt.runtime.Runtime`)."""
    if check_backend(backend) == "tensorrt":
        from looptool.backends.tensorrt.runtime import Runtime

        return Runtime(engine_dir)
    from looptool.backends.ort.runtime import Runtime

    return Runtime(engine_dir, threads=threads, prepack=prepack, spin=spin)


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


@dataclass(frozen=True)
class EngineOptions:
    """The options of :func:`exported_engine` that decide which graphs and weights its engine
    holds: the KV policies (``"all"`` or policy names), the verify graphs of speculative
    decoding, the adaptive-depth exit rules, and the weight quantization (None: the model's own
    float dtype, whichever float precision was named)."""

    kv: str | tuple[str, ...] = ("per-loop",)
    speculative: bool = False
    rules: tuple[str, ...] = ()
    quantize: str | None = None

    @classmethod
    def of(
        cls,
        kv: str | Iterable[str] = "per-loop",
        speculative: bool = False,
        adaptive: bool | str = False,
        precision: str = "fp16",
    ) -> EngineOptions:
        """The options as :func:`export_options` reads them: ``adaptive=True`` is the state
        rule, the rules sorted; a float ``precision`` is no quantization."""
        from looptool.backends.onnx.adaptive import adaptive_rules
        from looptool.backends.onnx.quantize import QUANTIZED

        names = kv.split(",") if isinstance(kv, str) else list(kv)
        policies = "all" if kv == "all" else tuple(sorted(dict.fromkeys(p.strip() for p in names)))
        quantize = precision if precision in QUANTIZED else None
        return cls(policies, bool(speculative), tuple(sorted(adaptive_rules(adaptive))), quantize)

    @property
    def key(self) -> str:
        """The name of the folder the engine of these options is kept in, e.g. ``per-loop``,
        ``per-loop-speculative``, ``last-loop-adaptive-state``, ``per-loop-int8``."""
        parts = ["all" if self.kv == "all" else "+".join(self.kv)]
        parts += [self.quantize] if self.quantize else []
        parts += ["speculative"] if self.speculative else []
        parts += ["adaptive-" + "+".join(self.rules)] if self.rules else []
        return "-".join(parts)

    def missing_from(self, kept: Manifest) -> str | None:
        """What the engine of manifest ``kept`` lacks that these options need (None: nothing)."""
        from looptool.backends.onnx.quantize import batch_dependent

        held = (kept.quantization or {}).get("precision")
        if held != self.quantize:
            return f"its weights are {held or 'float'}, not {self.quantize or 'float'}"
        if batch_dependent(kept.quantization):  # exported before float activations became the default
            return "its int8 activations (accuracy level 4) make each answer depend on the batch"
        lacking = [] if self.kv == "all" else [p for p in self.kv if p not in kept.kv_policies]
        if lacking:
            return f"this engine lacks the KV policy {lacking[0]!r}"
        if self.speculative and not kept.verify_graphs:
            return "this engine lacks the verify graphs speculative decoding needs"
        rule = next((r for r in self.rules if r not in kept.adaptive_graphs), None)
        if rule is not None:
            return f"this engine lacks the adaptive-depth graph of exit rule {rule!r}"
        if self.looped(kept) and kept.budgets:
            return "it runs a graph per budget; one looped graph now serves every budget"
        return None

    def looped(self, kept: Manifest) -> bool:
        """Whether an export of these options writes one looped graph for every budget of the
        plan ``kept`` records (:func:`looptool.backends.onnx.selection.looped_by_default`)."""
        from looptool.backends.onnx.selection import looped_by_default
        from looptool.core.plan import plan_from_dict

        if kept.plan is None or self.kv == "all":
            return False
        return looped_by_default(plan_from_dict(kept.plan), self.kv, speculative=self.speculative)


@dataclass(frozen=True)
class KeptEngine:
    """The engine :func:`exported_engine` found or wrote: its directory, its size in bytes,
    and why it was exported just now (None: it was reused as it was)."""

    path: Path
    bytes: int
    exported: str | None


def _export_reason(engine_dir: Path, source: dict, options: EngineOptions) -> str | None:
    """Why ``engine_dir`` needs the export of ``options`` (None: it holds their engine of the
    model files ``source``); one sentence for a directory exported_engine did not write."""
    import json

    from looptool.backends.manifest import MANIFEST, Manifest

    if not engine_dir.exists():
        return "no engine there yet"
    if not (engine_dir / SOURCE_STAMP).is_file():
        raise ExportError(
            f"'{engine_dir}' exists and was not written by exported_engine; give another engine directory "
            "or remove it.",
            parameter="engine_dir",
        )
    if json.loads((engine_dir / SOURCE_STAMP).read_text()) != source:
        return "model files changed"
    if not (engine_dir / MANIFEST).is_file():
        return "its manifest is missing"
    return options.missing_from(Manifest.read(engine_dir))


def _check_engines_dir(engines_dir: Path) -> None:
    """One sentence where ``engines_dir`` cannot hold a folder per option set: a file, or an
    engine directory itself (``looptool export -o`` wrote it, or an older exported_engine)."""
    from looptool.backends.manifest import MANIFEST

    if engines_dir.exists() and not engines_dir.is_dir():
        raise ExportError(
            f"'{engines_dir}' is a file, not a folder to keep engines in; give another folder.",
            parameter="engine_dir",
        )
    if (engines_dir / MANIFEST).is_file():
        raise ExportError(
            f"'{engines_dir}' is an engine directory, not a folder of engines (one per option set, in its "
            "subfolders); give another folder, or serve that engine directory as it is.",
            parameter="engine_dir",
        )


def _bytes_under(directory: Path) -> int:
    """The size of every file under ``directory``: what an engine takes on disk."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def exported_engine(
    model_dir: str | os.PathLike,
    engines_dir: str | os.PathLike,
    *,
    kv: str | Iterable[str] = "per-loop",
    validate: bool = True,
    speculative: bool = False,
    adaptive: bool | str = False,
    precision: str = "fp16",
    on_progress: Callable[[str], None] | None = None,
) -> KeptEngine:
    """The onnxruntime engine of the looped model directory ``model_dir`` for these options,
    kept in ``engines_dir`` in the subfolder named by them (:attr:`EngineOptions.key`, e.g.
    ``per-loop``, ``last-loop-adaptive-state``): exported there (every budget and the row-wise
    graph, validated; with ``speculative``, the verify graphs too; with ``adaptive``, an exit
    rule, its adaptive-depth graph; ``precision`` ``int8``/``int4`` quantizes the weights as
    :func:`export_options` does) unless it already holds that engine of the same model files
    (their sha256, recorded beside the manifest), so a second call costs two file hashes.

    One folder per option set, not one folder that grows the graphs each option needs: the
    exporter writes a whole engine directory at once (one ``weights.bin``, one manifest), so
    adding a graph to an engine means exporting it all again, over an engine a running server
    may still be opening sessions from. Kept apart, an engine is written only for its own
    options (again only when the model files changed, or it lacks a graph its options need),
    is never mistaken for the engine of other options and never overwritten by one, at the
    cost of a ``weights.bin`` per option set on disk. A directory this function did not write
    (no ``source.json``) is never overwritten, and ``engines_dir`` may not be an engine
    directory itself."""
    import json

    engines_dir = Path(engines_dir)
    options = EngineOptions.of(kv, speculative, adaptive, precision)
    _check_engines_dir(engines_dir)
    engine_dir = engines_dir / options.key
    source = _source_of(Path(model_dir))
    reason = _export_reason(engine_dir, source, options)
    if reason is not None:
        from looptool.runtime.convert import load

        export = export_options("onnx", kv=kv, speculative=speculative, adaptive=adaptive, precision=precision)
        model = load(model_dir)
        export_engines(  # budgets None: one looped graph where the plan loops, else every budget's own
            model, engine_dir, "onnx", None, options=export, overwrite=True, validate=validate, on_progress=on_progress
        )
        (engine_dir / SOURCE_STAMP).write_text(json.dumps(source, indent=1) + "\n")
    return KeptEngine(engine_dir, _bytes_under(engine_dir), reason)
