"""One graph for every budget: the window of a fixed-prefix plan as ONNX ``Loop`` nodes
(:mod:`looptool.backends.onnx.looped`), exported by default, run as one session."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch

import looptool
from looptool.backends.manifest import Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.onnx.selection import looped_by_default
from looptool.backends.ort.engine import OrtStepEngine
from looptool.backends.ort.runtime import Runtime
from looptool.core.graph import ROWWISE
from looptool.engine.budgets import RowBudgets
from looptool.runtime.generation import generate
from looptool.testing import every_onnx_node, left_padded_batch, move_off_init, tiny_model

PLAN = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))


@pytest.fixture(scope="module")
def model() -> looptool.LoopedModel:
    """A tiny llama looped over layers 1-2 with trained-looking (non-zero) gates, so every budget differs."""
    return move_off_init(looptool.convert(tiny_model("llama"), PLAN), scale=0.2, seed=5)


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """The default export (one looped graph) and the masked, unrolled one, each validated."""
    root = tmp_path_factory.mktemp("looped")
    looped = export_onnx(model, root / "loop")
    unrolled = export_onnx(model, root / "unrolled", "none", loop=False)
    return (looped, root / "loop"), (unrolled, root / "unrolled")


def test_the_default_export_is_one_looped_graph_whose_weights_have_one_consumer_each(model, engines):
    (report, directory), _ = engines
    manifest = Manifest.read(directory)
    assert manifest.budgets == () and [b.budget for b in report.rowwise] == [ROWWISE]
    entry = manifest.graph(ROWWISE, "per-loop")
    assert entry.form == "loop" and entry.loops == {1: 1, 2: 2}  # layer -> smallest budget that repeats it
    assert report.rowwise[0].form == "loop"
    graph = onnx.load(directory / entry.file, load_external_data=False).graph
    nodes = list(every_onnx_node(graph))
    assert collections.Counter(n.op_type for n in nodes)["Loop"] == 2
    consumers = collections.Counter(i for n in nodes for i in n.input)
    weights = [name for name in manifest.weights.tensors if ".layers.1." in name or ".layers.2." in name]
    assert weights and all(consumers[name] == 1 for name in weights), {w: consumers[w] for w in weights}


def test_the_looped_graph_decodes_every_budget_and_mix_as_pytorch_does_in_one_session(model, engines):
    (_, directory), (_, unrolled) = engines
    rt = Runtime(directory)
    assert rt.one_graph and rt.prepack and not rt.spin  # one session: one packed copy; spinning is asked for
    assert Runtime(directory, spin=None).spin  # as looptool run and serve ask: spin where there is one session
    masked = Runtime(unrolled, spin=None)
    assert not (masked.one_graph or masked.prepack or masked.spin)  # a masked graph: the per-budget defaults
    ids, mask = left_padded_batch(3, length=6)
    for budget in (0, 1, 2, [2, 0, 1], [1, 1, 0]):
        ref = generate(model, ids, attention_mask=mask, budget=budget, max_new_tokens=6, output_logits=True)
        out = rt.generate(ids, attention_mask=mask, budget=budget, max_new_tokens=6, output_logits=True)
        assert torch.equal(torch.as_tensor(out.sequences), ref.sequences), budget
        for a, b in zip(out.logits, ref.logits):
            assert torch.allclose(torch.as_tensor(a), b, atol=1e-4), budget
    # caches far longer than the positions written: each pass attends over the written ones only
    ref = generate(model, ids, attention_mask=mask, budget=[2, 0, 1], max_new_tokens=6)
    out = rt.generate(ids, attention_mask=mask, budget=[2, 0, 1], max_new_tokens=6, capacity=96)
    assert torch.equal(torch.as_tensor(out.sequences), ref.sequences)
    assert len(rt._sessions) == 1
    rt.close()


def _step_caches(directory, budgets: list[int]) -> tuple[list, list]:
    """One prefill of the row-wise graph at ``budgets``: the caches after it and the layout's pairs."""
    engine = OrtStepEngine(Runtime(directory))
    cache = engine.allocate(len(budgets), 8)
    ids, _ = left_padded_batch(len(budgets), length=4)
    mask = torch.zeros(len(budgets), 8, dtype=engine.mask_dtype)
    mask[:, :4] = 1
    rows = RowBudgets(tuple(budgets))
    engine.step(
        cache, slice(0, len(budgets)), ids, mask, torch.arange(4).expand(len(budgets), 4), torch.arange(4), rows
    )
    return cache.buffers, list(engine.layout.pairs)


