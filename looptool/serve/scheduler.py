"""The scheduler: iteration-level (continuous) batching over one slot cache, every request at
its own budget.

One thread owns a step engine (:class:`looptool.engine.StepEngine`: PyTorch, onnxruntime or
TensorRT alike) and a slot cache of ``max_batch`` rows. Each iteration admits waiting requests (a prefill of each at
its own budget), runs ONE row-wise-budget decode step for every running request whatever its
budget, and retires finished ones. Running requests stay packed in rows ``[0, n)``: a retired
row's slot takes the last row (``copy_row``). All rows share one write clock: a request's
tokens lie in ``[clock - len, clock)``, a prefill writes its prompt at ``[clock - len, clock)``
and each decode step writes slot ``clock`` for every row (so one decode step is one
``step(cache, slice(0, n), ...)`` with ``T = 1``).

The cache holds what the rows need, not what they could need (:meth:`Scheduler.fit`): it
starts at 64 positions and doubles up to ``capacity`` when the clock reaches its end; the
positions before the oldest running request's first token are dropped (``shift_left``) when
the clock reaches the end or they outnumber the longest request's; a prompt longer than the
clock moves the rows right (``shift_right``); a cache four times longer than the clock shrinks
to twice the clock. Each step
passes the mask up to the clock, so an engine attends over the positions the rows hold
(``capacity`` is a limit, not a cost).

A job that decodes speculatively (``Job.speculation``: ``draft_budget``, ``draft_tokens``) rides
in the same batch too: while one runs, an iteration is a round of draft steps and a verify step
(:mod:`looptool.serve.speculation`) in which the other rows take a token per draft step; the
clock then moves past the round, and the slots a row did not fill are masked for it.

A job of adaptive depth (``Job.auto``, ``budget: "auto"``) rides in the same batch: its step's
:class:`RowBudgets` carry its settings and the engine runs the adaptive-depth path for the
whole slice (fixed rows exactly at their budgets); every token's event carries the depth that
produced it, and the metrics count adaptive tokens by depth.

The HTTP side only submits :class:`Job` objects and receives :class:`Event` s through each
job's ``emit`` callback (called on the scheduler thread; it must be thread-safe).

A job counts against ``max_batch + max_queue`` from the moment it is accepted until it leaves
the scheduler (finished, cancelled or failed), whether it waits, is being prefilled or decodes,
so that bound is exactly how many requests the server holds at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looptool.engine import StepEngine, StepResult
from looptool.engine.budgets import AutoRow, RowBudgets
from looptool.engine.interface import Capabilities, StepBatch, with_length
from looptool.engine.prefix_cache import CacheGroup, PrefixCache
from looptool.engine.sampling import GREEDY, SamplingParams, TokenPicker
from looptool.engine.speculation import Speculation, SpeculationStats
from looptool.serve.logprobs import top_logprobs
from looptool.serve.metrics import Metrics
from looptool.serve.speculation import speculative_round

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What the scheduler tells a request: a ``token`` (with the ``depth`` that produced it), its
    ``prompt`` log-probabilities, that it ``finished`` (``reason`` ``stop`` or ``length``), or
    that it ``failed`` (``message``)."""

    kind: str
    token: int = -1
    depth: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    reason: str = ""
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    message: str = ""


@dataclass(eq=False)
class Job:
    """One generation request as the scheduler sees it: a fixed ``budget``, or adaptive depth
    (``auto``; ``budget`` is then its ``max_budget``)."""

    prompt: list[int]
    budget: int
    max_tokens: int
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # top-n log-probabilities of each generated token
    prompt_logprobs: int | None = None  # echo: log-probability (and top-n) of each prompt token
    ignore_eos: bool = False  # run to max_tokens (load tests)
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

    @property
    def label(self) -> str:
        """The metrics' ``budget`` label: the budget, or ``auto``."""
        return "auto" if self.auto is not None else str(self.budget)


FIRST_LENGTH = 64  # cache positions at start; the cache grows by doubling


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


class Draining(Exception):
    """The server is shutting down and admits no new request (HTTP 503)."""


