"""Batch invariance by budget through a real server: 12 concurrent greedy requests spread over
every budget of a conditioned ELR model (loop-conditioned modulation, ELR Sec. 3.3, every new
parameter non-zero), served by PyTorch, by onnxruntime from its exported engine and by TensorRT
from its built engines (under the TensorRT test double, ``fake_tensorrt``, in the server
process), each equal token for token to generating that prompt alone at its budget with the
same runtime."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from serve_process import ServerProcess, tiny_looped

import looptool
from looptool.runtime.generation import generate

openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install 'looptool[test]')")
pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

NAME = "elr"
PLAN = looptool.RecurrentLoop(recurrent=(1, 2), max_loops=3, conditioning=True, cond_dim=16, rank=4, init="exact")
PROMPTS = [f"Row {i}: {'abc' * (i % 4)}" for i in range(12)]
TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_looped(tmp_path_factory.mktemp("serve") / NAME, PLAN, seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    return looptool.load(model_dir)


def _concurrent(base: str, budgets: list[int]) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=base, api_key="dummy", max_retries=0, timeout=120)

    def ask(i):
        r = client.completions.create(model=f"{NAME}@{budgets[i]}", prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0)
        assert r.model_extra["cost"]["budget"] == budgets[i]
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


def _check(got, tok, alone) -> None:
    for i, (text, count) in enumerate(got):
        want = alone(i)
        assert (text, count) == (tok.decode(want, skip_special_tokens=True), len(want)), i
    assert len({text for text, _ in got}) > 3


def test_elr_requests_of_every_budget_batch_together_and_equal_generating_alone(model_dir, model, tmp_path):
    assert all(p.abs().sum() > 0 for _, p in model.new_parameters())
    budgets = [model.budgets[i % len(model.budgets)] for i in range(len(PROMPTS))]
    server = ServerProcess(model_dir, "--max-batch", "4", "--capacity", "64", "--device", "cpu", log=tmp_path / "log")
    try:
        got = _concurrent(server.base, budgets)
    finally:
        assert server.stop() == 0
    tok = model.tokenizer

    def alone(i):
        ids = torch.tensor([tok(PROMPTS[i])["input_ids"]])
        out = generate(model, ids, budget=budgets[i], max_new_tokens=TOKENS, eos_token_id=tok.eos_token_id)
        return out.sequences[0, ids.shape[1] :].tolist()

    _check(got, tok, alone)


@pytest.mark.slow  # the ONNX export of every budget and the row-wise graph dominates
def test_the_onnxruntime_engine_serves_the_same_way(model, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    from looptool.backends.onnx.export import export_onnx

    engine_dir = tmp_path / NAME
    export_onnx(model, engine_dir, validate=False)
    budgets = [model.budgets[i % len(model.budgets)] for i in range(len(PROMPTS))]
    server = ServerProcess(engine_dir, "--max-batch", "4", "--capacity", "64", "--threads", "1", log=tmp_path / "log")
    _check_against_onnxruntime(server, engine_dir, model, budgets)


def _check_against_onnxruntime(server: ServerProcess, engine_dir, model, budgets: list[int]) -> None:
    """Serve the concurrent requests, stop the server, and compare each answer with that prompt
    generated alone by onnxruntime over ``engine_dir``."""
    from looptool.backends.ort.runtime import Runtime

    try:
        got = _concurrent(server.base, budgets)
    finally:
        assert server.stop() == 0
    rt = Runtime(engine_dir, threads=1)
    tok = model.tokenizer

    def alone(i):
        ids = torch.tensor([tok(PROMPTS[i])["input_ids"]])
        out = rt.generate(ids, budget=budgets[i], max_new_tokens=TOKENS, eos_token_id=tok.eos_token_id)
        return out.sequences[0, ids.shape[1] :].tolist()

    _check(got, tok, alone)


@pytest.mark.slow  # the TensorRT export of every budget and the row-wise graph dominates
def test_the_tensorrt_engine_serves_the_same_way(model, tmp_path, monkeypatch):
    """Built by the test double; the server runs TensorRT's step engine. fp32: this model's new
    parameters are large enough (N(0, 0.5²)) to overflow fp16 in PyTorch itself; the export
    defaults (fp16) are covered in test_export_defaults."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    import fake_tensorrt

    from looptool.backends.tensorrt.export import build_engines, export_tensorrt

    engine_dir = tmp_path / NAME
    export_tensorrt(
        model, engine_dir, build_on_target=True, precision="fp32", max_batch=4, max_prefill=64, max_capacity=128
    )
    fake_tensorrt.install(monkeypatch)
    fake_tensorrt.pretend_gpu(monkeypatch)
    build_engines(engine_dir)
    budgets = [model.budgets[i % len(model.budgets)] for i in range(len(PROMPTS))]
    launcher = [str(Path(__file__).with_name("fake_trt_process.py"))]
    server = ServerProcess(
        engine_dir, "--max-batch", "4", "--capacity", "64", "--device", "cpu", log=tmp_path / "log", launcher=launcher
    )
    _check_against_onnxruntime(server, engine_dir, model, budgets)  # the TensorRT variants compute what ORT's do
    assert "runtime tensorrt" in (tmp_path / "log").read_text()
