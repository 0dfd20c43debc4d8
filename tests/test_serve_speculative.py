"""Self-speculative decoding in the server (``draft_budget``, ``draft_tokens``, ``looptool serve
--speculative``).

The scheduler is driven in process on a tiny fixed-prefix and a conditioned ELR model whose new
parameters sit off their init (so drafts are both kept and rejected): greedy requests that
speculate, at several (draft, target) pairs and draft lengths, share batches with plain ones at
other budgets, some arriving while others run, and every one gets token for token what
``generate`` gives at its budget alone. A seeded sampled request speculates reproducibly. Then
``looptool serve --speculative`` (in process, its app driven by a test client) drafts by
default, reports the counts in ``cost`` and ``/metrics``, and refuses bad fields, last-loop KV
and engines without a verify step in one sentence each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from serve_process import metric, prompt_ids, run_jobs, tiny_looped
from test_speculative import MODELS, _model

import looptool
from looptool.engine.sampling import SamplingParams
from looptool.engine.speculation import Speculation
from looptool.runtime.generation import generate
from looptool.runtime.step_engine import TorchStepEngine
from looptool.testing import plain_steps

pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

from fastapi.testclient import TestClient  # noqa: E402 (after the skip)
from typer.testing import CliRunner  # noqa: E402

from looptool.serve.app import create_app  # noqa: E402
from looptool.serve.budgets import BudgetResolver  # noqa: E402
from looptool.serve.models import open_model  # noqa: E402
from looptool.serve.scheduler import Event, Job, Scheduler  # noqa: E402

NAME = "tiny"
SCALES = {"prefix": 0.1}  # a little further off init than test_speculative's: these short requests reject drafts too


def _alone(model, prompt: list[int], budget: int, tokens: int) -> list[int]:
    out = generate(model, torch.tensor([prompt]), budget=budget, max_new_tokens=tokens)
    return out.sequences[0, len(prompt) :].tolist()


def _tokens(events: list[Event]) -> list[int]:
    assert events[-1].kind == "finished", events[-1]
    return [e.token for e in events if e.kind == "token"]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_speculating_and_plain_requests_share_batches_and_each_gets_its_budget_alone(name):
    model = _model(name, SCALES.get(name))
    menu = sorted(model.budgets)
    lo, mid, hi = menu[0], menu[1], menu[-1]
    # (budget, speculation, max_tokens): the first four start together, the rest arrive while they run
    asked = [
        (hi, Speculation(lo, 3), 10),
        (mid, None, 5),
        (mid, Speculation(lo, 1), 6),
        (hi, None, 8),
        (hi, Speculation(mid, 2), 7),
        (lo, None, 4),
        (hi, Speculation(lo, 4), 9),
    ]
    jobs = [Job(prompt_ids(i), k, n, ignore_eos=True, speculation=sp) for i, (k, sp, n) in enumerate(asked)]
    shifts: list[int] = []
    scheduler = run_jobs(TorchStepEngine(model), jobs, max_batch=4, start_after=4, shifts=shifts)
    for i, (budget, spec, tokens) in enumerate(asked):
        assert _tokens(scheduler.events[i]) == _alone(model, prompt_ids(i), budget, tokens), (i, budget, spec)
        stats = jobs[i].speculated
        if spec is None:
            assert stats.rounds == 0
        else:
            assert stats.proposed == spec.tokens * stats.rounds and stats.rounds <= tokens
    drafted = sum(job.speculated.proposed for job in jobs)
    accepted = sum(job.speculated.accepted for job in jobs)
    assert 0 < accepted < drafted  # drafts were both kept and rejected
    assert shifts  # the rows moved in the cache while speculating
    text = scheduler.metrics.render().decode()
    for kind, field in (("drafted", "proposed"), ("accepted", "accepted")):
        for k in menu:
            want = sum(getattr(job.speculated, field) for job in jobs if job.budget == k)
            assert metric(text, "looptool_draft_tokens_total", budget=str(k), kind=kind) == want, (kind, k)


def test_a_seeded_sampled_request_speculates_reproducibly():
    model = _model("prefix", SCALES["prefix"])
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=5)

    def run() -> tuple[list[int], Job]:
        job = Job(prompt_ids(1), 2, 10, sampling, ignore_eos=True, speculation=Speculation(0, 3))
        plain = Job(prompt_ids(2), 1, 10, sampling, ignore_eos=True)
        scheduler = run_jobs(TorchStepEngine(model), [job, plain], max_batch=2, start_after=2)
        return _tokens(scheduler.events[0]), job

    first, job = run()
    assert len(first) == 10 and job.speculated.proposed > 0
    assert run()[0] == first


# ------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_looped(
        tmp_path_factory.mktemp("serve-spec") / NAME, looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
    )


@pytest.fixture(scope="module")
def speculative(model_dir):
    """``looptool serve --speculative`` (its default --draft-tokens, 4) prepared in process (its uvicorn loop
    not run): the server object."""
    from looptool.cli import app
    from looptool.serve.server import Server

    servers: list[Server] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "run", lambda self: servers.append(self))
        res = CliRunner().invoke(app, ["serve", str(model_dir), "--speculative", "--port", "0", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    return servers[0]


@pytest.fixture(scope="module")
def client(speculative):
    with TestClient(speculative.app) as client:
        yield client


def _complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt_ids(4), "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_speculative_server_drafts_at_the_shallowest_budget_by_default(client, model_dir):
    model = looptool.load(model_dir)
    plain = model.tokenizer.decode(_alone(model, prompt_ids(4), 2, 12), skip_special_tokens=True)
    out = _complete(client, max_tokens=12, budget=2, ignore_eos=True)
    assert out["choices"][0]["text"] == plain
    spec = out["cost"]["speculation"]
    assert (spec["draft_budget"], spec["draft_tokens"]) == (0, 4) and spec["drafted"] == 4 * spec["rounds"] > 0
    assert out["cost"]["budget"] == 2
    own = _complete(client, max_tokens=12, budget=2, ignore_eos=True, draft_budget=1, draft_tokens=2)
    assert own["choices"][0]["text"] == plain
    assert (own["cost"]["speculation"]["draft_budget"], own["cost"]["speculation"]["draft_tokens"]) == (1, 2)
    for off in ({"draft_budget": None}, {"draft_budget": 2}, {"budget": 0}):
        out = _complete(client, max_tokens=4, **{"budget": 2, **off})
        assert "speculation" not in out["cost"], off
    chat = client.post(
        "/v1/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "budget": 1},
    )
    assert chat.status_code == 200 and chat.json()["cost"]["speculation"]["draft_budget"] == 0, chat.text
    sampled = [_complete(client, max_tokens=6, budget=2, ignore_eos=True, temperature=0.9, seed=11) for _ in range(2)]
    assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]  # seeded: reproducible
    assert sampled[0]["cost"]["speculation"]["drafted"] > 0
    metrics = client.get("/metrics").text
    assert 'looptool_draft_tokens_total{budget="2",kind="accepted"}' in metrics


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"budget": 1, "draft_budget": 2}, "draft_budget", "must be shallower than the budget"),
        ({"budget": 2, "draft_budget": 5}, "draft_budget", "not in the budget menu"),
        ({"budget": 2, "draft_budget": "1"}, "draft_budget", "must be an integer of the menu"),
        ({"budget": 2, "draft_budget": True}, "draft_budget", "must be an integer of the menu"),
        ({"budget": 2, "draft_tokens": 0}, "draft_tokens", "integer >= 1"),
        ({"budget": 2, "draft_tokens": 33}, "draft_tokens", "at most 32"),
        ({"budget": "auto", "draft_budget": 0}, "draft_budget", 'budget "auto" decides the depth'),
    ],
)
def test_bad_speculation_fields_are_one_sentence_naming_the_field(client, body, param, words):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["message"].count(". ") == 0 and error["message"].endswith("."), error["message"]


@pytest.mark.parametrize("kind", ["last-loop", "no-verify"])
def test_a_server_that_cannot_verify_refuses_draft_budget_in_one_sentence(model_dir, kind):
    served = open_model(
        model_dir, name=NAME, runtime="pytorch", device="cpu", kv="last-loop" if kind == "last-loop" else "per-loop"
    )
    if kind == "no-verify":
        served = dataclasses.replace(served, engine=plain_steps(served.engine), runtime="onnxruntime")
    scheduler = Scheduler(served.engine, max_batch=1, capacity=64, max_queue=0)
    client = TestClient(create_app(served, scheduler, BudgetResolver.create(NAME, served.budgets)))
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "budget": 2, "draft_budget": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    want = "--kv per-loop" if kind == "last-loop" else "onnxruntime engine"
    assert error["param"] == "draft_budget" and want in error["message"], error
    assert error["message"].count(". ") == 0


def test_speculative_serving_under_last_loop_kv_is_one_sentence_before_the_load(model_dir, monkeypatch):
    from looptool.serve import server

    monkeypatch.setattr(server, "open_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(looptool.LooptoolError, match="needs kv 'per-loop'") as err:
        server.prepare(model_dir, server.ServeOptions(port=0, speculative=True), kv="last-loop")
    assert err.value.parameter == "kv"
    with pytest.raises(looptool.LooptoolError, match="draft_tokens must be an integer from 1 to 32"):
        server.prepare(model_dir, server.ServeOptions(port=0, speculative=True, draft_tokens=0))
