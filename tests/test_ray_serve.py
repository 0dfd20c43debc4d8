"""``looptool.serve.ray`` on a real local Ray cluster (two CPUs, its own temporary directory):
a tiny fixed-prefix model (new parameters non-zero) served from two engine replicas behind the
OpenAI ingress, driven by the official ``openai`` client and httpx on 127.0.0.1.

Answers equal each request generated alone at its budget, greedy, through completions and
chat, streamed and not, alone and in a mixed-budget load (``/metrics`` shows the router's
decisions); set to wait rather than mix or ride, the depth-aware router keeps batches
one-budget; a replica whose process is killed mid-load is
replaced, and every request is answered exactly or ends with an error that says its replica
died; autoscaling adds a replica when more than a full batch waits (Ray's default router). Marked ``ray``: CI runs
them as a step of their own (``pytest -m ray``); they need the ``ray`` extra.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from serve_process import free_port, tiny_looped

import looptool
from looptool.runtime.generation import generate

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra (pip install 'looptool[ray]')")
openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install 'looptool[test]')")
from ray import serve  # noqa: E402

from looptool.serve import ServeOptions  # noqa: E402
from looptool.serve import ray as looptool_ray  # noqa: E402

NAME = "tiny"
BUDGETS = (0, 1, 2)
MAX_BATCH = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_looped(tmp_path_factory.mktemp("ray") / NAME, looptool.PrefixLoop(window=(1, 3), budgets=BUDGETS))


@pytest.fixture(scope="module")
def model(model_dir):
    return looptool.load(model_dir)


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, logging_level="warning", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def base(cluster, model_dir):
    application = looptool_ray.app(
        model_dir,
        ServeOptions(max_batch=MAX_BATCH, capacity=96),
        ray=looptool_ray.RayOptions(replicas=2, replica_cpus=0.5),
        runtime="pytorch",
        device="cpu",
    )
    serve.run(application, name="looptool", route_prefix="/")
    return f"{cluster}/v1"


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base, api_key="dummy", max_retries=0, timeout=120)


def prompt(i: int) -> list[int]:
    return torch.randint(3, 250, (6 + i % 3,), generator=torch.Generator().manual_seed(i)).tolist()


def alone(model, ids: list[int], budget: int, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    out = generate(
        model,
        torch.tensor([ids]),
        budget=budget,
        max_new_tokens=max_tokens,
        eos_token_id=None if ignore_eos else model.tokenizer.eos_token_id,
    )
    return out.sequences[0, len(ids) :].tolist()


def text(model, tokens: list[int]) -> str:
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def engine_pids() -> list[int]:
    """The processes of the engine replicas (Ray titles them ``ray::ServeReplica:APP:engine``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:looptool:engine" in cmdline:
                pids.append(int(entry.name))
    return pids


def running_replicas(app: str = "looptool", deployment: str = "engine") -> int:
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def total(page: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rpartition(" ")[2])
        for line in page.splitlines()
        if line.startswith(name + "{") and all(w in line for w in want)
    )


def steps(base: str) -> dict[str, float]:
    """The replicas' steps by batch kind, as ``/metrics`` shows them."""
    page = httpx.get(base.replace("/v1", "/metrics"), timeout=30).text
    return {kind: total(page, "looptool_replica_decode_steps_total", batch=kind) for kind in ("one-budget", "mixed")}


