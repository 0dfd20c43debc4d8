"""``looptool export`` at its defaults on every family the tool claims: dense (Llama),
parallel residual (GPT-NeoX), MoE (Qwen3-MoE, fixed-prefix looping) and ELR with loop
conditioning and MoE route replay (Qwen3-MoE), each with seeded non-zero new parameters.

The TensorRT export runs with ``--build-on-target`` and nothing else: its default precision
(fp16) rebuilds an fp16 copy of the fp32 model, exports it and validates every graph in
onnxruntime against that copy's PyTorch path (where an fp16 MoE export once failed). The fp16 TensorRT variants are then run in onnxruntime against the validated graphs.
The plain ONNX export at its defaults runs for the families no other test covers (dense:
``tests/test_defaults.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.backends.interface import BUDGETS
from looptool.backends.manifest import Manifest
from looptool.backends.onnx.validate import FP16_ATOL
from looptool.backends.tensorrt.export import PLUGIN_NAMESPACE, weight_arrays
from looptool.backends.tensorrt.moe import MOE_OPS
from looptool.cli import app
from looptool.core.graph import ROWWISE
from looptool.testing import tiny_model

FAMILIES = {
    "dense": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "parallel-residual": ("gpt_neox", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "moe": ("qwen3_moe", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "elr-conditioning-route-replay": (
        "qwen3_moe",
        looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2, conditioning=True, route_replay=True),
    ),
}
PLUGINS = {  # looptool nodes each family's deepest TensorRT variant must hand to a plugin
    "dense": {"GatedResidual"},
    "parallel-residual": {"GatedResidual"},
    "moe": {"GatedResidual", *MOE_OPS},
    "elr-conditioning-route-replay": {*MOE_OPS, "Modulate", "AdaptiveDeltaUpdate"},
}
# fp16 variant against the validated fp16 graph, logits and caches: the export's own fp16 limit
# (FP16_ATOL; |logits| < 1 here). Measured: 0 for the dense families, <= 2e-3 for the MoE ones
# (the variant's MoE steps multiply in fp32 and round once, the graph's dense Moe body rounds
# in fp16 after each op) and for ELR (also its AdaptiveDelta split into Gemm +
# AdaptiveDeltaUpdate, which rounds differently in fp16)
VARIANT_ATOL = FP16_ATOL


def _trained_like(model: looptool.LoopedModel, seed: int = 0) -> looptool.LoopedModel:
    """New parameters set to seeded non-zero values: vectors N(0, 0.5²), matrices N(0, 0.5²/fan_in)
    (plain N(0, 0.5²) conditioning heads drive the fp32 residual stream past fp16's 65504)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.new_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 / math.sqrt(fan_in))
    return model


class _Models(dict):
    """Each family converted and saved when a test first asks for it."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        arch, plan = FAMILIES[family]
        self[family] = _trained_like(looptool.convert(tiny_model(arch), plan)).save_pretrained(self.root / family)
        return self[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("families"))


def _export(args: list[str]) -> Manifest:
    """Run ``looptool export ARGS``; the written manifest."""
    res = CliRunner().invoke(app, ["export", *args])
    assert res.exit_code == 0, res.output
    assert "not validated" not in res.output
    return Manifest.read(Path(args[2]))


def _graphs(manifest: Manifest) -> dict:
    """``{(budget, policy): entry}`` of every graph, the row-wise ones included."""
    return {(b, p): e for b, ps in manifest.graphs.items() for p, e in ps.items()}


def _check_validated(manifest: Manifest, family: str, limit: float, looped: bool = False) -> None:
    """Every graph was validated on both prompts, within ``limit``: every budget's and the
    row-wise one, or (``looped``: the onnx default for a fixed-prefix plan) the one looped
    row-wise graph, at every budget alone and with its rows at every budget."""
    graphs = _graphs(manifest)
    budgets = FAMILIES[family][1].budgets
    assert {b for b, _ in graphs if b != ROWWISE} == (set() if looped else set(budgets))
    assert {p for _, p in graphs} == {"per-loop"} and (ROWWISE, "per-loop") in graphs  # the default kv, row-wise on
    assert bool(graphs[ROWWISE, "per-loop"].loops) == looped
    for key, entry in graphs.items():
        diff = entry.max_abs_diff
        alone = {f"{p}@{k}" for p in ("random", "real") for k in budgets} if looped else set()
        assert set(diff) == {"random", "real"} | alone, key
        assert all(0 <= d <= limit for d in diff.values()), (key, diff)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensorrt_export_defaults_validate(models, family, tmp_path):
    """``looptool export DIR -o OUT --backend tensorrt --build-on-target``: the fp16 copy's graphs
    validated within 1e-2 x max(1, |logits|) (``FP16_ATOL``), and every fp16 TensorRT variant
    (functions inlined, looptool nodes as plugin nodes, weights as inputs) gives the validated
    graph's logits and caches in onnxruntime within ``VARIANT_ATOL`` at a prefill and a decode step."""
    out = tmp_path / "trt"
    manifest = _export([str(models[family]), "-o", str(out), "--backend", "tensorrt", "--build-on-target"])
    assert manifest.tensorrt.precision == "fp16" and manifest.dtype == "float16"
    _check_validated(manifest, family, FP16_ATOL)
    weights = weight_arrays(out, manifest)
    variants = manifest.tensorrt.graphs
    deepest = max(manifest.budgets)
    assert set(variants[deepest]["per-loop"].plugins) == PLUGINS[family]
    rng = np.random.default_rng(0)
    for (budget, policy), entry in _graphs(manifest).items():
        variant = variants[budget][policy]
        plugin_nodes = [n for n in onnx.load(str(out / variant.file)).graph.node if n.domain == PLUGIN_NAMESPACE]
        assert len(plugin_nodes) == sum(variant.plugins.values())
        graph, trt = (
            ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for f in (entry.file, variant.file)
        )
        inputs = {i.name: i for i in graph.get_inputs()}
        batch, capacity = 2, 12
        caches = {
            n: np.zeros((batch, i.shape[1], capacity, i.shape[3]), np.float16) for n, i in inputs.items() if "past" in n
        }
        for start, step in ((0, 5), (5, 1)):
            feeds = {
                "input_ids": rng.integers(0, 256, (batch, step)),
                "attention_mask": np.ones((batch, capacity), np.dtype(manifest.mask_dtype)),
                "position_ids": np.tile(np.arange(start, start + step), (batch, 1)),
                "cache_position": np.arange(start, start + step),
                **({BUDGETS: np.array([min(entry.menu), max(entry.menu)])} if BUDGETS in inputs else {}),
                **caches,
            }
            ref = graph.run(None, feeds)
            got = trt.run(None, {**feeds, **{n: weights[n] for n in variant.weight_inputs}})
            assert ref[0].dtype == np.float16 and np.isfinite(ref[0]).all(), (budget, policy)
            for a, b in zip(ref, got):
                np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=0, atol=VARIANT_ATOL)
            caches = dict(zip(caches, ref[1:]))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "dense"])  # dense: tests/test_defaults.py
def test_onnx_export_defaults_validate(models, family, tmp_path):
    """``looptool export DIR -o OUT``: per-loop caches, the model's own dtype (fp32); a
    fixed-prefix plan: one looped row-wise graph, an ELR plan: every budget and the row-wise
    graph; each validated within 1e-4 x max(1, |logits|)."""
    manifest = _export([str(models[family]), "-o", str(tmp_path / "onnx")])
    assert manifest.dtype == "float32" and manifest.tensorrt is None
    _check_validated(manifest, family, 1e-4, looped=isinstance(FAMILIES[family][1], looptool.PrefixLoop))
