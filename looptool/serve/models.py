"""What a server serves: a step engine opened by :func:`looptool.engine.open_engine` (a looped
model directory on PyTorch, an engine directory on onnxruntime or, with built engines on a CUDA
GPU, TensorRT), the served name, and the facts its options are checked against before it
loads. Everything after this module sees only :class:`looptool.engine.StepEngine`."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from looptool.engine import EngineFacts, StepEngine, describe, open_engine


@dataclass(frozen=True)
class ServedFacts:
    """What the HTTP side needs to know about a served model, without its engine: what a Ray
    Serve ingress holds while the replicas hold the engines."""

    name: str
    tokenizer: object
    budgets: tuple[int, ...]
    costs: dict[int, dict]  # budget -> {"budget", "layer_executions", "kv_bytes_per_token"}
    eos: tuple[int, ...]
    device: str
    runtime: str  # "pytorch", "onnxruntime" or "tensorrt"
    vocab_size: int


@dataclass(frozen=True)
class ServedModel(ServedFacts):
    """A step engine and what the HTTP side needs to know about the model behind it."""

    engine: StepEngine

    @classmethod
    def of(cls, name: str, engine: StepEngine, tokenizer, costs: dict, eos: tuple, device: str, runtime: str):
        """``engine`` served as ``name``, its budgets and vocabulary read from it."""
        return cls(name, tokenizer, tuple(engine.budgets), costs, eos, device, runtime, engine.vocab_size, engine)

    def facts(self) -> ServedFacts:
        """What the HTTP side needs of this model, without the engine."""
        return ServedFacts(*(getattr(self, f.name) for f in fields(ServedFacts)))


def read_facts(path: str | os.PathLike, runtime: str = "auto") -> EngineFacts:
    """The budget menu and context of what ``path`` serves, read from its JSON files alone."""
    return describe(path, runtime)


def open_model(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    runtime: str = "auto",
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    **session,
) -> ServedModel:
    """The served model at ``path`` on ``runtime`` (``auto``: see :func:`looptool.engine.open_engine`,
    which takes ``session``). ``name`` (default: the directory's name) is the model id clients ask for."""
    opened = open_engine(path, runtime=runtime, device=device, kv=kv, tokenizer=tokenizer, threads=threads, **session)
    name = name or Path(path).resolve().name
    engine = opened.engine
    return ServedModel.of(name, engine, opened.tokenizer, opened.costs, opened.eos, opened.device, opened.runtime)
