"""A batch of prompts generated to the end through the engine core, in this thread: what
``LoopedModel.generate``, the exported runtimes' ``generate`` and ``looptool generate`` / ``run``
return, as vLLM's offline ``LLM.generate`` drives the engine its server drives.

:func:`generate_batch` submits one :class:`~looptool.engine.core.Job` per row of a (possibly
left-padded) batch to an :class:`~looptool.engine.core.EngineCore` over the given step engine,
runs the core until every row is done, and lays the tokens out as a batch again: each row's
prompt as given, then its new tokens, a row that reached EOS padded with ``pad_token_id`` from
the token after it. Tokens reach ``on_step`` a column at a time (one new token of every row),
once every row has it; the generation stops when ``on_step`` says so, when every row has reached
EOS or after ``max_new_tokens``.

A row runs on after its EOS until every row is done (its tokens replaced by padding), as a
static batch does, so ``output_logits`` has a row of logits for every row at every step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine.budgets import AutoRow
from looptool.engine.core import EngineCore, Event, Job
from looptool.engine.interface import StepEngine
from looptool.engine.outputs import GenerationOutput
from looptool.engine.sampling import GREEDY, SamplingParams, TokenPicker
from looptool.engine.speculation import Speculation, SpeculationStats


@dataclass
class _Collected:
    """What one row's events brought: its tokens, their depths and, when kept, their logits."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    depths: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def __call__(self, event: Event) -> None:
        if event.kind == "token":
            self.tokens.append(event.token)
            self.depths.append(-1 if event.depth is None else int(event.depth))
            if event.logits is not None:
                self.logits.append(event.logits)


def row_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt: its tokens where ``attention_mask`` is 1 (all of them without one)."""
    ids = input_ids.cpu()
    if attention_mask is None:
        return ids.tolist()
    keep = attention_mask.cpu().bool()
    return [row[m].tolist() for row, m in zip(ids, keep, strict=True)]


def generate_batch(
    engine: StepEngine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    budgets: Sequence[int | AutoRow],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
    speculation: Speculation | None = None,
    capacity: int | None = None,
    device: torch.device | str = "cpu",
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens for every row of ``input_ids [batch, prompt]``
    (left-padded where ``attention_mask`` is 0), row ``r`` at ``budgets[r]`` (a budget, or an
    :class:`AutoRow`: adaptive depth), through one engine core over ``engine`` (module
    docstring); ``speculation`` drafts for every row (where more than one token is asked for:
    a single token has nothing to draft). ``capacity`` (default: prompt plus new
    tokens) is what the rows' caches may grow to; ``kv_bytes`` in the result is what the rows'
    budgets keep for that many positions (Accordion Eq. 6)."""
    batch, prompt = input_ids.shape
    capacity = prompt + max_new_tokens if capacity is None else capacity
    if prompt + max_new_tokens > capacity:
        raise LooptoolError(
            f"the prompt ({counted(prompt, 'token')}) plus {counted(max_new_tokens, 'new token')} exceed the cache "
            f"capacity of {capacity}; raise the capacity or generate fewer tokens."
        )
    speculation = speculation if max_new_tokens > 1 else None
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    prompts = row_prompts(input_ids, attention_mask)
    rows = [_Collected() for _ in range(batch)]
    picker = TokenPicker(sampling, device)  # one generator for the batch, as a static batch draws
    jobs = [
        Job(
            prompts[r],
            b.max_budget if isinstance(b, AutoRow) else int(b),
            max(max_new_tokens, 1),
            sampling=sampling,
            ignore_eos=True,
            emit=rows[r],
            auto=b if isinstance(b, AutoRow) else None,
            speculation=speculation,
            keep_logits=output_logits,
            picker=picker,
        )
        for r, b in enumerate(budgets)
    ]
    core = EngineCore(engine, max_batch=batch, capacity=capacity, device=device)
    columns: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    done = torch.zeros(batch, dtype=torch.bool)
    eos_t = torch.tensor(eos, dtype=torch.long)
    t0 = time.perf_counter()
    prefill = decode = 0.0
    try:
        if max_new_tokens > 0:
            core.prefill(jobs)
            prefill = time.perf_counter() - t0
            t1 = time.perf_counter()
            while True:
                finished = _columns(rows, columns, kept, done, eos_t, pad, on_step, max_new_tokens)
                if finished or not core.rows:
                    break
                core.iterate()
                core.retire()
            decode = time.perf_counter() - t1
    finally:
        core.reset()
    new = torch.stack(columns, dim=1) if columns else input_ids.new_zeros(batch, 0)
    sequences = torch.cat([input_ids.cpu(), new.to(input_ids.dtype)], dim=1).to(input_ids.device)
    steps = len(columns)
    per_token = kv_bytes_per_position(engine, core.cache, budgets)
    auto = any(isinstance(b, AutoRow) for b in budgets)
    return GenerationOutput(
        sequences,
        steps,
        prefill,
        decode,
        per_token * batch * capacity,
        per_token,
        tuple(kept),
        speculation=_speculation(jobs) if speculation is not None else None,
        depths=torch.tensor([r.depths[:steps] for r in rows], dtype=torch.int64) if auto else None,
    )


def _columns(rows, columns, kept, done, eos, pad, on_step, max_new) -> bool:
    """Move every column all rows now have into ``columns`` (and ``kept``), padding rows past
    their EOS and calling ``on_step``; whether the generation is over."""
    while len(columns) < max_new and all(len(r.tokens) > len(columns) for r in rows):
        i = len(columns)
        token = torch.tensor([r.tokens[i] for r in rows], dtype=torch.long)
        token = torch.where(done, torch.full_like(token, pad), token)
        columns.append(token)
        if rows[0].logits:
            kept.append(torch.stack([r.logits[i] for r in rows]))
        if on_step is not None and on_step(token):
            return True  # the caller's stop condition (e.g. a stop string) holds for every row
        if len(eos):
            done |= torch.isin(token, eos)
            if bool(done.all()):
                return True
    return len(columns) >= max_new


def _speculation(jobs: list[Job]) -> SpeculationStats:
    """The rows' speculation together: rounds (verify steps) of the row that ran most, drafts
    proposed and kept by all, and the seconds spent."""
    stats = [job.speculated for job in jobs]
    return SpeculationStats(
        rounds=max(s.rounds for s in stats),
        proposed=sum(s.proposed for s in stats),
        accepted=sum(s.accepted for s in stats),
        draft_seconds=sum(s.draft_seconds for s in stats),
        verify_seconds=sum(s.verify_seconds for s in stats),
    )


def kv_bytes_per_position(engine: StepEngine, cache, budgets: Sequence[int | AutoRow]) -> int:
    """Bytes of keys and values one row keeps per position at ``budgets``: the buffers its budget
    reads when every row shares a fixed budget, all of the slot cache's otherwise (the row-wise
    and adaptive-depth paths read them all)."""
    first = budgets[0]
    if not isinstance(first, AutoRow) and all(b == first for b in budgets):
        read = engine.budget_buffers(first)
        if read is not None:
            return cache.position_bytes(read)
    return cache.position_bytes()
