"""Which runtime serves a directory, and opening it there.

Each runtime is a module with ``detect(path) -> bool`` (the directory is one it runs),
``describe(path) -> EngineFacts`` (from JSON alone) and ``open_dir(path, *, device, kv,
tokenizer, threads) -> OpenedEngine``. :data:`RUNTIMES` names them by import path, in the
order ``auto`` tries them, so the caller imports none of them and a new backend is one entry
here plus its module.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from looptool.core.errors import LooptoolError
from looptool.engine.interface import EngineFacts
from looptool.engine.opened import OpenedEngine

RUNTIMES: dict[str, str] = {
    "tensorrt": "looptool.backends.tensorrt.directory",  # an engine directory with TensorRT engines built, on a CUDA GPU
    "onnxruntime": "looptool.backends.ort.directory",  # an engine directory written by looptool export
    "pytorch": "looptool.runtime.directory",  # a looped model directory (save_pretrained, looptool convert)
}


def _module(runtime: str) -> ModuleType:
    return importlib.import_module(RUNTIMES[runtime])


def _choose(path: Path, runtime: str) -> ModuleType:
    """The runtime module for ``path``: the one named, or with ``auto`` the first that detects it."""
    if not path.is_dir():
        raise LooptoolError(
            f"'{path}' is not a directory; give a looped model directory or an exported engine directory.",
            parameter="model_dir",
        )
    if runtime != "auto":
        if runtime not in RUNTIMES:
            raise LooptoolError(f"unknown runtime {runtime!r}; use auto, {', '.join(RUNTIMES)}.", parameter="runtime")
        module = _module(runtime)
        if not module.detect(path):
            raise LooptoolError(
                f"'{path}' is not a directory the {runtime} runtime serves; {module.WANTS}.", parameter="runtime"
            )
        return module
    for name in RUNTIMES:
        module = _module(name)
        if module.detect(path):
            return module
    raise LooptoolError(
        f"'{path}' holds neither a looped model (looptool.json) nor an exported engine (manifest.json); "
        "give the folder written by looptool convert or looptool export.",
        parameter="model_dir",
    )


def describe(path: str | os.PathLike, runtime: str = "auto") -> EngineFacts:
    """The budgets and context of what ``path`` serves, read before anything loads."""
    path = Path(path)
    return _choose(path, runtime).describe(path)


def open_engine(
    path: str | os.PathLike,
    *,
    runtime: str = "auto",
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    **session,
) -> OpenedEngine:
    """The step engine for ``path`` on ``runtime`` (``auto``: TensorRT where the directory holds
    built engines and a CUDA GPU is present, else onnxruntime for an engine directory, PyTorch
    for a looped model directory). ``device`` applies to PyTorch, ``threads`` (intra-op) and
    ``session`` (``prepack``, ``spin``) to onnxruntime, ``session``'s ``exit_rule`` (how rows of
    adaptive depth stop) to PyTorch and onnxruntime (an engine exported with its adaptive-depth graph); ``tokenizer`` replaces the directory's own."""
    path = Path(path)
    return _choose(path, runtime).open_dir(path, device=device, kv=kv, tokenizer=tokenizer, threads=threads, **session)
