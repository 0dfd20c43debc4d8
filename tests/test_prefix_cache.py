"""The prefix cache (:mod:`looptool.engine.prefix_cache`) and the scheduler's use of it.

Requests that share a prompt prefix are served one after another by a scheduler with the cache
and by one without it; each gets the same tokens and log-probabilities, at one budget, across
budgets, after eviction, and on onnxruntime. The counters say what was reused: the second
request at a budget reuses every whole block of the shared prefix, and a request at another
budget reuses no block's looped layers but stores no second copy of the layers before the loop.
(The onnxruntime engine's reuse is checked in tests/test_open_engine.py, beside its export.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import looptool
from looptool.engine.prefix_cache import SHARED, CacheGroup, PrefixCache, cache_groups
from looptool.runtime.step_engine import TorchStepEngine
from looptool.serve.scheduler import Job, Scheduler
from looptool.testing import move_off_init, tiny_model

PREFIX = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def _question(i: int) -> list[int]:
    return torch.randint(3, 250, (5 + i,), generator=torch.Generator().manual_seed(100 + i)).tolist()


@pytest.fixture(scope="module")
def model():
    m = looptool.convert(tiny_model("llama", num_layers=4), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    return move_off_init(m)


def serve_one_by_one(engine, asked: list[tuple[list[int], int]], prefix: PrefixCache | None, tokens: int = 6):
    """Each ``(prompt, budget)`` served after the one before it finished; per request its tokens
    and their log-probabilities, and the scheduler."""
    scheduler = Scheduler(engine, max_batch=2, capacity=256, max_queue=4, prefix_cache=prefix)
    scheduler.start()
    out = []
    try:
        for prompt, budget in asked:
            events, done = [], threading.Event()

            def emit(event, events=events, done=done):
                events.append(event)
                if event.kind in ("finished", "failed"):
                    done.set()

            scheduler.submit(Job(prompt, budget, tokens, logprobs=1, ignore_eos=True, emit=emit))
            assert done.wait(60)
            assert events[-1].kind == "finished", events[-1]
            got = [e for e in events if e.kind == "token"]
            out.append(([e.token for e in got], np.array([e.logprob for e in got])))
    finally:
        scheduler.stop(10)
    return out, scheduler


def _hits(scheduler: Scheduler, kind: str = "hit") -> float:
    return scheduler.metrics.registry.get_sample_value("looptool_prefix_cache_tokens_total", {"kind": kind}) or 0.0


def _same(with_cache, without):
    for (tokens, logp), (want, want_logp) in zip(with_cache, without, strict=True):
        assert tokens == want
        np.testing.assert_allclose(logp, want_logp, atol=1e-4)


def test_blocks_are_chained_over_every_token_before_them_and_the_last_token_is_never_reused():
    cache = PrefixCache(block=4)
    a, b = cache.digests(list(range(12))), cache.digests([99, *range(1, 12)])
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # one token changed: every later block changes
    assert cache.digests(list(range(11))) == a[:2]
    group = CacheGroup(0, (0,))
    cache.store(list(range(12)), [group], lambda buffer, start, stop: np.full((1, stop - start, 2), start, np.float32))
    assert len(cache) == 3
    assert len(cache.lookup(list(range(12)), [group])) == 2  # 12 tokens: the block holding the last is computed
    found = cache.lookup(list(range(13)), [group])
    assert [int(block[0][0, 0, 0]) for block in found] == [0, 4, 8]
    assert cache.lookup(list(range(13)), [group, CacheGroup(1, (1,))]) == []  # every group of the budget, or none
    assert (cache.stats.queried, cache.stats.hit) == (38, 20)


def test_least_recently_used_blocks_are_evicted_within_the_byte_bound():
    block = np.zeros((1, 4, 2), np.float32)  # 32 bytes
    cache = PrefixCache(max_bytes=3 * block.nbytes, block=4)
    group = CacheGroup(0, (0,))
    cache.store(list(range(8)), [group], lambda *_: block.copy())
    cache.store(list(range(100, 108)), [group], lambda *_: block.copy())  # 4 blocks: the oldest goes
    assert len(cache) == 3 and cache.nbytes == 3 * block.nbytes and cache.stats.evicted == 1
    assert cache.lookup(list(range(9)), [group]) == []  # its first block was evicted: the chain breaks there


def test_layers_before_the_loop_are_one_group_for_every_budget():
    buffers = [(0, 1), (0, 1), (1, 1), (1, 1), (1, 2), (1, 2), (3, 1), (3, 1)]  # (layer, execution)
    assert cache_groups(buffers, range(8), 1, 2) == (CacheGroup(SHARED, (0, 1)), CacheGroup(2, (2, 3, 4, 5, 6, 7)))
    assert cache_groups(buffers, [0, 1, 2, 3, 6, 7], 1, 0) == (CacheGroup(SHARED, (0, 1)), CacheGroup(0, (2, 3, 6, 7)))


def test_a_shared_prefix_gives_what_no_cache_gives_at_one_budget_and_across_budgets(model):
    engine = TorchStepEngine(model)
    asked = [
        (PREFIX + _question(0), 2),
        (PREFIX + _question(1), 2),  # reuses the prefix's two whole blocks
        (PREFIX + _question(2), 0),  # another budget: its looped layers are computed
        (PREFIX + _question(3), 0),  # reuses budget 0's blocks
        (PREFIX + _question(6), 2),  # 51 tokens, three whole blocks: the two of the prefix are reused
    ]
    without, _ = serve_one_by_one(engine, asked, None)
    cache = PrefixCache()
    with_cache, scheduler = serve_one_by_one(engine, asked, cache)
    _same(with_cache, without)
    assert _hits(scheduler) == 16 * (0 + 2 + 0 + 2 + 2)
    assert _hits(scheduler, "queried") == sum(len(p) for p, _ in asked)
    # the layer before the window is one copy for both budgets: as many shared blocks as digests
    fed = [prompt + tokens[:-1] for (prompt, _), (tokens, _) in zip(asked, with_cache, strict=True)]
    digests = {d for ids in fed for d in cache.digests(ids)}
    kept = cache._blocks.keys()
    assert {d for key, d in kept if key == SHARED} == digests
    assert sum(1 for key, _ in kept if key == SHARED) == len(digests)
    assert {key for key, _ in kept} == {SHARED, 0, 2}


def test_a_follow_up_turn_reuses_the_answer_it_repeats(model):
    engine = TorchStepEngine(model)
    first = PREFIX[:30]
    without, _ = serve_one_by_one(engine, [(first, 2)], None, tokens=20)
    turn = first + without[0][0] + _question(4)  # the history: prompt, answer, a new question
    cache = PrefixCache()
    got, scheduler = serve_one_by_one(engine, [(first, 2), (turn, 2)], cache, tokens=20)
    want, _ = serve_one_by_one(engine, [(first, 2), (turn, 2)], None, tokens=20)
    _same(got, want)
    assert _hits(scheduler) == 16 * ((30 + 20 - 1) // 16)  # the answer's fed tokens were kept at the end


def test_after_eviction_requests_still_get_what_no_cache_gives(model):
    engine = TorchStepEngine(model)
    block_bytes = sum(b.nbytes for b in engine.allocate(1, 16).buffers)  # one block of every buffer
    asked = [(PREFIX + _question(i % 2), 2) for i in range(4)] + [(_question(5) * 4, 2), (PREFIX + _question(0), 2)]
    without, _ = serve_one_by_one(engine, asked, None)
    cache = PrefixCache(max_bytes=3 * block_bytes)
    with_cache, scheduler = serve_one_by_one(engine, asked, cache)
    _same(with_cache, without)
    assert cache.stats.evicted > 0 and cache.nbytes <= 3 * block_bytes
    assert 0 < _hits(scheduler) < 16 * 2 * 5
