"""``budget: "auto"`` through the server: adaptive depth per token (the adaptive-depth path of the
PyTorch step engine under last-loop KV) on a tiny fixed-prefix model whose new parameters are
moved off their init, so depths really vary.

Rows of adaptive depth and fixed-budget rows share one batch (one adaptive-path call per step,
a fixed row ``k`` as ``min_budget = max_budget = k``), and each gets exactly what it gets alone:
``generate(budget="auto", ...)`` for an adaptive one, ``generate(budget=k, kv="last-loop")`` for
a fixed one. The scheduler is driven in process (every request admitted before the first step,
so they run as one batch to the end), then a real ``looptool serve --kv last-loop`` answers the
same requests sent concurrently, reports the realised depth in ``cost`` and ``/metrics``, and
refuses bad fields; a per-loop server and a fixed-budget engine refuse ``"auto"`` in one sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_process import ServerProcess, alone_answer, budget_job, metric, run_jobs, tiny_looped

import looptool
from looptool.engine.budgets import AutoRow, RowBudgets
from looptool.engine.interface import StepBatch
from looptool.runtime.generation import generate
from looptool.runtime.step_engine import TorchStepEngine
from looptool.testing import plain_steps

openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install 'looptool[test]')")
pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

from fastapi.testclient import TestClient  # noqa: E402 (after the skip)

from looptool.serve.app import create_app  # noqa: E402
from looptool.serve.budgets import BudgetResolver  # noqa: E402
from looptool.serve.models import open_model  # noqa: E402
from looptool.serve.scheduler import Scheduler  # noqa: E402

NAME = "tiny"
PLAN = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
PROMPTS = ["Hello there", "abc abc abc", "The quick brown fox", "zz top"]
TOKENS = 8
CANDIDATES = (0.6, 0.5, 0.7, 0.3, 0.25, 0.4)  # thresholds tried until one mixes depths on this model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_looped(tmp_path_factory.mktemp("serve-auto") / NAME, PLAN, seed=0)


@pytest.fixture(scope="module")
def model(model_dir):
    model = looptool.load(model_dir)
    assert all(p.abs().sum() > 0 for _, p in model.new_parameters())
    return model


def _ids(model, prompt: str) -> list[int]:
    return model.tokenizer(prompt)["input_ids"]


_ALONE: dict[tuple, tuple[list[int], list[int]]] = {}  # (prompt, budget) -> answer; one model per module


def alone(model, prompt: list[int], budget: int | AutoRow) -> tuple[list[int], list[int]]:
    """Tokens and per-token depths of ``prompt`` generated alone (no EOS stop): adaptive with
    ``generate(budget="auto", ...)``, fixed with ``generate(budget=k, kv="last-loop")``."""
    key = (tuple(prompt), budget)
    if key not in _ALONE:
        _ALONE[key] = alone_answer(functools.partial(generate, model), prompt, budget, TOKENS)
    return _ALONE[key]


@pytest.fixture(scope="module")
def threshold(model) -> float:
    """A threshold at which the prompts' tokens, generated alone, run at different depths."""
    for thr in CANDIDATES:
        depths = [d for p in PROMPTS for d in alone(model, _ids(model, p), AutoRow(0, 2, thr))[1]]
        if len(set(depths)) > 1:
            return thr
    pytest.fail("no candidate threshold mixes depths on this model")


def _requests(threshold: float) -> list[int | AutoRow]:
    return [AutoRow(0, 2, 0.0), AutoRow(0, 2, threshold), 0, AutoRow(1, 2, threshold), 2, AutoRow(0, 1, threshold)]


# ------------------------------------------------------------------ the scheduler, in process
def test_auto_and_fixed_rows_share_one_batch_and_each_gets_what_it_gets_alone(model, threshold):
    engine = TorchStepEngine(model, kv="last-loop")
    budgets = _requests(threshold)
    prompts = [_ids(model, PROMPTS[i % len(PROMPTS)]) for i in range(len(budgets))]
    jobs = [budget_job(prompt, b, TOKENS) for prompt, b in zip(prompts, budgets)]
    scheduler = run_jobs(engine, jobs, max_batch=len(jobs), start_after=len(jobs))  # one batch from the start
    events = scheduler.events
    assert scheduler.steps == TOKENS - 1  # one decode step per token for all rows together
    mixed = False
    for i, budget in enumerate(budgets):
        tokens = [e.token for e in events[i] if e.kind == "token"]
        depths = [e.depth for e in events[i] if e.kind == "token"]
        assert events[i][-1].kind == "finished", events[i][-1]
        assert (tokens, depths) == alone(model, prompts[i], budget), (i, budget)
        mixed |= isinstance(budget, AutoRow) and len(set(depths)) > 1
    assert mixed  # some adaptive row changed depth from token to token
    snapshot = scheduler.metrics.render().decode()
    auto_tokens = TOKENS * sum(isinstance(b, AutoRow) for b in budgets)
    assert metric(snapshot, "looptool_realised_depth_count") == auto_tokens


