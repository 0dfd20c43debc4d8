"""The errors of every backend: exporting an engine, and reading or running one."""

from __future__ import annotations

from looptool.core.errors import LooptoolError


class ExportError(LooptoolError):
    """An export failed (unsupported model, exporter failure, or validation mismatch)."""


class EngineError(LooptoolError):
    """An engine directory is incomplete, tampered with or points outside itself."""
