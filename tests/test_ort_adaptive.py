"""``budget="auto"`` on onnxruntime: the adaptive-depth graph of an engine exported with
``adaptive=True`` (:mod:`looptool.backends.onnx.adaptive`), run by ``Runtime.generate`` and by the
onnxruntime step engine, against the PyTorch adaptive path.

A tiny fixed-prefix model (state rule) and a tiny ELR model (KL rule), new parameters moved off
their init so that depths vary, are exported under last-loop KV (validated by the export); their
greedy tokens and per-token depths equal PyTorch's at thresholds 0, an intermediate one and
infinity, and threshold 0 gives ``max_budget``'s own graph's tokens. On the step engine a batch
mixing adaptive and fixed rows gives each row what it gets alone; ``looptool export --adaptive``,
``looptool run --budget auto`` and ``looptool serve ENGINE --kv last-loop`` (in process) run it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from serve_process import alone_answer, budget_job, run_jobs

import looptool
from looptool.backends.engine_files import check_external_data
from looptool.backends.errors import EngineError, ExportError
from looptool.backends.manifest import Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.engine import OrtStepEngine
from looptool.backends.ort.runtime import Runtime
from looptool.engine.budgets import AutoRow, RowBudgets
from looptool.engine.interface import StepBatch
from looptool.runtime.generation import generate
from looptool.testing import move_off_init, tiny_model

CASES = {  # plan, export arguments
    "prefix": (looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), dict(budgets="all", adaptive=True)),
    "elr": (looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3), dict(budgets="3", rowwise=False, adaptive="kl")),
}
RULE = {"prefix": "state", "elr": "kl"}
CANDIDATES = (0.3, 0.5, 0.7, 0.9, 0.2, 1.2, 0.1, 1e-2, 1e-3)  # tried until one mixes depths
TOKENS = 6


class _Engines(dict):
    """Each case converted, moved off init and exported once (last-loop KV), when first asked for."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, case: str):
        plan, options = CASES[case]
        model = looptool.convert(tiny_model("llama"), plan)
        move_off_init(model)
        report = export_onnx(model, self.root / case, kv="last-loop", **options)
        self[case] = (model, report, Runtime(self.root / case))
        return self[case]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return _Engines(tmp_path_factory.mktemp("adaptive"))


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids, mask


def _auto(model_or_rt, threshold: float, rule: str, **extra):
    ids, mask = _prompt()
    run = model_or_rt.generate if isinstance(model_or_rt, Runtime) else lambda *a, **k: generate(model_or_rt, *a, **k)
    auto = dict(budget="auto", exit_threshold=threshold, exit_rule=rule, max_new_tokens=TOKENS, **extra)
    return run(ids, attention_mask=mask, **auto)


def _mixing(model, rule: str) -> float:
    """A threshold at which PyTorch's depths vary over the prompt's tokens and rows."""
    for thr in CANDIDATES:
        if len(set(_auto(model, thr, rule).depths.flatten().tolist())) > 1:
            return thr
    pytest.fail("no candidate threshold mixes depths on this model")


