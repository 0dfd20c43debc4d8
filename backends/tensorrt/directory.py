"""The ``tensorrt`` runtime of :func:`looptool.engine.open_engine`: an engine directory whose
TensorRT engines were built on this GPU, opened as a
:class:`~looptool.backends.tensorrt.runtime.Runtime` and its step engine."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from looptool.backends.engine_files import engine_tokenizer
from looptool.backends.errors import EngineError
from looptool.backends.manifest import MANIFEST, Manifest
from looptool.backends.tensorrt.engine import TrtStepEngine
from looptool.engine.interface import EngineFacts
from looptool.engine.opened import OpenedEngine, costs_by_budget, eos_ids

WANTS = "give an engine directory exported with backend='tensorrt' whose engines were built on this GPU"


def detect(path: Path) -> bool:
    """Whether ``path`` holds built TensorRT engines and a CUDA GPU is here to run them."""
    if not (path / MANIFEST).is_file() or not torch.cuda.is_available():
        return False
    try:
        section = Manifest.read(path).tensorrt
    except EngineError:
        return False
    return section is not None and bool(section.engines)


def describe(path: Path) -> EngineFacts:
    """The exported budgets and the source config's context, from the manifest alone."""
    return Manifest.read(path).facts()


def open_dir(
    path: Path,
    *,
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    **_,
) -> OpenedEngine:
    """The built engines of ``path`` on the CUDA ``device`` and their step engine for ``kv``."""
    from looptool.backends.tensorrt.runtime import Runtime

    rt = Runtime(path, device="cuda" if device == "auto" else device)
    tok = engine_tokenizer(path, rt.manifest, tokenizer)
    engine = TrtStepEngine(rt, kv=kv)
    costs = costs_by_budget([c.as_dict() for c in rt.manifest.costs], engine.budgets, kv)
    eos = eos_ids(tok, rt.manifest.eos_token_id)
    return OpenedEngine(engine, tok, costs, eos, str(rt.device), "tensorrt")
