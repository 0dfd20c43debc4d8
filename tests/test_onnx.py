"""ONNX export (one weights.bin, looptool-domain functions) and the onnxruntime Runtime."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from looptool.backends.onnx import (
    INLINE_LIMIT,
    MANIFEST,
    WEIGHTS,
    EngineError,
    ExportError,
    export_onnx,
    export_program,
    sha256_file,
)
from looptool.backends.ort import Runtime

import looptool
from looptool.testing import tiny_model

CASES = {
    "llama-prefix": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "gpt_neox-recurrent": ("gpt_neox", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)),
    "qwen3_moe-recurrent": ("qwen3_moe", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2, route_replay=True)),
}
_models: dict[str, looptool.LoopedModel] = {}


def looped(case: str) -> looptool.LoopedModel:
    """A converted tiny model with perturbed new parameters (so deeper budgets differ)."""
    if case not in _models:
        arch, plan = CASES[case]
        model = looptool.convert(tiny_model(arch), plan)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, p in model.new_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        _models[case] = model
    return _models[case]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Each case exported once, every budget (validated against PyTorch by the export)."""
    root = tmp_path_factory.mktemp("engines")
    return {case: (export_onnx(looped(case), root / case, "all"), root / case) for case in CASES}


def _graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


@pytest.mark.parametrize("case", list(CASES))
def test_every_budget_matches_pytorch(engines, case):
    report, directory = engines[case]
    model = looped(case)
    assert [b.budget for b in report.budgets] == list(model.budgets)
    for b in report.budgets:
        assert set(b.max_abs_diff) == {"random", "real"}
        assert max(b.max_abs_diff.values()) <= 1e-4, (case, b.budget, b.max_abs_diff)
    rt = Runtime(directory)
    g = torch.Generator().manual_seed(9)
    for shape in [(1, 1), (3, 21)]:  # dynamic batch and sequence, beyond the export example
        ids = torch.randint(0, model.config.vocab_size, shape, generator=g)
        for k in model.budgets:
            with torch.no_grad():
                ref = model(ids, budget=k).logits
            got = rt(ids, budget=k)
            assert isinstance(got, torch.Tensor) and got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-4, (case, k, shape)
    deep = [rt(np.arange(5)[None] % 256, budget=k) for k in model.budgets[-2:]]
    assert np.abs(deep[0] - deep[1]).max() > 1e-3  # budgets really are different graphs


@pytest.mark.parametrize("case", list(CASES))
def test_fused_ops_are_looptool_function_nodes(engines, case):
    report, directory = engines[case]
    arch = CASES[case][0]
    manifest = json.loads((directory / MANIFEST).read_text())
    deepest = report.budgets[-1]
    graph = _graph(directory / deepest.file)
    calls = {}
    for node in graph.graph.node:
        if node.domain == "looptool":
            calls[node.op_type] = calls.get(node.op_type, 0) + 1
    functions = {f.name: f for f in graph.functions}
    for fn in functions.values():
        assert fn.domain == "looptool" and len(fn.node) > 0 and all(n.domain in ("", "looptool") for n in fn.node)
    expected = {"GatedResidual": deepest.fused["gated_residual"], "AdaptiveDelta": deepest.fused["adaptive_delta"],
                "Moe": deepest.fused["moe"]}
    assert calls == {k: v for k, v in expected.items() if v}
    assert set(functions) == set(calls)
    assert ("looptool", 1) in {(o.domain, o.version) for o in graph.opset_import}
    if arch == "qwen3_moe":
        assert calls["Moe"] == 4 + 2 * (deepest.budget - 1)
        assert not any("grouped_mm" in n.op_type for n in graph.graph.node)
    assert manifest["budgets"][str(deepest.budget)]["fused"] == deepest.fused


@pytest.mark.parametrize("case", list(CASES))
def test_one_weight_store_no_duplicates(engines, case):
    report, directory = engines[case]
    model = looped(case)
    manifest = json.loads((directory / MANIFEST).read_text())
    param_bytes = model.dims().param_bytes
    assert manifest["parameter_bytes"] == param_bytes == report.parameter_bytes
    # each tensor once: weights.bin is no bigger than the parameters (+ alignment padding)
    assert (directory / WEIGHTS).stat().st_size <= 1.02 * param_bytes
    spans = {(e["offset"], e["length"]) for e in manifest["weights"]["tensors"].values()}
    assert sum(length for _, length in spans) <= param_bytes
    assert all(offset % 64 == 0 for offset, _ in spans)
    ends = sorted(spans)
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(ends))  # no overlaps
    for b in report.budgets:
        graph = _graph(directory / b.file)
        inline = 0
        for init in graph.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in init.external_data}
                assert info["location"] == WEIGHTS
                entry = manifest["weights"]["tensors"][init.name]
                assert (int(info["offset"]), int(info["length"])) == (entry["offset"], entry["length"])
            else:
                assert len(init.raw_data) < INLINE_LIMIT, f"{init.name} is a large inline constant (folded weight?)"
                inline += len(init.raw_data)
        assert inline < 0.01 * param_bytes
    # every weight a budget reads is stored, including the loop parameters of deep budgets
    names = set(manifest["weights"]["tensors"])
    assert {n for n, _ in model.new_parameters()} <= names
    assert report.total_bytes == sum(p.stat().st_size for p in directory.iterdir())