@pytest.mark.parametrize("case", list(CASES))
def test_the_adaptive_graph_is_exported_validated_and_shares_the_weights(engines, case):
    model, report, rt = engines[case]
    rule = RULE[case]
    (entry,) = report.adaptive
    assert entry.file == f"adaptive.{rule}.last-loop.onnx" and entry.composed
    assert {"random.0", "random.default", "random.inf", "real.0", "real.inf"} <= set(entry.max_abs_diff)
    manifest = Manifest.read(rt.directory)
    graph = manifest.adaptive_graph(rule, "last-loop")
    assert graph is not None and graph.max_abs_diff == entry.max_abs_diff and graph.menu == model.budgets
    proto = onnx.load(str(rt.directory / graph.file), load_external_data=False)
    assert [o.name for o in proto.graph.output][:2] == ["logits", "depth"]  # the depth comes out of the graph
    assert [i.name for i in proto.graph.input][4:7] == ["min_budget", "max_budget", "exit_threshold"]
    names = check_external_data(rt.directory, rt.directory / graph.file)  # every weight read from weights.bin
    assert names and set(names) <= set(manifest.weights.tensors)
    assert (rt.directory / graph.file).stat().st_size < manifest.weights.bytes / 4  # no weight copied into it


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_depths_equal_pytorch_auto(engines, case):
    model, _, rt = engines[case]
    rule, deepest, shallowest = RULE[case], max(model.budgets), min(model.budgets)
    mixing = _mixing(model, rule)
    for thr in (0.0, mixing, float("inf")):
        ref, got = _auto(model, thr, rule), _auto(rt, thr, rule)
        assert torch.equal(got.sequences, ref.sequences), thr
        assert torch.equal(got.depths, ref.depths), thr
        want = deepest if thr == 0 else shallowest if thr == float("inf") else None
        if want is not None:
            assert set(got.depths.flatten().tolist()) == {want}
    assert len(set(_auto(rt, mixing, rule).depths.flatten().tolist())) > 1
    ids, mask = _prompt()
    own = rt.generate(ids, attention_mask=mask, budget=deepest, kv="last-loop", max_new_tokens=TOKENS)
    assert torch.equal(_auto(rt, 0.0, rule).sequences, own.sequences)  # threshold 0: max_budget's own graph
    narrow = dict(min_budget=model.budgets[1], max_budget=model.budgets[1])
    assert torch.equal(_auto(rt, mixing, rule, **narrow).depths, _auto(model, mixing, rule, **narrow).depths)


def test_refusals_are_one_sentence(engines, tmp_path):
    model, _, rt = engines["prefix"]
    with pytest.raises(EngineError, match="no adaptive-depth graph .kl rule") as err:
        _auto(rt, 0.0, "kl")
    assert "adaptive=" in str(err.value) and err.value.parameter == "budget"
    with pytest.raises(EngineError, match="needs kv='last-loop'"):
        _auto(rt, 0.0, "state", kv="per-loop")
    with pytest.raises(looptool.LooptoolError, match="not in this model's budget menu"):
        _auto(rt, 0.0, "state", max_budget=7)
    with pytest.raises(ExportError, match="kv='last-loop'") as err:
        export_onnx(model, tmp_path / "x", "0", kv="per-loop", adaptive=True, validate=False)
    assert err.value.parameter == "adaptive" and not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="names no exit rule"):
        export_onnx(model, tmp_path / "y", "0", kv="last-loop", adaptive="fast", validate=False)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_the_step_engine_serves_auto_and_fixed_rows_in_one_batch_each_as_alone(engines):
    model, _, rt = engines["prefix"]
    engine = OrtStepEngine(rt, kv="last-loop")
    assert engine.capabilities.adaptive
    with pytest.raises(EngineError, match="last-loop KV policy"):
        _per_loop_check(engine)
    with pytest.raises(EngineError, match="export it again with adaptive=True"):
        raise OrtStepEngine(rt, kv="last-loop", exit_rule="kl").capabilities.adaptive_refusal
    thr = _mixing(model, "state")
    budgets = [AutoRow(0, 2, 0.0), AutoRow(0, 2, thr), 0, AutoRow(1, 2, thr), 2, AutoRow(0, 1, thr)]
    ids, _ = _prompt()
    prompts = [ids[i % 2].tolist() for i in range(len(budgets))]
    jobs = [budget_job(prompt, b, TOKENS) for prompt, b in zip(prompts, budgets)]
    scheduler = run_jobs(engine, jobs, max_batch=len(jobs), start_after=len(jobs))  # one batch from the start
    events = scheduler.events
    assert scheduler.steps == TOKENS - 1  # one step per token for all rows together
    mixed = False
    for i, budget in enumerate(budgets):
        assert events[i][-1].kind == "finished", events[i][-1]
        tokens = [e.token for e in events[i] if e.kind == "token"]
        depths = [e.depth for e in events[i] if e.kind == "token"]
        assert (tokens, depths) == alone_answer(rt.generate, prompts[i], budget, TOKENS), (i, budget)
        mixed |= isinstance(budget, AutoRow) and len(set(depths)) > 1
    assert mixed  # some adaptive row changed depth from token to token


