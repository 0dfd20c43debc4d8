"""The engine core: iteration-level (continuous) batching over one step engine and one slot
cache, every request at its own budget. ``looptool generate``, ``LoopedModel.generate``, the
exported runtimes' ``generate`` (:mod:`looptool.engine.offline`) and ``looptool serve``
(:class:`looptool.serve.scheduler.Scheduler`, which runs it on a thread behind HTTP) all drive
it, so there is one decode loop and one speculation loop.

An :class:`EngineCore` keeps its running requests in the rows of one persistent slot cache of
``max_batch`` rows and advances them with :meth:`EngineCore.prefill` (a request's prompt at its
own budget, the blocks the prefix cache holds copied instead of computed) and
:meth:`EngineCore.iterate` (ONE row-wise-budget decode step for every running request whatever
its budget, or a speculative round while some row speculates: :mod:`looptool.engine.rounds`),
then :meth:`EngineCore.retire` frees the rows of finished requests. Running requests stay
packed in rows ``[0, n)``: a retired row's slot takes the last row (``copy_row``). All rows
share one write clock: a request's tokens lie in ``[clock - span, clock)``, a prefill writes its
prompt at ``[clock - len, clock)`` and each decode step writes slot ``clock`` for every row (so
one decode step is one engine step over ``slice(0, n)`` with ``T = 1``).

The cache holds what the rows need, not what they could need (:meth:`EngineCore.fit`): it
starts at 64 positions and doubles up to ``capacity`` when the clock reaches its end; the
positions before the oldest running request's first token are dropped (``shift_left``) when
the clock reaches the end or they outnumber the longest request's; a prompt longer than the
clock moves the rows right (``shift_right``); a cache four times longer than the clock shrinks
to twice the clock. Each step passes the mask up to the clock, so an engine attends over the
positions the rows hold (``capacity`` is a limit, not a cost).

A request under a grammar (``Job.constraint``, structured outputs) has each token masked to
what the grammar allows; where the grammar forces the next tokens (a JSON key, a closing brace,
the stop token), they are taken without a step (jump-forward decoding, ``jump_forward``): the
row emits them at once and feeds them with its next decode step, which then writes several
slots for that row (left-padded to the row with the most, the padding masked): one step for
what plain decoding spends one step per token on. A job with ``copies`` (a request's ``n``
choices) is prefilled once; each copy's row is a copy of its row before its first token.

A job of adaptive depth (``Job.auto``, ``budget: "auto"``) rides in the same batch: its step's
:class:`RowBudgets` carry its settings and the engine runs the adaptive-depth path for the
whole slice (fixed rows exactly at their budgets); every token's event carries the depth that
produced it.

What the core does is reported to an :class:`Observer` (the server's Prometheus metrics;
nothing for an offline batch), and every request gets :class:`Event` s through its job's
``emit`` callback.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from looptool.engine.budgets import AutoRow, RowBudgets
from looptool.engine.interface import StepBatch, StepEngine, StepResult, with_length
from looptool.engine.prefix_cache import CacheGroup, PrefixCache
from looptool.engine.rounds import speculative_round
from looptool.engine.sampling import GREEDY, RowConstraint, SamplingParams, TokenPicker, by_picker, shape_logits
from looptool.engine.speculation import Speculation, SpeculationStats

log = logging.getLogger(__name__)

FIRST_LENGTH = 64  # cache positions at start; the cache grows by doubling


@dataclass
class Event:
    """What the core tells a request: a ``token`` (with the ``depth`` that produced it, and the
    ``logits`` it was chosen from where the job keeps them), its ``prompt`` log-probabilities,
    that it ``finished`` (``reason`` ``stop`` or ``length``), or that it ``failed``
    (``message``)."""

    kind: str
    token: int = -1
    depth: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    reason: str = ""
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    message: str = ""
    logits: torch.Tensor | None = None
    forced: bool = False  # a token the grammar forced, taken without a step (no depth, no logits)


@dataclass(eq=False)
class Job:
    """One generation request as the core sees it: a fixed ``budget``, or adaptive depth
    (``auto``; ``budget`` is then its ``max_budget``)."""

    prompt: list[int]
    budget: int
    max_tokens: int
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # top-n log-probabilities of each generated token
    prompt_logprobs: int | None = None  # echo: log-probability (and top-n) of each prompt token
    ignore_eos: bool = False  # run to max_tokens (load tests; an offline batch pads after EOS itself)
    emit: Callable[[Event], None] = lambda event: None
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # the finish reason counted in the metrics: "cancelled" or "stop"
    arrived: float = field(default_factory=time.perf_counter)
    auto: AutoRow | None = None
    # The consumer names the finish reason the metrics count (HTTP: a stop string it finds in the
    # text may end a job the engine already finished at its length); see Scheduler.cancel.
    consumer_counts: bool = False
    held_reason: str = ""  # the engine's finish reason, held back until the consumer names its own
    speculation: Speculation | None = None  # draft at speculation.budget, verify at budget (checked at the edge)
    speculated: SpeculationStats = field(default_factory=SpeculationStats)  # what its speculation did
    keep_logits: bool = False  # each token's event carries the logits it was chosen from
    picker: TokenPicker | None = None  # shared by the rows of one offline batch (one generator); None: its own
    constraint: RowConstraint | None = None  # a grammar's mask over each token (structured outputs)
    copies: list[Job] = field(default_factory=list)  # more choices of the same prompt, prefilled with this one

    @property
    def jumps(self) -> bool:
        """Whether tokens its grammar forces may be taken without a step (not where each token's
        log-probabilities or logits are asked for: a forced token has none)."""
        return self.constraint is not None and self.logprobs is None and not self.keep_logits

    @property
    def label(self) -> str:
        """The metrics' ``budget`` label: the budget, or ``auto``."""
        return "auto" if self.auto is not None else str(self.budget)


