"""Pointing a library error at the command line's option for the parameter it names.

Library errors name Python parameters (``seq_len``); a command-line user typed ``--seq-len``.
:func:`option_hint` finds the running command's option whose parameter is the one the error
names and returns " (option --seq-len)"; nothing when the error names none or the command has
no such option (the message alone is then the whole story).
"""

from __future__ import annotations

import click

from looptool.core.errors import LooptoolError

# library parameter -> the command-line parameter that sets it, where the two names differ
ALIASES = {"directory": "output", "lambdas": "lambda_", "tokens_per_step": "tokens"}


def option_hint(exc: LooptoolError) -> str:
    """`` (option --flag)`` for the current command's option that sets ``exc.parameter``."""
    name = getattr(exc, "parameter", None)
    ctx = click.get_current_context(silent=True)
    if not name or ctx is None:
        return ""
    wanted = {name, ALIASES.get(name, name)}
    for param in ctx.command.params:
        if param.name in wanted and isinstance(param, click.Option):
            flag = max(param.opts, key=len)  # the long form
            return "" if flag in str(exc) else f" (option {flag})"
    return ""
