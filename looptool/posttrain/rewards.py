"""Verifiable rewards for ``looptool rl``: the interface, the built-ins, and loading.

A reward function takes ``(prompt, completion, example)`` — the prompt text, the decoded
completion (up to, not including, the end-of-sequence token) and the example's JSONL record
with all its fields — and returns a number. ``--reward NAME`` picks a built-in
(:data:`BUILTIN`); ``--reward module:function`` or ``--reward path/to/file.py:function``
imports one.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path

from looptool.core.errors import LooptoolError

RewardFn = Callable[[str, str, dict], float]
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


class RewardError(LooptoolError):
    """A reward function cannot be loaded, raised, or returned something other than a number."""


def _answer(example: dict) -> str:
    if "answer" not in example:
        raise RewardError("the built-in rewards compare with the example's 'answer' field, and this example has none.")
    return str(example["answer"]).strip()


def exact_match(prompt: str, completion: str, example: dict) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals ``example["answer"]``."""
    return float(completion.strip() == _answer(example))


def numeric(prompt: str, completion: str, example: dict) -> float:
    """1.0 when the first number in the completion equals ``example["answer"]`` as a number
    (relative tolerance 1e-9, absolute 1e-9)."""
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    try:
        target = float(_answer(example))
    except ValueError:
        raise RewardError(f"the numeric reward needs a number as 'answer', not {example['answer']!r}.") from None
    return float(math.isclose(float(found.group()), target, rel_tol=1e-9, abs_tol=1e-9))


BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match, "numeric": numeric}


def load_reward(spec: str) -> RewardFn:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function``."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise RewardError(f"reward {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor 'module:function'.")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise RewardError(f"reward file '{where}' does not exist.")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward module '{where}' could not be imported ({type(exc).__name__}: {exc}).") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward module '{where}' has no function {name!r}.")
    return fn


def score(fn: RewardFn, prompt: str, completion: str, example: dict) -> float:
    """``fn``'s reward as a finite float, or one sentence on what went wrong."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        value = fn(prompt, completion, example)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"the reward function {name} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"the reward function {name} returned {value!r}; it must return a finite number.")
    return float(value)
