"""The ``looptool`` command line (typer + rich).

Every user mistake ends in one red sentence on stderr and exit code 1; nothing half-written
is left behind (outputs are written to a temp dir and renamed at the end).

One module per command group registers its commands on the one typer :data:`app`
(:mod:`looptool.cli.application`): :mod:`~looptool.cli.convert` (convert, inspect, demo),
:mod:`~looptool.cli.train` (train, rl, distill), :mod:`~looptool.cli.evaluate` (eval,
analyze, plot, lm-eval), :mod:`~looptool.cli.generate` (generate, run),
:mod:`~looptool.cli.merge`, :mod:`~looptool.cli.export` and :mod:`~looptool.cli.serve`; shared options live in
:mod:`~looptool.cli.options`, the progress display in :mod:`~looptool.cli.progress`. A
command parses its options, calls the library and prints: what it computes or writes is
a library function (tests/test_layout.py checks that no module here imports torch or
numpy, or writes a file itself).
"""

from looptool.cli import convert, train, evaluate, generate, merge, export, serve  # noqa: F401, I001  (registers the commands, in --help order)
from looptool.cli.application import app, main

__all__ = ["app", "main"]

if __name__ == "__main__":  # pragma: no cover
    main()
