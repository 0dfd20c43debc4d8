"""The TensorRT step engine in every part that runs without TensorRT: built engines (the
test double of TensorRT's API, ``fake_tensorrt``, runs each engine's TensorRT-flavoured graph
in onnxruntime and reads and writes the raw addresses bound to it) served through the
scheduler, a mixed-budget batch against the onnxruntime step engine and each row generated
alone, and :func:`looptool.engine.open_engine` choosing TensorRT for such a directory."""

from __future__ import annotations

import functools
import shutil
import threading

import pytest
import torch

import looptool
from looptool.testing import byte_tokenizer, tiny_model

pytest.importorskip("onnxruntime", reason="the TensorRT test double runs graphs in onnxruntime")
pytest.importorskip("onnxscript", reason="export needs the onnx extra")

BUDGETS = (0, 2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama with non-zero gates, exported for TensorRT with its default precision
    (fp16) on target: the variants, the row-wise graph and build.py, no engines yet."""
    from looptool.backends.tensorrt.export import export_tensorrt

    model = looptool.convert(
        tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=BUDGETS), tokenizer=byte_tokenizer()
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    out = tmp_path_factory.mktemp("trt") / "engine"
    export_tensorrt(model, out, "all", build_on_target=True, max_batch=4, max_prefill=64, max_capacity=128)
    return out


@pytest.fixture
def built(exported, tmp_path, monkeypatch):
    """A copy of the export with engines built by the test double, on a pretend CUDA GPU."""
    import fake_tensorrt

    from looptool.backends.tensorrt import plugins as trt_plugins
    from looptool.backends.tensorrt.export import build_engines

    fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(trt_plugins, "register", functools.cache(trt_plugins.register.__wrapped__))  # registers anew
    fake_tensorrt.pretend_gpu(monkeypatch)
    directory = tmp_path / "e"
    shutil.copytree(exported, directory)
    build_engines(directory)
    return directory


def _serve(engine, prompts: list[list[int]], budgets: list[int], tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt at its budget, all submitted at once to one scheduler (so
    rows of both budgets share decode steps and the row-wise engine runs)."""
    from looptool.serve.scheduler import Job, Scheduler

    scheduler = Scheduler(engine, max_batch=4, capacity=32, max_queue=4)
    out = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(i):
        def emit(event):
            if event.kind == "token":
                out[i].append(event.token)
            elif event.kind in ("finished", "failed"):
                assert event.kind == "finished", event.message
                done[i].set()

        return emit

    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        scheduler.submit(Job(prompt, budget, tokens, ignore_eos=True, emit=emitter(i)))
    scheduler.start()
    try:
        assert all(d.wait(120) for d in done)
    finally:
        scheduler.stop(30)
    return out


def test_a_mixed_budget_batch_through_the_tensorrt_step_engine_equals_onnxruntime_and_each_row_alone(built):
    from looptool.backends.ort.engine import OrtStepEngine
    from looptool.backends.ort.runtime import Runtime as OrtRuntime
    from looptool.backends.tensorrt.engine import TrtStepEngine
    from looptool.backends.tensorrt.runtime import Runtime as TrtRuntime

    rt = TrtRuntime(built, device="cpu")
    trt = TrtStepEngine(rt)
    ort_rt = OrtRuntime(built)
    ort = OrtStepEngine(ort_rt)
    assert trt.budgets == ort.budgets == BUDGETS and trt.vocab_size == ort.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    budgets = [2, 0, 0, 2]
    got = _serve(trt, prompts, budgets, 6)
    assert got == _serve(ort, prompts, budgets, 6)
    for prompt, budget, tokens in zip(prompts, budgets, got):
        alone = ort_rt.generate(torch.tensor([prompt]), budget=budget, max_new_tokens=6)
        assert tokens == alone.sequences[0, len(prompt) :].tolist()
    rowwise = rt.engines["rowwise", "per-loop"]
    assert rowwise.runs > 0  # mixed decode steps ran the row-wise engine
    assert {a: rt.contexts["rowwise", "per-loop"].addresses[a] for a in ("budgets",)}  # and bound its budgets


def test_open_engine_serves_built_engines_with_tensorrt(built):
    from looptool.engine import describe, open_engine

    opened = open_engine(built, device="cpu")
    assert opened.runtime == "tensorrt" and opened.engine.budgets == BUDGETS
    assert sorted(opened.costs) == list(BUDGETS) and opened.costs[2]["layer_executions"] == 6
    assert describe(built).budgets == BUDGETS
    assert open_engine(built, runtime="onnxruntime").runtime == "onnxruntime"  # the same directory on onnxruntime


def test_without_a_gpu_an_engine_directory_is_served_by_onnxruntime(exported):
    from looptool.core.errors import LooptoolError
    from looptool.engine import open_engine

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert open_engine(exported).runtime == "onnxruntime"
    with pytest.raises(LooptoolError, match="not a directory the tensorrt runtime serves"):
        open_engine(exported, runtime="tensorrt")
