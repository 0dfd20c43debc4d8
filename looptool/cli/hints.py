"""Pointing a library error at the command line's option for the parameter it names.

Library errors name Python parameters (``seq_len``); a command-line user typed ``--seq-len``.
:func:`option_hint` finds the running command's option whose parameter is the one the error
names and returns " (option --seq-len)"; nothing when the error names none or the command has
no such option (the message alone is then the whole story).
"""

from __future__ import annotations

import importlib

# Where the running command's context lives: typer >= 0.26 runs on its own vendored copy of
# click (whose context stack the click package never sees), older typer on click itself.
_CONTEXT_MODULES = ("typer._click.globals", "click.globals")

# library parameter -> the command-line parameter (the typer function's argument name, not the
# flag) that sets it, where the two names differ; a command matches either name
ALIASES = {
    "directory": "output",  # storage.files.check_output_dir / save(directory) <- every command's --output
    "teachers": "teacher",  # DistillConfig.teachers <- distill --teacher (repeatable)
    "budgets": "budget",  # export_onnx / export_tensorrt(budgets) <- export --budget
    "budget": "budgets",  # a budget of the menu train / rl / distill --budgets sample from
    "max_tokens": "tokens",  # eval.analyze.analyze(max_tokens) <- analyze --tokens
}


def _current_context():
    """The context of the command being run (typer's or click's), or None outside one."""
    for module in _CONTEXT_MODULES:
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            return ctx
    return None


def option_hint(exc: BaseException) -> str:
    """`` (option --flag)`` for the current command's option that sets ``exc.parameter``."""
    name = getattr(exc, "parameter", None)
    ctx = _current_context() if name else None
    if ctx is None:
        return ""
    wanted = {name, ALIASES.get(name, name)}
    for param in ctx.command.params:
        # an option, not an argument (duck-typed: click's and typer's vendored click's classes differ)
        if param.name in wanted and getattr(param, "param_type_name", None) == "option":
            flag = max(param.opts, key=len)  # the long form
            return "" if flag in str(exc) else f" (option {flag})"
    return ""
