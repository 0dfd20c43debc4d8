"""The depth-aware request router: :class:`~looptool.serve.routing.DepthRouting` behind Ray
Serve's request-router API (``RequestRouterConfig(request_router_class=...)``), for the engine
replicas' deployment.

Ray builds one router per deployment handle, in the process holding the handle (the ingress);
it asks :meth:`DepthAwareRouter.choose_replicas` for every request and tells
:meth:`~DepthAwareRouter.on_request_routed` and :meth:`~DepthAwareRouter.on_request_completed`
where each went and when it left, which is the policy's ledger. The request's budget label and
prompt blocks come from its :class:`~looptool.serve.ray.jobs.JobSpec`, the first argument of
every call to the replicas' ``run``. Each router registers its policy in
:data:`looptool.serve.routing.POLICIES` so the ingress's ``/metrics`` can show its decisions and
each replica's budget mix (there, not here: Ray ships this module's classes by value, with copies
of its globals).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from looptool.serve import routing
from looptool.serve.ray.jobs import JobSpec
from looptool.serve.routing import HOLD_S, MAX_HOLD_S, DepthRouting

log = logging.getLogger(__name__)
WAKE_S = 0.05  # seconds a held request sleeps at most between looks (a wake-up comes sooner when a row leaves)


class DepthAwareRouter(RequestRouter):
    """Routes each request to the replica whose running batch shares its budget, else an idle
    one, else the batch it deepens least, holding it while every batch is full (or, with
    ``hold_s``, until a batch of its budget has room); see :mod:`looptool.serve.routing`. A
    held request sleeps until a row leaves. Requests that are not a replica's ``run`` call (no
    :class:`JobSpec`) go to the least-loaded replica."""

    def initialize_state(
        self, max_batch: int = 8, hold_s: float = HOLD_S, max_hold_s: float = MAX_HOLD_S, ride: bool = True, **_
    ):
        self.policy = DepthRouting(max_batch, hold_s=hold_s, max_hold_s=max_hold_s, ride=ride)
        self.pending: dict[str, tuple] = {}  # internal request id -> (key, reason), chosen and not yet routed
        self.changed = asyncio.Event()  # set (and replaced) when a row leaves or the replicas change
        routing.POLICIES.append(self.policy)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        spec = _spec(pending_request)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        if spec is None:
            return [self._least_loaded(candidate_replicas)]
        request = pending_request.metadata.internal_request_id
        since = self.policy.clock() - max(0.0, time.time() - pending_request.created_at)
        try:
            decision = self.policy.choose(request, spec.key, list(by_id), since)
            if decision is None:  # sleep until a row leaves (or the hold may end), then look again
                changed = self.changed
                try:
                    await asyncio.wait_for(changed.wait(), timeout=max(self.policy.hold_s, WAKE_S))
                except asyncio.TimeoutError:
                    pass
                decision = self.policy.choose(request, spec.key, list(by_id), since)
        except Exception:  # a fault of the policy must not strand the request: Ray's plain choice
            log.exception("depth-aware routing failed; this request goes to the least-loaded replica")
            return [self._least_loaded(candidate_replicas)]
        if decision is None:
            pending_request.routing_context.should_backoff = True  # Ray's (short) backoff, then here again
            return []
        self.pending[request] = (spec.key, decision.reason)
        return [[by_id[rid]] for rid in decision.ranked]

    def _least_loaded(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """``replicas``, the fewest rows routed first."""
        load = self.policy.mix()
        return sorted(replicas, key=lambda r: sum(load.get(r.replica_id, {}).values()))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key, reason = self.pending.pop(pending_request.metadata.internal_request_id, (None, None))
        if key is not None:
            self.policy.routed(pending_request.metadata.internal_request_id, replica_id, key, reason)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(internal_request_id)
        self._wake()

    def _wake(self) -> None:
        """Wake every held request: a slot may fit one of them now."""
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def max_num_routing_tasks(self) -> int:
        """One routing task per pending request (up to Ray's cap), so a request held for its budget
        does not keep another that fits a free slot from being routed."""
        return self.max_num_routing_tasks_cap

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "policy"):
            self.policy.forget(replica_id)
            self._wake()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "policy"):  # replicas may arrive before initialize_state
            return
        present = {replica.replica_id for replica in replicas}
        for gone in [rid for rid in self.policy.replicas if rid not in present]:
            self.policy.forget(gone)
        self._wake()


def _spec(pending_request: PendingRequest | None) -> JobSpec | None:
    """The job a request carries, if it is a replica's ``run`` call."""
    if pending_request is None or not pending_request.args:
        return None
    spec = pending_request.args[0]
    return spec if isinstance(spec, JobSpec) else None
