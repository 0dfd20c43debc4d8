"""User-facing error types.

Every error a user can cause (bad path, bad plan, unsupported architecture, corrupt
checkpoint) is raised as a :class:`LooptoolError` whose message is one sentence that names
the problem and the fix. The CLI prints it and exits non-zero; programming errors keep
their normal tracebacks.
"""

from __future__ import annotations


class LooptoolError(Exception):
    """Base class for errors caused by user input; the message says what to change."""


class PlanError(LooptoolError, ValueError):
    """A loop plan that cannot be applied to the model (window, budgets, partition)."""


class CaptureError(LooptoolError):
    """The model's graph could not be captured or its residual structure not identified."""


class CheckpointError(LooptoolError):
    """A saved looped model is missing files, has the wrong version or mismatched tensors."""


class SourceError(LooptoolError):
    """A model source (directory, GGUF file, demo name) could not be loaded."""


class PassError(LooptoolError):
    """A graph pass failed or left the graph in an inconsistent state."""
