"""``looptool.open_engine(path)``: the engine object that ``generate``, ``run`` and ``serve``
share, for a looped model directory and for an exported engine directory; its ``generate``
gives what the model's and the runtime's own ``generate`` give (all three run the engine core).
The onnxruntime engine's prefix cache is checked here too, on the same export."""

from __future__ import annotations

import pytest
import torch
from test_prefix_cache import PREFIX, _hits, _question, _same, serve_one_by_one

import looptool
from looptool.engine.budgets import AutoRow
from looptool.engine.prefix_cache import PrefixCache
from looptool.testing import byte_tokenizer, move_off_init, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = looptool.convert(
        tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)), tokenizer=byte_tokenizer()
    )
    move_off_init(model)
    return model, model.save_pretrained(tmp_path_factory.mktemp("open") / "looped")


def test_a_looped_model_directory_opens_as_the_engine_generate_and_serve_use(saved):
    model, directory = saved
    engine = looptool.open_engine(directory)
    assert engine.runtime == "pytorch" and engine.engine.budgets == (0, 2)
    ids = torch.randint(3, 250, (3, 6), generator=torch.Generator().manual_seed(0))
    eos = list(engine.eos)
    got = engine.generate(ids, budget=[2, 0, 2], max_new_tokens=5)
    assert torch.equal(got.sequences, model.generate(ids, budget=[2, 0, 2], max_new_tokens=5, eos_token_id=eos))
    spec = engine.generate(ids[:1], budget=2, draft_budget=0, draft_tokens=2, max_new_tokens=6)
    assert torch.equal(spec.sequences, engine.generate(ids[:1], budget=2, max_new_tokens=6).sequences)
    assert spec.speculation.proposed > 0
    with pytest.raises(looptool.LooptoolError, match="last-loop KV policy"):
        engine.generate(ids, budget="auto")
    auto = looptool.open_engine(directory, kv="last-loop").generate(
        ids, budget="auto", auto=AutoRow(0, 2, 0.0), max_new_tokens=4
    )
    assert (auto.depths == 2).all()  # threshold 0: always the deepest
    ref = model.generate(ids, budget=2, kv="last-loop", max_new_tokens=4, eos_token_id=eos)
    assert torch.equal(auto.sequences, ref)


@pytest.fixture(scope="module")
def engine_dir(saved, tmp_path_factory):
    """The looped model's onnxruntime engine (export's defaults: one looped graph)."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    from looptool.backends.onnx.export import export_onnx

    directory = tmp_path_factory.mktemp("engine") / "engine"
    export_onnx(saved[0], directory, validate=False)
    return directory


def test_an_engine_directory_opens_as_the_engine_its_runtime_generates_with(engine_dir):
    from looptool.backends.ort.runtime import Runtime

    engine = looptool.open_engine(engine_dir)
    assert engine.runtime == "onnxruntime"
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(1))
    got = engine.generate(ids, budget=[0, 2], max_new_tokens=5, eos_token_id=None)
    want = Runtime(engine_dir).generate(ids, budget=[0, 2], max_new_tokens=5)
    assert torch.equal(got.sequences, torch.as_tensor(want.sequences))
    with pytest.raises(looptool.LooptoolError, match="verify graph"):
        engine.generate(ids, budget=2, draft_budget=0, max_new_tokens=4)


def test_the_onnxruntime_engine_reuses_a_prefix_and_gives_what_no_cache_gives(engine_dir):
    from looptool.backends.ort.engine import OrtStepEngine
    from looptool.backends.ort.runtime import Runtime

    engine = OrtStepEngine(Runtime(engine_dir))
    asked = [(PREFIX + _question(0), 2), (PREFIX + _question(1), 2), (PREFIX + _question(2), 0)]
    without, _ = serve_one_by_one(engine, asked, None)
    with_cache, scheduler = serve_one_by_one(engine, asked, PrefixCache())
    _same(with_cache, without)
    assert _hits(scheduler) == 32
