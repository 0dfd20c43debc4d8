"""Self-speculative decoding in PyTorch: a shallow budget of the same model drafts, the
requested budget verifies (:func:`speculative_generate`, reached through
``generate(..., budget=k, draft_budget=j, draft_tokens=n)``).

Each round drafts ``n`` tokens one step at a time on budget ``j``'s cached path, then runs
budget ``k``'s verify path (:func:`~looptool.runtime.decode_graphs.verify_paths`: logits at
every position) once over the last accepted token and the ``n`` drafts, and keeps what
:func:`~looptool.engine.speculation.accept_drafts` accepts (greedy: token for token what budget
``k`` decodes alone; sampling: exactly budget ``k``'s distribution).

The cache: both budgets read and write one set of buffers, budget ``k``'s cache inputs; the
draft path's inputs are a subset of them (per-loop KV: a slot per ``(layer, execution)``;
last-loop KV is refused, see :meth:`~looptool.engine.speculation.Speculation.check`). The draft therefore reads the keys and values budget ``k`` wrote for every
accepted token, and every slot it writes for a drafted position is written again by the
verify step, so after a round the accepted positions hold budget ``k``'s values exactly.
Rolling back is a mask: the rows share one write clock, which moves past the longest kept
prefix of the batch; a row that kept fewer drafts masks the positions it rejected, which are
never read again (the buffers grow when a round would not fit).

Not shared between draft and verify: the layers before a fixed-prefix window compute the same
keys and values at both budgets (Accordion Eq. 1), but the verify step recomputes them for
the drafted positions; skipping them needs a verify graph that starts after the window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.interface import with_length
from looptool.engine.sampling import GREEDY, SamplingParams, TokenPicker
from looptool.engine.speculation import Speculation, SpeculationStats, accept_drafts, draft_probs
from looptool.runtime.decode_graphs import allocate_cache, cached_paths, verify_paths
from looptool.runtime.outputs import GenerationOutput, position_ids

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def speculative_generate(
    model: LoopedNetwork,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    budget: int,
    speculation: Speculation,
    max_new_tokens: int,
    kv: str = "per-loop",
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
) -> GenerationOutput:
    """Generate at ``budget`` with drafts from ``speculation.budget`` on ``model``'s PyTorch
    paths (see the module docstring); arguments and result as
    :func:`looptool.runtime.generation.generate`'s, plus the result's ``speculation`` counts."""
    k, j = budget, speculation.budget
    param = next(model.parameters())
    prefill = cached_paths(model, kv, [k])[k]
    verify = verify_paths(model, kv, [k])[k]
    draft = cached_paths(model, kv, [j])[j]
    names = [s.name for s in prefill.slots]
    if [s.name for s in verify.slots] != names or any(s.name not in names for s in draft.slots):
        raise LooptoolError(f"budget {j}'s cache slots are not a subset of budget {k}'s; it cannot draft for it.")
    ids = input_ids.to(param.device)
    capacity = ids.shape[1] + max_new_tokens + speculation.tokens + 1
    caches = allocate_cache(prefill, ids.shape[0], capacity, dtype=param.dtype, device=param.device)
    picks = [names.index(s.name) for s in draft.slots]

    def resize(length: int) -> None:
        caches[:] = [with_length(c, length, dim=2) for c in caches]

    return speculative_loop(
        lambda *a: prefill.module(*a, *caches)[:, -1],
        lambda *a: draft.module(*a, *(caches[i] for i in picks))[:, -1],
        lambda *a: verify.module(*a, *caches),
        resize,
        ids,
        attention_mask,
        capacity=capacity,
        speculation=speculation,
        max_new_tokens=max_new_tokens,
        mask_dtype=model.mask_dtype,
        sampling=sampling,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        on_step=on_step,
        output_logits=output_logits,
        kv_bytes=lambda: sum(c.numel() * c.element_size() for c in caches),
    )


def speculative_loop(
    prefill: Step,
    draft: Step,
    verify: Step,
    resize: Callable[[int], None],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    capacity: int,
    speculation: Speculation,
    max_new_tokens: int,
    mask_dtype: torch.dtype,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
    kv_bytes: Callable[[], int] = lambda: 0,
) -> GenerationOutput:
    """The draft-verify loop shared by every runtime, as
    :func:`~looptool.runtime.generation.decode_loop` is for plain decoding.

    Each step is ``step(ids, attention_mask, position_ids, cache_position)`` over one set of
    caches of ``capacity`` positions: ``prefill`` (budget ``k``, the prompt) and ``draft``
    (budget ``j``, one token) return next-token logits ``[batch, vocab]``, ``verify`` (budget
    ``k``, ``n + 1`` tokens) returns ``[batch, n + 1, vocab]``. The loop owns the ``[batch,
    capacity]`` mask; when a round would pass the end of the caches it grows the mask and calls
    ``resize(length)``, which must give every cache ``length`` positions, keeping the first ones.
    """
    device = input_ids.device
    n = speculation.tokens
    ids = input_ids
    batch, prompt = ids.shape
    pick = TokenPicker(sampling, device)
    eos_list = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    eos = set(eos_list)
    pad = pad_token_id if pad_token_id is not None else (eos_list[0] if eos_list else 0)  # as decode_loop pads
    mask = torch.zeros(batch, capacity, dtype=mask_dtype, device=device)
    mask[:, :prompt] = 1 if attention_mask is None else attention_mask.to(device=device, dtype=mask_dtype)
    position = position_ids(mask[:, :prompt])

    t0 = time.perf_counter()
    logits = prefill(ids, mask, position, torch.arange(prompt, device=device))
    prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = pick(logits, ids)
    rows = _Rows(batch, max_new_tokens, eos, pad, on_step, output_logits)
    rows.emit([[t] for t in first.tolist()], [[0]] * batch, [logits[:, None]] if output_logits else None)
    last, pos, clock = first, position[:, -1] + 1, prompt
    stats = SpeculationStats()
    while not rows.finished():
        if clock + n + 1 > mask.shape[1]:  # the rows' shared clock has passed rejected positions: grow
            size = max(2 * mask.shape[1], clock + n + 1)
            mask = with_length(mask, size, dim=1)
            resize(size)
        tokens, dists = [last], []
        t_draft = time.perf_counter()
        for i in range(n):
            mask[:, clock + i] = 1
            out = draft(tokens[-1][:, None], mask, (pos + i)[:, None], torch.tensor([clock + i], device=device))
            q = draft_probs(pick, out)
            tokens.append(out.argmax(-1) if q is None else torch.multinomial(q, 1, generator=pick.generator)[:, 0])
            dists.append(q)
        mask[:, clock + n] = 1
        seq = torch.stack(tokens, dim=1)  # [B, n+1]: the last accepted token, then the drafts
        span = torch.arange(n + 1, device=device)
        t_verify = time.perf_counter()
        scores = verify(seq, mask, pos[:, None] + span, clock + span)  # [B, n+1, V]
        stats.draft_seconds += t_verify - t_draft
        stats.verify_seconds += time.perf_counter() - t_verify
        kept, nxt = accept_drafts(pick, scores, seq[:, 1:], None if dists[0] is None else torch.stack(dists, 1))
        live = rows.live()
        stats.rounds += 1
        stats.proposed += n * len(live)
        stats.accepted += int(kept[live].sum()) if live else 0
        # each row keeps positions clock .. clock + kept (its last token and its kept drafts)
        mask[:, clock : clock + n + 1] = (span[None] <= kept[:, None]).to(mask.dtype)
        emitted = torch.cat([seq[:, 1:], nxt[:, None]], dim=1).scatter(1, kept[:, None], nxt[:, None])
        counts = (kept + 1).tolist()
        rows.emit(
            [emitted[r, : counts[r]].tolist() for r in range(batch)],
            [list(range(c)) for c in counts],
            [scores] if output_logits else None,
        )
        last, pos, clock = nxt, pos + kept + 1, clock + int(kept.max()) + 1
    decode = time.perf_counter() - t1
    sequences = torch.cat([ids, rows.tensor(device, ids.dtype)], dim=1)
    total = kv_bytes()
    return GenerationOutput(
        sequences,
        rows.columns,
        prefill_seconds,
        decode,
        total,
        total / (batch * mask.shape[1]),
        rows.logits(),
        speculation=stats,
    )


class _Rows:
    """Each row's emitted tokens (and their logits), its stop (EOS, ``max_new_tokens``) and the
    columns streamed to ``on_step`` so far: a column goes out once every running row has it."""

    def __init__(self, batch, max_new, eos, pad, on_step, output_logits):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.kept: list[list[torch.Tensor]] | None = [[] for _ in range(batch)] if output_logits else None
        self.done = [False] * batch
        self.max_new, self.eos, self.pad, self.on_step = max_new, eos, pad, on_step
        self.columns = 0  # columns streamed (and the result's length)
        self.stopped = False  # on_step asked to stop

    def live(self) -> list[int]:
        """Rows still generating."""
        return [r for r, d in enumerate(self.done) if not d]

    def finished(self) -> bool:
        """Whether the generation is over: every row stopped, or ``on_step`` said so."""
        return self.stopped or all(self.done)

    def emit(self, tokens: list[list[int]], at: list[list[int]], scores: list[torch.Tensor] | None) -> None:
        """Append each running row's new ``tokens`` (``at``: their positions in ``scores[0][r]``,
        the logits they were chosen from), then stream the columns every row now has."""
        for r, new in enumerate(tokens):
            for t, i in zip(new, at[r]):
                if self.done[r]:
                    break
                self.tokens[r].append(t)
                if self.kept is not None and scores is not None:
                    self.kept[r].append(scores[0][r, i])
                self.done[r] = t in self.eos or len(self.tokens[r]) >= self.max_new
        running = [len(self.tokens[r]) for r in self.live()]
        ready = min(running) if running else max(len(t) for t in self.tokens)
        while self.columns < ready and not self.stopped:
            self.columns += 1
            if self.on_step is not None and self.on_step(self.column(self.columns - 1)):
                self.stopped = True

    def column(self, c: int) -> torch.Tensor:
        """Every row's token ``c`` (``pad`` past a row's end)."""
        return torch.tensor([t[c] if c < len(t) else self.pad for t in self.tokens])

    def tensor(self, device, dtype) -> torch.Tensor:
        """``[batch, columns]`` of the streamed columns."""
        return torch.stack([self.column(c) for c in range(self.columns)], dim=1).to(device=device, dtype=dtype)

    def logits(self) -> tuple[torch.Tensor, ...]:
        """Per column, every row's logits for its token (zeros past a row's end); () unless kept."""
        if self.kept is None:
            return ()
        like = next(x for row in self.kept for x in row)
        return tuple(
            torch.stack([row[c] if c < len(row) else torch.zeros_like(like) for row in self.kept])
            for c in range(self.columns)
        )
