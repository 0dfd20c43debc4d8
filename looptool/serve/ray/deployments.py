"""The two Ray Serve deployments of a looptool application.

:class:`EngineReplica` is one engine core: the served model and its scheduler thread, as one
``looptool serve`` process holds them (:func:`~looptool.serve.server.make_scheduler`). Its
``run`` method takes a :class:`~looptool.serve.ray.jobs.JobSpec` and streams the job's
:class:`~looptool.engine.core.Event` s back (its :class:`~looptool.serve.ray.jobs.ReplicaStats`
just before the last one); a caller that goes away cancels the job and frees its slot.

:class:`OpenAIIngress` is the HTTP side: the same FastAPI app as the single server
(:func:`looptool.serve.app.create_app`), over a :class:`RemoteScheduler` that sends each job to
a replica through a deployment handle (whose request router picks the replica) and relays its
events. Ray ships these classes by value (with copies of this module's globals), so state shared
with the routers lives in :mod:`looptool.serve.routing`, reached as a module. A job whose replica died before it sent an event is sent again, to another replica
(:data:`RETRIES` times); one that had started ends with a ``failed`` event saying so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from looptool.engine.core import Event, Job
from looptool.engine.interface import Capabilities
from looptool.serve import routing
from looptool.serve.metrics import BATCH_KINDS, Metrics
from looptool.serve.models import ServedFacts, open_model
from looptool.serve.ray.jobs import JobSpec, ReplicaStats
from looptool.serve.scheduler import Draining, QueueFull
from looptool.serve.server import ResolvedOptions, check_resolved, make_scheduler
from looptool.serve.structured import Grammars, GrammarSpec

log = logging.getLogger(__name__)

RETRIES = 2  # times a job whose replica died before its first event is sent to another replica
ENDED = ("finished", "failed")  # the event kinds that end a job


@dataclass(frozen=True)
class ReplicaFacts:
    """What the ingress needs of the replicas' model: the served facts, the engine's capabilities
    and the slot capacity."""

    served: ServedFacts
    capabilities: Capabilities
    capacity: int


@serve.deployment
class EngineReplica:
    """One engine core serving ``model_dir`` (``open_kwargs``: :func:`~looptool.serve.models.open_model`'s
    keywords) with ``options`` resolved for it by the driver."""

    def __init__(self, model_dir: str, options: ResolvedOptions, open_kwargs: dict):
        self.served = open_model(model_dir, **open_kwargs)
        check_resolved(self.served, options)
        self.scheduler = make_scheduler(self.served, options)
        self.scheduler.start()
        self.id = serve.get_replica_context().replica_id.unique_id
        self.grammars: Grammars | None = None  # structured outputs' grammars, built on first use

    def facts(self) -> ReplicaFacts:
        """The model's facts for the ingress."""
        return ReplicaFacts(self.served.facts(), self.scheduler.capabilities, self.scheduler.capacity)

    async def run(self, spec: JobSpec):
        """Run ``spec``'s job here and stream its events (its :class:`ReplicaStats` before the
        last one). Cancelling the stream cancels the job."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        job = spec.job()
        if spec.grammar is not None:
            job.constraint = await asyncio.to_thread(self._grammar_row, spec.grammar)
        job.emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
        try:
            self.scheduler.submit(job)
        except (QueueFull, Draining) as exc:
            why = "is shutting down" if isinstance(exc, Draining) else "is at capacity"
            yield Event("failed", message=f"the replica {why}; retry later.")
            return
        try:
            while True:
                event = await queue.get()
                if event.kind in ENDED:
                    yield ReplicaStats(self.id, self.scheduler.metrics.step_counts())
                    yield event
                    return
                yield event
        finally:
            self.scheduler.cancel(job)  # a caller that went away frees the slot; no-op once finished

    def _grammar_row(self, spec: GrammarSpec):
        """A fresh row of ``spec``'s grammar, compiled here once per grammar (:class:`Grammars`)."""
        if self.grammars is None:
            self.grammars = Grammars(self.served.tokenizer, self.served.vocab_size, self.served.eos)
        return self.grammars.row(self.grammars.compile(spec), spec)

    def check_health(self) -> None:
        """Ray's health check: the scheduler thread must be alive."""
        if not self.scheduler.alive:
            raise RuntimeError("the scheduler thread of this replica has stopped")

    def __del__(self):
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()  # finishes the admitted requests (Ray waits graceful_shutdown_timeout_s)