def test_unfused_moe_does_not_export_but_fused_does():
    model = looped("qwen3_moe-recurrent")
    from looptool.graph import shared_graph_module

    raw = shared_graph_module(model, model.layer_graph.paths[1])
    with pytest.raises(Exception, match="grouped_mm"):
        export_program(raw, model.config.vocab_size, torch.int64)


def test_failed_export_leaves_nothing(tmp_path):
    model = looped("llama-prefix")
    target = tmp_path / "engine"
    with pytest.raises(ExportError, match="differ by"):
        export_onnx(model, target, 1, atol=0.0)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(looptool.LooptoolError, match="budget 7 is not in"):
        export_onnx(model, target, 7)
    target.mkdir()
    with pytest.raises(looptool.LooptoolError, match="already exists"):
        export_onnx(model, target, 0)


@pytest.fixture
def engine_copy(engines, tmp_path):
    _, directory = engines["llama-prefix"]
    copy = tmp_path / "engine"
    shutil.copytree(directory, copy)
    return copy


def test_tampered_weights_refused(engine_copy):
    with open(engine_copy / WEIGHTS, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(EngineError, match=r"weights.bin does not match the sha256"):
        Runtime(engine_copy)


def test_manifest_hash_mismatch_refused(engine_copy):
    manifest = json.loads((engine_copy / MANIFEST).read_text())
    manifest["budgets"]["1"]["sha256"] = "0" * 64
    (engine_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"budget_1.onnx does not match the sha256"):
        Runtime(engine_copy)


def test_external_data_outside_engine_refused(engine_copy, tmp_path):
    path = engine_copy / "budget_0.onnx"
    graph = _graph(path)
    init = next(i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = "../stolen.bin"
    onnx.save(graph, str(path))
    manifest = json.loads((engine_copy / MANIFEST).read_text())
    manifest["budgets"]["0"]["sha256"] = sha256_file(path)  # a consistent but hostile engine
    (engine_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="outside the engine directory"):
        Runtime(engine_copy)


def test_runtime_bad_input_and_lazy_sessions(engines):
    _, directory = engines["llama-prefix"]
    rt = Runtime(directory)
    assert rt.budgets == (0, 1, 2) and rt._sessions == {}
    ids = np.array([[1, 2, 3]])
    out = rt(ids, budget=1, attention_mask=np.ones_like(ids))
    assert isinstance(out, np.ndarray) and out.shape == (1, 3, 256)
    assert sorted(rt._sessions) == [1]  # created on first use only
    with pytest.raises(EngineError, match="budget 5 is not in"):
        rt(ids, budget=5)
    with pytest.raises(EngineError, match=r"\[batch, sequence\]"):
        rt(np.array([1, 2, 3]), budget=1)
    with pytest.raises(EngineError, match="integer token ids"):
        rt(ids.astype(np.float32), budget=1)
    with pytest.raises(EngineError, match="must lie in"):
        rt(np.array([[1, 999]]), budget=1)
    with pytest.raises(EngineError, match="attention_mask has shape"):
        rt(ids, budget=1, attention_mask=np.ones((1, 4)))
    with pytest.raises(EngineError, match="no manifest.json"):
        Runtime(directory.parent)


def test_cli_export_and_run(tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app
    from looptool.testing import byte_tokenizer

    runner = CliRunner()
    model = looped("llama-prefix")
    model.tokenizer = byte_tokenizer()
    try:
        model.save_pretrained(tmp_path / "looped")
    finally:
        model.tokenizer = None
    engines = tmp_path / "engines"
    res = runner.invoke(app, ["export", str(tmp_path / "looped"), "-o", str(engines), "--backend", "onnx", "--budget", "2"])
    assert res.exit_code == 0, res.output
    assert "budget_2.onnx" in res.output and "× the parameter bytes" in res.output and "gated_residual×4" in res.output
    assert sorted(p.name for p in engines.glob("*.onnx")) == ["budget_2.onnx"]
    res = runner.invoke(app, ["run", str(engines), "--budget", "2", "--prompt", "Hello", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("Hello") and "4 new tokens" in res.output
    # the engine's greedy tokens are PyTorch's greedy tokens
    ids = torch.tensor([list(b"Hello")])
    seq = Runtime(engines).greedy(ids.numpy(), budget=2, max_new_tokens=4)
    ref = ids
    with torch.no_grad():
        for _ in range(4):
            ref = torch.cat([ref, model(ref, budget=2).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert seq.tolist() == ref.tolist()
    for args, message in [
        (["export", str(tmp_path / "looped"), "-o", str(tmp_path / "e2"), "--backend", "tensorrt"], "--backend 'tensorrt'"),
        (["export", str(tmp_path / "looped"), "-o", str(tmp_path / "e2"), "--budget", "7"], "budget 7 is not in"),
        (["export", str(tmp_path / "looped"), "-o", str(engines)], "already exists"),
        (["run", str(engines), "--budget", "0", "--prompt", "x"], "budget 0 is not in"),
        (["run", str(tmp_path), "--prompt", "x"], "no manifest.json"),
        (["run", str(engines), "--prompt", " "], "--prompt is empty"),
    ]:
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert message in res.output, (args, res.output)
        assert "Traceback" not in res.output
    assert not (tmp_path / "e2").exists()
