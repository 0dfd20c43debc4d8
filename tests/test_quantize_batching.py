"""Batch invariance of weight-only int8/int4 engines: a prompt decoded alone gives the tokens
(and, to float noise, the logits) it gets in any batch, of any size and mix of budgets, through
``Runtime.generate`` (``looptool run``) and through the scheduler over the onnxruntime step engine
(``looptool serve``); int8 activations (``accuracy_level=4``) trade that for speed, are refused
where nothing is quantized, are flagged by the manifest and re-exported by ``exported_engine``.

Why logits and not only tokens: int8 activations move a row's logits by ~1e-3 with its batch
(float activations, like float engines: ~1e-6), which changes a greedy token only at a near tie
(SmolLM2-135M: 3 of 8 served answers); a tiny model rarely has one, so the logits are what show
the dependence on every machine, and the tokens are checked as well.
"""

from __future__ import annotations

import logging

import onnx
import pytest
from onnx import helper
from serve_process import alone_answer, budget_job, prompt_ids, run_jobs

import looptool
from looptool.backends.engines import EngineOptions, export_options
from looptool.backends.errors import ExportError
from looptool.backends.manifest import Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.onnx.quantize import ACCURACY_LEVEL, FAST_ACCURACY_LEVEL, batch_dependent
from looptool.backends.ort.directory import open_dir
from looptool.backends.ort.engine import OrtStepEngine
from looptool.backends.ort.runtime import Runtime
from looptool.testing import batch_gaps, byte_tokenizer, move_off_init, tiny_model

PRECISIONS = ("int8", "int4")
BUDGETS = [2, 0, 1, 1, 2, 0]  # prompt i's budget
TOKENS = 8
# Max |logit| difference of a row between alone and batched: float32 noise (attention over a
# longer padded cache, another kernel for another row count; measured ≤ 2e-6 here) passes,
# int8 activations (measured 1e-3 to 5e-2 on this model) do not.
NOISE = 1e-5


@pytest.fixture(scope="module")
def model():
    """A tiny fixed-prefix Llama, wide enough (hidden 256) for int8 rounding to show, its new
    parameters moved off their init so that budgets differ, with the byte tokenizer (a server
    opens its engine)."""
    source = tiny_model("llama", num_layers=3, hidden_size=256, intermediate_size=512, vocab_size=512)
    plan = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
    return move_off_init(looptool.convert(source, plan, tokenizer=byte_tokenizer()))


def _engine(model, directory, precision: str, **options) -> Runtime:
    """``model`` exported at ``precision`` into ``directory`` (every budget's graph and the
    row-wise graph, last-loop KV; ``options`` beside the defaults), opened."""
    export_onnx(model, directory, "all", kv="last-loop", quantize=precision, validate=False, **options)
    return Runtime(directory)


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """Each precision's engine with the default settings, exported on first use."""
    root, opened = tmp_path_factory.mktemp("batching"), {}

    def engine(precision: str) -> Runtime:
        if precision not in opened:
            opened[precision] = _engine(model, root / precision, precision)
        return opened[precision]

    return engine


def _generate_gaps(rt: Runtime, groups: list[list[int]]) -> tuple[float, list[int]]:
    """:func:`~looptool.testing.batch_gaps` of the prompts at their budgets through ``rt``."""
    prompts = [prompt_ids(i) for i in range(len(BUDGETS))]
    return batch_gaps(rt.generate, prompts, BUDGETS, groups, TOKENS, kv="last-loop")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_run_gives_each_prompt_its_alone_answer_in_any_batch(engines, precision):
    rt = engines(precision)
    groups = [[0, 1, 2, 3, 4, 5], [0, 1], [2, 3, 4], [5, 4, 3, 2, 1]]  # sizes 6, 2, 3, 5; mixed budgets
    worst, differ = _generate_gaps(rt, groups)
    assert not differ, f"{precision}: prompts {differ} decode differently in a batch than alone"
    assert worst <= NOISE, f"{precision}: a prompt's logits move by {worst:.2e} with its batch"
    assert rt.manifest.quantization["accuracy_level"] == ACCURACY_LEVEL
    assert not batch_dependent(rt.manifest.quantization)


def _served(engine: OrtStepEngine, max_batch: int) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt through the scheduler, all queued before it starts, ``max_batch`` at a time:
    each one's tokens and their log-probabilities."""
    jobs = [budget_job(prompt_ids(i), b, TOKENS) for i, b in enumerate(BUDGETS)]
    for job in jobs:
        job.logprobs = 1
    events = run_jobs(engine, jobs, max_batch=max_batch, start_after=len(jobs)).events
    tokens = [[e.token for e in ev if e.kind == "token"] for ev in events]
    return tokens, [[e.logprob for e in ev if e.kind == "token"] for ev in events]