def test_answers_equal_each_request_alone_at_its_budget(client, model):
    for k in BUDGETS:
        ids = prompt(k)
        want = text(model, alone(model, ids, k, 10))
        got = client.completions.create(model=f"{NAME}@{k}", prompt=[ids], max_tokens=10, temperature=0)
        assert got.choices[0].text == want
        assert got.model_extra["cost"]["budget"] == k
        stream = client.completions.create(
            model=NAME, prompt=[ids], max_tokens=10, temperature=0, stream=True, extra_body={"budget": k}
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    chat = client.chat.completions.create(
        model=f"{NAME}@1", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert chat.choices[0].message.content == text(model, alone(model, list(ids), 1, 8))
    assert [m.id for m in client.models.list().data] == [NAME, *(f"{NAME}@{k}" for k in BUDGETS)]
    assert httpx.get(str(client.base_url).replace("/v1/", "/health")).json()["status"] == "ok"


def _mixed_load(client, model, n: int = 12) -> None:
    """``n`` requests at once over every budget; each answer equals its request alone."""
    asks = [(prompt(i), BUDGETS[i % len(BUDGETS)]) for i in range(n)]

    def ask(item):
        ids, k = item
        out = client.completions.create(
            model=f"{NAME}@{k}", prompt=[ids], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        return out.choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(ask, asks))
    for (ids, k), answer in zip(asks, answers):
        assert answer == text(model, alone(model, ids, k, 12, ignore_eos=True))


def test_mixed_budget_load_through_the_default_router(client, base, model):
    _mixed_load(client, model)
    page = httpx.get(base.replace("/v1", "/metrics")).text
    assert total(page, "looptool_routed_requests_total") >= 12
    assert total(page, "looptool_routed_requests_total", reason="budget") >= 1
    assert total(page, "looptool_requests_finished_total", budget="2", reason="length") >= 4
    assert total(page, "looptool_replica_decode_steps_total") > 0


def test_holding_without_riding_keeps_batches_one_budget(cluster, model_dir, model):
    application = looptool_ray.app(
        model_dir,
        ServeOptions(max_batch=MAX_BATCH, capacity=96),
        ray=looptool_ray.RayOptions(replicas=2, replica_cpus=0.5, ride=False, hold_s=0.2, max_hold_s=10.0),
        runtime="pytorch",
        device="cpu",
    )
    serve.run(application, name="strict", route_prefix="/strict")
    base = f"{cluster}/strict/v1"
    try:
        before = steps(base)
        _mixed_load(openai.OpenAI(base_url=base, api_key="dummy", max_retries=0, timeout=120), model)
        after = steps(base)
    finally:
        serve.delete("strict")
    one, mixed = (after[kind] - before[kind] for kind in ("one-budget", "mixed"))
    assert one / (one + mixed) >= 0.8, (one, mixed)


def _stream(base: str, ids: list[int], k: int, new: int) -> dict:
    """One streamed completion: its text, whether it ended with an error event, and that error."""
    pieces, error = [], None
    with httpx.stream(
        "POST",
        f"{base}/completions",
        json={
            "model": f"{NAME}@{k}",
            "prompt": [ids],
            "max_tokens": new,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=120,
    ) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "text": "", "error": response.read().decode()}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            item = json.loads(line[6:])
            if "error" in item:
                error = item["error"]["message"]
            elif item["choices"]:
                pieces.append(item["choices"][0]["text"])
    return {"status": 200, "text": "".join(pieces), "error": error}


def test_a_killed_replica_is_replaced_and_no_request_is_lost(base, model):
    new = 48
    asks = [(prompt(20 + i), BUDGETS[i % len(BUDGETS)]) for i in range(8)]
    pids = engine_pids()
    assert len(pids) == 2
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(_stream, base, ids, k, new) for ids, k in asks]
        time.sleep(1.5)  # streams under way on both replicas, more held by the router
        os.kill(pids[0], signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    exact = failed = 0
    for (ids, k), result in zip(asks, results):
        want = text(model, alone(model, ids, k, new, ignore_eos=True))
        if result["error"] is None and result["status"] == 200:
            assert result["text"] == want
            exact += 1
        else:  # a stream under way on the killed replica: it says so, after a true prefix of its answer
            assert "died after" in (result["error"] or ""), result
            assert want.startswith(result["text"])
            failed += 1
    assert exact + failed == len(asks) and exact >= len(asks) - MAX_BATCH
    deadline = time.monotonic() + 90
    while running_replicas() < 2 or len(engine_pids()) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    after = _stream(base, prompt(40), 1, 8)
    assert after["error"] is None and after["text"] == text(model, alone(model, prompt(40), 1, 8, ignore_eos=True))


def test_autoscaling_adds_a_replica_under_load_with_rays_router(cluster, model_dir, model):
    serve.delete("looptool")
    application = looptool_ray.app(
        model_dir,
        ServeOptions(max_batch=MAX_BATCH, capacity=96),
        ray=looptool_ray.RayOptions(
            replicas=1,
            min_replicas=1,
            max_replicas=2,
            router="ray",
            replica_cpus=0.5,
            autoscaling={"upscale_delay_s": 1.0, "look_back_period_s": 2.0, "metrics_interval_s": 0.5},
        ),
        runtime="pytorch",
        device="cpu",
    )
    serve.run(application, name="scaled", route_prefix="/")
    assert running_replicas("scaled") == 1
    base = f"{cluster}/v1"
    asks = [(prompt(60 + i), BUDGETS[i % len(BUDGETS)]) for i in range(10)]
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(_stream, base, ids, k, 64) for ids, k in asks]
        deadline, scaled = time.monotonic() + 60, False
        while not scaled and time.monotonic() < deadline:
            scaled = running_replicas("scaled") == 2
            time.sleep(0.5)
        results = [f.result(timeout=240) for f in futures]
    assert scaled, "autoscaling did not add a replica"
    for (ids, k), result in zip(asks, results):
        assert result["error"] is None and result["text"] == text(model, alone(model, ids, k, 64, ignore_eos=True))


class _Stream:
    """A replica's event stream that fails (its actor died) before item ``fail_at``."""

    def __init__(self, items, fail_at=None):
        self.items, self.fail_at, self.cancelled = items, fail_at, False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        from ray.exceptions import ActorDiedError

        for i, item in enumerate(self.items):
            if i == self.fail_at:
                raise ActorDiedError()
            yield item
        if self.fail_at == len(self.items):
            raise ActorDiedError()

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A deployment handle whose successive calls return the given streams."""

    def __init__(self, streams):
        self.streams, self.specs = list(streams), []

    def options(self, **_):
        return self

    def remote(self, spec):
        self.specs.append(spec)
        return self.streams.pop(0)


def _relay(streams) -> tuple[list, _Handle]:
    """Run one job through a RemoteScheduler over ``streams``; the events it got, the handle."""
    import asyncio

    from looptool.engine.core import Job
    from looptool.engine.interface import Capabilities
    from looptool.serve.models import ServedFacts
    from looptool.serve.ray.deployments import RemoteScheduler, ReplicaFacts

    facts = ReplicaFacts(
        ServedFacts("m", None, (0, 1), {}, (), "cpu", "pytorch", 16), Capabilities("per-loop", "float32"), 64
    )
    handle = _Handle(streams)
    events = []

    async def main():
        remote = RemoteScheduler(handle, facts, prefix_blocks=True)
        job = Job([1, 2, 3], 1, 4, emit=events.append)
        remote.submit(job)
        await remote.tasks[job]

    asyncio.run(main())
    return events, handle


def test_a_job_whose_replica_died_before_answering_is_sent_again():
    from looptool.engine.core import Event
    from looptool.serve.ray.jobs import ReplicaStats

    answer = [
        Event("token", token=5, depth=1),
        ReplicaStats("r2", {"one-budget": 3, "mixed": 0}),
        Event("finished", reason="length"),
    ]
    events, handle = _relay([_Stream([], fail_at=0), _Stream(answer)])
    assert [e.kind for e in events] == ["token", "finished"] and len(handle.specs) == 2
    assert (
        handle.specs[0] == handle.specs[1] and handle.specs[0].key.label == "1" and handle.specs[0].prompt == (1, 2, 3)
    )


def test_a_stream_whose_replica_died_after_a_token_ends_with_an_error_saying_so():
    from looptool.engine.core import Event

    events, handle = _relay([_Stream([Event("token", token=5, depth=1)], fail_at=1)])
    assert [e.kind for e in events] == ["token", "failed"] and len(handle.specs) == 1
    assert events[-1].message == "the replica serving this request died after 1 token."
    events, handle = _relay([_Stream([], fail_at=0)] * 3)  # it died every time it was sent
    assert [e.kind for e in events] == ["failed"] and len(handle.specs) == 3
    assert events[-1].message == "the replica serving this request died before answering."


def test_the_serve_run_builder_takes_string_arguments_and_refuses_bad_ones(model_dir):
    from looptool.core.errors import LooptoolError

    application = looptool_ray.build({"model_dir": str(model_dir), "replicas": "2", "max_batch": "2", "ride": "false"})
    assert type(application).__name__ == "Application"  # what serve run deploys (checked end to end by hand)
    with pytest.raises(LooptoolError, match="build argument replicas: Input should be a valid integer"):
        looptool_ray.build({"model_dir": str(model_dir), "replicas": "two"})
    with pytest.raises(LooptoolError, match="build argument colour: Extra inputs are not permitted"):
        looptool_ray.build({"model_dir": str(model_dir), "colour": "red"})
    with pytest.raises(LooptoolError, match="replicas must be at least 1"):
        looptool_ray.build({"model_dir": str(model_dir), "replicas": "0"})


def test_structured_outputs_and_n_choices_through_the_replicas(client, model):
    """A grammar travels to the replica as its text (compiled there); ``n`` choices run as one
    job each on whichever replicas the router picks, choice ``j`` seeded ``seed + j``."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": schema}}
    r = client.chat.completions.create(
        model=f"{NAME}@1", messages=[{"role": "user", "content": "go"}], n=2, seed=4, temperature=1.0,
        max_tokens=40, response_format=fmt,
    )  # fmt: skip
    for c in r.choices:
        got = json.loads(c.message.content)
        assert set(got) == {"a", "b"} and 0 <= got["a"] <= 99 and got["b"] in ("x", "y")
    assert r.model_extra["cost"]["forced_tokens"] > 0
    settings = dict(model=f"{NAME}@2", prompt="Four score", max_tokens=8, temperature=1.0)
    many = client.completions.create(n=2, seed=9, **settings)
    assert [c.text for c in many.choices] == [
        client.completions.create(seed=9 + j, **settings).choices[0].text for j in range(2)
    ]
