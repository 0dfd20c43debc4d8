"""The typer app, its consoles, the ``--debug`` callback, the error wrapper every command
wears (:func:`friendly`) and the console-script entry point :func:`main`.

(Named ``application`` rather than ``app`` so that ``looptool.cli.app`` stays the typer app.)
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape

from looptool.cli.hints import option_hint
from looptool.core.errors import LooptoolError

app = typer.Typer(
    name="looptool",
    help="Loop pretrained decoder LMs for elastic-depth inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
# Tables are wide; when piped (CI logs, files) do not squeeze them into 80 columns.
out = Console() if sys.stdout.isatty() else Console(width=160)

_DEBUG = {"on": False}  # set per invocation by the app callback


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback of an internal error (or LOOPTOOL_DEBUG=1).")
    ] = False,
) -> None:
    """Loop pretrained decoder LMs for elastic-depth inference."""
    _DEBUG["on"] = debug or os.environ.get("LOOPTOOL_DEBUG", "") not in ("", "0")


def friendly(fn: Callable) -> Callable:
    """User errors (LooptoolError): one red line, exit code 1. Anything else is a looptool
    bug: one line saying so and how to see the traceback, exit code 2 (``--debug`` or
    ``LOOPTOOL_DEBUG=1``: the exception propagates with its traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LooptoolError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc) + option_hint(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        except (
            typer.Exit,
            typer.Abort,
            click.exceptions.Exit,
            click.exceptions.Abort,
            click.ClickException,
            typer.TyperException,  # typer >= 0.26 bundles its own click: its usage errors subclass this
            KeyboardInterrupt,
        ):
            raise
        except Exception as exc:
            if _DEBUG["on"]:
                raise
            console.print(
                f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))} — this is a "
                "looptool bug, not your input; rerun with --debug for the traceback and report it.",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(code=2) from None

    return wrapper


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