@pytest.mark.parametrize("rule", ["state", "kl"])
def test_the_engine_runs_fixed_rows_of_an_adaptive_step_exactly_at_their_budget(model, rule):
    """One step through the engine: the fixed rows' depths are their budgets, they run exactly
    those budgets, and an adaptive row at threshold 0 runs its ``max_budget``, whatever the rule."""
    engine = TorchStepEngine(model, kv="last-loop", exit_rule=rule)
    ids = torch.tensor([_ids(model, PROMPTS[0])] * 3)
    n = ids.shape[1]
    args = (ids, torch.ones(3, n, dtype=engine.mask_dtype), torch.arange(n)[None].expand(3, n), torch.arange(n))
    mixed = RowBudgets((2, 1, 0), (AutoRow(0, 2, 0.0), None, None))
    out = engine.run(engine.allocate(3, n), StepBatch(slice(0, 3), *args, mixed))
    assert out.depths.tolist() == [2, 1, 0]
    fixed = engine.run(engine.allocate(3, n), StepBatch(slice(0, 3), *args, RowBudgets((2, 1, 0))))
    assert fixed.depths.tolist() == [2, 1, 0]
    assert torch.allclose(out.logits, fixed.logits, atol=1e-5, rtol=0)
    assert RowBudgets((2,), (None,)).auto is None and not RowBudgets((2,)).adaptive  # fixed budgets as before


def test_an_unknown_exit_rule_is_one_sentence_before_the_load(model_dir, monkeypatch):
    from looptool.serve import server

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(server, "open_model", no_load)
    with pytest.raises(looptool.LooptoolError, match="unknown exit_rule 'entropy'") as err:
        server.prepare(model_dir, exit_rule="entropy")
    assert err.value.parameter == "exit_rule"


# ------------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = ServerProcess(
        model_dir,
        *("--kv", "last-loop", "--exit-rule", "state", "--max-batch", "4", "--capacity", "64", "--device", "cpu"),
        log=tmp_path_factory.mktemp("log") / "s",
    )
    yield proc
    assert proc.stop() == 0


def _body(budget: int | AutoRow) -> dict:
    if isinstance(budget, AutoRow):
        return {
            "budget": "auto",
            "min_budget": budget.min_budget,
            "max_budget": budget.max_budget,
            "exit_threshold": budget.exit_threshold,
        }
    return {"budget": budget}


def test_auto_at_threshold_zero_is_generate_auto_and_the_max_budget(server, model):
    client = openai.OpenAI(base_url=server.base, api_key="dummy", max_retries=0, timeout=60)
    prompt = _ids(model, PROMPTS[0])
    r = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"budget": "auto", "exit_threshold": 0, "ignore_eos": True},
    )
    tokens, depths = alone(model, prompt, AutoRow(0, 2, 0.0))
    assert (tokens, depths) == alone(model, prompt, 2)  # threshold 0 is the max budget
    assert r.choices[0].text == model.tokenizer.decode(tokens, skip_special_tokens=True)
    cost = r.model_extra["cost"]
    assert cost["budget"] == "auto" and (cost["min_budget"], cost["max_budget"]) == (0, 2)
    assert cost["mean_depth"] == 2.0 and cost["tokens"] == TOKENS
    deepest = next(m for m in client.models.list().data if m.id == f"{NAME}@2").model_extra["cost"]
    assert cost["layer_executions"] == deepest["layer_executions"]
    assert cost["kv_bytes_per_token"] == deepest["kv_bytes_per_token"]


