"""Loop plans: frozen, versioned, serialisable descriptions of how a model is looped.

A plan is written by the user (``PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))``),
resolved against a model's layer count (defaults filled in, everything validated with
messages a user can act on), applied by the passes, and saved in ``looptool.json``.

The plan also owns the cost model: layer executions, FLOPs and KV-cache bytes per token
for every budget (Accordion Eq. 6).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from looptool.errors import PlanError

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrefixLoop:
    """Fixed-prefix looping (Accordion, seed 000): budget ``k`` runs each of the first ``k``
    layers of ``window`` twice, consecutively (Eq. 1); the second pass writes through
    zero-initialised per-channel ``tanh`` gates (Eq. 5).

    ``window`` is 0-based and half-open, like ``model.layers[start:stop]``. ``budgets`` are
    prefix lengths ``0 <= k <= stop - start``; the default is ``(0, m/4, m/2, 3m/4, m)``
    rounded, ``m`` the window length. ``None`` fields are filled by :meth:`resolve`.
    """

    window: tuple[int, int] | None = None
    budgets: tuple[int, ...] | None = None
    kind: ClassVar[str] = "prefix"

    def resolve(self, num_layers: int) -> "PrefixLoop":
        """Fill defaults for a model of ``num_layers`` layers and validate; returns a new plan."""
        window = self.window
        if window is None:
            # Accordion's window 7-18 of 24 layers: the middle half (0-based 6:18).
            start = num_layers // 4
            window = (start, start + max(1, num_layers // 2))
        window = _int_pair(window, "window")
        start, stop = window
        if not 0 <= start < stop <= num_layers:
            raise PlanError(
                f"window {start}:{stop} is not a non-empty range inside the model's "
                f"{num_layers} layers; use START:STOP with 0 <= START < STOP <= {num_layers}."
            )
        m = stop - start
        budgets = self.budgets
        if budgets is None:
            budgets = tuple(sorted({round(m * q / 4) for q in range(5)}))
        budgets = _int_tuple(budgets, "budgets")
        bad = [k for k in budgets if not 0 <= k <= m]
        if bad:
            raise PlanError(
                f"budget {bad[0]} is outside 0..{m}: a budget is how many layers of the "
                f"{m}-layer window {start}:{stop} run twice."
            )
        if len(set(budgets)) != len(budgets) or not budgets:
            raise PlanError(f"budgets {list(budgets)} must be a non-empty list without repeats.")
        return PrefixLoop(window=(start, stop), budgets=tuple(sorted(budgets)))

    @property
    def resolved(self) -> bool:
        """True once :meth:`resolve` filled every field."""
        return self.window is not None and self.budgets is not None

    def repeated_layers(self, budget: int) -> tuple[int, ...]:
        """Layer indices that run twice at ``budget`` (the prefix S_k of Eq. 1)."""
        self._require_resolved()
        start = self.window[0]
        return tuple(range(start, start + budget))

    def layer_executions(self, budget: int, num_layers: int) -> int:
        """Decoder-layer executions per token at ``budget``: ``L + k`` (Eq. 1)."""
        return num_layers + len(self.repeated_layers(budget))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with kind and format version."""
        return {
            "kind": self.kind,
            "version": PLAN_FORMAT_VERSION,
            "window": list(self.window) if self.window is not None else None,
            "budgets": list(self.budgets) if self.budgets is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrefixLoop":
        """Inverse of :meth:`to_dict`; refuses other kinds and newer versions."""
        _check_header(data, cls.kind)
        window = data.get("window")
        budgets = data.get("budgets")
        return cls(
            window=tuple(window) if window is not None else None,
            budgets=tuple(budgets) if budgets is not None else None,
        )

    def _require_resolved(self) -> None:
        if not self.resolved:
            raise PlanError("this plan has unresolved defaults; call plan.resolve(num_layers) first.")


LoopPlan = PrefixLoop  # the union grows as schemes land (RecurrentLoop)
_PLAN_KINDS: dict[str, type] = {PrefixLoop.kind: PrefixLoop}


def plan_from_dict(data: dict[str, Any]) -> LoopPlan:
    """Rebuild any plan from its :meth:`to_dict` form."""
    kind = data.get("kind")
    if kind not in _PLAN_KINDS:
        raise PlanError(f"unknown loop plan kind {kind!r}; known kinds: {sorted(_PLAN_KINDS)}.")
    return _PLAN_KINDS[kind].from_dict(data)


def _check_header(data: dict[str, Any], kind: str) -> None:
    if data.get("kind") != kind:
        raise PlanError(f"expected a '{kind}' plan, got {data.get('kind')!r}.")
    version = data.get("version")
    if version != PLAN_FORMAT_VERSION:
        raise PlanError(
            f"plan format version {version} is not supported (this looptool reads "
            f"version {PLAN_FORMAT_VERSION}); upgrade looptool or re-convert the model."
        )


def _int_pair(value: Any, what: str) -> tuple[int, int]:
    items = _int_tuple(value, what)
    if len(items) != 2:
        raise PlanError(f"{what} must be two integers START:STOP, got {value!r}.")
    return items[0], items[1]


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise PlanError(f"{what} must be a list of integers, got {value!r}.") from None
    out = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise PlanError(f"{what} must contain whole numbers, got {v!r}.")
        out.append(int(v))
    return tuple(out)


def parse_window(text: str) -> tuple[int, int]:
    """Parse ``"START:STOP"`` (CLI form) into a pair of ints."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise PlanError(f"window {text!r} must look like START:STOP, e.g. 8:20.")
    return int(parts[0]), int(parts[1])


def parse_budgets(text: str) -> tuple[int, ...]:
    """Parse ``"0,3,6"`` (CLI form) into a tuple of ints."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise PlanError(f"budget {part!r} is not a whole number; pass e.g. --budgets 0,3,6,9,12.")
        out.append(int(part))
    return tuple(out)


# ---------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class ModelDims:
    """What the cost model needs to know about a model (filled from config and params)."""

    num_layers: int
    layer_flops: tuple[float, ...]  # FLOPs per token of each layer (2 x active params)
    fixed_flops: float  # FLOPs per token outside the layers (LM head)
    kv_bytes_per_layer: int  # K and V bytes per token for one attention execution
    param_bytes: int


@dataclass(frozen=True)
class BudgetCost:
    """Per-token cost of one budget, absolute and relative to the shallowest budget."""

    budget: int
    layer_executions: int
    flops_per_token: float
    kv_bytes_per_token: int
    relative_flops: float
    relative_kv: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def cost_table(plan: LoopPlan, dims: ModelDims) -> list[BudgetCost]:
    """Cost of every budget of a resolved plan (Accordion Eq. 6:
    ``C(k) = C_fixed + sum of executed layers``; KV grows as ``(L + k) / L``)."""
    rows = []
    for k in plan.budgets:
        layers = list(range(dims.num_layers)) + list(plan.repeated_layers(k))
        flops = dims.fixed_flops + sum(dims.layer_flops[i] for i in layers)
        rows.append((k, len(layers), flops, len(layers) * dims.kv_bytes_per_layer))
    base_flops, base_kv = rows[0][2], rows[0][3]
    return [
        BudgetCost(k, n, f, kv, f / base_flops, kv / base_kv) for k, n, f, kv in rows
    ]
