"""``looptool serve`` as a client sees it: a real server process on 127.0.0.1 over a tiny
fixed-prefix model (new parameters non-zero), driven by the official ``openai`` client, raw
HTTP for the faults, and lm-evaluation-harness's stock ``local-completions`` model.

Every test runs on every runtime (``served``: the looped model directory on PyTorch, its
exported engine directory on onnxruntime, its TensorRT engine directory under the TensorRT
test double), each answer compared with that prompt generated alone on the same runtime;
only the lm-eval comparison, which scores the model in process with PyTorch, runs on PyTorch
alone. Per runtime, one server (``server``: 4 slots of 64 tokens, so requests queue, rows are
repacked and the slot cache drops the positions of finished requests) answers the API, budget, batching and fault tests; a second
one (``guarded``: one slot, one queue place, an API key) shows the queue-full 503 and the exact
queue bound, the API key, disconnects (streamed and not) freeing their slot and the draining
SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_process import RUNTIMES, metric, served_on, tiny_looped

import looptool
from looptool.engine.sampling import SamplingParams

openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install 'looptool[test]')")
pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

NAME = "tiny"
BUDGETS = (0, 1, 2)
KEY = "sekret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_looped(tmp_path_factory.mktemp("serve") / NAME, looptool.PrefixLoop(window=(1, 3), budgets=BUDGETS))


@pytest.fixture(scope="module")
def model(model_dir):
    return looptool.load(model_dir)


@pytest.fixture(scope="module", params=RUNTIMES)
def served(request, model_dir, model, tmp_path_factory):
    """The model on one runtime (one engine directory per runtime for the whole module)."""
    return served_on(request.param, model_dir, model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    proc = served.start("--max-batch", "4", "--capacity", "64", log=tmp_path_factory.mktemp("log") / "s")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="dummy", max_retries=0, timeout=60)


def text_of(model, tokens: list[int]) -> str:
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_lists_the_name_and_one_id_per_budget_with_its_cost(client, model):
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == [NAME, *(f"{NAME}@{k}" for k in BUDGETS)]
    costs = {c.budget: c for c in model.cost_table()}
    for k in BUDGETS:
        cost = listed[f"{NAME}@{k}"].model_extra["cost"]
        assert cost == {"budget": k, "layer_executions": 3 + k, "kv_bytes_per_token": costs[k].kv_bytes_per_token}
    assert listed[NAME].model_extra["cost"]["budget"] == BUDGETS[-1]  # the default budget: the deepest


@pytest.mark.parametrize(
    ("how", "budget"),
    [
        ({"model": f"{NAME}@1"}, 1),
        ({"model": NAME, "extra_body": {"budget": 0}}, 0),
        ({"model": NAME, "extra_body": {"reasoning_effort": "medium"}}, 1),  # the ladder over 0,1,2
        ({"model": NAME}, 2),
        ({"model": NAME, "extra_body": {"budget": "minimal"}}, 0),  # an effort level in the budget field
    ],
    ids=["model@k", "extra_body budget", "reasoning_effort", "default", "budget effort level"],
)
def test_completion_runs_at_the_budget_the_request_picks(client, served, model, how, budget):
    prompt = "We the People"
    r = client.completions.create(prompt=prompt, max_tokens=12, temperature=0, **how)
    want = served.alone(model.tokenizer(prompt)["input_ids"], budget, 12)
    assert r.choices[0].text == text_of(model, want)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(prompt) + len(want)
    assert r.model_extra["cost"]["budget"] == budget
    assert r.choices[0].finish_reason == ("length" if len(want) == 12 else "stop")


def test_chat_uses_the_chat_template_and_reasoning_effort(client, served, model):
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, reasoning_effort="minimal"
    )
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = served.alone(list(ids), 0, 10)
    assert r.choices[0].message.content == text_of(model, want)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.model_extra["cost"]["budget"] == 0


def test_streams_end_with_done_and_carry_cost_and_usage(client, server, model):
    whole = client.completions.create(model=f"{NAME}@2", prompt="Four score", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(model=f"{NAME}@2", prompt="Four score", max_tokens=16, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["cost"] == whole.model_extra["cost"]
    stream = client.chat.completions.create(
        model=f"{NAME}@1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].model_extra["cost"]["budget"] == 1
    with httpx.stream(
        "POST", f"{server.base}/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2, "stream": True}
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_twelve_concurrent_requests_each_equal_generating_alone_at_its_budget(client, served, model):
    """Batch invariance by budget: requests of every budget share decode steps (4 slots, so
    they also queue, get repacked, and the slot cache drops finished requests' positions) and each gets exactly
    what its prompt alone gets at its budget, EOS included."""
    prompts = [f"Request {i}: {'xyz' * (i % 5)}" for i in range(12)]
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(12)]

    def ask(i):
        r = client.completions.create(model=f"{NAME}@{budgets[i]}", prompt=prompts[i], max_tokens=24, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens, r.model_extra["cost"]["budget"]

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, range(12)))
    for i, (text, count, budget) in enumerate(got):
        want = served.alone(model.tokenizer(prompts[i])["input_ids"], budgets[i], 24)
        assert (text, count, budget) == (text_of(model, want), len(want), budgets[i]), i
    assert len({text for text, _, _ in got}) > 3  # budgets and prompts differ, so do the answers


def test_seeded_sampling_equals_generate_with_that_seed(client, served, model):
    prompt = "Liberty"
    settings = dict(temperature=0.9, top_p=0.9, seed=7)
    r = client.completions.create(model=f"{NAME}@1", prompt=prompt, max_tokens=12, extra_body={"top_k": 40}, **settings)
    ids = model.tokenizer(prompt)["input_ids"]
    want = served.alone(ids, 1, 12, SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7))
    assert r.choices[0].text == text_of(model, want)


def test_stop_strings_cut_the_text_and_count_as_stop(client, server, model):
    prompt = "We the People"
    full = client.completions.create(
        model=f"{NAME}@0", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop = text[3:5]
    before = {
        r: metric(server.metrics(), "looptool_requests_finished_total", budget="0", reason=r)
        for r in ("stop", "cancelled")
    }
    r = client.completions.create(
        model=f"{NAME}@0", prompt=prompt, max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    want = {"stop": before["stop"] + 1, "cancelled": before["cancelled"]}
    deadline = time.monotonic() + 10  # the scheduler retires the stopped job after the reply went out
    while True:
        after = {
            r: metric(server.metrics(), "looptool_requests_finished_total", budget="0", reason=r)
            for r in ("stop", "cancelled")
        }
        if after == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after == want


def test_echo_logprobs_of_token_prompts_are_the_models_log_likelihoods(server, model):
    ids = model.tokenizer("The Constitution")["input_ids"]
    body = {"model": f"{NAME}@1", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(f"{server.base}/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids]), budget=1).logits[0].float(), -1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
    assert r["choices"][0]["text"].startswith("The Constitution")
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1])  # greedy: the top token


@pytest.mark.parametrize("served", ["pytorch"], indirect=True)  # compared with PyTorch in process
def test_lm_eval_local_completions_scores_a_budget_like_looptool_lm_eval(server, model_dir, tmp_path):
    """lm-eval's stock ``local-completions`` model (token-id prompts, ``echo`` + ``logprobs``)
    against the served model at two budgets gives what ``looptool lm-eval`` gives in process."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'looptool[eval]')")
    import yaml
    from test_harness import _task_configs

    from looptool.eval import lm_eval_budgets

    (tmp_path / "lt_choice.yaml").write_text(yaml.safe_dump({"task": "lt_choice", **_task_configs()["lt_choice"]}))
    manager = lm_eval_budgets.task_manager(["lt_choice"], [str(tmp_path)])
    local = lm_eval_budgets.evaluate_budgets(
        str(model_dir), ["lt_choice"], budgets=[0, 2], include_path=[str(tmp_path)], bootstrap_iters=0
    )
    scores = {}
    for row in local["budgets"]:
        k = row["budget"]
        args = {
            "model": f"{NAME}@{k}",
            "base_url": f"{server.base}/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
        }
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["lt_choice"],
            task_manager=manager,
            bootstrap_iters=0,
            log_samples=True,
        )
        got = lm_eval_budgets._metrics(out["results"]["lt_choice"])
        assert {m: v["value"] for m, v in got.items()} == {
            m: v["value"] for m, v in row["results"]["lt_choice"].items()
        }
        scores[k] = [resp[0][0] for sample in out["samples"]["lt_choice"] for resp in sample["resps"]]
    assert scores[0] != pytest.approx(scores[2], abs=1e-3)  # the budget reached the server


