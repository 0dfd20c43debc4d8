"""Self-speculative decoding in the engine core: its speculative round.

A request with a :class:`~looptool.engine.speculation.Speculation` (``draft_budget`` ``j``,
``draft_tokens`` ``n``) drafts at budget ``j`` and keeps what its own budget ``k`` accepts
(:func:`~looptool.engine.speculation.accept_drafts`: greedy, token for token what budget ``k``
decodes alone; sampling, exactly budget ``k``'s distribution). Requests with and without it
share one batch. While some running row speculates, each core iteration is one round
(:func:`speculative_round`) over every running row, ``N`` being the largest ``draft_tokens`` of
the speculating rows:

* ``N`` draft steps over all rows (one row-wise-budget step each, writing slots ``clock`` to
  ``clock + N - 1``): a row that does not speculate takes its real token at its own budget each
  step, exactly as in a plain decode step; a speculating row runs its draft budget and draws a
  draft (the most likely token, or a sample from the draft distribution);
* one verify step (a :class:`~looptool.engine.StepBatch` with ``every_position``) per
  contiguous run of speculating rows, at their own budgets, over the row's last accepted token
  and its drafts at slots ``clock`` to ``clock + N``; each row accepts over its own first
  ``draft_tokens`` drafts.

The shared write clock then moves ``N + 1`` slots and never back: slots a row did not fill
(a non-speculating row's ``clock + N``, a speculating row's rejected drafts) are masked for that
row and never read again. Budget ``j``'s cache slots are a subset of budget ``k``'s under
per-loop KV, and the verify step rewrites every slot of budget ``k`` at the drafted positions,
so a row's accepted positions hold exactly what budget ``k`` writes. A row's masked slots count
in its span (:attr:`~looptool.engine.core.Row.span`), which the cache's growth and shifts
follow: a row that rejects many drafts holds more slots than tokens.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from looptool.engine.budgets import RowBudgets
from looptool.engine.speculation import accept_drafts, draft_probs


class Rounds(Protocol):
    """What a speculative round uses of the core that runs it (its public side): the running
    rows, the shared mask and write clock, and steps, token picking and the observer."""

    rows: list
    mask: torch.Tensor
    clock: int
    steps: int
    device: torch.device
    observer: object

    def fit(self, before: int, ahead: int = 0) -> None: ...

    def run(self, rows, input_ids, position_ids, cache_position, budgets, every_position=False): ...

    def take(self, row, logits: torch.Tensor, depth: int) -> None: ...

    def emit(self, row, token: int, logits: torch.Tensor, depth: int) -> None: ...


def speculative_round(s: Rounds) -> None:
    """One round of drafts and verification over every running row of ``s`` (module docstring)."""
    rows = s.rows
    count = len(rows)
    dev = s.device
    n = max(row.job.speculation.tokens for row in rows if row.job.speculation is not None)
    s.fit(before=0, ahead=n)
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
        out = s.run(
            slice(0, count),
            torch.tensor(feed, dtype=torch.long, device=dev)[:, None],
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
                    s.take(row, logits, int(out.depths[r]))
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


def _verify(s: Rounds, n: int, base: list[int], drafts: list[list[int]]) -> dict[int, torch.Tensor]:
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
        logits = s.run(
            slice(r, end),
            torch.tensor([[rows[i].ids[-1], *drafts[i]] for i in range(r, end)], dtype=torch.long, device=dev),
            torch.tensor(base[r:end], dtype=torch.long, device=dev)[:, None] + span,
            clock + span,
            RowBudgets(tuple(rows[i].job.budget for i in range(r, end))),
            every_position=True,
        ).logits
        scores.update({i: logits[i - r] for i in range(r, end)})
        r = end
    s.steps += 1
    return scores


def _accept(s: Rounds, row, r: int, scores: torch.Tensor, drafts: list[int], dists: list[torch.Tensor | None]) -> None:
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
    s.observer.drafted(job, n, kept)
    row.position += kept + 1
    for i, token in enumerate([*drafts[:kept], int(nxt[0])]):
        if row.done:
            break
        s.emit(row, token, scores[i : i + 1], job.budget)
