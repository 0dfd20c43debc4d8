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

RL post-training assigns budgets per *prompt* instead (:func:`assign_budgets`): every rollout
of a prompt runs at one loop count, prompts split by a ratio, optionally by pass rate.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
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
        return tuple(ordered[: 1 + (step * len(ordered)) // self.curriculum_steps])

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


def ratio_counts(n: int, ratio: Sequence[float]) -> list[int]:
    """Split ``n`` items by ``ratio`` (largest remainder; ties to the earlier entry)."""
    total = float(sum(ratio))
    exact = [n * r / total for r in ratio]
    counts = [int(x) for x in exact]
    order = sorted(range(len(ratio)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def assign_budgets(
    menu: Sequence[int],
    ratio: Sequence[float],
    n: int,
    *,
    pass_rates: Sequence[float | None] | None = None,
    key: str = "",
) -> list[int]:
    """A budget per prompt for one RL step (ELR post-training): prompts are split across
    ``menu`` (shallowest first) by ``ratio`` (e.g. 4:1:1:1 over k = 1..4). Without
    ``pass_rates`` the split is a seeded shuffle (``key``); with them (the pass-rate
    curriculum) the easiest prompts go to the shallowest budget and the hardest to the
    deepest, prompts never seen counting as pass rate 0.5 (ties broken by the shuffle)."""
    if len(ratio) != len(menu) or any(r < 0 for r in ratio) or sum(ratio) <= 0:
        raise ValueError(f"the budget ratio {list(ratio)} needs one non-negative weight per budget of {list(menu)}")
    rng = random.Random(key)
    order = list(range(n))
    rng.shuffle(order)
    if pass_rates is not None:
        rank = {i: r for r, i in enumerate(order)}
        order.sort(key=lambda i: (-(0.5 if pass_rates[i] is None else pass_rates[i]), rank[i]))
    out = [0] * n
    start = 0
    for k, count in zip(sorted(menu), ratio_counts(n, ratio)):
        for i in order[start : start + count]:
            out[i] = k
        start += count
    return out