@dataclass(eq=False)
class Row:
    """A running request: its job, its tokens so far and where it is."""

    job: Job
    ids: list[int]
    picker: TokenPicker
    position: int  # position id of the next token fed
    span: int  # cache slots from its first token to the clock (position, plus rejected drafts' masked slots)
    generated: int = 0
    last_time: float = 0.0
    done: str = ""  # finish reason once finished


class Scheduler:
    """Continuous batching over ``engine`` with ``max_batch`` slots of ``capacity`` tokens and at
    most ``max_queue`` requests waiting; ``eos`` token ids stop a request."""

    def __init__(
        self,
        engine: StepEngine,
        *,
        max_batch: int,
        capacity: int,
        max_queue: int,
        eos: tuple[int, ...] = (),
        metrics: Metrics | None = None,
        device: torch.device | str = "cpu",
        prefix_cache: PrefixCache | None = None,
    ):
        self.engine = engine
        self.max_batch = max_batch
        self.capacity = capacity
        self.max_queue = max_queue
        self.eos = frozenset(eos)
        self.metrics = metrics or Metrics(engine.budgets)
        self.device = torch.device(device)
        self.cache = engine.allocate(max_batch, min(FIRST_LENGTH, capacity))
        self.mask = torch.zeros(max_batch, self.cache.length, dtype=engine.mask_dtype, device=self.device)
        self.clock = 0
        self.rows: list[Row] = []
        self.waiting: deque[Job] = deque()
        self._held: set[Job] = set()  # accepted and not yet out of the scheduler: waiting, prefilling or running
        self._cond = threading.Condition()
        self._draining = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="looptool-scheduler", daemon=True)
        self.steps = 0  # decode steps run (all rows at once)
        self.prefix = prefix_cache  # None: every prompt is computed in full
        self._groups: dict[int, tuple[CacheGroup, ...] | None] = {}

    # ------------------------------------------------------------------ HTTP side
    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_batch`` run and ``max_queue`` wait,
        :class:`Draining` once :meth:`drain` was called."""
        with self._cond:
            if self._draining:
                raise Draining()
            if len(self._held) >= self.max_batch + self.max_queue:
                raise QueueFull()
            self._held.add(job)
            self.waiting.append(job)
            self.metrics.waiting.set(len(self.waiting))
            self._cond.notify()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop ``job``: its client went away (``reason`` ``cancelled``) or the HTTP side ended it
        on a stop string (``stop``, the reason the metrics count). Its slot is freed at the next
        iteration; a job that already left the scheduler is left alone."""
        with self._cond:
            if job.held_reason:  # it finished in the engine; count what the consumer saw
                self.metrics.finished.labels(budget=job.label, reason=reason).inc()
                job.held_reason = ""
                return
            if job.cancelled or job not in self._held:
                return
            job.cancelled, job.cancel_reason = True, reason
            if job in self.waiting:  # never admitted: leaves the queue at once
                self.waiting.remove(job)
                self._held.discard(job)
                self.metrics.waiting.set(len(self.waiting))
                self.metrics.finished.labels(budget=job.label, reason=reason).inc()
            self._cond.notify()

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called (new requests are refused)."""
        return self._draining

    def drain(self) -> None:
        """Admit no new request; the queued and running ones finish."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Finish what was admitted, then end the scheduler thread."""
        with self._cond:
            self._draining = True
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def warm_up(self, budgets, draft_tokens: int | None = None) -> None:
        """Run a one-token prompt and one decode step at every budget, and of adaptive depth
        where the engine runs it, before serving (first calls build and compile what they
        need), outside the metrics; with ``draft_tokens``, also one speculative round at every
        budget deeper than the shallowest, drafting that many tokens at the shallowest."""
        metrics, self.metrics = self.metrics, Metrics(self.engine.budgets)
        jobs = [Job([0], int(budget), 2) for budget in budgets]
        if draft_tokens is not None:
            draft = min(budgets)
            jobs += [Job([0], int(k), 2, speculation=Speculation(draft, draft_tokens)) for k in budgets if k > draft]
        if self.capabilities.adaptive:
            deepest = max(budgets)
            jobs.append(Job([0], deepest, 2, auto=AutoRow(min(budgets), deepest)))
        try:
            for job in jobs:
                self._prefill(job)
                self._iterate()
                self._retire()
        finally:
            self.metrics = metrics
            self.rows.clear()
            self.mask.zero_()

    @property
    def capabilities(self) -> Capabilities:
        """What the engine runs beside fixed budgets (adaptive depth, verify steps) and why not."""
        return self.engine.capabilities

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self.rows)

    @property
    def held(self) -> int:
        """Requests accepted and not yet out of the scheduler (waiting, prefilling or decoding)."""
        with self._cond:
            return len(self._held)

    def _release(self, job: Job) -> None:
        """``job`` left the engine: its place counts no more against the bound."""
        with self._cond:
            self._held.discard(job)

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.waiting and not self.rows and not self._stop:
                    self._cond.wait()
                if self._stop and not self.waiting and not self.rows:
                    return
                admitted = [
                    self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch - len(self.rows)))
                ]
                self.metrics.waiting.set(len(self.waiting))
            try:
                for job in admitted:
                    if job.cancelled:  # cancelled between leaving the queue and its prefill
                        self.metrics.finished.labels(budget=job.label, reason=job.cancel_reason).inc()
                        self._release(job)
                    else:
                        self._admit(job)
                self._retire()
                if self.rows:
                    self._iterate()
                    self._retire()
            except Exception as exc:  # a failing step fails the requests it served, not the server
                log.exception("engine step failed")
                for row in self.rows:
                    row.job.emit(Event("failed", message=f"{type(exc).__name__}: {exc}"))
                    self._release(row.job)
                self.rows.clear()
                self.mask.zero_()
            self.metrics.running.set(len(self.rows))

    def _admit(self, job: Job) -> None:
        """Prefill ``job``; a failure fails that request alone."""
        try:
            self._prefill(job)
        except Exception as exc:
            log.exception("prefill failed")
            if self.rows and self.rows[-1].job is job:
                self.rows.pop()
            self._release(job)
            job.emit(Event("failed", message=f"{type(exc).__name__}: {exc}"))

    def _prefill(self, job: Job) -> None:
        """Write ``job``'s prompt at slots ``[clock - len, clock)`` of the next free row (the
        blocks the prefix cache holds copied, the rest computed) and pick its first token."""
        n = len(job.prompt)
        ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)
        if job.prompt_logprobs is not None:
            logp = self.engine.prompt_logprobs(ids, job.budget)
            job.emit(Event("prompt", prompt_logprobs=_prompt_logprobs(logp, job.prompt, job.prompt_logprobs)))
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
            self.metrics.prefix_tokens.labels(kind="queried").inc(n)
            self.metrics.prefix_tokens.labels(kind="hit").inc(hit)
            self.metrics.prefix_bytes.set(self.prefix.nbytes)
        row = Row(job, list(job.prompt), TokenPicker(job.sampling, self.device), position=n, span=n)
        self.rows.append(row)
        self.metrics.prompt_tokens.labels(budget=job.label).inc(n)
        self.take(row, out.logits[0:1], int(out.depths[0]))

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

    def _keep(self, r: int, row: Row) -> None:
        """Keep the keys and values of the tokens a finishing row fed (prompt and answer) in the
        prefix cache, so a follow-up turn that repeats them reuses them; a row with masked
        slots (a speculative one's rejected drafts) is skipped."""
        groups = self._prefix_groups(row.job)
        if groups and row.job.speculation is None and row.span == row.position:
            self.prefix.store(row.ids[: row.position], groups, functools.partial(self._read, r, self.clock - row.span))
            self.metrics.prefix_bytes.set(self.prefix.nbytes)

    def _iterate(self) -> None:
        """Advance every running row: a speculative round (:func:`speculative_round`) when some
        row speculates, else one decode step."""
        if any(row.job.speculation is not None for row in self.rows):
            speculative_round(self)
        else:
            self._decode()

    def _decode(self) -> None:
        """One step for all running rows: each feeds its last token at slot ``clock``."""
        n = len(self.rows)
        self.fit(before=0)
        self.mask[:n, self.clock] = 1
        dev = self.device
        out = self.run(
            slice(0, n),
            torch.tensor([[row.ids[-1]] for row in self.rows], dtype=torch.long, device=dev),
            torch.tensor([[row.position] for row in self.rows], dtype=torch.long, device=dev),
            torch.tensor([self.clock], dtype=torch.long, device=dev),
            RowBudgets(tuple(row.job.budget for row in self.rows), tuple(row.job.auto for row in self.rows)),
        )  # budgets resolved at the HTTP edge
        self.clock += 1
        self.steps += 1
        depths = out.depths.tolist()
        for i, row in enumerate(self.rows):
            row.position += 1
            row.span += 1
            self.take(row, out.logits[i : i + 1], int(depths[i]))

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
            self._shift(-oldest)  # drop them: a step then reads at most about twice what the rows hold
        target = max(self.clock, before)
        need = target + 1 + ahead
        if need > length:
            self._resize(max(need, min(self.capacity, 2 * length)))
        elif length > FIRST_LENGTH and 4 * need <= length:
            self._resize(max(FIRST_LENGTH, 2 * need))
        if target > self.clock:
            self._shift(target - self.clock)

    def _shift(self, n: int) -> None:
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

    def take(self, row: Row, logits: torch.Tensor, depth: int) -> None:
        """Pick ``row``'s next token from ``logits [1, vocab]`` (run at ``depth``), send it, and
        mark the row done at EOS or ``max_tokens``."""
        if row.job.cancelled:
            row.done = row.job.cancel_reason
            return
        ids = torch.tensor([row.ids], device=self.device) if row.picker.warpers is not None else None
        self.emit(row, int(row.picker(logits.float(), ids)), logits, depth)

    def emit(self, row: Row, token: int, logits: torch.Tensor, depth: int) -> None:
        """Send ``row``'s next ``token`` (chosen from ``logits [1, vocab]``, run at ``depth``) and
        mark the row done at EOS or ``max_tokens``."""
        job = row.job
        logprob, top = (None, None)
        if job.logprobs is not None:
            logprob, top = top_logprobs(torch.log_softmax(logits[0].float(), -1), token, job.logprobs)
        row.ids.append(token)
        row.generated += 1
        now = time.perf_counter()
        budget = job.label
        if job.auto is not None:
            self.metrics.depth.observe(depth)
        if row.generated == 1:
            self.metrics.ttft.labels(budget=budget).observe(now - job.arrived)
        else:
            self.metrics.tpot.labels(budget=budget).observe(now - row.last_time)
        row.last_time = now
        self.metrics.generation_tokens.labels(budget=budget).inc()
        job.emit(Event("token", token=token, depth=depth, logprob=logprob, top=top))
        if token in self.eos and not job.ignore_eos:
            row.done = "stop"
        elif row.generated >= job.max_tokens:
            row.done = "length"

    def _retire(self) -> None:
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
                self.cache.copy_row(last, r)
                self.mask[r] = self.mask[last]
                self.rows[r] = self.rows[last]
            self.rows.pop()
            job = row.job
            with self._cond:  # decided under the lock cancel() takes, so a finish is counted once
                if job.cancelled:
                    self.metrics.finished.labels(budget=job.label, reason=job.cancel_reason).inc()
                elif job.consumer_counts:
                    job.held_reason = row.done
                else:
                    self.metrics.finished.labels(budget=job.label, reason=row.done).inc()
                self._held.discard(job)
            self.metrics.e2e.labels(budget=job.label).observe(time.perf_counter() - job.arrived)
            if not job.cancelled:
                job.emit(Event("finished", reason=row.done))


def _prompt_logprobs(logp: torch.Tensor, prompt: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per prompt token after the first: its log-probability under ``logp [T, vocab]`` (the
    log-softmax at the position before it) and the ``n`` most likely tokens there."""
    logp = logp.float()
    return [top_logprobs(logp[i - 1], prompt[i], n) for i in range(1, len(prompt))]
