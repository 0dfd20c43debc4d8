"""onnxruntime's fused ops in exported serving graphs (:mod:`looptool.backends.onnx.fuse_ort`):
what they replace, that the engine still validates, and that no weight is copied for them."""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import onnx
import onnx.inliner
import pytest

import looptool
from looptool.backends.manifest import WEIGHTS, Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.testing import tiny_model

LLAMA_PLAN = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
LAYERS = 4  # tiny_model's default


@functools.cache
def _llama():
    return looptool.convert(tiny_model("llama"), LLAMA_PLAN)


@pytest.fixture(scope="module")
def llama_engines(tmp_path_factory):
    """The tiny llama exported twice, lowered to onnxruntime's fused ops and not (every
    budget and the masked row-wise graph, every pass unrolled so that each graph's ops can be
    counted at its top level; each export validated against PyTorch)."""
    root = tmp_path_factory.mktemp("fuse_ort")
    fused = export_onnx(_llama(), root / "fused", "all", kv="per-loop", loop=False)
    plain = export_onnx(_llama(), root / "plain", "all", kv="per-loop", fuse_ort=False, loop=False)
    return (fused, root / "fused"), (plain, root / "plain")


def _inlined(path: Path) -> onnx.ModelProto:
    return onnx.inliner.inline_local_functions(onnx.load(str(path), load_external_data=False))


def _ops(graph: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in graph.graph.node)


def _graphs(report) -> list:
    return [*report.budgets, *report.rowwise]


def test_fused_ops_replace_the_exported_patterns(llama_engines):
    (fused, directory), (plain, plain_dir) = llama_engines
    for b, p in zip(_graphs(fused), _graphs(plain)):
        graph, before = _inlined(directory / b.file), _ops(_inlined(plain_dir / p.file))
        ops = _ops(graph)
        for op in ("FusedMatMul", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
            assert ops[op] > 0, (b.budget, op)
        assert ops["Attention"] == b.ort_ops["attention"] >= LAYERS
        assert ops["RotaryEmbedding"] == b.ort_ops["rotary"] == 2 * ops["Attention"]
        # every linear of a layer is a FusedMatMul over the stored weight; only the head's Gemm is left
        assert ops["FusedMatMul"] == b.ort_ops["linear"] == before["Gemm"] - ops["Gemm"]
        assert ops["Gemm"] == 1
        weights = {i.name for i in graph.graph.initializer}
        producer = {o: n for n in graph.graph.node for o in n.output}
        for node in graph.graph.node:
            if node.op_type == "FusedMatMul":
                assert node.input[1] in weights and node.domain == "com.microsoft"
                assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["transB"] == 1
            if node.op_type == "Attention":  # reads the caches as written, not a repeat_kv copy
                assert {producer[node.input[1]].op_type, producer[node.input[2]].op_type} == {"ScatterElements"}
            if node.op_type == "Expand":  # no repeat_kv of a cache remains
                source = producer.get(node.input[0])
                assert (
                    source is None
                    or source.op_type != "Unsqueeze"
                    or source.input[0]
                    not in {o for n in graph.graph.node if n.op_type == "ScatterElements" for o in n.output}
                )
        assert len(graph.graph.node) < 0.6 * sum(before.values())
        assert p.ort_ops == {}


def test_fused_engine_validates_with_the_same_weights(llama_engines):
    (fused, directory), (plain, plain_dir) = llama_engines
    assert fused.max_abs_diff <= 1e-4
    assert {(b.budget, b.kv) for b in _graphs(fused)} == {(b.budget, b.kv) for b in _graphs(plain)}
    # one copy of every weight: the same store, and each graph reads the same external tensors
    assert (directory / WEIGHTS).stat().st_size == (plain_dir / WEIGHTS).stat().st_size
    assert Manifest.read(directory).weights.tensors.keys() == Manifest.read(plain_dir).weights.tensors.keys()
    for b, p in zip(_graphs(fused), _graphs(plain)):
        names = [
            {i.name for i in onnx.load(str(d / g.file), load_external_data=False).graph.initializer}
            for d, g in ((directory, b), (plain_dir, p))
        ]
        assert names[0] == names[1], b.budget


def test_budget_zero_counts(llama_engines):
    (fused, _), _ = llama_engines
    zero = next(b for b in fused.budgets if b.budget == 0)
    # per layer: 7 linears, 2 RMSNorms (the second with the residual add), attention, rotary of q and k
    assert zero.ort_ops == {
        "linear": 7 * LAYERS,
        "rms_norm": 2 * LAYERS + 1,
        "skip_rms_norm": LAYERS,
        "attention": LAYERS,
        "rotary": 2 * LAYERS,
    }


def test_unmatched_architecture_is_left_as_exported(tmp_path):
    """gpt2 (biased Conv1D linears, LayerNorm, fused QKV): nothing matches, the graph is the
    plain export's (but for the no-op Identity nodes the lowering drops) and validates."""
    model = looptool.convert(tiny_model("gpt2"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1)))
    fused = export_onnx(model, tmp_path / "fused", [0], rowwise=False)
    plain = export_onnx(model, tmp_path / "plain", [0], rowwise=False, fuse_ort=False)
    assert fused.budgets[0].ort_ops == {}
    ops = [_ops(_inlined(tmp_path / d / r.budgets[0].file)) for d, r in (("fused", fused), ("plain", plain))]
    for counts in ops:
        counts.pop("Identity", None)
    assert ops[0] == ops[1]
    assert fused.max_abs_diff <= 1e-4
