"""Budget sampling for mixed-depth training (Accordion Eq. 2; ELR Sec. 3.2, Eq. 3, App. A.3).

Every micro-batch draws one budget uniformly from the menu — the same draw on every rank,
seeded by ``(seed, step, micro)`` so a resumed run replays it exactly. A fraction ``f`` of
the work is then forced to the shallowest budget (the one-loop / ``k = 0`` override):

* one process: ``round(f * G)`` of the ``G`` accumulation micro-batches of each optimizer
  step, at positions that rotate from step to step;
* under DDP (``world > 1``): ``round(f * world)`` contiguous ranks, a block that rotates
  every micro-batch, so one-loop and deeper gradients meet in the same all-reduce.

A micro-batch then runs the shallowest budget with probability
``p_1 = 1/K + (1 - 1/K) f_eff`` and the mean depth is ``f_eff k_min + (1 - f_eff) mean(K)``
(Eq. 3), with ``f_eff`` the realised override fraction ``round(f n) / n``.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSampler:
    """Deterministic budget schedule: ``budget(step, micro, rank)``."""

    budgets: tuple[int, ...]
    override: float = 0.0
    grad_accum: int = 1
    world: int = 1
    seed: int = 0
    curriculum_steps: int = 0  # depth curriculum: the menu grows from the shallowest budget over these steps

    def __post_init__(self):
        if not self.budgets:
            raise ValueError("the budget menu is empty")
        if not 0.0 <= self.override <= 1.0:
            raise ValueError(f"override fraction {self.override} must be in [0, 1]")

    @property
    def shallowest(self) -> int:
        """The override budget: the smallest in the menu."""
        return min(self.budgets)

    @property
    def override_slots(self) -> int:
        """How many micro-batches (one process) or ranks (DDP) are overridden."""
        n = self.world if self.world > 1 else self.grad_accum
        return round(self.override * n)

    def menu_at(self, step: int) -> tuple[int, ...]:
        """The budgets drawn from at ``step``: the whole menu, or under a depth curriculum
        the ``1 + ⌊step / curriculum_steps · K⌋`` shallowest of the ``K`` (deeper budgets
        unlock at evenly spaced steps, the whole menu from ``curriculum_steps`` on)."""
        if step >= self.curriculum_steps:
            return self.budgets
        ordered = sorted(self.budgets)
        return tuple(ordered[:1 + (step * len(ordered)) // self.curriculum_steps])

    def drawn(self, step: int, micro: int) -> int:
        """The shared uniform draw of a micro-batch (identical on every rank)."""
        return random.Random(f"{self.seed}:{step}:{micro}").choice(self.menu_at(step))

    def overridden(self, step: int, micro: int, rank: int = 0) -> bool:
        """Whether this micro-batch on this rank is forced to the shallowest budget."""
        n = self.override_slots
        if n == 0:
            return False
        if self.world > 1:
            start = ((step * self.grad_accum + micro) * n) % self.world
            return (rank - start) % self.world < n
        start = (step * n) % self.grad_accum
        return (micro - start) % self.grad_accum < n

    def budget(self, step: int, micro: int, rank: int = 0) -> int:
        """The budget of micro-batch ``micro`` of optimizer step ``step`` on ``rank``."""
        return self.shallowest if self.overridden(step, micro, rank) else self.drawn(step, micro)

    def expected(self) -> dict[str, float]:
        """Eq. 3: probability of the shallowest budget and mean depth, for the realised f."""
        n = self.world if self.world > 1 else self.grad_accum
        f = self.override_slots / n
        K = len(self.budgets)
        return {
            "override_fraction": f,
            "p_shallowest": 1 / K + (1 - 1 / K) * f,
            "mean_budget": f * self.shallowest + (1 - f) * statistics.fmean(self.budgets),
        }
