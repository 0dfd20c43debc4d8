"""Weight-only int8/int4 engines: MatMulNBits in every graph over one stored copy of each
quantized weight, validated against PyTorch's float path by a bound a broken layout fails."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from typer.testing import CliRunner

import looptool
from looptool.backends.errors import ExportError
from looptool.backends.manifest import WEIGHTS, Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.onnx.quantize import ACCURACY_LEVEL, BLOCK_SIZE, MS_DOMAIN, Quantizer
from looptool.backends.onnx.store import to_numpy
from looptool.backends.onnx.validate import QUANTIZED_BOUNDS
from looptool.backends.ort.runtime import Runtime
from looptool.cli import app
from looptool.testing import every_onnx_node, tiny_model

PRECISIONS = ("int8", "int4")


def _looped(**overrides) -> looptool.LoopedModel:
    """A tiny llama with a prefix loop, its new parameters perturbed so that budgets differ."""
    model = looptool.convert(tiny_model("llama", **overrides), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def model():
    return _looped()


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """Every budget and the row-wise graph, exported (and validated) at int8 and int4."""
    root = tmp_path_factory.mktemp("quantized")
    return {p: (export_onnx(model, root / p, "all", quantize=p), root / p) for p in PRECISIONS}


def _graph(path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def _graphs(directory) -> dict[str, onnx.ModelProto]:
    return {p.name: _graph(p) for p in sorted(directory.glob("*.onnx"))}


def _linear_weights(model) -> dict[str, np.ndarray]:
    """The model's linear weights by the names the graphs give them (``...proj.weight``, ``lm_head.weight``)."""
    from looptool.storage.tensors import graph_tensors

    return {
        name: to_numpy(t)
        for name, t in graph_tensors(model).items()
        if t.ndim == 2 and ("proj" in name or name == "lm_head.weight")
    }


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_graph_reads_matmulnbits_and_no_float_linear(engines, precision):
    _, directory = engines[precision]
    bits = int(precision[3:])
    for name, graph in _graphs(directory).items():
        ops = Counter(n.op_type for n in graph.graph.node)
        assert ops["MatMulNBits"] > 0 and ops["Gemm"] == 0, (name, ops)
        float_weights = {i.name for i in graph.graph.initializer if i.data_type == TensorProto.FLOAT}
        for node in graph.graph.node:
            if node.op_type == "MatMul":  # attention's products: activations only
                assert not set(node.input) & float_weights, (name, node.input)
            if node.op_type == "MatMulNBits":
                assert node.domain == MS_DOMAIN
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                assert (
                    attrs["bits"] == bits
                    and attrs["block_size"] == BLOCK_SIZE
                    and attrs["accuracy_level"] == ACCURACY_LEVEL
                )
                assert node.input[1].endswith(f".q{bits}") and node.input[2].endswith(".scales")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_store_holds_each_quantized_weight_once_and_no_float_copy(engines, model, precision):
    _, directory = engines[precision]
    manifest = Manifest.read(directory)
    tensors = manifest.weights.tensors
    bits = int(precision[3:])
    quantized = manifest.quantization["weights"]
    linears = _linear_weights(model)
    assert set(quantized) == set(linears)
    assert manifest.quantization["bits"] == bits and manifest.quantization["block_size"] == BLOCK_SIZE
    for name in quantized:
        assert name not in tensors  # the float original is gone
        blocks, scales = tensors[f"{name}.q{bits}"], tensors[f"{name}.scales"]
        n, k = linears[name].shape
        assert blocks.dtype == "UINT8" and blocks.shape == (n, -(-k // BLOCK_SIZE), BLOCK_SIZE * bits // 8)
        assert scales.dtype == "FLOAT" and scales.shape == (n, -(-k // BLOCK_SIZE))
    float_digests = {hashlib.sha256(a.tobytes()).hexdigest() for a in linears.values()}
    assert not float_digests & {t.sha256 for t in tensors.values()}
    # one copy: distinct bytes lie at one offset, and the file is no longer than their sum (+ alignment)
    spans = {(t.offset, t.length) for t in tensors.values()}
    assert len(spans) == len({t.sha256 for t in tensors.values()})
    assert manifest.weights.bytes <= sum(length for _, length in spans) + 4096 * len(spans)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_budget_reads_the_same_quantized_tensors(engines, precision):
    _, directory = engines[precision]
    manifest = Manifest.read(directory)
    read = {
        name: {n.input[1] for n in every_onnx_node(graph.graph) if n.op_type == "MatMulNBits"}
        for name, graph in _graphs(directory).items()
    }
    shallow = read["budget_0.per-loop.onnx"]
    assert "lm_head.weight.q" + precision[3:] in shallow
    for name, names in read.items():
        assert shallow <= names, name  # deeper budgets read budget 0's tensors, by the same names
        entry = next(e for b in manifest.graphs.values() for e in b.values() if e.file == name)
        assert names <= set(entry.initializers)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_engine_generates_within_the_bound(engines, model, precision):
    report, directory = engines[precision]
    bound = QUANTIZED_BOUNDS[precision]
    for b in [*report.budgets, *report.rowwise]:
        assert 0 < b.max_abs_diff["real"] <= bound and b.max_abs_diff["random"] <= bound, (b.budget, b.max_abs_diff)
        assert b.max_abs_diff["real.kl"] < 0.01
    rt = Runtime(directory)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    for budget in rt.budgets:
        out = rt.generate(ids, budget=budget, max_new_tokens=4, output_logits=True)
        assert out.sequences.shape == (1, 9) and all(torch.isfinite(t).all() for t in out.logits)
    rt.close()
    # int8 is much closer than int4 (the bound per precision means something)
    if precision == "int4":
        int8 = engines["int8"][0]
        assert int8.max_abs_diff < report.max_abs_diff / 4


def _dequantize(blocks: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """``[N, n_blocks, blob]`` symmetric blocks → ``[N, K]`` floats (zero point 8 or 128)."""
    if bits == 4:
        values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[0], blocks.shape[1], -1)
    else:
        values = blocks
    zero = 1 << (bits - 1)
    w = (values.astype(np.float32) - zero) * scales[:, :, None]
    return w.reshape(blocks.shape[0], -1)[:, :k]


def _matmulnbits(x: np.ndarray, blocks: np.ndarray, scales: np.ndarray, bits: int, k: int, n: int) -> np.ndarray:
    """One MatMulNBits node run by onnxruntime (accuracy level 0: float activations, so only
    the weight layout is under test)."""
    import onnxruntime as ort

    node = helper.make_node(
        "MatMulNBits", ["x", "b", "s"], ["y"], domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=BLOCK_SIZE
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [onnx.numpy_helper.from_array(blocks, "b"), onnx.numpy_helper.from_array(scales, "s")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)])
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stored_blocks_dequantize_to_the_weight_and_match_matmulnbits(engines, model, precision):
    _, directory = engines[precision]
    bits = int(precision[3:])
    tensors = Manifest.read(directory).weights.tensors
    data = np.fromfile(directory / WEIGHTS, dtype=np.uint8)
    name = "model.layers.0.mlp.down_proj.weight"
    w = _linear_weights(model)[name]
    n, k = w.shape

    def stored(key: str, dtype) -> np.ndarray:
        t = tensors[key]
        return data[t.offset : t.offset + t.length].view(dtype).reshape(t.shape)

    blocks, scales = stored(f"{name}.q{bits}", np.uint8), stored(f"{name}.scales", np.float32)
    w_deq = _dequantize(blocks, scales, bits, k)
    # symmetric rounding to the block scale (absmax / -8 or / -128: the extreme value maps to the minimum)
    step = np.abs(np.repeat(scales, BLOCK_SIZE, axis=1)[:, :k])  # onnxruntime's scales carry the sign
    assert np.all(np.abs(w_deq - w) <= step + 1e-6)  # a full step where the clamp to [-8, 7] bites
    assert np.abs(w_deq - w).mean() <= np.abs(step).mean() / 3
    x = np.random.default_rng(0).standard_normal((5, k)).astype(np.float32)
    got = _matmulnbits(x, blocks, scales, bits, k, n)
    np.testing.assert_allclose(got, x @ w_deq.T, atol=1e-4, rtol=1e-4)
    # a wrong reading of the layout (blocks taken K-major) does not match
    wrong = _dequantize(blocks.reshape(blocks.shape[1], blocks.shape[0], -1).transpose(1, 0, 2), scales, bits, k)
    assert np.abs(got - x @ wrong.T).max() > 1e-2


def test_a_broken_quantization_fails_validation(model, tmp_path, monkeypatch):
    """Blocks scrambled along N (a wrong N/K reading) give unrelated logits: export refuses."""
    original = Quantizer.quantize

    def scrambled(self, name, weight):
        q = original(self, name, weight)
        if name not in scrambled.done:
            q.blocks = np.ascontiguousarray(np.roll(q.blocks, 1, axis=0))
            self.tensors[q.blocks_name] = self.tensors[q.gather_name] = hashlib.sha256(q.blocks.tobytes()).hexdigest()
            scrambled.done.add(name)
        return q

    scrambled.done = set()

    monkeypatch.setattr(Quantizer, "quantize", scrambled)
    with pytest.raises(ExportError, match="relative error"):
        export_onnx(model, tmp_path / "broken", [0], quantize="int4", rowwise=False)
    assert not (tmp_path / "broken").exists()


def test_tied_embedding_gathers_the_lm_heads_int4_blocks(tmp_path):
    """genai's shared embeddings at int4: GatherBlockQuantized over the LM head's blocks, no float copy."""
    model = _looped(tie_word_embeddings=True)
    export_onnx(model, tmp_path / "tied", [0], quantize="int4", rowwise=False)
    graph = _graph(tmp_path / "tied" / "budget_0.per-loop.onnx")
    ops = Counter(n.op_type for n in graph.graph.node)
    assert ops["GatherBlockQuantized"] == 1
    tensors = Manifest.read(tmp_path / "tied").weights.tensors
    from looptool.storage.tensors import graph_tensors

    embed = to_numpy(graph_tensors(model)["lm_head.weight"])  # tied: the one name Gather and the head read
    assert hashlib.sha256(embed.tobytes()).hexdigest() not in {t.sha256 for t in tensors.values()}
    assert [name for name in tensors if name.endswith(".rows")] == ["lm_head.weight.q4.rows"]
    rows, blocks = tensors["lm_head.weight.q4.rows"], tensors["lm_head.weight.q4"]
    assert (rows.offset, rows.length) == (blocks.offset, blocks.length)  # the same bytes, once
    assert rows.shape == (blocks.shape[0], blocks.shape[1] * blocks.shape[2])


def test_bad_quantize_is_refused(model, tmp_path):
    with pytest.raises(ExportError, match="'int3' is not supported"):
        export_onnx(model, tmp_path / "x", [0], quantize="int3")


def test_cli_default_precision_and_int4_with_tensorrt(model, tmp_path):
    model.save_pretrained(tmp_path / "m")
    runner = CliRunner()
    res = runner.invoke(
        app, ["export", str(tmp_path / "m"), "-o", str(tmp_path / "f"), "--budget", "0", "--no-rowwise"]
    )
    assert res.exit_code == 0, res.output
    assert Manifest.read(tmp_path / "f").quantization is None
    graph = _graph(tmp_path / "f" / "budget_0.per-loop.onnx")
    assert "Gemm" in {n.op_type for f in graph.functions for n in f.node}  # composed, float linears
    res = runner.invoke(
        app,
        ["export", str(tmp_path / "m"), "-o", str(tmp_path / "q"), "--backend", "tensorrt", "--precision", "int4"],
    )
    assert res.exit_code == 1 and "export it with --backend onnx" in res.output
    assert not (tmp_path / "q").exists()


def test_quantized_engines_prepack_by_default(engines):
    """MatMulNBits runs its fast kernels only over packed weights: a quantized engine's sessions pack."""
    _, directory = engines["int4"]
    assert Runtime(directory).prepack is True
    assert Runtime(directory, prepack=False).prepack is False