def _per_loop_check(engine: OrtStepEngine) -> None:
    engine.kv, kept = "per-loop", engine.kv
    try:
        raise engine._adaptive_refusal()
    finally:
        engine.kv = kept


def test_a_fixed_step_of_the_step_engine_reports_its_budgets(engines):
    _, _, rt = engines["prefix"]
    engine = OrtStepEngine(rt, kv="last-loop")
    ids, _ = _prompt()
    n = ids.shape[1]
    args = (ids, np.ones((2, n), dtype=np.int64), torch.arange(n)[None].expand(2, n), torch.arange(n))
    mixed = RowBudgets((2, 1), (AutoRow(0, 2, 0.0), None))
    out = engine.run(engine.allocate(2, n), StepBatch(slice(0, 2), *args, mixed))
    fixed = engine.run(engine.allocate(2, n), StepBatch(slice(0, 2), *args, RowBudgets((2, 1))))
    assert out.depths.tolist() == fixed.depths.tolist() == [2, 1]
    assert torch.allclose(out.logits, fixed.logits, atol=1e-5, rtol=0)


def test_cli_export_adaptive_then_run_and_serve_budget_auto(engines, tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app
    from looptool.testing import byte_tokenizer

    model, _, _ = engines["prefix"]
    model.tokenizer = byte_tokenizer()
    try:
        model.save_pretrained(tmp_path / "looped")
    finally:
        model.tokenizer = None
    out = tmp_path / "engines"
    runner = CliRunner()
    args = ["export", str(tmp_path / "looped"), "-o", str(out), "--budget", "all", "--kv", "last-loop", "--adaptive"]
    res = runner.invoke(app, [*args, "--no-validate"])
    assert res.exit_code == 0, res.output
    assert "adaptive.state.last-loop.onnx" in res.output
    files = ["adaptive.state.last-loop.onnx", *(f"budget_{k}.last-loop.onnx" for k in range(3))]
    assert sorted(p.name for p in out.glob("*.onnx")) == [*files, "rowwise.last-loop.onnx"]
    run = ["run", str(out), "--prompt", "Hello", "--max-new-tokens", "4", "--budget", "auto"]
    res = runner.invoke(app, [*run, "--exit-threshold", "0"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("Hello") and "kv last-loop" in res.output and "realised depth per token" in res.output
    for extra, message in (
        (["--exit-rule", "kl"], "no adaptive-depth graph (kl rule, last-loop)"),
        (["--kv", "per-loop"], "--budget auto needs --kv last-loop"),
    ):
        res = runner.invoke(app, [*run, *extra])
        assert res.exit_code == 1 and message in res.output, res.output
        assert "Traceback" not in res.output
    _serve_auto_over(out, model)


def _serve_auto_over(engine_dir, model) -> None:
    """``looptool serve ENGINE_DIR --kv last-loop`` (prepared in process, its uvicorn loop not run)
    answers a ``budget: "auto"`` request as ``Runtime.generate(budget="auto")`` and a fixed one."""
    pytest.importorskip("fastapi", reason="looptool serve needs the serve extra")
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from looptool.cli import app
    from looptool.serve.server import Server

    servers: list[Server] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "run", lambda self: servers.append(self))
        res = CliRunner().invoke(app, ["serve", str(engine_dir), "--kv", "last-loop", "--port", "0", "--threads", "1"])
    assert res.exit_code == 0, res.output
    prompt = list(b"Hello")
    want = Runtime(engine_dir).generate(torch.tensor([prompt]), budget="auto", exit_threshold=0.0, max_new_tokens=4)
    with TestClient(servers[0].app) as client:
        body = {"model": Path(engine_dir).resolve().name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/completions", json={**body, "budget": "auto", "exit_threshold": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        cost = r.json()["cost"]
        assert cost["budget"] == "auto" and cost["mean_depth"] == 2.0 and cost["tokens"] == 4
        assert r.json()["choices"][0]["text"] == servers[0].served.tokenizer.decode(
            want.sequences[0, len(prompt) :].tolist(), skip_special_tokens=True
        )
        r = client.post("/v1/completions", json={**body, "budget": 1})
        assert r.status_code == 200 and r.json()["cost"]["budget"] == 1, r.text
