"""Which graphs an export writes: the budgets, the KV policies and whether the row-wise graph
loops its window and stands for every budget (:func:`looptool.backends.onnx.export.export_onnx`)."""

from __future__ import annotations

from collections.abc import Iterable

from looptool.backends.errors import ExportError


def resolve_budgets(model, budgets: int | str | Iterable[int] | None) -> tuple[int, ...]:
    """``"all"``/None → every budget; ``"none"`` or no ints → no per-budget graph (an engine of
    row-wise graphs only); an int or ints → checked against the menu."""
    if budgets is None or budgets == "all":
        return model.budgets
    if budgets == "none":
        return ()
    if isinstance(budgets, str):
        try:
            budgets = [int(b) for b in budgets.split(",")]
        except ValueError:
            raise ExportError(
                f"budget {budgets!r} is not a number; pass e.g. 6, 0,6 or all.", parameter="budgets"
            ) from None
    if isinstance(budgets, int):
        budgets = [budgets]
    return tuple(sorted({model.check_budget(int(b)) for b in budgets}))


def resolve_policies(model, kv: str | Iterable[str]) -> tuple[str, ...]:
    """KV policies to export: one, a comma-separated list, or ``all`` (every policy the
    model supports: last-loop only where some budget repeats a layer)."""
    from looptool.passes.kv_cache import KV_POLICIES
    from looptool.runtime.decode_graphs import check_policy, repeats_layers

    if kv == "all":
        chosen = [p for p in KV_POLICIES if p == "per-loop" or repeats_layers(model)]
    else:
        chosen = [p.strip() for p in kv.split(",")] if isinstance(kv, str) else list(kv)
    if not chosen:
        raise ExportError("no KV policy given; pass kv='per-loop', 'last-loop' or 'all'.", parameter="kv")
    return tuple(check_policy(model, p) for p in dict.fromkeys(chosen))


def looped_by_default(
    plan,
    policies: tuple[str, ...],
    *,
    loop: bool = True,
    rowwise: bool = True,
    compose: bool = True,
    speculative: bool = False,
) -> bool:
    """Whether an export of a model looped by ``plan`` (a :class:`~looptool.core.plan.LoopPlan`)
    with these settings and ``budgets=None`` writes one looped row-wise graph and no per-budget
    graph (:mod:`looptool.backends.onnx.looped`): a fixed-prefix plan with a window, per-loop KV
    only, composed, and no verify graphs (their drafts run per-budget graphs). An ELR plan's
    row-wise graph stays masked, so its budgets keep graphs of their own."""
    from looptool.core.plan import PrefixLoop

    plan_loops = isinstance(plan, PrefixLoop) and max(plan.budgets) > 0
    return loop and rowwise and compose and not speculative and tuple(policies) == ("per-loop",) and plan_loops