def test_a_batch_runs_only_the_passes_its_deepest_row_asks_for(engines):
    (_, looped), (_, unrolled) = engines
    for budgets, runs in (([0, 0], set()), ([1, 0], {1}), ([0, 2], {1, 2})):
        caches, pairs = _step_caches(looped, budgets)
        for j, pair in enumerate(pairs):
            written = bool(np.abs(caches[2 * j]).sum())
            assert written == (pair.execution == 1 or pair.layer in runs), (budgets, pair)
    # the masked graph runs every second pass whatever the rows ask for (what the loop saves)
    caches, pairs = _step_caches(unrolled, [0, 0])
    assert all(np.abs(caches[2 * j]).sum() for j in range(len(pairs)))


def test_an_int4_looped_graph_quantizes_the_linears_inside_its_loops(model, tmp_path):
    report = export_onnx(model, tmp_path / "q", quantize="int4")
    assert report.rowwise[0].form == "loop"
    graph = onnx.load(tmp_path / "q" / report.rowwise[0].file, load_external_data=False).graph
    in_loops = [n for loop in graph.node if loop.op_type == "Loop" for n in every_onnx_node(loop.attribute[0].g)]
    assert sum(n.op_type == "MatMulNBits" for n in in_loops) == 2 * 7  # q, k, v, o, gate, up, down per window layer
    rt = Runtime(tmp_path / "q")
    ids, mask = left_padded_batch(2, length=5)
    out = rt.generate(ids, attention_mask=mask, budget=[2, 0], max_new_tokens=4)
    assert out.sequences.shape == (2, 9) and len(rt._sessions) == 1


def test_plans_and_settings_the_loop_does_not_cover_keep_a_graph_per_budget(model, tmp_path):
    assert looped_by_default(model.plan, ("per-loop",))
    assert not looped_by_default(model.plan, ("per-loop",), speculative=True)  # drafts run per-budget graphs
    assert not looped_by_default(model.plan, ("last-loop",))
    assert not looped_by_default(model.plan, ("per-loop",), loop=False)
    elr = looptool.convert(tiny_model("llama"), looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2))
    assert not looped_by_default(elr.plan, ("per-loop",))
    report = export_onnx(model, tmp_path / "e", loop=False)
    assert [b.budget for b in report.budgets] == [0, 1, 2] and report.rowwise[0].form == "unrolled"


def test_layer_bodies_reshape_to_constant_targets(engines):
    """The exporter computes reshape targets from Shape/Squeeze/Concat chains at run time;
    constant_reshapes makes them constants (0 copies the input's size), so a layer body has no
    such chain left: every Reshape reads a Constant target and no Concat or Squeeze remains."""
    (report, directory), _ = engines
    model = onnx.load(directory / report.rowwise[0].file, load_external_data=False)
    layers = [f for f in model.functions if any(n.op_type == "Attention" for n in f.node)]
    assert layers
    for f in layers:
        constants = {o for n in f.node if n.op_type == "Constant" for o in n.output}
        ops = collections.Counter(n.op_type for n in f.node)
        assert ops["Concat"] == ops["Squeeze"] == 0, (f.name, ops)
        assert all(n.input[1] in constants for n in f.node if n.op_type == "Reshape"), f.name
