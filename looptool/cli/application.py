"""The typer app, its consoles, the ``--debug`` callback, the error wrapper every command
wears (:func:`friendly`), the help every command shows as whole paragraphs (:func:`prose`) and
the console-script entry point :func:`main`.

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
from typer.core import TyperGroup

from looptool.cli.hints import cli_message, current_context
from looptool.core.errors import LooptoolError


def prose(text: str | None, markup: bool = True) -> str | None:
    """Help text as rich-mode typer should show it: each paragraph (blank-line separated) on one
    line, so the terminal, not the source's line breaks, wraps it (typer keeps single newlines
    in rich mode, cutting sentences where the docstring happened to break); with ``markup``,
    brackets escaped so that ``[recurrent]`` is shown, not read as a style. A paragraph that
    starts with click's ``\\b`` keeps its lines."""
    if not text:
        return text
    paragraphs = [p if p.startswith("\b") else " ".join(p.split()) for p in text.strip().split("\n\n")]
    joined = "\n\n".join(p for p in paragraphs if p)
    return escape(joined) if markup else joined


class HelpGroup(TyperGroup):
    """The looptool group: its own, every command's and every parameter's help through :func:`prose`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        markup = self.rich_markup_mode == "rich"
        for command in (self, *self.commands.values()):
            command.help = prose(command.help, markup)
            for param in command.params:
                if getattr(param, "help", None):
                    param.help = prose(param.help, markup)


app = typer.Typer(
    name="looptool",
    help="Loop pretrained decoder LMs for elastic-depth inference.",
    cls=HelpGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
# Tables are wide; when piped (CI logs, files) do not squeeze them into 80 columns.
out = Console() if sys.stdout.isatty() else Console(width=160)


@app.callback()
def _options(
    ctx: typer.Context,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback of an internal error (or LOOPTOOL_DEBUG=1).")
    ] = False,
) -> None:
    """Loop pretrained decoder LMs for elastic-depth inference."""
    ctx.obj = {"debug": debug}  # this invocation's settings, read by friendly()


def _debugging() -> bool:
    """Whether this invocation shows tracebacks: ``--debug`` on its command line, or
    ``LOOPTOOL_DEBUG`` set (and not 0)."""
    ctx = current_context()
    flag = bool(ctx is not None and isinstance(ctx.find_root().obj, dict) and ctx.find_root().obj.get("debug"))
    return flag or os.environ.get("LOOPTOOL_DEBUG", "") not in ("", "0")


def friendly(fn: Callable) -> Callable:
    """User errors (LooptoolError): one red line in the command line's words (flags, not Python
    parameters: :func:`~looptool.cli.hints.cli_message`), exit code 1. Anything else is a looptool
    bug: one line saying so and how to see the traceback, exit code 2 (``--debug`` or
    ``LOOPTOOL_DEBUG=1``: the exception propagates with its traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LooptoolError as exc:
            console.print(f"[bold red]error:[/] {escape(cli_message(exc))}", highlight=False, soft_wrap=True)
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
            if _debugging():
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
