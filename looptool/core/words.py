"""Counts in the sentences a user reads: ``1 token``, ``2 tokens``."""

from __future__ import annotations


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``noun`` as it reads after the count ``n``: singular for exactly 1, else ``plural_form``
    (default: ``noun + "s"``)."""
    if n == 1:
        return noun
    return plural_form if plural_form is not None else noun + "s"


def counted(n: int, noun: str, plural_form: str | None = None, *, grouped: bool = False) -> str:
    """``n`` followed by ``noun`` in the number it takes: ``counted(1, "token")`` is ``"1 token"``,
    ``counted(2048, "token", grouped=True)`` is ``"2,048 tokens"``."""
    number = f"{n:,}" if grouped else f"{n}"
    return f"{number} {plural(n, noun, plural_form)}"
