"""The depth-aware routing policy (``looptool.serve.routing``) on its own, with a hand-driven
clock: which replica a request of each budget goes to, when it waits, when a replica drains
for a waiting budget, and what the ledger shows. The Ray side is ``tests/ray``."""

from __future__ import annotations

import pytest

from looptool.core.errors import LooptoolError
from looptool.engine.prefix_cache import BLOCK, PrefixCache, block_digests
from looptool.serve.routing import DepthRouting, RouteKey


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(max_batch=2, **kw) -> tuple[DepthRouting, Clock]:
    clock = Clock()
    return DepthRouting(max_batch, clock=clock, **kw), clock


def route(p: DepthRouting, request, label: str, replicas=("a", "b"), since=None, digests=()):
    """Choose and, when chosen, record it as routed to the first ranked replica."""
    key = RouteKey(label, int(label), tuple(digests))
    decision = p.choose(request, key, list(replicas), p.clock() if since is None else since)
    if decision is not None:
        p.routed(request, decision.ranked[0], key, decision.reason)
    return decision


def test_same_budget_first_then_idle_then_wait():
    p, clock = policy(ride=False, hold_s=0.5, max_hold_s=10.0)
    assert route(p, 1, "0").reason == "idle"
    first = p.requests[1][0]
    d = route(p, 2, "0")
    assert (d.reason, d.ranked) == ("budget", (first,))  # joins the batch of its budget
    d = route(p, 3, "3")
    assert d.reason == "idle" and d.ranked[0] != first  # the other replica, idle
    assert route(p, 4, "0") is None  # its budget's batch is full and nothing is idle: it waits
    assert route(p, 5, "6") is None
    assert p.mix() == {first: {"0": 2}, d.ranked[0]: {"3": 1}}
    p.completed(1)
    assert route(p, 4, "0").ranked == (first,)  # room again in the budget-0 batch
    assert sum(n for (_, _, reason), n in p.decisions.items() if reason == "budget") == 2


def test_a_waiting_budget_drains_the_least_loaded_replica_and_takes_it():
    p, clock = policy(max_batch=4, hold_s=0.5, max_hold_s=10.0)  # budget 6 is the deepest: it rides nowhere
    for r in range(3):
        route(p, ("x", r), "0")
    route(p, ("y", 0), "3")
    a, b = p.requests[("x", 0)][0], p.requests[("y", 0)][0]
    since = clock.now
    assert route(p, "late", "6", since=since) is None
    clock.now += 0.6  # past hold_s: the replica with the fewest rows (b, one row) drains
    assert route(p, "late", "6", since=since) is None
    assert p.replicas[b].draining and not p.replicas[a].draining
    assert route(p, ("y", 1), "3") is None  # the draining replica takes no more of its own budget
    assert route(p, ("x", 3), "0").ranked == (a,)  # the other replica still does
    p.completed(("y", 0))  # b is idle: no longer draining, and the waiting budget takes it first
    assert not p.replicas[b].draining
    assert route(p, ("y", 1), "3", since=clock.now) is None  # a newer request of another budget waits
    d = route(p, "late", "6", since=since)
    assert (d.reason, d.ranked) == ("idle", (b,))


def test_after_max_hold_a_request_takes_any_replica_with_room():
    p, clock = policy(max_batch=4, hold_s=0.5, max_hold_s=2.0, ride=False)
    route(p, 1, "0")
    route(p, 2, "3")
    since = clock.now
    assert route(p, 3, "6", since=since) is None  # room, but not for its budget: its wait starts
    clock.now += 2.5
    d = route(p, 3, "6", since=since)
    assert d.reason == "mixed" and set(d.ranked) == {"a", "b"}
    assert route(p, 4, "9", since=clock.now) is None  # a fresh request still waits


def test_waiting_for_capacity_does_not_count_toward_the_hold():
    p, clock = policy(max_batch=2, hold_s=0.5, max_hold_s=1.0, ride=False)
    for request, label in ((1, "0"), (2, "0"), (3, "3"), (4, "3")):
        route(p, request, label)
    since = clock.now
    assert route(p, 5, "6", since=since) is None  # every batch full: it waits for a slot
    clock.now += 5.0
    assert route(p, 5, "6", since=since) is None  # still full: no hold has started, so no mixing either
    p.completed(1)
    assert route(p, 5, "6", since=since) is None  # a slot, at another budget: now its hold starts
    route(p, 6, "0")  # the slot is taken again before the hold ends
    clock.now += 1.0
    assert route(p, 5, "6", since=since) is None  # past max_hold_s, but no room anywhere: it still waits
    p.completed(2)
    assert route(p, 5, "6", since=since).reason == "mixed"


def test_a_shallower_request_rides_the_shallowest_deeper_batch_rather_than_wait():
    p, clock = policy(max_batch=4, hold_s=0.5, max_hold_s=10.0)
    route(p, 1, "12")
    route(p, 2, "6")
    deep, middle = p.requests[1][0], p.requests[2][0]
    d = route(p, 3, "3")
    assert (d.reason, d.ranked) == ("ride", (middle,))  # budget 6's batch: the cheapest that costs it nothing more
    assert route(p, 4, "9").ranked == (deep,)  # deeper than 6: only budget 12's batch takes it at no cost
    assert route(p, 5, "15") is None  # deeper than every batch: it waits
    assert p.mix() == {deep: {"12": 1, "9": 1}, middle: {"6": 1, "3": 1}}


def test_prefix_blocks_break_ties_toward_the_replica_that_holds_them():
    p, clock = policy(max_batch=8)
    shared = list(range(3 * BLOCK))
    digests = block_digests(shared + [7, 7])
    assert digests == PrefixCache(1 << 20).digests(shared + [7, 7])  # the prefix cache's own names
    route(p, 1, "0", digests=block_digests(list(range(100, 100 + 2 * BLOCK))))
    route(p, 2, "0", replicas=("b",), digests=digests)
    p.completed(1)
    p.completed(2)
    d = route(p, 3, "0", digests=block_digests(shared + [9]))
    assert d.ranked[0] == "b"  # both idle; b was sent the prompt's three blocks


def test_a_replica_gone_leaves_the_ledger():
    p, _ = policy()
    route(p, 1, "0")
    gone = p.requests[1][0]
    p.forget(gone)
    assert gone not in p.mix() and 1 not in p.requests
    p.completed(1)  # a completion of a forgotten request is ignored


def test_settings_out_of_range_are_one_sentence():
    with pytest.raises(LooptoolError, match="max_batch"):
        DepthRouting(0)
    with pytest.raises(LooptoolError, match="hold_s"):
        DepthRouting(2, hold_s=3.0, max_hold_s=1.0)


def test_by_default_a_request_mixes_at_once_where_it_deepens_the_fewest_rows():
    p, _ = policy(max_batch=4)  # the defaults: no slot left empty while a request waits
    for r in range(3):
        route(p, ("a", r), "0")
    route(p, "b", "3")
    shallow, few = p.requests[("a", 0)][0], p.requests["b"][0]
    d = route(p, "deep", "12")  # no batch of 12, none idle, none deep enough to ride
    assert d.reason == "mixed" and d.ranked == (few, shallow)  # 9 extra layers for one row, not 12 for three
