"""Self-speculative decoding in the server: the scheduler's speculative round.

A request with a :class:`~looptool.engine.speculation.Speculation` (``draft_budget`` ``j``,
``draft_tokens`` ``n``) drafts at budget ``j`` and keeps what its own budget ``k`` accepts
(:func:`~looptool.engine.speculation.accept_drafts`: greedy, token for token what budget ``k``
decodes alone; sampling, exactly budget ``k``'s distribution). Requests with and without it
share one batch. While some running row speculates, each scheduler iteration is one round
(:func:`speculative_round`) over every running row, ``N`` being the largest ``draft_tokens`` of
the speculating rows:

* ``N`` draft steps over all rows (one row-wise-budget step each, writing slots ``clock`` to
  ``clock + N - 1``): a row that does not speculate takes its real token at its own budget each
  step, exactly as in a plain decode step; a speculating row runs its draft budget and draws a
  draft (the most likely token, or a sample from the draft distribution);
* one verify step (:meth:`~looptool.engine.StepEngine.verify`, logits at every position) per
  contiguous run of speculating rows, at their own budgets, over the row's last accepted token
  and its drafts at slots ``clock`` to ``clock + N``; each row accepts over its own first
  ``draft_tokens`` drafts.

The shared write clock then moves ``N + 1`` slots and never back: slots a row did not fill
(a non-speculating row's ``clock + N``, a speculating row's rejected drafts) are masked for that
row and never read again. Budget ``j``'s cache slots are a subset of budget ``k``'s under
per-loop KV, and the verify step rewrites every slot of budget ``k`` at the drafted positions,
so a row's accepted positions hold exactly what budget ``k`` writes. A row's masked slots count
in its span (:attr:`~looptool.serve.scheduler._Row.span`), which the cache's growth and shifts
follow: a row that rejects many drafts holds more slots than tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow, RowBudgets
from looptool.engine.speculation import Speculation, SpeculationStats, accept_drafts, draft_probs
from looptool.serve.protocol import APIError

if TYPE_CHECKING:
    from looptool.serve.scheduler import Scheduler, _Row

DEFAULT_DRAFT_TOKENS = 4  # tokens drafted per verify step unless the request or the server says otherwise
MAX_DRAFT_TOKENS = 32  # a round holds the clock's slots for this many drafts of every row


def choose_speculation(
    req,
    budget: int | AutoRow,
    menu: Sequence[int],
    refusal: Callable[[], Exception | None],
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
    that cannot draft, and what ``refusal()`` returns (the engine's reason it runs no verify
    step, see :meth:`~looptool.serve.scheduler.Scheduler.speculation_refusal`) on ``runtime``."""
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
    reason = refusal()
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


def speculative_round(s: Scheduler) -> None:
    """One round of drafts and verification over every running row of ``s`` (module docstring)."""
    rows = s.rows
    count = len(rows)
    dev = s.device
    n = max(row.job.speculation.tokens for row in rows if row.job.speculation is not None)
    s._fit(before=0, ahead=n)
    clock = s.clock
    base = [row.position for row in rows]  # position id of each row's first token of the round
    feed = [row.ids[-1] for row in rows]
    drafts: list[list[int]] = [[] for _ in rows]
    dists: list[list[torch.Tensor | None]] = [[] for _ in rows]
    spec = [row.job.speculation for row in rows]
    budgets = RowBudgets(tuple(row.job.budget if sp is None else sp.budget for row, sp in zip(rows, spec)))
    t_draft = time.perf_counter()
    for i in range(n):
        s.mask[:count, clock + i] = 1
        out = s._step(
            s.cache,
            slice(0, count),
            torch.tensor(feed, dtype=torch.long, device=dev)[:, None],
            s.mask[:count, : clock + i + 1],
            torch.tensor([[b + i] for b in base], dtype=torch.long, device=dev),
            torch.tensor([clock + i], dtype=torch.long, device=dev),
            budgets,
        )
        s.steps += 1
        for r, row in enumerate(rows):
            logits = out.logits[r : r + 1]
            if spec[r] is None:  # a plain row: its real token, as a decode step takes it
                row.position += 1
                if not row.done:
                    s._take(row, logits, int(out.depths[r]))
                feed[r] = row.ids[-1]
            else:
                q = draft_probs(row.picker, logits)
                token = logits.argmax(-1) if q is None else torch.multinomial(q, 1, generator=row.picker.generator)[0]
                drafts[r].append(int(token))
                dists[r].append(q)
                feed[r] = int(token)
    draft_seconds = time.perf_counter() - t_draft
    t_verify = time.perf_counter()
    scores = _verify(s, n, base, drafts)
    verify_seconds = time.perf_counter() - t_verify
    speculating = sum(sp is not None for sp in spec)
    for r, row in enumerate(rows):
        if spec[r] is None:
            s.mask[r, clock + n] = 0  # a plain row wrote n slots this round
        else:
            _accept(s, row, r, scores[r], drafts[r], dists[r])
            row.job.speculated.draft_seconds += draft_seconds / speculating
            row.job.speculated.verify_seconds += verify_seconds / speculating
        row.span += n + 1
    s.clock += n + 1


