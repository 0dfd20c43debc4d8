"""The errors of every backend: exporting an engine, and reading or running one."""

from __future__ import annotations

from looptool.core.errors import LooptoolError


class ExportError(LooptoolError):
    """An export failed (unsupported model, exporter failure, or validation mismatch)."""


class EngineError(LooptoolError):
    """An engine directory is incomplete, tampered with or points outside itself."""


class ReexportError(EngineError):
    """An engine directory lacks a graph a call needs: exporting it again with the options the
    message names is the fix (``rerun="export"``, so the command line spells them as ``looptool
    export``'s flags)."""

    def __init__(self, message: str = "", *, parameter: str | None = None):
        super().__init__(message, parameter=parameter, rerun="export")
