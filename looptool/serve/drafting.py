"""The request fields of self-speculative decoding: ``draft_budget`` and ``draft_tokens`` checked
against the menu and the engine (:func:`choose_speculation`, HTTP 400 errors), and the
``speculation`` entry of a response's ``cost`` (:func:`speculation_cost`). The rounds
themselves are :mod:`looptool.engine.rounds`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow
from looptool.engine.interface import Capabilities
from looptool.engine.speculation import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, Speculation, SpeculationStats
from looptool.serve.protocol import APIError


def choose_speculation(
    req,
    budget: int | AutoRow,
    menu: Sequence[int],
    capabilities: Capabilities,
    runtime: str,
    default_tokens: int | None = None,
) -> Speculation | None:
    """How the request ``req`` (its ``draft_budget`` and ``draft_tokens`` fields) at ``budget``
    decodes: a :class:`Speculation` checked against the sorted ``menu``, or None (plainly).

    A ``draft_budget`` below the budget drafts there; ``null`` or the budget itself turns
    speculation off. Without the field, a speculative server (``default_tokens``, not None)
    drafts a fixed budget deeper than the menu's shallowest at the shallowest. ``draft_tokens``
    (default ``default_tokens``, else :data:`DEFAULT_DRAFT_TOKENS`) is an integer from 1 to
    :data:`MAX_DRAFT_TOKENS`. Every refusal is one sentence naming the field: a draft budget off
    the menu or deeper than the budget, with ``budget: "auto"``, ``draft_tokens`` on a request
    that cannot draft, and an engine on ``runtime`` whose ``capabilities`` refuse verify steps
    (the reason rephrased for a client)."""
    given = "draft_budget" in req.model_fields_set and req.draft_budget is not None
    tokens = req.draft_tokens
    if isinstance(budget, AutoRow):
        if given or tokens is not None:
            field = "draft_budget" if given else "draft_tokens"
            raise APIError(
                f'{field} needs a fixed budget, but budget "auto" decides the depth per token; drop one of them.',
                param=field,
            )
        return None
    if given:
        draft = req.draft_budget
        if isinstance(draft, bool) or not isinstance(draft, int):
            raise APIError(
                f"draft_budget must be an integer of the menu {list(menu)} below the request's budget, or null, "
                f"got {json.dumps(draft)}.",
                param="draft_budget",
            )
        if draft == budget:
            return None  # drafting at the budget itself: plain decoding
    elif "draft_budget" not in req.model_fields_set and default_tokens is not None and budget > menu[0]:
        draft = menu[0]
    else:
        if tokens is not None and default_tokens is None:
            raise APIError(
                "draft_tokens applies to a request that drafts; send a draft_budget below the budget with it.",
                param="draft_tokens",
            )
        return None
    reason = capabilities.verify_refusal
    if reason is not None:
        if getattr(reason, "parameter", None) == "kv":
            message = "speculative decoding needs per-loop KV and this server keeps last-loop KV; start it with --kv per-loop."
        else:
            message = (
                f"speculative decoding is not served by this {runtime} engine (it has no verify step); serve the "
                "looped model directory on PyTorch, or an onnxruntime engine exported with --speculative."
            )
        raise APIError(message, param="draft_budget")
    if tokens is None:
        tokens = DEFAULT_DRAFT_TOKENS if default_tokens is None else default_tokens
    if not isinstance(tokens, bool) and isinstance(tokens, int) and tokens > MAX_DRAFT_TOKENS:
        raise APIError(f"draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {tokens}.", param="draft_tokens")
    try:
        return Speculation(draft, tokens).check(budget, menu)
    except LooptoolError as exc:
        raise APIError(str(exc), param=exc.parameter) from None


def speculation_cost(speculation: Speculation, stats: Sequence[SpeculationStats]) -> dict:
    """The ``speculation`` entry of a response's ``cost``: the draft budget and tokens per round,
    and over ``stats`` (one per prompt) the rounds, the tokens drafted and those accepted."""
    drafted = sum(s.proposed for s in stats)
    accepted = sum(s.accepted for s in stats)
    return {
        "draft_budget": speculation.budget,
        "draft_tokens": speculation.tokens,
        "rounds": sum(s.rounds for s in stats),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
    }