@dataclass(eq=False)
class Row:
    """A running request: its job, its tokens so far and where it is."""

    job: Job
    ids: list[int]
    picker: TokenPicker
    position: int  # position id of the next token fed (its tokens before it are in the cache)
    span: int  # cache slots from its first token to the clock (position, plus rejected drafts' masked slots)
    generated: int = 0
    last_time: float = 0.0
    done: str = ""  # finish reason once finished


class Observer:
    """What the core reports as it works (this base: nothing; the server counts it)."""

    def prefilled(self, job: Job, tokens: int, cached: int, prefix_bytes: int) -> None:
        """``job``'s prompt of ``tokens`` tokens is in its row, ``cached`` of them copied from the
        prefix cache, which now holds ``prefix_bytes`` (``cached`` is -1 without one)."""

    def emitted(self, job: Job, depth: int | None, first: bool, seconds: float) -> None:
        """``job`` got a token of ``depth`` (None: its grammar forced it), ``seconds`` after it
        arrived (its ``first``) or after its previous token."""

    def drafted(self, job: Job, drafted: int, accepted: int) -> None:
        """A speculative round of ``job`` drafted and accepted that many tokens."""

    def retired(self, job: Job, seconds: float) -> None:
        """``job`` left its row, ``seconds`` after it arrived."""

    def forced(self, job: Job, tokens: int) -> None:
        """``job`` took ``tokens`` tokens its grammar forced, without a step."""

    def stepped(self, labels: frozenset[str]) -> None:
        """One step advanced every running row (a decode step, a draft step or a verify step);
        ``labels`` are the rows' budget labels (:attr:`Job.label`): one label is a one-budget
        batch, which costs that budget, several a mixed one, which costs its deepest row."""


