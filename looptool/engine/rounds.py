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
from looptool.engine.sampling import by_picker
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

    def count_step(self) -> None: ...

    def run(self, rows, input_ids, position_ids, cache_position, budgets, every_position=False): ...

    def take(self, row, logits: torch.Tensor, depth: int) -> None: ...

    def take_many(self, rows: list, logits: torch.Tensor, depths: list[int]) -> None: ...

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
        s.count_step()
        plain = [r for r in range(count) if spec[r] is None]
        for r in plain:  # a plain row: its real token, as a decode step takes it
            rows[r].position += 1
        live = [r for r in plain if not rows[r].done]
        s.take_many([rows[r] for r in live], out.logits[live], [int(out.depths[r]) for r in live])
        for r in plain:
            feed[r] = rows[r].ids[-1]
        for group in by_picker(rows, [r for r in range(count) if spec[r] is not None]):
            picker, logits = rows[group[0]].picker, out.logits[group]
            q = draft_probs(picker, logits)
            tokens = logits.argmax(-1) if q is None else torch.multinomial(q, 1, generator=picker.generator)[:, 0]
            for j, r in enumerate(group):
                drafts[r].append(int(tokens[j]))
                dists[r].append(None if q is None else q[j : j + 1])
                feed[r] = int(tokens[j])
    draft_seconds = time.perf_counter() - t_draft
    t_verify = time.perf_counter()
    scores = _verify(s, n, base, drafts)
    verify_seconds = time.perf_counter() - t_verify
    speculating = [r for r in range(count) if spec[r] is not None]
    for r in speculating:
        job = rows[r].job
        if job.cancelled:
            rows[r].done = job.cancel_reason
        job.speculated.draft_seconds += draft_seconds / len(speculating)
        job.speculated.verify_seconds += verify_seconds / len(speculating)
    for group in by_picker(
        rows, [r for r in speculating if not rows[r].done], key=lambda row: row.job.speculation.tokens
    ):
        _accept(s, group, scores, drafts, dists)
    for r, row in enumerate(rows):
        if spec[r] is None:
            s.mask[r, clock + n] = 0  # a plain row wrote n slots this round
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
    s.count_step()
    return scores


def _accept(
    s: Rounds,
    group: list[int],
    scores: dict[int, torch.Tensor],
    drafts: list[list[int]],
    dists: list[list[torch.Tensor | None]],
) -> None:
    """Keep what budget ``k`` accepts of the first ``draft_tokens`` drafts of each row in
    ``group`` (rows that share a picker and a draft length; ``scores[r] [N + 1, vocab]``, row
    ``r``'s verify logits), send those tokens and the one after them, and mask the slots of the
    drafts it rejected."""
    rows, clock = s.rows, s.clock
    picker, n = rows[group[0]].picker, rows[group[0]].job.speculation.tokens
    q = None if dists[group[0]][0] is None else torch.stack([torch.cat(dists[r][:n]) for r in group])
    target = torch.stack([scores[r][: n + 1] for r in group])
    drafted = torch.tensor([drafts[r][:n] for r in group], dtype=torch.long, device=target.device)
    kept_t, nxt = accept_drafts(picker, target, drafted, q)
    for j, r in enumerate(group):
        row, job, kept = rows[r], rows[r].job, int(kept_t[j])
        s.mask[r, clock + kept + 1 : clock + len(drafts[r]) + 1] = 0  # rejected (or never verified) drafts
        stats = job.speculated
        stats.rounds += 1
        stats.proposed += n
        stats.accepted += kept
        s.observer.drafted(job, n, kept)
        row.position += kept + 1
        for i, token in enumerate([*drafts[r][:kept], int(nxt[j])]):
            if row.done:
                break
            s.emit(row, token, scores[r][i : i + 1], job.budget)