class RemoteScheduler:
    """The scheduler interface the HTTP app drives (:class:`looptool.serve.scheduler.Scheduler`'s
    ``submit``, ``cancel``, ``draining``, ``running``, ``capacity``, ``capabilities``,
    ``metrics``), over the replicas behind ``handle``: each job runs as a task relaying its
    events from a replica. ``metrics`` are the ingress's own (what clients saw, timed here),
    with each replica's steps by batch kind and the routers' decisions added to ``/metrics``."""

    def __init__(self, handle, facts: ReplicaFacts, *, prefix_blocks: bool):
        self.handle = handle.options(stream=True, method_name="run")
        self.capacity, self.capabilities = facts.capacity, facts.capabilities
        self.metrics = Metrics(facts.served.budgets)
        self.metrics.registry.register(_ClusterCollector(self))
        self.prefix_blocks = prefix_blocks
        self.tasks: dict[Job, asyncio.Task] = {}
        self.counted: weakref.WeakSet[Job] = weakref.WeakSet()  # jobs whose finish was counted (not kept alive)
        self.replica_steps: dict[str, dict[str, int]] = {}  # replica id -> steps by batch kind, as last reported
        self._draining = False

    def start(self) -> None:
        """Nothing to start: the replicas run their own schedulers."""

    def stop(self) -> None:
        """Cancel what still runs (the app is shutting down)."""
        for task in list(self.tasks.values()):
            task.cancel()

    def drain(self) -> None:
        """Admit no new request; the running ones finish."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def running(self) -> int:
        """Requests under way through this ingress."""
        return len(self.tasks)

    held = running

    def submit(self, job: Job) -> None:
        """Send ``job`` to a replica; its events reach ``job.emit``. :class:`Draining` once
        :meth:`drain` was called."""
        if self._draining:
            raise Draining()
        for each in (job, *job.copies):  # a request's choices: one job each (replicas prefill them apart)
            self.tasks[each] = asyncio.get_running_loop().create_task(self._relay(each))
        self.metrics.running.set(len(self.tasks))

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The consumer is done with ``job`` (its finish ``reason``, or ``cancelled``): counted
        once; a relay still running is cancelled, which cancels the job on its replica."""
        if job not in self.counted:
            self.counted.add(job)
            self.metrics.finished.labels(budget=job.label, reason=reason).inc()
        task = self.tasks.pop(job, None)
        if task is not None:
            task.cancel()
        self.metrics.running.set(len(self.tasks))

    async def _relay(self, job: Job) -> None:
        spec = JobSpec.of(job, self.prefix_blocks)
        sent, last = 0, job.arrived
        for attempt in range(RETRIES + 1):
            stream = self.handle.remote(spec)
            try:
                async for item in stream:
                    if isinstance(item, ReplicaStats):
                        self.replica_steps[item.replica] = item.steps
                        continue
                    if item.kind == "token":
                        now = time.perf_counter()
                        if sent == 0:
                            self.metrics.prefilled(job, len(job.prompt), -1, 0)
                        self.metrics.emitted(job, item.depth, sent == 0, max(0.0, now - last))
                        if item.forced:
                            self.metrics.forced(job, 1)
                        sent, last = sent + 1, now
                    elif item.kind in ENDED:
                        self.metrics.retired(job, time.perf_counter() - job.arrived)
                    job.emit(item)
                return
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except BackPressureError:
                self.metrics.rejected.inc()
                job.emit(Event("failed", message="every replica is at capacity (queues full); retry later."))
                return
            except (RayActorError, ActorUnavailableError) as exc:
                if sent == 0 and attempt < RETRIES:
                    log.warning("a replica died before answering; sending the request to another (%s)", exc)
                    continue
                what = f"after {sent} token{'s' if sent != 1 else ''}" if sent else "before answering"
                job.emit(Event("failed", message=f"the replica serving this request died {what}."))
                return
            except Exception as exc:  # a failure of this request alone
                job.emit(Event("failed", message=f"{type(exc).__name__}: {exc}"))
                return


class _ClusterCollector:
    """``/metrics`` of the whole application: each replica's steps by batch kind (as its last
    job reported them) and, from this process's depth-aware routers, the requests routed by
    replica, budget and reason and the rows each replica runs now, by budget."""

    def __init__(self, remote: RemoteScheduler):
        self.remote = remote

    def collect(self):
        steps = CounterMetricFamily(
            "looptool_replica_decode_steps",
            "Steps of each replica by batch kind (one-budget or mixed), as its last finished job reported them.",
            labels=["replica", "batch"],
        )
        for replica, counts in sorted(self.remote.replica_steps.items()):
            for kind in BATCH_KINDS:
                steps.add_metric([replica, kind], counts.get(kind, 0))
        yield steps
        routed = CounterMetricFamily(
            "looptool_routed_requests",
            "Requests the depth-aware router sent, by replica, budget and reason (budget: a batch of that budget; "
            "idle: an idle replica; mixed: waited past max_hold_s).",
            labels=["replica", "budget", "reason"],
        )
        rows = GaugeMetricFamily(
            "looptool_replica_rows",
            "Requests the depth-aware router sent to each replica that have not completed, by budget.",
            labels=["replica", "budget"],
        )
        for policy in routing.POLICIES:
            for (replica, label, reason), n in sorted(policy.decisions.items(), key=str):
                routed.add_metric([_name(replica), label, reason], n)
            for replica, mix in policy.mix().items():
                for label, n in sorted(mix.items()):
                    rows.add_metric([_name(replica), label], n)
        yield routed
        yield rows


def _name(replica) -> str:
    """A replica id as a metrics label."""
    return getattr(replica, "unique_id", str(replica))


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The OpenAI API over the engine replicas behind ``engine`` (a deployment handle), with
    ``options`` resolved for the model by the driver."""

    async def __init__(self, engine, options: ResolvedOptions):
        self.options = options
        self.facts: ReplicaFacts = await engine.facts.remote()
        self.remote = RemoteScheduler(engine, self.facts, prefix_blocks=options.prefix_cache_bytes is not None)

    def __serve_build_asgi_app__(self):
        from looptool.serve.app import create_app

        return create_app(
            self.facts.served,
            self.remote,
            self.options.resolver,
            api_key=self.options.api_key,
            draft_tokens=self.options.draft_tokens,
            tool_call_parser=self.options.tool_call_parser,
        )

    def drain(self) -> int:
        """Admit no new request (503); returns the requests still under way."""
        self.remote.drain()
        return self.remote.running

    def under_way(self) -> int:
        """Requests still under way through this ingress."""
        return self.remote.running


def model_path(model_dir: str | os.PathLike) -> str:
    """``model_dir`` as an absolute path, as every node of the cluster must find it."""
    return str(Path(model_dir).resolve())
