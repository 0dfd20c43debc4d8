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

from looptool.core.errors import PlanError
from looptool.core.words import counted

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrefixLoop:
    """Fixed-prefix looping (Accordion): budget ``k`` runs each of the first ``k``
    layers of ``window`` twice, consecutively (Eq. 1); the second pass writes through
    zero-initialised per-channel ``tanh`` gates (Eq. 5).

    ``window`` is 0-based and half-open, like ``model.layers[start:stop]``. ``budgets`` are
    prefix lengths ``0 <= k <= stop - start``; the default is ``(0, m/4, m/2, 3m/4, m)``
    rounded, ``m`` the window length. ``None`` fields are filled by :meth:`resolve`.
    """

    window: tuple[int, int] | None = None
    budgets: tuple[int, ...] | None = None
    kind: ClassVar[str] = "prefix"
    has_loop_exits: ClassVar[bool] = False  # intermediate exits (deep supervision) are ELR's
    budget_columns: ClassVar[tuple[str, str]] = ("budget", "layers")  # a budget, its layer executions

    def resolve(self, num_layers: int) -> PrefixLoop:
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
                f"{counted(num_layers, 'layer')}; use START:STOP with 0 <= START < STOP <= {num_layers}."
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

    def executed_layers(self, budget: int, num_layers: int) -> tuple[int, ...]:
        """Layer indices in execution order at ``budget`` (each repeated layer twice in a row)."""
        repeated = set(self.repeated_layers(budget))
        return tuple(i for layer in range(num_layers) for i in ((layer, layer) if layer in repeated else (layer,)))

    def layer_executions(self, budget: int, num_layers: int) -> int:
        """Decoder-layer executions per token at ``budget``: ``L + k`` (Eq. 1)."""
        return len(self.executed_layers(budget, num_layers))

    def extra_flops(self, budget: int, hidden: int) -> float:
        """Matmul FLOPs per token the plan adds outside the layers (gates are elementwise: 0)."""
        return 0.0

    def looped_layers(self) -> range:
        """The layers the plan loops: the window (its prefix runs twice)."""
        self._require_resolved()
        return range(*self.window)

    def frozen_layers(self) -> range:
        """The source layers that freezing below the looped block freezes: those before the window."""
        return range(self.looped_layers().start)

    def caption(self) -> str:
        """One line for tables: ``window 8:20``."""
        self._require_resolved()
        return f"window {self.window[0]}:{self.window[1]}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with kind and format version."""
        return {
            "kind": self.kind,
            "version": PLAN_FORMAT_VERSION,
            "window": list(self.window) if self.window is not None else None,
            "budgets": list(self.budgets) if self.budgets is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixLoop:
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


UPDATE_RULES = ("adaptive-delta", "delta", "residual", "replace")
INIT_MODES = ("exact", "paper")


@dataclass(frozen=True)
class RecurrentLoop:
    """Elastic latent recurrence (Elastic Latent Recurrence): input block ``layers[:start]``, recurrent
    block ``layers[start:stop]`` run ``k`` times, output block ``layers[stop:]`` (Sec. 3.1).

    Budgets are loop counts ``1..max_loops``. ``update`` picks the state update (Eq. 2 and
    Sec. 6.1); ``reinject`` adds ``h_in`` to the state before every loop; ``conditioning``
    adds loop-conditioned modulation (Sec. 3.3, Eq. 4) with ``cond_dim`` and low-rank
    ``rank``; ``route_replay`` reuses loop-1 MoE routes on later loops (Sec. 3.4);
    ``init="exact"`` preserves the source at every k, ``"paper"`` is the paper's
    from-scratch initialisation. ``recurrent=None`` is the middle half, the rest split evenly.
    """

    recurrent: tuple[int, int] | None = None
    max_loops: int = 4
    update: str = "adaptive-delta"
    reinject: bool = True
    conditioning: bool = False
    cond_dim: int = 256
    rank: int = 64
    route_replay: bool = False
    init: str = "exact"
    kind: ClassVar[str] = "recurrent"
    has_loop_exits: ClassVar[bool] = True  # every loop's state s_i is an exit (intermediate-exit loss)
    budget_columns: ClassVar[tuple[str, str]] = ("loops", "D_eff")  # a loop count, its effective depth

    def resolve(self, num_layers: int) -> RecurrentLoop:
        """Fill defaults for a model of ``num_layers`` layers and validate; returns a new plan."""
        part = self.recurrent
        if part is None:
            rec = max(1, round(num_layers / 2))
            start = (num_layers - rec) // 2
            part = (start, start + rec)
        start, stop = _int_pair(part, "recurrent")
        if not 0 <= start < stop <= num_layers:
            raise PlanError(
                f"recurrent block {start}:{stop} is not a non-empty range inside the model's "
                f"{counted(num_layers, 'layer')}; use START:STOP with 0 <= START < STOP <= {num_layers}."
            )
        if isinstance(self.max_loops, bool) or not isinstance(self.max_loops, int) or self.max_loops < 1:
            raise PlanError(f"max_loops must be a whole number >= 1, got {self.max_loops!r}.")
        if self.update not in UPDATE_RULES:
            raise PlanError(f"update rule {self.update!r} is unknown; use one of {', '.join(UPDATE_RULES)}.")
        if self.init not in INIT_MODES:
            raise PlanError(
                f"init {self.init!r} is unknown; use 'exact' (pretrained source) or 'paper' (from scratch)."
            )
        for name in ("cond_dim", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a whole number >= 1, got {value!r}.")
        return dataclasses.replace(self, recurrent=(start, stop))

    @property
    def resolved(self) -> bool:
        """True once :meth:`resolve` filled every field."""
        return self.recurrent is not None

    @property
    def budgets(self) -> tuple[int, ...]:
        """Loop counts ``1..max_loops``."""
        return tuple(range(1, self.max_loops + 1))

    def executed_layers(self, budget: int, num_layers: int) -> tuple[int, ...]:
        """Layer indices in execution order with ``budget`` loops: D_eff(k) of them (Eq. 1)."""
        if not self.resolved:
            raise PlanError("this plan has unresolved defaults; call plan.resolve(num_layers) first.")
        start, stop = self.recurrent
        return tuple(range(start)) + tuple(range(start, stop)) * budget + tuple(range(stop, num_layers))

    def layer_executions(self, budget: int, num_layers: int) -> int:
        """``D_eff(k) = L_in + k L_rec + L_out`` (Eq. 1)."""
        return len(self.executed_layers(budget, num_layers))

    def extra_flops(self, budget: int, hidden: int) -> float:
        """Matmul FLOPs per token of the state updates: ``2 d^2`` per adaptive-delta update
        (loops 2..k under exact init, 1..k under paper init)."""
        if self.update != "adaptive-delta":
            return 0.0
        updates = budget - 1 if self.init == "exact" else budget
        return 2.0 * hidden * hidden * updates

    def looped_layers(self) -> range:
        """The layers the plan loops: the recurrent block."""
        if not self.resolved:
            raise PlanError("this plan has unresolved defaults; call plan.resolve(num_layers) first.")
        return range(*self.recurrent)

    def frozen_layers(self) -> range:
        """The source layers that freezing below the looped block freezes: the input block."""
        return range(self.looped_layers().start)

    def caption(self) -> str:
        """One line for tables: ``recurrent 8:22 (adaptive-delta, init exact, re-injection, ...)``."""
        block = self.looped_layers()
        extras = [self.update, f"init {self.init}"]
        extras += ["re-injection"] if self.reinject else ["no re-injection"]
        extras += [f"conditioning d={self.cond_dim} r={self.rank}"] if self.conditioning else []
        extras += ["route replay"] if self.route_replay else []
        return f"recurrent {block.start}:{block.stop} ({', '.join(extras)})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with kind and format version."""
        data = {"kind": self.kind, "version": PLAN_FORMAT_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecurrentLoop:
        """Inverse of :meth:`to_dict`; refuses other kinds and newer versions."""
        _check_header(data, cls.kind)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("recurrent") is not None:
            kwargs["recurrent"] = tuple(kwargs["recurrent"])
        return cls(**kwargs)


def delta_params(hidden: int) -> int:
    """Parameters the adaptive-delta gate adds: ``W_beta, b_beta, gamma`` = d^2 + 2d (Sec. 3.1)."""
    return hidden * hidden + 2 * hidden


LoopPlan = PrefixLoop | RecurrentLoop
_PLAN_KINDS: dict[str, type] = {PrefixLoop.kind: PrefixLoop, RecurrentLoop.kind: RecurrentLoop}


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
            raise PlanError(
                f"budget {part!r} is not a whole number; budgets are comma-separated whole numbers, e.g. '0,3,6,9,12'.",
                parameter="budgets",
            )
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
    hidden_size: int = 0


@dataclass(frozen=True)
class BudgetCost:
    """Per-token cost of one budget, absolute and relative to the shallowest budget."""

    budget: int
    layer_executions: int
    flops_per_token: float
    kv_bytes_per_token: int
    relative_flops: float
    relative_kv: float
    kv_bytes_per_token_last_loop: int  # one cache slot per attention layer (ELR Sec. 3.4)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def cost_table(plan: LoopPlan, dims: ModelDims) -> list[BudgetCost]:
    """Cost of every budget of a resolved plan: ``C(k) = C_fixed + sum of the executed
    layers' FLOPs`` (Accordion Eq. 6; ELR's D_eff(k), Eq. 1). KV per token under per-loop
    caching grows with executed layers (``(L + k) / L`` for fixed-prefix looping); under
    last-loop caching it stays at the source's ``L`` layers."""
    rows = []
    for k in plan.budgets:
        layers = plan.executed_layers(k, dims.num_layers)
        flops = dims.fixed_flops + sum(dims.layer_flops[i] for i in layers) + plan.extra_flops(k, dims.hidden_size)
        rows.append((k, len(layers), flops, len(layers) * dims.kv_bytes_per_layer))
    base_flops, base_kv = rows[0][2], rows[0][3]
    last_loop = dims.num_layers * dims.kv_bytes_per_layer
    return [BudgetCost(k, n, f, kv, f / base_flops, kv / base_kv, last_loop) for k, n, f, kv in rows]
