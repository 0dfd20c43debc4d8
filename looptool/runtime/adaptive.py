"""Per-token adaptive depth for :func:`looptool.runtime.generation.generate` (``budget="auto"``).

Every row decides, token by token, how deep to go between ``min_budget`` and ``max_budget``:
after each loop (ELR) or each repeated window layer (fixed-prefix looping) it continues while the
relative change of its state, ``||s_i - s_{i-1}|| / ||s_i||``, stays at or above
``exit_threshold`` (the ``adaptive_depth`` pass, which builds the one cached path every step
runs: :func:`looptool.runtime.decode_graphs.adaptive_path`; the ``skip_exited`` pass ends a
step's loops once every row has exited, so a step costs its deepest row's realised depth).
Threshold 0 computes exactly what ``max_budget`` computes; an infinite threshold exactly what
``min_budget`` computes (for an ELR model with loop conditioning, every loop is conditioned as
``max_budget``: only threshold 0 then matches a fixed budget).

It needs the last-loop KV policy (ELR Sec. 3.4): each layer keeps one cache slot per token that
holds its last executed pass, so a token that stopped early leaves a consistent cache behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import PER_LOOP_AUTO, check_exit_threshold, default_exit_threshold
from looptool.passes.adaptive_depth import check_exit_rule
from looptool.runtime.decode_graphs import check_policy

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork


@dataclass(frozen=True)
class AutoDepth:
    """Checked adaptive-depth settings: the depth range, the exit threshold and rule."""

    min_budget: int
    max_budget: int
    exit_threshold: float
    exit_rule: str

    @classmethod
    def resolve(
        cls,
        model: LoopedNetwork,
        min_budget: int | None = None,
        max_budget: int | None = None,
        exit_threshold: float | None = None,
        exit_rule: str | None = None,
    ) -> AutoDepth:
        """Defaults filled in (the menu's smallest and deepest budgets, the default threshold,
        rule ``"state"``) and each value checked, one sentence per mistake."""
        lo = min(model.budgets) if min_budget is None else _menu_budget(model, min_budget, "min_budget")
        hi = max(model.budgets) if max_budget is None else _menu_budget(model, max_budget, "max_budget")
        if lo > hi:
            raise LooptoolError(
                f"min_budget {lo} is above max_budget {hi}; give min_budget <= max_budget.", parameter="min_budget"
            )
        rule = "state" if exit_rule is None else exit_rule
        check_exit_rule(rule)
        thr = default_exit_threshold(rule) if exit_threshold is None else exit_threshold
        thr = check_exit_threshold(thr, rule)
        if rule == "gate" and not getattr(model, "exit_gates", True):
            raise LooptoolError(
                "exit_rule 'gate' reads learned exit gates, and this model has none; add and train them by training "
                "with exit_gate_only=True, or use exit_rule='state'.",
                parameter="exit_rule",
                rerun="train",
            )
        return cls(lo, hi, thr, rule)


def _menu_budget(model: LoopedNetwork, value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LooptoolError(f"{name} must be one integer budget of the menu, got {value!r}.", parameter=name)
    if value not in model.budgets:
        raise LooptoolError(
            f"{name} {value} is not in this model's budget menu {list(model.budgets)}; pick one of those.",
            parameter=name,
        )
    return value


def check_auto_policy(model: LoopedNetwork, kv: str | None) -> str:
    """The KV policy for ``budget="auto"`` (None: ``"last-loop"``); per-loop is refused."""
    if kv == "per-loop":
        raise LooptoolError(
            f"budget='auto' needs kv='last-loop': {PER_LOOP_AUTO}",
            parameter="kv",
        )
    return check_policy(model, "last-loop" if kv is None else kv)