def test_serving_gives_each_request_its_alone_answer_in_any_batch(engines):
    """The scheduler over the int4 engine: one request at a time, then all six at once (the
    row-wise graph, mixed budgets) and three at a time (batches forming and draining)."""
    rt = engines("int4")
    engine = OrtStepEngine(rt, kv="last-loop")
    alone_tokens, alone_logprobs = _served(engine, max_batch=1)
    for i, budget in enumerate(BUDGETS):
        assert alone_tokens[i] == alone_answer(rt.generate, prompt_ids(i), budget, TOKENS)[0], i
    for max_batch in (len(BUDGETS), 3):
        tokens, logprobs = _served(engine, max_batch)
        assert tokens == alone_tokens, max_batch
        gap = max(abs(x - y) for a, b in zip(logprobs, alone_logprobs) for x, y in zip(a, b))
        assert gap <= NOISE, f"max_batch {max_batch}: a request's log-probabilities move by {gap:.2e}"


def test_int8_activations_are_an_option_that_says_answers_depend_on_the_batch(model, engines, tmp_path, caplog):
    """``accuracy_level=4`` writes level-4 MatMulNBits, which the manifest records and the checks
    above catch (its logits move with the batch); a server opening such an engine warns, and
    ``exported_engine`` exports it again."""
    rt = _engine(model, tmp_path / "fast", "int4", accuracy_level=FAST_ACCURACY_LEVEL)
    assert rt.manifest.quantization["accuracy_level"] == FAST_ACCURACY_LEVEL
    assert batch_dependent(rt.manifest.quantization)
    graph = onnx.load(str(tmp_path / "fast" / "rowwise.last-loop.onnx"), load_external_data=False)
    levels = {
        helper.get_attribute_value(a) for n in graph.graph.node for a in n.attribute if a.name == "accuracy_level"
    }
    assert levels == {FAST_ACCURACY_LEVEL}
    worst, _ = _generate_gaps(rt, [[0, 1, 2, 3, 4, 5], [2, 3, 4]])
    assert worst > 10 * NOISE  # the dependence the default avoids, seen by the same check
    reason = EngineOptions.of(precision="int4").missing_from(Manifest.read(tmp_path / "fast"))
    assert reason == "its int8 activations (accuracy level 4) make each answer depend on the batch"
    with caplog.at_level(logging.WARNING, logger="looptool.backends.ort.directory"):
        open_dir(tmp_path / "fast", kv="last-loop")
    assert "a request's greedy answer depends on the other requests in its batch" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="looptool.backends.ort.directory"):
        open_dir(engines("int4").directory, kv="last-loop")  # the default: no warning
    assert not caplog.text


def test_bad_accuracy_levels_are_refused_in_one_sentence(model, tmp_path):
    with pytest.raises(ExportError, match=r"accuracy level 2 is not supported; choose 1 .* or 4 ") as err:
        export_onnx(model, tmp_path / "a", [0], quantize="int4", accuracy_level=2, validate=False)
    assert err.value.parameter == "accuracy_level" and not (tmp_path / "a").exists()
    with pytest.raises(ExportError, match="accuracy level 4 applies to int8/int4 weights"):
        export_onnx(model, tmp_path / "b", [0], accuracy_level=4, validate=False)
    with pytest.raises(ExportError, match="accuracy level 4 applies to int8/int4 weights"):
        export_options("tensorrt", precision="fp16", accuracy_level=4, build_on_target=True)
    assert export_options("onnx", precision="int4")["accuracy_level"] == ACCURACY_LEVEL


def test_export_command_offers_int8_activations_and_says_what_they_cost(model_dir, tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app

    runner = CliRunner()
    base = ["export", str(model_dir), "--budget", "0", "--no-rowwise", "--no-validate", "--precision", "int4"]
    res = runner.invoke(app, [*base, "-o", str(tmp_path / "fast"), "--accuracy-level", "4"])
    assert res.exit_code == 0, res.output
    assert "int8 activations (accuracy level 4: faster, each answer depends on its batch)" in " ".join(
        res.output.split()
    )
    assert Manifest.read(tmp_path / "fast").quantization["accuracy_level"] == FAST_ACCURACY_LEVEL
    res = runner.invoke(app, [*base, "-o", str(tmp_path / "bad"), "--accuracy-level", "0"])
    assert res.exit_code == 1 and "accuracy level 0 is not supported" in " ".join(res.output.split())
    assert not (tmp_path / "bad").exists()
    res = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "400"})
    assert "depends on the batch it runs in" in " ".join(res.output.split())
