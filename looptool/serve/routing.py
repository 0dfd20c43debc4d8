"""Depth-aware routing across replicas: which replica takes a request, so that a batch's steps
cost as little depth as they can under mixed load.

A decode step of a batch costs its deepest row: a batch whose rows share a budget runs at that
budget's cost, a mixed one at the deepest budget's. A prefix cache helps only the replica that
holds the prefix. :class:`DepthRouting` keeps a ledger of the rows it routed to each replica
(their budget labels, from the moment it chooses a replica until they complete: Ray routes
requests concurrently, so a choice counts at once) and of the prompt blocks each replica has seen
(:func:`~looptool.engine.prefix_cache.block_digests`, the prefix cache's own block names), and
chooses, for a request of budget label ``b``:

1. ``budget``: a replica with room in its running batch (fewer than ``max_batch`` rows routed)
   whose rows all run ``b``, unless it is draining (below);
2. ``idle``: a replica with no rows;
3. ``ride`` (with ``ride=True``, the default): a replica with room whose batch's deepest row is
   at least as deep as the request (the step costs its deepest row, so the request rides at no
   extra cost per step), the shallowest such batch first;
4. ``mixed``: where it deepens the step least (the replica with room minimising its extra depth
   times the rows that pay it).

Every batch full: the request waits at the router (not in a replica's queue) for a row to
leave. With ``max_hold_s`` > 0 a request waits rather than take rule 4 (held by the router, not
queued behind other budgets at a replica): once it has waited ``hold_s`` while some replica had
room (time spent waiting because every batch was full does not count), one busy replica (the
one with the fewest rows) drains: it takes no new rows until it is idle, and then the waiting
budget takes it; once it has waited ``max_hold_s`` so, rule 4. The defaults (0 and 0) never
leave a slot empty while a request waits: on a CPU, measured, an empty slot cost more
throughput than one-budget batches saved.

Among equals, the replica holding the longest run of the prompt's blocks wins, then the least
loaded.

This module knows nothing of Ray: :mod:`looptool.serve.ray.router` puts it behind Ray Serve's
request-router API. It is not thread-safe; Ray calls a router on one event loop.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from looptool.core.errors import LooptoolError

REASONS = ("budget", "idle", "ride", "mixed")  # why a request went where it went (the routing metrics' label)
HOLD_S = 0.0  # seconds a request waits for a replica of its budget before one replica drains for it
MAX_HOLD_S = 0.0  # seconds after which a request takes any replica with room (a mixed batch)
# The defaults never leave a slot empty while a request waits (see the module).
RESERVE_S = 10.0  # seconds a chosen replica keeps a row for a request Ray has not reported sent
PREFIX_MEMORY = 4096  # prompt blocks remembered per replica (least recently routed forgotten first)


@dataclass(frozen=True)
class RouteKey:
    """What routing reads of a request: its budget ``label`` (``"3"``, or ``"auto"`` for adaptive
    depth), the ``depth`` a step of it may cost (its budget, or an adaptive row's ``max_budget``)
    and the chained digests of its prompt's whole blocks (empty without a prefix cache)."""

    label: str
    depth: int = 0
    digests: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Decision:
    """Where a request goes: ``ranked`` replicas (the first preferred; Ray tries the next when one
    refuses) and why (one of :data:`REASONS`)."""

    ranked: tuple[Hashable, ...]
    reason: str


@dataclass
class _Replica:
    rows: Counter = field(default_factory=Counter)  # budget label -> rows routed and not completed
    blocks: OrderedDict = field(default_factory=OrderedDict)  # prompt block digests routed here, LRU
    draining: bool = False

    @property
    def load(self) -> int:
        return sum(self.rows.values())


class DepthRouting:
    """The routing policy and its ledger, for replicas of ``max_batch`` rows (see the module;
    ``ride``: whether a request may join a deeper batch rather than wait)."""

    def __init__(
        self,
        max_batch: int,
        *,
        hold_s: float = HOLD_S,
        max_hold_s: float = MAX_HOLD_S,
        ride: bool = True,
        prefix_memory: int = PREFIX_MEMORY,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_batch < 1 or hold_s < 0 or max_hold_s < hold_s or prefix_memory < 0:
            raise LooptoolError(
                f"depth-aware routing needs max_batch >= 1 and 0 <= hold_s <= max_hold_s, got max_batch {max_batch}, "
                f"hold_s {hold_s}, max_hold_s {max_hold_s}.",
                parameter="max_batch" if max_batch < 1 else "hold_s",
            )
        self.max_batch, self.hold_s, self.max_hold_s, self.ride = max_batch, hold_s, max_hold_s, ride
        self.depth_of: dict[str, int] = {}  # budget label -> the depth its steps cost
        self.prefix_memory, self.clock = prefix_memory, clock
        self.replicas: dict[Hashable, _Replica] = {}
        # request id -> (replica, label, confirmed, when): a row counts from the moment it is chosen
        # (reserved), and is confirmed when Ray reports where it went
        self.requests: dict[Hashable, tuple[Hashable, str, bool, float]] = {}
        self.decisions: Counter = Counter()  # (replica, label, reason) -> requests routed
        # request held back -> (since, label, held, seen): held is when it first waited while some replica
        # had room (None while every batch is full), which hold_s and max_hold_s count from; seen is
        # when it last asked (a request Ray cancelled stops asking, and is forgotten after RESERVE_S)
        self.waiting: dict[Hashable, tuple[float, str, float | None, float]] = {}

    # ------------------------------------------------------------------ choosing
    def choose(self, request: Hashable, key: RouteKey, replicas: Sequence[Hashable], since: float) -> Decision | None:
        """Where ``request`` of ``key``, waiting since ``since`` (:attr:`clock` time), goes among
        ``replicas``, or None while it waits. An idle replica goes to the request of another
        budget that has waited longest, so a drained replica serves the budget it drained for."""
        self._unreserve(request)  # chosen again: Ray's earlier choice was refused
        self._expire()
        for rid in replicas:
            self.replicas.setdefault(rid, _Replica())
        state = {rid: self.replicas[rid] for rid in replicas}
        room = [rid for rid in replicas if state[rid].load < self.max_batch]
        now = self.clock()
        self.waiting = {r: w for r, w in self.waiting.items() if now - w[3] < RESERVE_S}  # gone if not seen for long

        def ranked(pool: list, reason: str, cost=lambda rid: 0) -> Decision:
            order = sorted(pool, key=lambda rid: (cost(rid), -self._shared(state[rid], key.digests), state[rid].load))
            self.waiting.pop(request, None)
            self._add(request, order[0], key.label, confirmed=False)  # counted at once: routing runs concurrently
            return Decision(tuple(order), reason)

        self.depth_of[key.label] = key.depth
        same = [rid for rid in room if set(state[rid].rows) == {key.label} and not state[rid].draining]
        if same:
            return ranked(same, "budget")
        idle = [rid for rid in room if state[rid].load == 0]
        first = min(self.waiting.items(), key=lambda item: item[1][0], default=(None, (now, key.label)))
        if idle and (first[0] == request or first[1][1] == key.label or first[1][0] >= since):
            return ranked(idle, "idle")
        deepest = {rid: max((self.depth_of.get(label, 0) for label in state[rid].rows), default=-1) for rid in room}
        rides = [rid for rid in room if state[rid].load and not state[rid].draining and deepest[rid] >= key.depth]
        if self.ride and rides:
            shallowest = min(deepest[rid] for rid in rides)
            return ranked([rid for rid in rides if deepest[rid] == shallowest], "ride")
        held = self.waiting.get(request, (since, key.label, None, now))[2]
        if room and held is None:
            held = now  # it waits for its budget, not for capacity, from now on
        self.waiting[request] = (since, key.label, held, now)
        if not room or held is None or now - held < self.hold_s:
            return None
        if now - held >= self.max_hold_s:  # where it deepens the fewest rows' steps the least
            return ranked(room, "mixed", lambda rid: max(0, key.depth - deepest[rid]) * state[rid].load)
        busy = [rid for rid in replicas if state[rid].load > 0]
        if busy and not any(state[rid].draining for rid in busy):
            state[min(busy, key=lambda rid: state[rid].load)].draining = True
        return None

    @staticmethod
    def _shared(replica: _Replica, digests: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks ``replica`` was routed."""
        n = 0
        for digest in digests:
            if digest not in replica.blocks:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ the ledger
    def routed(self, request: Hashable, replica: Hashable, key: RouteKey, reason: str) -> None:
        """``request`` of ``key`` went to ``replica`` (for ``reason``): its reservation is
        confirmed there (moved, if Ray sent it to another replica than the first chosen)."""
        self.waiting.pop(request, None)
        entry = self.requests.get(request)
        if entry is None or entry[0] != replica:
            self._unreserve(request, confirmed_too=True)
            self._add(request, replica, key.label, confirmed=True)
        else:
            self.requests[request] = (replica, key.label, True, entry[3])
        self.decisions[(replica, key.label, reason)] += 1
        state = self.replicas[replica]
        for digest in key.digests:
            state.blocks[digest] = None
            state.blocks.move_to_end(digest)
        while len(state.blocks) > self.prefix_memory:
            state.blocks.popitem(last=False)

    def _add(self, request: Hashable, replica: Hashable, label: str, *, confirmed: bool) -> None:
        self.replicas.setdefault(replica, _Replica()).rows[label] += 1
        self.requests[request] = (replica, label, confirmed, self.clock())

    def _unreserve(self, request: Hashable, confirmed_too: bool = False) -> None:
        """Take back ``request``'s row (unless it was confirmed, or ``confirmed_too``)."""
        entry = self.requests.get(request)
        if entry is not None and (confirmed_too or not entry[2]):
            self.completed(request)

    def _expire(self) -> None:
        """Forget reservations never confirmed within :data:`RESERVE_S` (their request was
        cancelled before Ray sent it)."""
        now = self.clock()
        for request in [r for r, e in self.requests.items() if not e[2] and now - e[3] > RESERVE_S]:
            self.completed(request)

    def completed(self, request: Hashable) -> None:
        """``request`` left its replica (finished, failed or cancelled)."""
        replica, label, *_ = self.requests.pop(request, (None, None))
        state = self.replicas.get(replica)
        if state is None:
            return
        state.rows[label] -= 1
        if state.rows[label] <= 0:
            del state.rows[label]
        if not state.rows:
            state.draining = False

    def forget(self, replica: Hashable) -> None:
        """``replica`` is gone: its rows and blocks with it."""
        self.replicas.pop(replica, None)
        for request in [r for r, entry in self.requests.items() if entry[0] == replica]:
            del self.requests[request]

    def mix(self) -> dict[Hashable, dict[str, int]]:
        """Rows routed and not completed, per replica and budget label."""
        return {rid: dict(state.rows) for rid, state in self.replicas.items()}


POLICIES: list[DepthRouting] = []  # the policies of this process's routers (a Ray ingress's /metrics reads them)
