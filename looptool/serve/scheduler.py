"""The scheduler: the engine core (:class:`looptool.engine.core.EngineCore`) on a thread of its
own behind HTTP, with a bounded queue.

One thread owns the core. Each iteration admits waiting requests (a prefill of each at its own
budget), advances every running request by one decode step (or one speculative round) whatever
its budget, and retires finished ones; see the core for how rows, the write clock and the
cache's length are kept.

The HTTP side only submits :class:`~looptool.engine.core.Job` objects and receives
:class:`~looptool.engine.core.Event` s through each job's ``emit`` callback (called on the
scheduler thread; it must be thread-safe).

A job counts against ``max_batch + max_queue`` from the moment it is accepted until it leaves
the scheduler (finished, cancelled or failed), whether it waits, is being prefilled or decodes,
so that bound is exactly how many requests the server holds at once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine import StepEngine
from looptool.engine.budgets import AutoRow
from looptool.engine.core import EngineCore, Event, Job, Row
from looptool.engine.interface import Capabilities
from looptool.engine.prefix_cache import PrefixCache
from looptool.engine.speculation import MAX_DRAFT_TOKENS, Speculation
from looptool.serve.metrics import Metrics

__all__ = ["Draining", "Event", "Job", "QueueFull", "Row", "Scheduler"]

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


class Draining(Exception):
    """The server is shutting down and admits no new request (HTTP 503)."""


def slots_within(engine: StepEngine, kv_memory: int, capacity: int) -> int:
    """How many slots of ``capacity`` tokens (plus a speculative round's drafts) ``engine``'s slot
    cache holds within ``kv_memory`` bytes; one sentence when not even one fits."""
    per_position = engine.allocate(1, 1).position_bytes()
    positions = capacity + MAX_DRAFT_TOKENS + 1  # a row's span: its tokens, and a round's drafts past them
    slots = kv_memory // (per_position * positions)
    if slots < 1:
        raise LooptoolError(
            f"a KV memory of {kv_memory / 2**20:.1f} MiB does not hold one request of {counted(capacity, 'token')} "
            f"({per_position * positions / 2**20:.1f} MiB); raise kv_memory or lower capacity.",
            parameter="kv_memory",
        )
    return int(slots)


class Scheduler:
    """Continuous batching over ``engine`` with ``max_batch`` slots of ``capacity`` tokens and at
    most ``max_queue`` requests waiting; ``eos`` token ids stop a request; ``prefix_cache``
    (None: off) reuses the keys and values of prompt prefixes. ``kv_memory`` (bytes; None: no
    bound) bounds the slot cache: it holds only as many slots of ``capacity`` tokens (and a
    speculative round's drafts) as fit, fewer than ``max_batch`` where they do not, and the
    requests beyond them wait in the queue. ``jump_forward`` takes the tokens a request's grammar
    forces without a step (:class:`~looptool.engine.core.EngineCore`)."""

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
        kv_memory: int | None = None,
        jump_forward: bool = True,
    ):
        self.engine = engine
        max_batch = min(max_batch, slots_within(engine, kv_memory, capacity)) if kv_memory is not None else max_batch
        self.max_batch = max_batch
        self.capacity = capacity
        self.max_queue = max_queue
        self.metrics = metrics or Metrics(engine.budgets)
        self.core = EngineCore(
            engine,
            max_batch=max_batch,
            capacity=capacity,
            eos=eos,
            device=device,
            prefix_cache=prefix_cache,
            observer=self.metrics,
            leave=self._leave,
            jump_forward=jump_forward,
        )
        self.waiting: deque[Job] = deque()
        self._held: set[Job] = set()  # accepted and not yet out of the scheduler: waiting, prefilling or running
        self._cond = threading.Condition()
        self._draining = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="looptool-scheduler", daemon=True)

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
            if len(self._held) + len(job.copies) >= self.max_batch + self.max_queue:
                raise QueueFull()
            self._held.update(job.copies)
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
                self._forget(job)
                self.metrics.waiting.set(len(self.waiting))
            self._cond.notify()

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs (a replica's health check)."""
        return self._thread.is_alive()

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
        observer, self.core.observer = self.core.observer, Metrics(self.engine.budgets)
        jobs = [Job([0], int(budget), 2) for budget in budgets]
        if draft_tokens is not None:
            draft = min(budgets)
            jobs += [Job([0], int(k), 2, speculation=Speculation(draft, draft_tokens)) for k in budgets if k > draft]
        if self.capabilities.adaptive:
            deepest = max(budgets)
            jobs.append(Job([0], deepest, 2, auto=AutoRow(min(budgets), deepest)))
        leave, self.core.leave = self.core.leave, lambda job, reason: None
        try:
            for job in jobs:
                self.core.prefill([job])
                self.core.iterate()
                self.core.retire()
        finally:
            self.core.observer, self.core.leave = observer, leave
            self.core.reset()

    @property
    def capabilities(self) -> Capabilities:
        """What the engine runs beside fixed budgets (adaptive depth, verify steps) and why not."""
        return self.engine.capabilities

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self.core.rows)

    @property
    def steps(self) -> int:
        """Steps that advanced every running request (decode steps; drafts and verification)."""
        return self.core.steps

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
                while not self.waiting and not self.core.rows and not self._stop:
                    self._cond.wait()
                if self._stop and not self.waiting and not self.core.rows:
                    return
                admitted, free = [], self.core.free
                while self.waiting and 1 + len(self.waiting[0].copies) <= free:  # a job and its copies: one row each
                    admitted.append(self.waiting.popleft())
                    free -= 1 + len(admitted[-1].copies)
                self.metrics.waiting.set(len(self.waiting))
            try:
                for job in admitted:
                    if job.cancelled:  # cancelled between leaving the queue and its prefill
                        with self._cond:
                            self._forget(job)
                    else:
                        self._admit(job)
                self.core.retire()
                if self.core.rows:
                    self.core.iterate()
                    self.core.retire()
            except Exception as exc:  # a failing step fails the requests it served, not the server
                log.exception("engine step failed")
                for job in self.core.fail(exc):
                    self._release(job)
            self.metrics.running.set(len(self.core.rows))

    def _forget(self, job: Job) -> None:
        """``job`` was cancelled before its prefill (called under the lock): count it, let go of
        its place, and queue its copies at the front, each a job of its own (those cancelled
        too are forgotten likewise)."""
        self.metrics.finished.labels(budget=job.label, reason=job.cancel_reason).inc()
        self._held.discard(job)
        for copy in reversed(job.copies):
            if copy.cancelled:
                self._forget(copy)
            else:
                self.waiting.appendleft(copy)

    def _admit(self, job: Job) -> None:
        """Prefill ``job`` (and its copies); a failure fails that request alone."""
        try:
            self.core.prefill([job])
        except Exception as exc:
            log.exception("prefill failed")
            group = [job, *job.copies]
            self.core.abandon(group)
            for each in group:
                self._release(each)
                each.emit(Event("failed", message=f"{type(exc).__name__}: {exc}"))

    def _leave(self, job: Job, reason: str) -> None:
        """``job`` finished (``reason``) or was cancelled, and its row is free: count it once,
        under the lock :meth:`cancel` takes, and tell its consumer."""
        with self._cond:
            if job.cancelled:
                self.metrics.finished.labels(budget=job.label, reason=job.cancel_reason).inc()
            elif job.consumer_counts:
                job.held_reason = reason
            else:
                self.metrics.finished.labels(budget=job.label, reason=reason).inc()
            self._held.discard(job)
        if not job.cancelled:
            job.emit(Event("finished", reason=reason))