def test_concurrent_auto_and_fixed_requests_each_get_what_they_get_alone(server, model, threshold):
    client = openai.OpenAI(base_url=server.base, api_key="dummy", max_retries=0, timeout=60)
    budgets = _requests(threshold)
    prompts = [_ids(model, PROMPTS[i % len(PROMPTS)]) for i in range(len(budgets))]
    before = server.metrics()

    def ask(i):
        extra = {**_body(budgets[i]), "ignore_eos": True}
        r = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=TOKENS, temperature=0, extra_body=extra)
        return r.choices[0].text, r.model_extra["cost"]

    with ThreadPoolExecutor(len(budgets)) as pool:
        got = list(pool.map(ask, range(len(budgets))))
    seen: list[int] = []
    for i, (text, cost) in enumerate(got):
        tokens, depths = alone(model, prompts[i], budgets[i])
        assert text == model.tokenizer.decode(tokens, skip_special_tokens=True), (i, budgets[i])
        if isinstance(budgets[i], AutoRow):
            assert cost["budget"] == "auto" and cost["mean_depth"] == pytest.approx(sum(depths) / TOKENS, abs=1e-4)
            assert cost["exit_threshold"] == budgets[i].exit_threshold
            seen += depths
        else:
            assert cost["budget"] == budgets[i]
    after = server.metrics()
    grew = {  # per bucket: tokens of adaptive requests at that depth or shallower
        le: metric(after, "looptool_realised_depth_bucket", le=le)
        - metric(before, "looptool_realised_depth_bucket", le=le)
        for le in ("0.0", "1.0", "2.0", "+Inf")
    }
    assert grew == {"0.0": seen.count(0), "1.0": seen.count(0) + seen.count(1), "2.0": len(seen), "+Inf": len(seen)}
    assert len(set(seen)) > 1


def test_a_streamed_auto_chat_ends_with_its_realised_depth(server, model):
    with httpx.stream(
        "POST",
        f"{server.base}/chat/completions",
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "budget": "auto",
            "exit_threshold": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["usage"]["completion_tokens"] == 4
    assert last["cost"]["budget"] == "auto" and last["cost"]["mean_depth"] == 2.0


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"budget": "auto", "min_budget": 5}, "min_budget", "not in the budget menu"),
        ({"budget": "auto", "max_budget": "2"}, "max_budget", "must be an integer"),
        ({"budget": "auto", "min_budget": 2, "max_budget": 1}, "min_budget", "above max_budget"),
        ({"budget": "auto", "exit_threshold": -1}, "exit_threshold", "number >= 0"),
        ({"budget": "auto", "exit_threshold": "low"}, "exit_threshold", "number >= 0"),
        ({"min_budget": 0}, "min_budget", 'applies to budget "auto" only'),
        ({"budget": 1, "exit_threshold": 0.1}, "exit_threshold", 'applies to budget "auto" only'),
        ({"budget": "auto", "model": f"{NAME}@1"}, "model", "asks for a fixed budget"),
        ({"budget": "auto", "reasoning_effort": "low"}, "reasoning_effort", "asks for a fixed budget"),
        ({"budget": "auto", "echo": True, "logprobs": 1}, "echo", "fixed budget"),
        ({"budget": "Auto"}, "budget", 'or "auto"'),
    ],
)
def test_bad_auto_fields_are_one_sentence_naming_the_field(server, body, param, words):
    r = httpx.post(
        f"{server.base}/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["message"].count(". ") == 0 and error["message"].endswith("."), error["message"]


def test_the_resolver_fills_in_the_auto_defaults_and_keeps_fixed_budgets_as_they_were():
    r = BudgetResolver.create(NAME, (0, 3, 6))
    assert r.choose(NAME, "auto") == AutoRow(0, 6, 0.05)
    assert r.choose(NAME, "auto", min_budget=3, exit_threshold=0) == AutoRow(3, 6, 0.0)
    assert r.choose(NAME, "auto", exit_threshold=10**400).exit_threshold == float("inf")  # never a crash
    assert r.choose(f"{NAME}@3") == 3 and r.choose(NAME, "low") == r.resolve(NAME, "low")
    with pytest.raises(looptool.LooptoolError, match="number >= 0") as err:
        r.choose(NAME, "auto", exit_threshold=float("nan"))
    assert err.value.parameter == "exit_threshold"
    with pytest.raises(looptool.LooptoolError, match="does not exist"):
        r.choose("other", "auto")


# ------------------------------------------------------------------ servers that cannot
@pytest.mark.parametrize("kind", ["per-loop", "fixed-only"])
def test_a_server_that_cannot_run_auto_refuses_it_in_one_sentence(model_dir, kind):
    served = open_model(model_dir, name=NAME, runtime="pytorch", device="cpu", kv="per-loop")
    if kind == "fixed-only":
        served = dataclasses.replace(served, engine=plain_steps(served.engine), runtime="onnxruntime")
    scheduler = Scheduler(served.engine, max_batch=1, capacity=64, max_queue=0)
    app = create_app(served, scheduler, BudgetResolver.create(NAME, served.budgets))
    client = TestClient(app)  # no lifespan: refused requests never reach the scheduler
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, "budget": "auto"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    want = "--kv last-loop" if kind == "per-loop" else "onnxruntime engine"
    assert error["param"] == "budget" and want in error["message"], error
    assert error["message"].count(". ") == 0
    with pytest.raises(looptool.LooptoolError, match="fixed budgets only" if kind == "fixed-only" else "last-loop"):
        raise served.engine.capabilities.adaptive_refusal
