"""The ``onnxruntime`` runtime of :func:`looptool.engine.open_engine`: an engine directory written
by looptool export, opened as a :class:`~looptool.backends.ort.runtime.Runtime` and its step
engine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from looptool.backends.engine_files import engine_tokenizer
from looptool.backends.manifest import MANIFEST, Manifest
from looptool.backends.ort.engine import OrtStepEngine
from looptool.engine.interface import EngineFacts
from looptool.engine.opened import OpenedEngine, costs_by_budget, eos_ids

log = logging.getLogger(__name__)

WANTS = "give an engine directory written by looptool export"


def detect(path: Path) -> bool:
    """Whether ``path`` is an engine directory (it holds the engine manifest)."""
    return (path / MANIFEST).is_file()


def describe(path: Path) -> EngineFacts:
    """The exported budgets and the source config's context, from the manifest alone."""
    return Manifest.read(path).facts()


def open_dir(
    path: Path,
    *,
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    prepack: bool | None = None,
    spin: bool | None = False,
    exit_rule: str = "state",
    **_,
) -> OpenedEngine:
    """onnxruntime sessions over the engine directory ``path`` (``threads`` intra-op threads,
    CPU; ``prepack`` and ``spin`` as :class:`~looptool.backends.ort.runtime.Runtime` takes them)
    and their step engine for ``kv`` (rows of adaptive depth stopping by ``exit_rule``, where
    the engine holds its adaptive-depth graph)."""
    from looptool.backends.onnx.quantize import batch_dependent
    from looptool.backends.ort.runtime import Runtime

    rt = Runtime(path, threads=threads, prepack=prepack, spin=spin)
    if batch_dependent(rt.manifest.quantization):
        log.warning(
            "%s quantizes activations to int8 (accuracy level 4), so a request's greedy answer depends on the other "
            "requests in its batch; export it again without --accuracy-level 4 for answers that do not.",
            path,
        )
    tok = engine_tokenizer(path, rt.manifest, tokenizer)
    engine = OrtStepEngine(rt, kv=kv, exit_rule=exit_rule)
    costs = costs_by_budget([c.as_dict() for c in rt.manifest.costs], engine.budgets, kv)
    eos = eos_ids(tok, rt.manifest.eos_token_id)
    return OpenedEngine(engine, tok, costs, eos, "cpu", "onnxruntime")
