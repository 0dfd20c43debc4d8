"""Each row's budget, resolved once at the edge (the Python API's ``budget=`` argument, a
command line's ``--budget``, an HTTP request's budget) into one value that every inner layer
takes as it is: :class:`RowBudgets`. It also says which graph runs the rows: a budget's own
path when every row shares that budget and the runtime has it, else the row-wise-budget path
(:data:`~looptool.core.graph.ROWWISE`), in which every row runs exactly its own budget
(Accordion Eq. 1, ELR Eq. 2)."""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from looptool.core.errors import LooptoolError
from looptool.core.graph import ROWWISE


@dataclass(frozen=True)
class RowBudgets:
    """The budget of every row of a batch, each one of the menu (checked by :meth:`resolve`;
    made directly only from budgets already checked)."""

    rows: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        """Whether every row has the same budget."""
        return len(set(self.rows)) == 1

    def graph(self, own: Collection[int]) -> int | str:
        """The path that runs these rows: their shared budget where ``own`` (the budgets with a
        path of their own) has it, else :data:`~looptool.core.graph.ROWWISE`."""
        return self.rows[0] if self.uniform and self.rows[0] in own else ROWWISE

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
                    f"{len(values)} budgets for a batch of {batch} rows; give one budget per row.", parameter="budget"
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
