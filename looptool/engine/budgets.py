"""Each row's budget, resolved once at the edge (the Python API's ``budget=`` argument, a
command line's ``--budget``, an HTTP request's budget) into one value that every inner layer
takes as it is: :class:`RowBudgets`. It also says which graph runs the rows: a budget's own
path when every row shares that budget and the runtime has it, else the row-wise-budget path
(:data:`~looptool.core.graph.ROWWISE`), in which every row runs exactly its own budget
(Accordion Eq. 1, ELR Eq. 2).

A row may instead decide its depth per token (adaptive depth, ``budget="auto"``): its
:class:`AutoRow` (``min_budget``, ``max_budget``, ``exit_threshold``) rides in
:attr:`RowBudgets.auto`. An engine that runs such rows runs the adaptive-depth path for the
whole batch, a fixed row ``k`` as ``min_budget = max_budget = k`` (exactly budget ``k`` under
last-loop KV)."""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from looptool.core.errors import LooptoolError
from looptool.core.graph import ROWWISE
from looptool.core.words import counted

DEFAULT_EXIT_THRESHOLD = 0.05  # relative state change below which an adaptive row stops (not calibrated per model)


@dataclass(frozen=True)
class ThresholdScale:
    """What ``exit_threshold`` means under one exit rule: its default, the value at which every
    row runs its ``max_budget`` (``deepest``) and the one at which every row stops at its
    ``min_budget`` (``shallowest``), the valid range lying between them, and how a token stops
    (``stops``: the comparison of its criterion with the threshold, as the CLI shows it)."""

    default: float
    deepest: float
    shallowest: float
    stops: str

    def check(self, thr, rule: str, error: type[LooptoolError] = LooptoolError) -> float:
        """``thr`` as a float within this scale; else one sentence (an ``error`` naming
        ``exit_threshold``). An int beyond a float's exact range counts as infinity."""
        if isinstance(thr, int) and not isinstance(thr, bool) and thr > 2**53:
            thr = math.inf  # above any relative change (and beyond a float's exact range)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or math.isnan(thr) or thr < 0:
            raise error(
                f"exit_threshold must be a number >= 0 (0: always max_budget), got {thr!r}.", parameter="exit_threshold"
            )
        if thr > max(self.deepest, self.shallowest):
            raise error(
                f"exit_threshold is the cumulative exit probability q under exit_rule {rule!r}, in [0, 1] (0: always "
                f"min_budget, 1: always max_budget), got {thr!r}.",
                parameter="exit_threshold",
            )
        return float(thr)


# each exit rule's threshold: the state and KL rules stop a token once its change falls under it
# (0: never; infinity: at once), the learned exits (rule "gate") once its cumulative exit
# probability reaches q (1: never; 0: at once)
EXIT_THRESHOLDS = {
    "state": ThresholdScale(DEFAULT_EXIT_THRESHOLD, 0.0, math.inf, "<"),
    "kl": ThresholdScale(DEFAULT_EXIT_THRESHOLD, 0.0, math.inf, "<"),
    "gate": ThresholdScale(0.5, 1.0, 0.0, "exit probability ≥"),
}


def default_exit_threshold(rule: str = "state") -> float:
    """The exit threshold ``budget="auto"`` uses under ``rule`` when none is given."""
    return EXIT_THRESHOLDS[rule].default


def check_exit_threshold(thr, rule: str = "state", error: type[LooptoolError] = LooptoolError) -> float:
    """``thr`` as a float when it is a threshold of ``rule`` (:data:`EXIT_THRESHOLDS`): a number
    >= 0 for the state and KL rules, a probability q in [0, 1] for the learned exits; else one
    sentence (an ``error`` naming ``exit_threshold``)."""
    return EXIT_THRESHOLDS[rule].check(thr, rule, error)


# Why adaptive depth refuses per-loop KV, said by every runtime that refuses it.
PER_LOOP_AUTO = (
    "under per-loop KV a token that stops early writes no keys and values for the loops it skips, which later "
    "tokens running those loops would read."
)


AUTO = "auto"  # the budget that asks for adaptive depth


def wants_auto(budget, min_budget=None, max_budget=None, exit_threshold=None, exit_rule=None) -> bool:
    """Whether ``budget`` asks for adaptive depth (``"auto"``); one sentence for a string that
    is not ``"auto"``, a per-row list holding ``"auto"``, or the adaptive-depth arguments given
    with a fixed budget."""
    if isinstance(budget, str):
        if budget != AUTO:
            raise LooptoolError(
                f"budget {budget!r} is not a budget; give an integer, a list or 'auto'.", parameter="budget"
            )
        return True
    if isinstance(budget, Sequence) and any(isinstance(b, str) for b in budget):
        raise LooptoolError(
            "budget='auto' decides every row's depth per token and cannot be mixed into a per-row list; "
            "give budget='auto' (with min_budget / max_budget) or a list of integers.",
            parameter="budget",
        )
    given = [n for n, v in (("min_budget", min_budget), ("max_budget", max_budget)) if v is not None]
    given += [n for n, v in (("exit_threshold", exit_threshold), ("exit_rule", exit_rule)) if v is not None]
    if given:
        raise LooptoolError(
            f"{given[0]} applies to budget='auto' only; pass budget='auto' or drop it.", parameter=given[0]
        )
    return False


