"""The KV memory bound of ``looptool serve`` (``--kv-memory``): the slot cache holds only as many
requests as fit; more requests than that arrive at once, wait, and all finish with the answers
each gets alone; a bound too small for one request is one sentence."""

from __future__ import annotations

import threading

import pytest
import torch

import looptool
from looptool.runtime.step_engine import TorchStepEngine
from looptool.serve.scheduler import Job, Scheduler, slots_within
from looptool.testing import move_off_init, tiny_model


@pytest.fixture(scope="module")
def model():
    m = looptool.convert(tiny_model("llama", num_layers=4), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    return move_off_init(m)


def test_more_requests_than_fit_wait_and_all_finish_with_their_answers(model):
    engine = TorchStepEngine(model)
    capacity = 48
    per_slot = engine.allocate(1, 1).nbytes * (capacity + 33)
    scheduler = Scheduler(engine, max_batch=8, capacity=capacity, max_queue=8, kv_memory=2 * per_slot + per_slot // 2)
    assert scheduler.max_batch == 2 == slots_within(engine, 2 * per_slot + 1, capacity)
    prompts = [torch.randint(3, 250, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    budgets = [0, 2, 2, 0, 2, 0]
    answers, done, running = [[] for _ in prompts], threading.Semaphore(0), []

    def emit(i):
        def put(event):
            if event.kind == "token":
                answers[i].append(event.token)
                running.append(scheduler.running)
            elif event.kind == "finished":
                done.release()

        return put

    for i, (prompt, k) in enumerate(zip(prompts, budgets)):  # all at once, before the scheduler runs
        scheduler.submit(Job(prompt, k, 6, ignore_eos=True, emit=emit(i)))
    scheduler.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        scheduler.stop(10)
    assert max(running) == 2 and scheduler.core.cache.slots == 2
    for i, (prompt, k) in enumerate(zip(prompts, budgets)):
        alone = model.generate(torch.tensor([prompt]), budget=k, max_new_tokens=6, eos_token_id=None)
        assert answers[i] == alone[0, len(prompt) :].tolist(), i


def test_a_bound_too_small_for_one_request_is_one_sentence(model):
    engine = TorchStepEngine(model)
    with pytest.raises(
        looptool.LooptoolError,
        match=r"a KV memory of 0.1 MiB does not hold one request of 1024 tokens \(\d\.\d MiB\); raise kv_memory",
    ) as err:
        Scheduler(engine, max_batch=8, capacity=1024, max_queue=8, kv_memory=1 << 16)
    assert err.value.parameter == "kv_memory"
