"""Which budget a request runs at: the model id (``NAME`` or ``NAME@k``), a ``budget`` body
field, or ``reasoning_effort`` mapped onto the budget menu by the effort ladder.

The default ladder spreads the effort levels over the sorted menu: ``minimal`` is the
shallowest budget, ``xhigh`` the deepest, ``low``/``medium``/``high`` the quarter points
(menu index ``i * (n - 1) / 4`` rounded half up, for level ``i`` of the five), so the menu
``0,3,6,9,12`` maps ``minimal=0, low=3, medium=6, high=9, xhigh=12``. ``none`` goes with
``minimal`` and ``max`` with ``xhigh``. The ``budget`` body field takes a JSON integer of the
menu or an effort level; strings of digits, floats and booleans are refused. An ``--effort low=0,high=12`` override maps only the
levels it names; every other level takes the budget of the nearest mapped level on the
ladder (the cheaper one on a tie).

``budget: "auto"`` asks for adaptive depth (each token decides its own, :class:`AutoRow`) with
the optional body fields ``min_budget``, ``max_budget`` (default: the menu's shallowest and
deepest) and ``exit_threshold`` (default: the exit rule's, :func:`default_exit_threshold`); those fields without
it, and ``auto`` beside a fixed choice (``NAME@k``, ``reasoning_effort``), are refused
(:meth:`BudgetResolver.choose`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AUTO, AutoRow, default_exit_threshold

AUTO_FIELDS = ("min_budget", "max_budget", "exit_threshold")  # body fields that go with budget "auto"
LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the official client's values, in order
_LADDER = ("minimal", "low", "medium", "high", "xhigh")  # the levels the default ladder spreads over the menu


class BudgetChoiceError(LooptoolError):
    """A request names a model, budget or effort level the server does not serve (HTTP ``status``)."""

    def __init__(self, message: str, *, parameter: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(message, parameter=parameter)
        self.status = status
        self.code = code


def default_ladder(budgets: Sequence[int]) -> dict[str, int]:
    """The documented effort ladder over the sorted menu ``budgets``."""
    menu = sorted(budgets)
    n = len(menu)
    ladder = {level: menu[int(i * (n - 1) / (len(_LADDER) - 1) + 0.5)] for i, level in enumerate(_LADDER)}
    return {"none": ladder["minimal"], **ladder, "max": ladder["xhigh"]}


def parse_effort(text: str, budgets: Sequence[int]) -> dict[str, int]:
    """``"low=0,medium=6,high=12"`` → the full ladder: the named levels as given, every other
    level at the budget of its nearest named level (ties: the cheaper one)."""
    given: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        level, sep, value = part.partition("=")
        level = level.strip()
        if not sep or level not in LEVELS:
            raise LooptoolError(
                f"effort entry {part!r} is not LEVEL=BUDGET with LEVEL one of {', '.join(LEVELS)}; "
                "write e.g. low=0,medium=6,high=12.",
                parameter="effort",
            )
        try:
            budget = int(value)
        except ValueError:
            raise LooptoolError(
                f"effort {level}={value!r}: the budget must be an integer.", parameter="effort"
            ) from None
        if budget not in budgets:
            raise LooptoolError(
                f"effort {level}={budget}: {budget} is not in the budget menu {sorted(budgets)}.", parameter="effort"
            )
        given[level] = budget
    if not given:
        raise LooptoolError("effort is empty; write e.g. low=0,medium=6,high=12.", parameter="effort")
    ladder = {}
    for i, level in enumerate(LEVELS):
        nearest = min(given, key=lambda named: (abs(LEVELS.index(named) - i), given[named]))
        ladder[level] = given[nearest]
    return ladder


@dataclass(frozen=True)
class BudgetResolver:
    """Turns a request's ``model``, ``budget`` and ``reasoning_effort`` into one budget."""

    name: str
    budgets: tuple[int, ...]
    default: int
    ladder: Mapping[str, int]
    exit_rule: str = "state"  # how the server's budget "auto" rows stop: picks the threshold's default and range

    @classmethod
    def create(
        cls,
        name: str,
        budgets: Sequence[int],
        default: int | None = None,
        effort: str | None = None,
        exit_rule: str = "state",
    ) -> BudgetResolver:
        """The resolver for model ``name`` with the menu ``budgets``; ``default`` (the budget of
        the plain ``NAME``; default: the deepest) and the ``effort`` override are checked."""
        menu = tuple(sorted(budgets))
        if default is None:
            default = menu[-1]
        if default not in menu:
            raise LooptoolError(
                f"default_budget {default} is not in the budget menu {list(menu)}; pick one of those.",
                parameter="default_budget",
            )
        if "@" in name:
            raise LooptoolError(f"the served model name {name!r} may not contain '@'.", parameter="served_model_name")
        ladder = parse_effort(effort, menu) if effort else default_ladder(menu)
        return cls(name, menu, default, ladder, exit_rule)

    def model_ids(self) -> list[str]:
        """What ``/v1/models`` lists: ``NAME`` (the default budget), then ``NAME@k`` per budget."""
        return [self.name, *(f"{self.name}@{k}" for k in self.budgets)]

    def resolve(self, model: str, budget: object = None, effort: str | None = None) -> int:
        """The budget of a request; every choice it makes must agree. ``budget`` is the body
        field as sent: an integer of the menu or an effort level; anything else (``"6"``,
        ``6.0``, ``true``) is refused rather than read as a number."""
        base, at, suffix = model.partition("@")
        if base != self.name:
            raise BudgetChoiceError(
                f"the model {model!r} does not exist; this server serves {', '.join(self.model_ids())}.",
                parameter="model",
                status=404,
                code="model_not_found",
            )
        chosen: list[tuple[str, int]] = []
        if at:
            if not suffix.lstrip("-").isdigit() or int(suffix) not in self.budgets:
                raise BudgetChoiceError(
                    f"the model {model!r} names budget {suffix!r}, which is not in the menu {list(self.budgets)}.",
                    parameter="model",
                    status=404,
                    code="model_not_found",
                )
            chosen.append(("model", int(suffix)))
        if budget is not None:
            chosen.append(("budget", self._budget_field(budget)))
        if effort is not None:
            if effort not in self.ladder:
                raise BudgetChoiceError(
                    f"reasoning_effort {effort!r} is not one of {', '.join(LEVELS)}.", parameter="reasoning_effort"
                )
            chosen.append(("reasoning_effort", self.ladder[effort]))
        if len({k for _, k in chosen}) > 1:
            said = ", ".join(f"{field} → {k}" for field, k in chosen)
            raise BudgetChoiceError(
                f"the request asks for different budgets ({said}); give one of model@k, budget or reasoning_effort.",
                parameter=chosen[-1][0],
            )
        return chosen[0][1] if chosen else self.default

    def choose(
        self,
        model: str,
        budget: object = None,
        effort: str | None = None,
        min_budget: object = None,
        max_budget: object = None,
        exit_threshold: object = None,
    ) -> int | AutoRow:
        """A request's fixed budget (:meth:`resolve`) or, for ``budget`` ``"auto"``, its
        adaptive-depth settings checked against the menu (defaults filled in). The fields of
        :data:`AUTO_FIELDS` without ``"auto"``, and ``"auto"`` with ``NAME@k`` or
        ``reasoning_effort``, are one sentence each."""
        fields = dict(zip(AUTO_FIELDS, (min_budget, max_budget, exit_threshold)))
        if budget != AUTO:
            given = [name for name, value in fields.items() if value is not None]
            if given:
                raise BudgetChoiceError(
                    f'{given[0]} applies to budget "auto" only; send budget "auto" or drop {given[0]}.',
                    parameter=given[0],
                )
            return self.resolve(model, budget, effort)
        self.resolve(model.partition("@")[0])  # the model must exist (404 otherwise)
        if "@" in model or effort is not None:
            field = "model" if "@" in model else "reasoning_effort"
            raise BudgetChoiceError(
                f'budget "auto" decides the depth per token, but {field} asks for a fixed budget; send one of them.',
                parameter=field,
            )
        thr = default_exit_threshold(self.exit_rule) if exit_threshold is None else exit_threshold
        row = AutoRow(
            self.budgets[0] if min_budget is None else min_budget,  # type: ignore[arg-type]
            self.budgets[-1] if max_budget is None else max_budget,  # type: ignore[arg-type]
            thr,  # type: ignore[arg-type]
        )
        return row.check(self.budgets, BudgetChoiceError, self.exit_rule)

    def _budget_field(self, budget: object) -> int:
        """The budget the ``budget`` body field names: a JSON integer of the menu, or an effort
        level mapped by the ladder."""
        if isinstance(budget, str) and budget in self.ladder:
            return self.ladder[budget]
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise BudgetChoiceError(
                f"budget must be an integer of the menu {list(self.budgets)}, an effort level "
                f'({", ".join(LEVELS)}) or "auto", got {json.dumps(budget)}.',
                parameter="budget",
            )
        if budget not in self.budgets:
            raise BudgetChoiceError(
                f"budget {budget} is not in this model's menu {list(self.budgets)}; pick one of those.",
                parameter="budget",
            )
        return budget