FAULTS = [
    ({"model": "nope", "prompt": "a"}, 404, "model"),
    ({"model": f"{NAME}@7", "prompt": "a"}, 404, "model"),
    ({"model": NAME, "prompt": "a", "budget": 5}, 400, "budget"),
    ({"model": NAME, "prompt": "a", "budget": "1"}, 400, "budget"),
    ({"model": NAME, "prompt": "a", "budget": 1.0}, 400, "budget"),
    ({"model": NAME, "prompt": "a", "budget": True}, 400, "budget"),
    ({"model": NAME, "prompt": "a", "reasoning_effort": "enormous"}, 400, "reasoning_effort"),
    ({"model": f"{NAME}@0", "prompt": "a", "budget": 2}, 400, "budget"),
    ({"model": NAME, "prompt": "x" * 70}, 400, "prompt"),
    ({"model": NAME, "prompt": "a", "max_tokens": 64}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "a", "n": 0}, 400, "n"),
    ({"model": NAME, "prompt": "a", "n": 5}, 400, "n"),  # more choices than the server's 4 slots
    ({"model": NAME, "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
    ({"model": NAME, "prompt": []}, 400, "prompt"),
    ({"model": NAME, "prompt": [[]]}, 400, "prompt"),
    ({"model": NAME, "prompt": [999]}, 400, "prompt"),
    ({"prompt": "a"}, 400, "model"),
    ('{"model": "tiny", "prompt": ', 400, None),
    ("[1, 2]", 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), FAULTS, ids=[str(i) for i in range(len(FAULTS))])
def test_a_bad_request_is_one_openai_error_and_the_server_keeps_serving(server, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.base}/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"].endswith(".") and error["param"] == param and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.base}/completions", json={"model": NAME, "prompt": "a", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_chat_faults(server):
    def post(body):
        return httpx.post(f"{server.base}/chat/completions", json=body, timeout=60)

    assert post({"model": NAME, "messages": []}).json()["error"]["param"] == "messages"
    assert post({"model": NAME, "messages": "hi"}).status_code == 400
    assert (
        post({"model": NAME, "messages": [{"role": "user", "content": "x" * 80}]}).json()["error"]["param"] == "prompt"
    )
    assert post({"model": NAME, "messages": [{"role": "user", "content": "a"}], "n": 5}).json()["error"]["param"] == "n"


# ------------------------------------------------------------------------- one slot, a key
@pytest.fixture(scope="module")
def guarded(served, tmp_path_factory):
    logs = tmp_path_factory.mktemp("log")
    proc = served.start(*("--max-batch", "1", "--max-queue", "1", "--api-key", KEY), log=logs / "g", hold=logs / "hold")
    proc.hold = logs / "hold"  # while this file exists the server's running rows wait
    yield proc
    proc.stop()


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_is_required_on_the_api(guarded):
    body = {"model": NAME, "prompt": "a", "max_tokens": 1}
    assert httpx.post(f"{guarded.base}/completions", json=body).status_code == 401
    r = httpx.post(f"{guarded.base}/completions", json=body, headers=_auth("wrong"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{guarded.base}/completions", json=body, headers=_auth(), timeout=60).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base, api_key="dummy", max_retries=0).models.list()
    assert len(openai.OpenAI(base_url=guarded.base, api_key=KEY, max_retries=0).models.list().data) == 4
    assert httpx.get(guarded.base.removesuffix("/v1") + "/health").status_code == 200  # health needs no key


def _long_stream(guarded, tokens: int = 900):
    body = {"model": NAME, "prompt": "a", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    return httpx.stream("POST", f"{guarded.base}/completions", json=body, headers=_auth(), timeout=60)


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@contextlib.contextmanager
def _held(guarded):
    """Inside the block the guarded server's running rows take no step (``held_process.py``)
    unless every one is cancelled: a request admitted there is still in the server at the
    block's end, at any machine speed."""
    guarded.hold.touch()
    try:
        yield
    finally:
        guarded.hold.unlink(missing_ok=True)


def test_queue_full_is_503_at_once_and_a_disconnect_frees_its_slot(guarded):
    """With the one slot and the one queue place taken, a third request gets 503 at once: while
    the other two are held in the server, so it cannot have waited for either to leave,
    whatever the machine's speed. Both clients then go away mid-stream: they count as
    cancelled and their places are free."""
    running = lambda: metric(guarded.metrics(), "looptool_requests_running")  # noqa: E731
    waiting = lambda: metric(guarded.metrics(), "looptool_requests_waiting")  # noqa: E731
    cancelled = lambda: metric(guarded.metrics(), "looptool_requests_finished_total", budget="2", reason="cancelled")  # noqa: E731
    before = cancelled()
    with _held(guarded):
        with _long_stream(guarded) as first:
            first_lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(first_lines).startswith("data: ")  # holds the one slot (its prefill's token)
            with _long_stream(guarded):  # waits in the one queue place
                _wait(lambda: waiting() == 1)
                body = {"model": NAME, "prompt": "a"}
                r = httpx.post(f"{guarded.base}/completions", json=body, headers=_auth(), timeout=30)
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
                assert running() == 1 and waiting() == 1  # refused while both were held, not once one left
            _wait(lambda: waiting() == 0)
        # both clients went away mid-stream: their slots are free and they count as cancelled
        _wait(lambda: running() == 0 and cancelled() == before + 2)
    assert metric(guarded.metrics(), "looptool_requests_rejected_total") >= 1


def test_a_non_streamed_client_that_gives_up_frees_its_slot(guarded):
    """A client that gives up on a plain (non-streamed) request while it runs: the server sees
    the disconnect, frees the slot and counts it as cancelled. The request outlasts its client
    by construction (its rows are held until the client is gone), not by a length that a fast
    machine could decode inside the client's timeout."""
    cancelled = lambda: metric(guarded.metrics(), "looptool_requests_finished_total", budget="2", reason="cancelled")  # noqa: E731
    running = lambda: metric(guarded.metrics(), "looptool_requests_running")  # noqa: E731
    length = lambda: metric(guarded.metrics(), "looptool_requests_finished_total", budget="2", reason="length")  # noqa: E731
    before, before_length = cancelled(), length()
    body = {"model": NAME, "prompt": "a", "max_tokens": 50, "ignore_eos": True}
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{guarded.port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with _held(guarded):  # the running row takes no step until it is cancelled
        with socket.create_connection(("127.0.0.1", guarded.port)) as client:
            client.sendall(head.encode() + payload)
            _wait(lambda: running() == 1)  # admitted, and held
        # the client gave up (closed its connection) with its request running
        _wait(lambda: running() == 0 and cancelled() == before + 1)
    assert length() == before_length  # it did not run to max_tokens
    ok = httpx.post(f"{guarded.base}/completions", json={**body, "max_tokens": 2}, headers=_auth(), timeout=60)
    assert ok.status_code == 200  # the slot serves the next request


def test_the_server_holds_exactly_max_batch_plus_max_queue_requests(guarded):
    """One slot and one queue place: of six requests sent at once (long prompts, so their
    prefills overlap the arrivals), exactly two are accepted and four get 503. The accepted
    ones are held in the server until all six are answered, so none can finish and make room
    for a later arrival, however fast the machine or however spread out the arrivals."""
    body = {"model": NAME, "prompt": "y" * 900, "max_tokens": 100, "stream": True, "ignore_eos": True}
    barrier = threading.Barrier(6)

    def send(_):
        client = httpx.Client(headers=_auth(), timeout=60)
        barrier.wait()
        response = client.send(client.build_request("POST", f"{guarded.base}/completions", json=body), stream=True)
        return client, response

    with _held(guarded):
        with ThreadPoolExecutor(6) as pool:
            opened = list(pool.map(send, range(6)))
        try:
            statuses = sorted(r.status_code for _, r in opened)
            assert statuses == [200, 200, 503, 503, 503, 503], statuses
        finally:
            for client, response in opened:
                response.close()
                client.close()
        _wait(lambda: metric(guarded.metrics(), "looptool_requests_running") == 0)


def test_sigterm_drains_with_503_then_exits_0(guarded):
    """Last of each runtime's tests (pytest runs them runtime by runtime, in file order): the
    guarded server is stopped here. After SIGTERM the socket stays open: /health and new
    requests get 503 while the running stream finishes (held in the server until those checks
    are done, so it is still running then at any machine speed)."""
    events, done = [], threading.Event()

    def read():
        body = {"model": NAME, "prompt": "a", "max_tokens": 50, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{guarded.base}/completions", json=body, headers=_auth(), timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if len(events) == 1:
                        done.set()

    reader = threading.Thread(target=read)
    with _held(guarded):
        reader.start()
        assert done.wait(30)
        guarded.proc.send_signal(signal.SIGTERM)
        health = f"{guarded.base.removesuffix('/v1')}/health"
        _wait(lambda: httpx.get(health, timeout=10).status_code == 503)
        assert httpx.get(health, timeout=10).json()["status"] == "draining"
        refused = httpx.post(
            f"{guarded.base}/completions", json={"model": NAME, "prompt": "a"}, headers=_auth(), timeout=10
        )
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        assert reader.is_alive()  # the admitted stream is still running
    reader.join(60)
    assert guarded.proc.wait(60) == 0, guarded.output()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1])
    assert len(text) > 0 and "server stopped" in guarded.output()
