"""The step-engine interface: the one seam between serving and every runtime.

A scheduler (:class:`looptool.serve.scheduler.Scheduler`) keeps its running requests in the
rows of one persistent :class:`SlotCache` and drives a :class:`StepEngine`: one cached step
over a contiguous slice of rows, each row at its own budget. The PyTorch runtime, onnxruntime
and TensorRT each implement it; :func:`open_engine` opens the right one for a directory (a
looped model, an ONNX engine directory, a TensorRT engine directory) without its caller
importing any of them.
"""

from looptool.engine.interface import (
    ArraySlotCache,
    Capabilities,
    EngineFacts,
    SlotCache,
    StepBatch,
    StepEngine,
    StepResult,
    TensorSlotCache,
)
from looptool.engine.opened import OpenedEngine, costs_by_budget, eos_ids
from looptool.engine.registry import RUNTIMES, describe, open_engine

__all__ = [
    "RUNTIMES",
    "ArraySlotCache",
    "Capabilities",
    "EngineFacts",
    "OpenedEngine",
    "SlotCache",
    "StepBatch",
    "StepEngine",
    "StepResult",
    "TensorSlotCache",
    "costs_by_budget",
    "describe",
    "eos_ids",
    "open_engine",
]
