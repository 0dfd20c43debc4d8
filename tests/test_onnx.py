"""ONNX serving engines (one weights.bin, layer functions, KV-cached decode) and the onnxruntime Runtime."""

from __future__ import annotations

import functools
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import looptool
from looptool.backends.errors import EngineError, ExportError
from looptool.backends.interface import CacheLayout, serving_graph
from looptool.backends.manifest import MANIFEST, WEIGHTS, Manifest
from looptool.backends.onnx.export import export_onnx, export_program, serving_example
from looptool.backends.onnx.layers import LAYER_DOMAIN
from looptool.backends.onnx.store import INLINE_LIMIT
from looptool.backends.ort.engine import OrtStepEngine
from looptool.backends.ort.runtime import Runtime
from looptool.engine.budgets import RowBudgets
from looptool.engine.outputs import GenerationOutput
from looptool.runtime.generation import generate
from looptool.storage.files import sha256_file
from looptool.testing import tiny_model

CASES = {
    "llama-prefix": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
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


class _Engines(dict):
    """Each case exported once, every budget and both KV policies (validated by the export),
    when a test first asks for it: the two cases are separate xdist work units (conftest)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, case: str):
        self[case] = (export_onnx(looped(case), self.root / case, "all", kv="all"), self.root / case)
        return self[case]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return _Engines(tmp_path_factory.mktemp("engines"))


def _graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


@pytest.mark.parametrize("case", list(CASES))
def test_every_graph_validated_and_composed(engines, case):
    report, directory = engines[case]
    model = looped(case)
    assert sorted((b.budget, b.kv) for b in report.budgets) == sorted(
        itertools.product(model.budgets, ("per-loop", "last-loop"))
    )
    for b in report.budgets:
        assert set(b.max_abs_diff) == {"random", "real"}
        assert max(b.max_abs_diff.values()) <= 1e-4, (case, b.budget, b.max_abs_diff)
        assert b.file == f"budget_{b.budget}.{b.kv}.onnx"
        # every graph is composed: route replay's loop-1 routing ([batch x step, k]) crosses layer
        # units as [batch, step, k] (a flattened dynamic axis has no name a body export accepts)
        assert b.composed, (case, b.budget, b.kv)
    assert report.rowwise and all(r.composed for r in report.rowwise)
    # each distinct body exported once for all graphs; budgets and layers share them
    calls = sum(sum(b.layer_calls.values()) for b in report.budgets)
    assert report.layer_functions < calls / (4 if case == "llama-prefix" else 1)
    rt = Runtime(directory)
    assert rt.kv_policies == ("last-loop", "per-loop") and rt.budgets == model.budgets
    ids = torch.randint(0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(9))
    for k in model.budgets:  # next-token logits, beyond the export's example shapes
        with torch.no_grad():
            ref = model(ids, budget=k).logits[:, -1]
        got = rt(ids, budget=k)
        assert isinstance(got, torch.Tensor) and got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4, (case, k)
    deep = [rt(np.arange(5)[None] % 256, budget=k) for k in model.budgets[-2:]]
    assert np.abs(deep[0] - deep[1]).max() > 1e-3  # budgets really are different graphs


@pytest.mark.parametrize("case", list(CASES))
def test_graphs_call_layer_functions_with_fused_ops(engines, case):
    report, directory = engines[case]
    arch = CASES[case][0]
    manifest = Manifest.read(directory)
    deepest = max((b for b in report.budgets if b.composed and b.kv == "per-loop"), key=lambda b: b.budget)
    graph = _graph(directory / deepest.file)
    top = {}
    for node in graph.graph.node:
        assert node.domain == LAYER_DOMAIN  # nothing but calls at the top level
        top[node.op_type] = top.get(node.op_type, 0) + 1
    assert top == deepest.layer_calls
    functions = {(f.domain, f.name): f for f in graph.functions}
    inner: dict[str, int] = {}
    for name, count in top.items():
        for node in functions[LAYER_DOMAIN, name].node:
            if node.domain == "looptool":
                inner[node.op_type] = inner.get(node.op_type, 0) + count
    expected = {
        "GatedResidual": deepest.fused["gated_residual"],
        "AdaptiveDelta": deepest.fused["adaptive_delta"],
        "Moe": deepest.fused["moe"],
    }
    assert inner == {k: v for k, v in expected.items() if v}
    for kind in inner:
        fn = functions["looptool", kind]
        assert len(fn.node) > 0 and all(n.domain == "" for n in fn.node)
    assert {("looptool", 1), (LAYER_DOMAIN, 1)} <= {(o.domain, o.version) for o in graph.opset_import}
    if arch == "qwen3_moe":
        assert inner["Moe"] == 4 + 2 * (deepest.budget - 1)
    entry = manifest.graphs[deepest.budget]["per-loop"]
    assert entry.fused == deepest.fused and entry.layer_calls == deepest.layer_calls
    assert manifest.kv_policies == ("last-loop", "per-loop")
    names = [i.name for i in graph.graph.input]
    assert names[:4] == ["input_ids", "attention_mask", "position_ids", "cache_position"]
    pairs = len(entry.cache.pairs)
    assert names[4:] == [f"past_key_values.{j}.{kv}" for j in range(pairs) for kv in ("key", "value")]
    assert [o.name for o in graph.graph.output] == ["logits"] + [
        f"present.{j}.{kv}" for j in range(pairs) for kv in ("key", "value")
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_one_weight_store_no_duplicates(engines, case):
    report, directory = engines[case]
    model = looped(case)
    manifest = Manifest.read(directory)
    param_bytes = model.dims().param_bytes
    assert manifest.parameter_bytes == param_bytes == report.parameter_bytes
    # each tensor once: weights.bin is no bigger than the parameters (+ alignment padding)
    assert (directory / WEIGHTS).stat().st_size <= 1.02 * param_bytes
    spans = {(e.offset, e.length) for e in manifest.weights.tensors.values()}
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
                entry = manifest.weights.tensors[init.name]
                assert (int(info["offset"]), int(info["length"])) == (entry.offset, entry.length)
            else:
                assert len(init.raw_data) < INLINE_LIMIT, f"{init.name} is a large inline constant (folded weight?)"
                inline += len(init.raw_data)
        assert inline < 0.01 * param_bytes
    # every weight a budget reads is stored, including the loop parameters of deep budgets
    names = set(manifest.weights.tensors)
    assert {n for n, _ in model.new_parameters()} <= names
    assert report.total_bytes == sum(p.stat().st_size for p in directory.iterdir())


def test_kv_bytes_match_the_cost_model(engines):
    _, directory = engines["llama-prefix"]
    model = looped("llama-prefix")
    rt = Runtime(directory)
    costs = {c.budget: c for c in model.cost_table()}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    for k in model.budgets:
        for kv, per_token in (
            ("per-loop", costs[k].kv_bytes_per_token),
            ("last-loop", costs[k].kv_bytes_per_token_last_loop),
        ):
            out = rt.generate(ids, budget=k, kv=kv, max_new_tokens=3)
            assert out.kv_bytes == 2 * 12 * per_token == rt.kv_bytes(k, kv, batch=2, capacity=12), (k, kv)
    assert costs[2].kv_bytes_per_token == costs[0].kv_bytes_per_token * (4 + 2) / 4  # per-loop: (L + k) / L


def test_prepacked_runtime_gives_the_same_tokens(engines):
    _, directory = engines["qwen3_moe-recurrent"]
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    plain = Runtime(directory).generate(ids, budget=2, max_new_tokens=6)
    packed = Runtime(directory, prepack=True).generate(ids, budget=2, max_new_tokens=6)
    assert torch.equal(plain.sequences, packed.sequences)


def test_caches_are_written_in_place(engines):
    """The runtime binds one buffer per cache as both past input and present output: a step
    writes its keys and values into those very arrays at ``cache_position`` and nowhere else."""
    _, directory = engines["llama-prefix"]
    engine = OrtStepEngine(Runtime(directory))
    cache = engine.allocate(1, 10)
    buffers = [id(c) for c in cache.buffers]
    caches = [cache.buffers[i] for i in engine.budget_buffers(2)]
    mask = torch.zeros(1, 10, dtype=torch.long)
    mask[:, :4] = 1
    two = RowBudgets((2,))
    engine.step(cache, slice(0, 1), torch.tensor([[5, 6, 7, 8]]), mask, torch.arange(4)[None], torch.arange(4), two)
    assert all(np.abs(c[:, :, :4]).max() > 0 and not c[:, :, 4:].any() for c in caches)
    mask[:, 4] = 1
    engine.step(cache, slice(0, 1), torch.tensor([[9]]), mask, torch.tensor([[4]]), torch.tensor([4]), two)
    assert all(np.abs(c[:, :, 4]).max() > 0 and not c[:, :, 5:].any() for c in caches)
    assert [id(c) for c in cache.buffers] == buffers


def test_unfused_moe_does_not_export_but_fused_does():
    model = looped("qwen3_moe-recurrent")
    raw = serving_graph(model, 1, fuse=False)
    args, shapes = serving_example(raw)
    with pytest.raises(Exception, match="grouped_mm"):
        export_program(raw.module, args, shapes)


class _TranslatedOps(torch.nn.Module):
    """The four ops looptool translates itself (index_copy along a middle and the last dim,
    ``&`` of bool and integer tensors, ``to`` a dtype and a device+dtype)."""

    def forward(self, cache, index, new, mask, bits, x):
        return (
            cache.index_copy(1, index, new),
            cache.transpose(1, 2).contiguous().index_copy(-1, index, new.transpose(1, 2)),
            mask & mask.flip(-1),
            bits & bits.flip(0),
            x.to(torch.float16),
            x.to("cpu", torch.float64),
        )


class _UntranslatedOp(torch.nn.Module):
    def forward(self, x, index, source):
        return x.index_add(0, index, source)  # no torchlib translation: decomposed


def test_graphs_of_translated_ops_skip_the_decomposition_retrace(monkeypatch):
    from torch.onnx._internal.exporter import _fx_passes

    decomposed = []
    original = _fx_passes.decompose_with_registry
    monkeypatch.setattr(
        _fx_passes, "decompose_with_registry", lambda ep, registry: decomposed.append(ep) or original(ep, registry)
    )
    g = torch.Generator().manual_seed(3)
    args = (
        torch.randn(2, 7, 4, generator=g),
        torch.tensor([5, 0, 3]),
        torch.randn(2, 3, 4, generator=g),
        torch.rand(3, 5, generator=g) > 0.5,
        torch.randint(0, 64, (6,), generator=g),
        torch.randn(3, 5, generator=g),
    )
    program = export_program(_TranslatedOps(), args, [None] * len(args))
    assert decomposed == []  # every op translated: no retrace
    ops = {n.op_type for n in program.model.graph}
    assert {"ScatterElements", "And", "BitwiseAnd", "Cast"} <= ops, ops
    for got, want in zip(program(*args), _TranslatedOps()(*args), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    args = (torch.randn(4, 3, generator=g), torch.tensor([2, 0]), torch.randn(2, 3, generator=g))
    program = export_program(_UntranslatedOp(), args, [None] * len(args))
    assert len(decomposed) == 1  # an op without a translation: decomposed as before
    assert torch.allclose(program(*args)[0], _UntranslatedOp()(*args))


def test_flat_export_matches_composed(tmp_path):
    model = looped("llama-prefix")
    report = export_onnx(model, tmp_path / "flat", 1, compose=False)
    (b,) = report.budgets
    assert not b.composed and max(b.max_abs_diff.values()) <= 1e-4
    graph = _graph(tmp_path / "flat" / b.file)
    assert not any(n.domain == LAYER_DOMAIN for n in graph.graph.node)


def test_failed_export_leaves_nothing(tmp_path):
    model = looped("llama-prefix")
    target = tmp_path / "engine"
    with pytest.raises(ExportError, match="differ by"):
        export_onnx(model, target, 1, atol=0.0)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(looptool.LooptoolError, match="budget 7 is not in"):
        export_onnx(model, target, 7)
    with pytest.raises(looptool.LooptoolError, match="unknown KV cache policy 'sideways'"):
        export_onnx(model, target, 0, kv="sideways")
    target.mkdir()
    with pytest.raises(looptool.LooptoolError, match="already exists"):
        export_onnx(model, target, 0)


def _greedy(ids, steps: int, table: torch.Tensor):
    """A stand-in generation: greedy, the next-token logits a function of the last token."""
    logits = []
    for _ in range(steps):
        logits.append(table[ids[:, -1]])
        ids = torch.cat([ids, logits[-1].argmax(-1)[:, None]], dim=1)
    return GenerationOutput(ids, steps, 0.0, 0.0, 0, 0.0, tuple(logits))


def test_validation_tells_a_near_tie_from_a_wrong_token():
    from looptool.backends.onnx.validate import _check

    table = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) * 0.5
    table[0, 1], table[0, 2] = 0.5, 0.4998  # after token 0, tokens 1 and 2 nearly tie
    ids = torch.tensor([[3, 0]])
    mask = torch.ones_like(ids)
    ref = _greedy(ids, 4, table)
    flipped = table.clone()
    flipped[0, 2] = 0.5002  # the other runtime's rounding swaps them: the rest runs on the reference's tokens
    calls = []

    def run(ids, mask, n, table=flipped):
        calls.append((ids.shape[1], n))
        return _greedy(ids, n, table)

    assert _check(ref, run, ids, mask, 1e-2, "budget 0", "random") == pytest.approx(4e-4, abs=1e-6)
    assert calls == [(2, 4), (3, 3)]  # after the tie at the first step: resumed on the reference's token
    with pytest.raises(ExportError, match=r"differ by 0.0004 .* \(limit 0\) and generate different tokens"):
        _check(ref, run, ids, mask, 0.0, "budget 0", "random")  # no tie is near enough
    table[0, 2] = 0.485  # 0.015 apart: onnxruntime's logits within 0.01, its pick 0.015 below the reference's
    ref, wrong = _greedy(ids, 4, table), table.clone()
    wrong[0, 1], wrong[0, 2] = 0.493, 0.494
    with pytest.raises(ExportError, match="differ by 0.009 .* and generate different tokens"):
        _check(ref, functools.partial(run, table=wrong), ids, mask, 1e-2, "budget 0", "random")


def test_a_reference_that_overflows_is_refused_naming_the_precision():
    from looptool.backends.onnx.validate import _check

    table = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)).half()
    table[0, 1] = float("inf")  # what an fp16 model whose residual stream passes 65504 produces
    ids = torch.tensor([[3, 0]])
    ref = _greedy(ids, 3, table)
    with pytest.raises(ExportError, match="non-finite logits in float16 .*precision='bf16' or 'fp32'") as err:
        _check(ref, lambda ids, mask, n: _greedy(ids, n, table), ids, torch.ones_like(ids), 1e-2, "budget 0", "random")
    assert err.value.parameter == "precision"


def test_fp16_greedy_near_tie_validates(tmp_path):
    # a 3-layer tiny Llama in fp16: at its first decode step the left-padded random row's two
    # best tokens lie one fp16 ulp apart (fp32: 0.34820 vs 0.34794) and PyTorch and
    # onnxruntime pick different ones; every step agrees to 5e-4 on the same tokens
    model = looptool.convert(tiny_model("llama", num_layers=3), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    report = export_onnx(looptool.cast(model, torch.float16), tmp_path / "engine", 0, rowwise=False)
    assert report.max_abs_diff < 1e-3


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


def test_tampered_graph_refused(engine_copy):
    path = engine_copy / "budget_1.last-loop.onnx"
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    rt = Runtime(engine_copy)  # graphs are checked per budget, when first run
    rt.session(1, "per-loop")
    with pytest.raises(EngineError, match=r"budget_1.last-loop.onnx does not match the sha256"):
        rt.session(1, "last-loop")


def test_manifest_without_cache_layout_refused(engine_copy):
    manifest = json.loads((engine_copy / MANIFEST).read_text())
    del manifest["budgets"]["1"]["per-loop"]["cache"]
    (engine_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="does not describe the cache layout of budget 1"):
        Runtime(engine_copy)
    manifest["budgets"]["1"]["per-loop"]["cache"] = {"dtype": "float32", "pairs": [{"layer": 0}]}
    (engine_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="does not describe the cache layout of budget 1"):
        Runtime(engine_copy)


def test_cache_layout_that_does_not_match_the_graph_refused(engine_copy):
    manifest = Manifest.read(engine_copy)
    layout = manifest.graphs[2]["per-loop"].cache
    manifest.graphs[2]["per-loop"].cache = CacheLayout(layout.pairs[:-1], layout.dtype)
    manifest.write(engine_copy)
    with pytest.raises(EngineError, match="do not match the cache layout"):
        Runtime(engine_copy).generate(np.array([[1, 2]]), budget=2)


def test_external_data_outside_engine_refused(engine_copy, tmp_path):
    path = engine_copy / "budget_0.per-loop.onnx"
    graph = _graph(path)
    init = next(i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = "../stolen.bin"
    onnx.save(graph, str(path))
    manifest = Manifest.read(engine_copy)
    manifest.graphs[0]["per-loop"].sha256 = sha256_file(path)  # a consistent but hostile engine
    manifest.write(engine_copy)
    with pytest.raises(EngineError, match="outside the engine directory"):
        Runtime(engine_copy).session(0, "per-loop")


def test_runtime_bad_input_and_lazy_sessions(engines, tmp_path):
    _, directory = engines["llama-prefix"]
    rt = Runtime(directory)
    assert rt._sessions == {}
    ids = np.array([[1, 2, 3]])
    out = rt(ids, budget=1, attention_mask=np.ones_like(ids))
    assert isinstance(out, np.ndarray) and out.shape == (1, 256)
    assert sorted(rt._sessions) == [(1, "per-loop")]  # created on first use only
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
    with pytest.raises(EngineError, match="more than the cache capacity 2"):
        rt.generate(ids, budget=1, capacity=2)
    with pytest.raises(looptool.LooptoolError, match="exceed the cache capacity of 5"):
        rt.generate(ids, budget=1, capacity=5, max_new_tokens=4)
    with pytest.raises(EngineError, match="exceeds the model's"):
        rt.generate(ids, budget=1, max_new_tokens=10**6)
    with pytest.raises(EngineError, match="no manifest.json"):
        Runtime(directory.parent)
    per_loop_only = tmp_path / "per-loop"
    export_onnx(looped("llama-prefix"), per_loop_only, 2, validate=False)
    with pytest.raises(EngineError, match=r"exported with KV policies \['per-loop'\], not 'last-loop'"):
        Runtime(per_loop_only).generate(ids, budget=2, kv="last-loop")


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
    res = runner.invoke(
        app, ["export", str(tmp_path / "looped"), "-o", str(engines), "--backend", "onnx", "--budget", "2"]
    )
    assert res.exit_code == 0, res.output
    assert (
        "budget_2.per-loop.onnx" in res.output
        and "× the parameter bytes" in res.output
        and "gated_residual×4" in res.output
    )
    assert sorted(p.name for p in engines.glob("*.onnx")) == ["budget_2.per-loop.onnx", "rowwise.per-loop.onnx"]
    res = runner.invoke(app, ["run", str(engines), "--budget", "2", "--prompt", "Hello", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert (
        res.stdout.startswith("Hello")
        and "budget 2 · kv per-loop · onnxruntime CPU" in res.output
        and "KiB" in res.output
    )
    # the engine's greedy tokens are PyTorch's cached-generation tokens
    ids = torch.tensor([list(b"Hello")])
    seq = Runtime(engines).generate(ids, budget=2, max_new_tokens=4).sequences
    assert torch.equal(seq, generate(model, ids, budget=2, max_new_tokens=4).sequences)
    for args, message in [
        (
            ["export", str(tmp_path / "looped"), "-o", str(tmp_path / "e2"), "--backend", "tvm"],
            "--backend 'tvm' is not available; use --backend onnx or --backend tensorrt",
        ),
        (["export", str(tmp_path / "looped"), "-o", str(tmp_path / "e2"), "--budget", "7"], "budget 7 is not in"),
        (["export", str(tmp_path / "looped"), "-o", str(engines)], "already exists"),
        (["run", str(engines), "--budget", "7", "--prompt", "x"], "budget 7 is not in"),
        (["run", str(engines), "--prompt", "x", "--kv", "last-loop"], "exported with KV policies ['per-loop']"),
        (["run", str(engines), "--prompt", "Hello", "--capacity", "3"], "more than the cache capacity 3"),
        (["run", str(tmp_path), "--prompt", "x"], "no manifest.json"),
        (["run", str(engines), "--prompt", " "], "--prompt is empty"),
    ]:
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert message in res.output, (args, res.output)
        assert "Traceback" not in res.output
    assert not (tmp_path / "e2").exists()
