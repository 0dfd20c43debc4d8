"""User-facing error types.

Every error a user can cause (bad path, bad plan, unsupported architecture, corrupt
checkpoint) is raised as a :class:`LooptoolError` whose message is one sentence that names
the problem and the fix; the CLI prints it and exits with 1. Anything else is a looptool
bug: it keeps its traceback (:class:`InternalError` wraps a crash inside a pass, chained to
the original exception), and the CLI prints one line saying so, exits with 2, and shows the
traceback with ``--debug``.
"""

from __future__ import annotations


class LooptoolError(Exception):
    """Base class for errors caused by user input; the message says what to change.

    Messages name the Python parameter at fault (``seq_len``, ``overwrite=True``), never a
    command-line flag: a Python caller has no flags. ``parameter`` (optional) names that
    parameter, so the command line can point at its own option for it. ``rerun`` (optional)
    names the looptool step — ``"export"``, ``"convert"``: the function and the command share
    the name — whose parameters the message's ``name=value`` fixes are when that is not the call
    that raised ("export the engine again with adaptive=True"), so the command line can spell
    them as that command (:mod:`looptool.cli.hints`).
    """

    def __init__(self, message: str = "", *, parameter: str | None = None, rerun: str | None = None):
        super().__init__(message)
        self.parameter = parameter
        self.rerun = rerun


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


class InternalError(Exception):
    """A looptool bug, not a user error (deliberately not a :class:`LooptoolError`): the
    message names where it happened; the original exception is its ``__cause__``."""


class MissingExtraError(LooptoolError):
    """An optional dependency of a feature is not installed."""


def require_extra(extra: str, feature: str, *modules: str) -> None:
    """Refuse, in one sentence naming the pip extra and the command that installs it for this copy
    of looptool (:func:`looptool.core.install.install_command`), when a module ``feature`` needs is
    missing."""
    import importlib.util

    from looptool.core.install import install_command

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"{feature} needs the '{extra}' extra ({', '.join(missing)} not installed): {install_command(extra)}."
        )