def _verify(s: Scheduler, n: int, base: list[int], drafts: list[list[int]]) -> dict[int, torch.Tensor]:
    """Budget ``k``'s logits ``[n + 1, vocab]`` over each speculating row's last accepted token
    and its ``n`` drafts (slots ``clock`` to ``clock + n``), by row: one verify step per
    contiguous run of speculating rows."""
    rows, clock, dev = s.rows, s.clock, s.device
    span = torch.arange(n + 1, device=dev)
    scores: dict[int, torch.Tensor] = {}
    r = 0
    while r < len(rows):
        if rows[r].job.speculation is None:
            r += 1
            continue
        end = r
        while end < len(rows) and rows[end].job.speculation is not None:
            end += 1
        s.mask[r:end, clock + n] = 1
        logits = s.engine.verify(
            s.cache,
            slice(r, end),
            torch.tensor([[rows[i].ids[-1], *drafts[i]] for i in range(r, end)], dtype=torch.long, device=dev),
            s.mask[r:end, : clock + n + 1],
            torch.tensor(base[r:end], dtype=torch.long, device=dev)[:, None] + span,
            clock + span,
            RowBudgets(tuple(rows[i].job.budget for i in range(r, end))),
        )
        scores.update({i: logits[i - r] for i in range(r, end)})
        r = end
    s.steps += 1
    return scores


def _accept(
    s: Scheduler, row: _Row, r: int, scores: torch.Tensor, drafts: list[int], dists: list[torch.Tensor | None]
) -> None:
    """Keep what budget ``k`` accepts of row ``r``'s first ``draft_tokens`` drafts (``scores
    [N + 1, vocab]``, its verify logits), send those tokens and the one after them, and mask
    the slots of the drafts it rejected."""
    job = row.job
    spec = job.speculation
    assert spec is not None
    n = spec.tokens
    clock = s.clock
    if job.cancelled:
        row.done = job.cancel_reason
    if row.done:
        return
    q = None if dists[0] is None else torch.stack([d[0] for d in dists[:n]])[None]
    drafted = torch.tensor([drafts[:n]], dtype=torch.long, device=scores.device)
    kept_t, nxt = accept_drafts(row.picker, scores[None, : n + 1], drafted, q)
    kept = int(kept_t[0])
    s.mask[r, clock + kept + 1 : clock + len(drafts) + 1] = 0  # rejected (or never verified) drafts
    stats = job.speculated
    stats.rounds += 1
    stats.proposed += n
    stats.accepted += kept
    s.metrics.draft_tokens.labels(budget=job.label, kind="drafted").inc(n)
    s.metrics.draft_tokens.labels(budget=job.label, kind="accepted").inc(kept)
    row.position += kept + 1
    for i, token in enumerate([*drafts[:kept], int(nxt[0])]):
        if row.done:
            break
        s._emit(row, token, scores[i : i + 1], job.budget)