def top_logprobs(logp: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the log-probabilities ``logp [vocab]`` and the
    ``n`` most likely tokens with theirs."""
    top = torch.topk(logp, n) if n > 0 else None
    pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top is not None else []
    return float(logp[token]), pairs


class EngineCore:
    """Continuous batching over ``engine`` with ``max_batch`` rows of up to ``capacity`` cache
    positions; ``eos`` token ids stop a request; ``prefix_cache`` (None: off) reuses the keys
    and values of prompt prefixes; ``observer`` hears what happens; ``leave(job, reason)`` is
    called for each request that finished or was cancelled, as its row is freed;
    ``jump_forward`` takes the tokens a grammar forces without a step (module docstring)."""

    def __init__(
        self,
        engine: StepEngine,
        *,
        max_batch: int,
        capacity: int,
        eos: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
        prefix_cache: PrefixCache | None = None,
        observer: Observer | None = None,
        leave: Callable[[Job, str], None] | None = None,
        jump_forward: bool = True,
    ):
        self.engine = engine
        self.max_batch = max_batch
        self.capacity = capacity
        self.eos = frozenset(eos)
        self.device = torch.device(device)
        self.prefix = prefix_cache
        self.observer = observer or Observer()
        self.leave = leave or (lambda job, reason: job.emit(Event("finished", reason=reason)))
        self.jump_forward = jump_forward
        self.cache = engine.allocate(max_batch, min(FIRST_LENGTH, capacity))
        self.mask = torch.zeros(max_batch, self.cache.length, dtype=engine.mask_dtype, device=self.device)
        self.clock = 0
        self.rows: list[Row] = []
        self.steps = 0  # steps that advanced every running row (decode steps; a round's drafts and verification)
        self._groups: dict[int, tuple[CacheGroup, ...] | None] = {}

    @property
    def free(self) -> int:
        """Rows a new request may take."""
        return self.max_batch - len(self.rows)

    # ------------------------------------------------------------------ admitting requests
    def prefill(self, jobs: list[Job]) -> None:
        """Write each job's prompt at slots ``[clock - len, clock)`` of the next free rows and
        pick its first token: one job with the prefix cache (the blocks it holds copied, the rest
        computed), several in one step, left-padded to the longest prompt, each row at its own
        budget (without the prefix cache)."""
        if len(jobs) == 1:
            self._score_prompt(jobs[0], jobs[0].copies)
            self._prefill_one(jobs[0])
            return
        jobs = [j for job in jobs for j in (job, *job.copies)]  # a batched prefill computes every copy
        for job in jobs:
            self._score_prompt(job)
        n, m = max(len(job.prompt) for job in jobs), len(jobs)
        self.fit(before=n)
        r = len(self.rows)
        ids = torch.zeros(m, n, dtype=torch.long)
        positions = torch.ones(m, n, dtype=torch.long)  # padding's positions are masked out
        for i, job in enumerate(jobs):
            length = len(job.prompt)
            ids[i, n - length :] = torch.tensor(job.prompt)
            positions[i, n - length :] = torch.arange(length)
            self.mask[r + i].zero_()
            self.mask[r + i, self.clock - length : self.clock] = 1
        out = self.run(
            slice(r, r + m),
            ids.to(self.device),
            positions.to(self.device),
            torch.arange(self.clock - n, self.clock, device=self.device),
            RowBudgets(tuple(job.budget for job in jobs), tuple(job.auto for job in jobs)),
        )
        added = []
        for job in jobs:
            length = len(job.prompt)
            self.observer.prefilled(job, length, -1, 0)
            added.append(Row(job, list(job.prompt), self._picker(job), position=length, span=length))
        self.rows += added
        self.take_many(added, out.logits, out.depths.tolist())
        self._jump(added)

    def _prefill_one(self, job: Job) -> None:
        """:meth:`prefill` of one job, with the prefix cache."""
        n = len(job.prompt)
        ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)
        groups = self._prefix_groups(job)
        found = self.prefix.lookup(job.prompt, groups) if groups else []
        self.fit(before=n)
        r, first = len(self.rows), self.clock - n
        hit = len(found) * self.prefix.block if found else 0
        for i, block in enumerate(found):
            for buffer, value in block.items():
                self.cache.write(buffer, r, first + i * self.prefix.block, value)
        self.mask[r].zero_()
        self.mask[r, first : self.clock] = 1
        out = self.run(
            slice(r, r + 1),
            ids[:, hit:],
            torch.arange(hit, n, device=self.device)[None],
            torch.arange(first + hit, self.clock, device=self.device),
            RowBudgets((job.budget,), (job.auto,)),
        )
        if groups:
            self.prefix.store(job.prompt, groups, functools.partial(self._read, r, first), skip=len(found))
        self.observer.prefilled(job, n, hit if groups else -1, self.prefix.nbytes if self.prefix else 0)
        row = Row(job, list(job.prompt), self._picker(job), position=n, span=n)
        self.rows.append(row)
        rows = [row, *self._copy(row, job.copies)]
        for each in rows:
            self.take(each, out.logits[0:1], int(out.depths[0]))
        self._jump(rows)

    def _score_prompt(self, job: Job, copies: Sequence[Job] = ()) -> None:
        """Send ``job`` (and its ``copies`` still wanted) its prompt's log-probabilities where it
        asks for them (``echo`` with ``logprobs``), computed once."""
        if job.prompt_logprobs is None:
            return
        ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)
        logp = self.engine.prompt_logprobs(ids, job.budget)
        event = Event("prompt", prompt_logprobs=_prompt_logprobs(logp, job.prompt, job.prompt_logprobs))
        for each in (job, *copies):
            if not each.cancelled:
                each.emit(event)

    def _copy(self, row: Row, copies: list[Job]) -> list[Row]:
        """Rows for ``copies`` of ``row``'s job (more choices of its prompt), each a copy of
        ``row``'s cache and mask; a copy already cancelled leaves without a row."""
        added = []
        r = len(self.rows) - 1
        for job in copies:
            if job.cancelled:
                self.leave(job, job.cancel_reason)
                continue
            dst = len(self.rows)
            self._copy_slot(r, dst)
            self.observer.prefilled(job, len(job.prompt), -1, self.prefix.nbytes if self.prefix else 0)
            added.append(Row(job, list(job.prompt), self._picker(job), position=row.position, span=row.span))
            self.rows.append(added[-1])
        return added

    def _picker(self, job: Job) -> TokenPicker:
        """The picker of ``job``'s tokens: the one it shares with the rest of its batch, else its own."""
        return job.picker if job.picker is not None else TokenPicker(job.sampling, self.device)

    def abandon(self, jobs: list[Job]) -> None:
        """Forget ``jobs`` after their prefill failed (the rows they got are freed)."""
        while self.rows and self.rows[-1].job in jobs:
            self.rows.pop()

    def _prefix_groups(self, job: Job) -> tuple[CacheGroup, ...] | None:
        """The cache groups ``job``'s prompt is looked up and kept in (None: not cached: no prefix
        cache, an engine that does not say, or adaptive depth, whose keys and values depend on
        the depth each token took)."""
        if self.prefix is None or job.auto is not None:
            return None
        if job.budget not in self._groups:
            self._groups[job.budget] = self.engine.prefix_groups(job.budget)
        return self._groups[job.budget]

    def _read(self, row: int, first: int, buffer: int, start: int, stop: int):
        """A copy of ``buffer``'s keys or values of the tokens ``[start, stop)`` of the request in
        ``row`` whose first token is at slot ``first``."""
        return self.cache.read(buffer, row, first + start, first + stop)

    # ------------------------------------------------------------------ advancing every row
    def iterate(self) -> None:
        """Advance every running row: a speculative round (:func:`speculative_round`) when some
        row speculates, else one decode step."""
        if any(row.job.speculation is not None for row in self.rows) and not any(
            len(row.ids) - row.position > 1 for row in self.rows
        ):  # tokens a grammar forced are fed by a decode step first
            speculative_round(self)
        else:
            self._decode()

    def _decode(self) -> None:
        """One step for all running rows: each feeds its last token at slot ``clock`` (or, after
        its grammar forced tokens, every token it has not fed, at the slots up to
        ``clock + width - 1``, left-padded to the ``width`` of the row with the most)."""
        n = len(self.rows)
        fed = [row.ids[row.position :] for row in self.rows]
        width = max(len(f) for f in fed)
        self.fit(before=0, ahead=width - 1)
        clock, dev = self.clock, self.device
        if width == 1:  # every row feeds its last token
            ids = torch.tensor(fed, dtype=torch.long)
            positions = torch.tensor([[row.position] for row in self.rows], dtype=torch.long)
            self.mask[:n, clock] = 1
        else:
            ids = torch.zeros(n, width, dtype=torch.long)
            positions = torch.zeros(n, width, dtype=torch.long)
            for r, (row, tokens) in enumerate(zip(self.rows, fed)):
                pad = width - len(tokens)
                ids[r, pad:] = torch.tensor(tokens)
                positions[r] = torch.arange(row.position - pad, row.position + len(tokens)).clamp(min=0)
                self.mask[r, clock : clock + pad] = 0  # the padding's slots stay masked
                self.mask[r, clock + pad : clock + width] = 1
        out = self.run(
            slice(0, n),
            ids.to(dev),
            positions.to(dev),
            torch.arange(clock, clock + width, device=dev),
            RowBudgets(tuple(row.job.budget for row in self.rows), tuple(row.job.auto for row in self.rows)),
        )  # budgets resolved at the edge
        self.clock += width
        self.count_step()
        for row, tokens in zip(self.rows, fed):
            row.position += len(tokens)
            row.span += width
        self.take_many(self.rows, out.logits, out.depths.tolist())
        self._jump(self.rows)

    def _jump(self, rows: list[Row]) -> None:
        """Take the tokens each row's grammar forces next, without a step (``jump_forward``);
        the next decode step feeds them."""
        if not self.jump_forward:
            return
        for row in rows:
            if row.done or not row.job.jumps:
                continue
            tokens = row.job.constraint.forced()
            taken = 0
            for token in tokens:
                if row.done:
                    break
                self.emit(row, token, None, None)
                taken += 1
            if taken:
                self.observer.forced(row.job, taken)

    def count_step(self) -> None:
        """One more step advanced every running row (:attr:`steps`), told to the observer with
        the rows' budget labels."""
        self.steps += 1
        self.observer.stepped(frozenset(row.job.label for row in self.rows))

    def run(
        self,
        rows: slice,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        budgets: RowBudgets,
        every_position: bool = False,
    ) -> StepResult:
        """One engine step over running rows ``rows``, each attending over its mask up to the
        last slot this step writes (``cache_position[-1]``)."""
        width = int(cache_position[-1]) + 1
        batch = StepBatch(
            rows, input_ids, self.mask[rows, :width], position_ids, cache_position, budgets, every_position
        )
        return self.engine.run(self.cache, batch)

    def fit(self, before: int, ahead: int = 0) -> None:
        """Arrange the cache for the next step: at least ``before`` positions before the clock
        (a prompt's) and the clock's own slot plus ``ahead`` more (a speculative round's), with
        no more positions than the rows need (up to a factor of four); moves the rows and the
        mask, never a row's content."""
        if not self.rows:  # nothing to keep: start over at the front
            self.clock = 0
        length = self.cache.length
        longest = max((row.span for row in self.rows), default=0)
        oldest = self.clock - longest  # positions before every running request's first token
        if oldest and (
            self.clock + 1 + ahead > length or oldest >= max(longest, FIRST_LENGTH // 2) or self.clock < before
        ):
            self.shift(-oldest)  # drop them: a step then reads at most about twice what the rows hold
        target = max(self.clock, before)
        need = target + 1 + ahead
        if need > length:
            self._resize(max(need, min(self.capacity, 2 * length)))
        elif length > FIRST_LENGTH and 4 * need <= length:
            self._resize(max(FIRST_LENGTH, 2 * need))
        if target > self.clock:
            self.shift(target - self.clock)

    def shift(self, n: int) -> None:
        """Move every row's positions (cache and mask) ``n`` to the right (left when negative);
        the clock moves with them."""
        if n > 0:
            self.cache.shift_right(n)
            self.mask[:, n:] = self.mask[:, :-n].clone()
            self.mask[:, :n] = 0
        else:
            self.cache.shift_left(-n)
            self.mask[:, :n] = self.mask[:, -n:].clone()
            self.mask[:, n:] = 0
        self.clock += n

    def _resize(self, length: int) -> None:
        """Give the cache and the mask ``length`` positions (the first ones kept)."""
        self.cache.resize(length)
        self.mask = with_length(self.mask, length, dim=1)
        log.debug("slot cache resized to %d positions", length)

    # ------------------------------------------------------------------ tokens
    def take(self, row: Row, logits: torch.Tensor, depth: int) -> None:
        """Pick ``row``'s next token from ``logits [1, vocab]`` (run at ``depth``), send it, and
        mark the row done at EOS or ``max_tokens``."""
        if row.job.cancelled:
            row.done = row.job.cancel_reason
            return
        ids = torch.tensor([row.ids], device=self.device) if row.picker.warpers is not None else None
        self.emit(row, int(row.picker(self._shaped(row, logits), ids)), logits, depth)

    def _shaped(self, row: Row, logits: torch.Tensor) -> torch.Tensor:
        """``row``'s logits ``[1, vocab]`` as its token is picked from them: masked by its
        grammar, biased and penalised (:func:`shape_logits`), as float."""
        job = row.job
        return shape_logits(logits.float(), job.sampling, row.ids, len(job.prompt), job.constraint)

    def take_many(self, rows: list[Row], logits: torch.Tensor, depths: list[int]) -> None:
        """:meth:`take` for ``rows`` (``logits [R, vocab]``, one row each): rows that share a
        picker draw in one call, as a static batch does (one generator, one draw per step)."""
        if not rows:
            return
        for row in rows:
            if row.job.cancelled:
                row.done = row.job.cancel_reason
        for group in by_picker(rows, [i for i, row in enumerate(rows) if not row.job.cancelled]):
            if len(group) == 1:
                self.take(rows[group[0]], logits[group[0] : group[0] + 1], depths[group[0]])
                continue
            if any(rows[i].job.constraint is not None or rows[i].job.sampling.shapes for i in group):
                shaped = torch.cat([self._shaped(rows[i], logits[i : i + 1]) for i in group])
            else:
                shaped = logits[group].float()
            tokens = rows[group[0]].picker(shaped, None)  # the warpers read no ids
            for j, i in enumerate(group):
                self.emit(rows[i], int(tokens[j]), logits[i : i + 1], depths[i])

    def emit(self, row: Row, token: int, logits: torch.Tensor | None, depth: int | None) -> None:
        """Send ``row``'s next ``token`` (chosen from ``logits [1, vocab]``, run at ``depth``; both
        None for a token its grammar forced) and mark the row done at EOS or ``max_tokens``."""
        job = row.job
        logprob, top = (None, None)
        if job.logprobs is not None and logits is not None:
            logprob, top = top_logprobs(torch.log_softmax(logits[0].float(), -1), token, job.logprobs)
        row.ids.append(token)
        row.generated += 1
        if job.constraint is not None:
            job.constraint.accept(token)
        now = time.perf_counter()
        self.observer.emitted(
            job, depth, row.generated == 1, now - (job.arrived if row.generated == 1 else row.last_time)
        )
        row.last_time = now
        kept = logits[0].float().clone() if job.keep_logits and logits is not None else None
        event = Event("token", token=token, depth=depth, logprob=logprob, top=top, logits=kept, forced=logits is None)
        job.emit(event)
        if token in self.eos and not job.ignore_eos:
            row.done = "stop"
        elif row.generated >= job.max_tokens:
            row.done = "length"

    # ------------------------------------------------------------------ freeing rows
    def retire(self) -> None:
        """Free the rows of finished or cancelled requests, keeping the running ones packed."""
        for r in range(len(self.rows) - 1, -1, -1):
            row = self.rows[r]
            if row.job.cancelled and not row.done:
                row.done = row.job.cancel_reason
            if not row.done:
                continue
            self._keep(r, row)
            last = len(self.rows) - 1
            if r != last:
                self._copy_slot(last, r)
                self.rows[r] = self.rows[last]
            self.rows.pop()
            self.observer.retired(row.job, time.perf_counter() - row.job.arrived)
            self.leave(row.job, row.done)

    def _copy_slot(self, src: int, dst: int) -> None:
        """Row ``dst`` of the cache and the mask takes row ``src``'s content."""
        self.cache.copy_row(src, dst)
        self.mask[dst] = self.mask[src]

    def fail(self, exc: BaseException) -> list[Job]:
        """Fail every running request with ``exc`` (a step raised it) and free their rows; the
        jobs failed."""
        jobs = [row.job for row in self.rows]
        for job in jobs:
            job.emit(Event("failed", message=f"{type(exc).__name__}: {exc}"))
        self.reset()
        return jobs

    def reset(self) -> None:
        """Free every row without a word to its request."""
        self.rows.clear()
        self.mask.zero_()

    def _keep(self, r: int, row: Row) -> None:
        """Keep the keys and values of the tokens a finishing row fed (prompt and answer) in the
        prefix cache, so a follow-up turn that repeats them reuses them; a row with masked
        slots (a speculative one's rejected drafts) is skipped."""
        groups = self._prefix_groups(row.job)
        if groups and row.job.speculation is None and row.span == row.position:
            self.prefix.store(row.ids[: row.position], groups, functools.partial(self._read, r, self.clock - row.span))


def _prompt_logprobs(logp: torch.Tensor, prompt: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per prompt token after the first: its log-probability under ``logp [T, vocab]`` (the
    log-softmax at the position before it) and the ``n`` most likely tokens there."""
    logp = logp.float()
    return [top_logprobs(logp[i - 1], prompt[i], n) for i in range(1, len(prompt))]