@dataclass(frozen=True)
class AutoRow:
    """One row's adaptive-depth settings: it runs between ``min_budget`` and ``max_budget``
    (budgets of the menu, ``min_budget <= max_budget``) and stops once its change falls under
    ``exit_threshold`` (>= 0; 0: always ``max_budget``). Checked where it is made (:meth:`check`)."""

    min_budget: int
    max_budget: int
    exit_threshold: float = DEFAULT_EXIT_THRESHOLD

    def check(self, menu: Collection[int], error: type[LooptoolError] = LooptoolError, rule: str = "state") -> AutoRow:
        """These settings (the threshold as a float), one sentence (an ``error`` naming the field) for a depth off the menu,
        a range upside down or a threshold that is not a number >= 0."""
        for name in ("min_budget", "max_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise error(f"{name} must be an integer budget of the menu, got {value!r}.", parameter=name)
            if value not in menu:
                raise error(
                    f"{name} {value} is not in the budget menu {sorted(menu)}; pick one of those.", parameter=name
                )
        if self.min_budget > self.max_budget:
            raise error(
                f"min_budget {self.min_budget} is above max_budget {self.max_budget}; give min_budget <= max_budget.",
                parameter="min_budget",
            )
        return AutoRow(self.min_budget, self.max_budget, check_exit_threshold(self.exit_threshold, rule, error))


@dataclass(frozen=True)
class RowBudgets:
    """The budget of every row of a batch, each one of the menu (checked by :meth:`resolve`;
    made directly only from budgets already checked).

    ``auto`` (None: every row fixed) gives each row's :class:`AutoRow`, or None for a fixed
    row; an adaptive row's entry in ``rows`` is its ``max_budget`` (the deepest it may run).
    An ``auto`` without an adaptive row is stored as None."""

    rows: tuple[int, ...]
    auto: tuple[AutoRow | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.auto is not None:
            if len(self.auto) != len(self.rows):
                raise LooptoolError(
                    f"{counted(len(self.auto), 'adaptive-depth entry', 'adaptive-depth entries')} for {counted(len(self.rows), 'row')}."
                )
            if all(a is None for a in self.auto):
                object.__setattr__(self, "auto", None)

    @property
    def adaptive(self) -> bool:
        """Whether some row decides its depth per token (then only the adaptive-depth path runs
        these rows; :meth:`graph` speaks of fixed budgets only)."""
        return self.auto is not None

    def depth_inputs(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The adaptive-depth path's ``min_budget``, ``max_budget`` (int64 ``[batch]``) and
        ``exit_threshold`` (float32 ``[batch]``): an adaptive row's settings, a fixed row ``k``
        as ``k, k, 0``."""
        auto = self.auto or (None,) * len(self.rows)
        lo = [a.min_budget if a else k for k, a in zip(self.rows, auto)]
        hi = [a.max_budget if a else k for k, a in zip(self.rows, auto)]
        thr = [a.exit_threshold if a else 0.0 for a in auto]
        return (
            torch.tensor(lo, dtype=torch.long, device=device),
            torch.tensor(hi, dtype=torch.long, device=device),
            torch.tensor(thr, dtype=torch.float32, device=device),
        )

    @property
    def uniform(self) -> bool:
        """Whether every row has the same budget."""
        return len(set(self.rows)) == 1

    def graph(self, own: Collection[int]) -> int | str:
        """The path that runs these rows: their shared budget where ``own`` (the budgets with a
        path of their own) has it, else :data:`~looptool.core.graph.ROWWISE`."""
        return self.rows[0] if self.uniform and self.rows[0] in own else ROWWISE

    def runs(self) -> list[tuple[int, slice]]:
        """Each run of consecutive rows sharing a budget: ``(budget, rows)`` in row order (what
        runs one budget's own path per run, as a verify step does)."""
        out, first = [], 0
        for last in range(1, len(self.rows) + 1):
            if last == len(self.rows) or self.rows[last] != self.rows[first]:
                out.append((self.rows[first], slice(first, last)))
                first = last
        return out

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The row-wise path's ``budgets`` input: int64 ``[batch]``."""
        return torch.tensor(self.rows, dtype=torch.long, device=device)

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def resolve(
        cls,
        budget,
        menu: Sequence[int],
        batch: int,
        *,
        default: int | None = None,
        error: type[LooptoolError] = LooptoolError,
    ) -> RowBudgets:
        """``budget`` as the caller gave it (None: ``default`` for every row; an integer: that
        budget for every row; a list, tuple, 1-D tensor or array: one budget per row) checked
        against ``menu`` for ``batch`` rows; one sentence (an ``error``) for anything else."""
        if isinstance(budget, RowBudgets):  # resolved before: taken as it is
            return budget
        menu = tuple(sorted(menu))
        if budget is None:
            values = [menu[-1] if default is None else default] * batch
        elif _integer(budget) is not None:
            values = [_integer(budget)] * batch
        elif isinstance(budget, (str, bytes, bool, float)) or not hasattr(budget, "__len__"):
            raise error(f"budget {budget!r} is neither an integer nor a list of integers.", parameter="budget")
        else:
            if getattr(budget, "ndim", 1) != 1:
                raise error(f"a budget list must be 1-D, got shape {tuple(budget.shape)}.", parameter="budget")
            values = budget.tolist() if hasattr(budget, "tolist") else list(budget)
            if len(values) != batch:
                raise error(
                    f"{counted(len(values), 'budget')} for a batch of {counted(batch, 'row')}; give one budget per row.",
                    parameter="budget",
                )
        rows = []
        for value in values:
            k = _integer(value)
            if k is None:
                raise error(f"budget {value!r} is not an integer; give whole numbers.", parameter="budget")
            if k not in menu:
                raise error(
                    f"budget {k} is not in the budget menu {list(menu)}; pick one of those.", parameter="budget"
                )
            rows.append(k)
        return cls(tuple(rows))


def _integer(value) -> int | None:
    """``value`` as an int when it is an integer (ints, numpy and 0-d torch integers), else None."""
    if isinstance(value, (bool, float, str)) or getattr(value, "dtype", None) in (torch.bool,):
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_floating_point()):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
