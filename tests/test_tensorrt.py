"""The TensorRT backend in every part that runs without TensorRT: export with
--build-on-target (variants, manifest, build.py), AOT PTX for sm_90 of every plugin's kernel,
errors for bad input, the runtime's checks, and the plugin definitions where ``tensorrt.plugin``
imports (the MoE steps' plugins in detail: test_trt_moe).
(The variants' onnxruntime equivalence on four architectures is in test_ort_generate.)"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import onnx
import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.backends.errors import EngineError, ExportError
from looptool.backends.manifest import WEIGHTS, BuiltOn, FileEntry, Manifest, Profiles
from looptool.backends.tensorrt.export import (
    AOT_OPS,
    BUILD_SCRIPT,
    PLUGIN_NAMESPACE,
    build_engines,
    export_tensorrt,
    trt_graph_file,
)
from looptool.backends.tensorrt.runtime import Runtime, check_built_for
from looptool.cli import app
from looptool.core.install import install_command
from looptool.testing import tiny_model


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@pytest.fixture(scope="module")
def prefix_model():
    model = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.1)
    return model


@pytest.fixture(scope="module")
def exported(prefix_model, tmp_path_factory):
    """The default precision (fp16) of an fp32 model: a rebuilt fp16 copy is exported and
    every graph validated in onnxruntime against that copy's PyTorch path."""
    out = tmp_path_factory.mktemp("trt") / "engine"
    report = export_tensorrt(
        prefix_model, out, [0, 2], build_on_target=True, max_batch=4, max_prefill=64, max_capacity=128
    )
    return out, report


@pytest.fixture(scope="module")
def on_target(exported):
    return exported[0]


def test_default_precision_exports_and_validates_an_fp16_copy(exported, prefix_model):
    from looptool.backends.onnx.validate import FP16_ATOL

    out, report = exported
    manifest = Manifest.read(out)
    assert manifest.tensorrt.precision == "fp16"
    dtypes = {name: t.dtype for name, t in manifest.weights.tensors.items()}
    assert all(d == "FLOAT16" or "inv_freq" in n for n, d in dtypes.items()), dtypes  # rotary stays fp32, as in HF
    assert next(prefix_model.parameters()).dtype == torch.float32  # the model itself is untouched
    for b in report.budgets:
        assert set(b.max_abs_diff) == {"random", "real"}  # validated on both prompts
        assert 0 < max(b.max_abs_diff.values()) < FP16_ATOL * 20  # fp16 rounding, within the limit
    for entry in manifest.tensorrt.graphs.values():
        onnx.checker.check_model(onnx.load(str(out / entry["per-loop"].file)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_function_body_runs_in_the_graph_dtype(dtype):
    """The ``looptool.Moe`` node's function body (what onnxruntime runs for an ONNX export; a
    TensorRT variant splits the node into the MoE step plugins, test_trt_moe) type-checks and
    matches ``moe_reference`` in the graph's float type: its routing matrix once was fp32
    whatever the graph ("B has inconsistent type tensor(float16)" for every fp16 MoE export).
    Limit: 1e-5 (fp32) or ``FP16_ATOL`` (fp16) times max(1, max |reference|)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from looptool.backends.onnx.functions import DOMAIN, DOMAIN_VERSION, OPSET, Moe
    from looptool.backends.onnx.validate import FP16_ATOL
    from looptool.ops import moe_reference

    g = torch.Generator().manual_seed(0)
    tokens, d, experts, inter, top_k = 5, 16, 4, 8, 2
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k, -1)
    inputs = {
        "x": torch.randn(tokens, d, generator=g).to(dtype),
        "routing_weights": (weights / weights.sum(-1, keepdim=True)).to(dtype),
        "expert_ids": ids,
        "gate_up_proj": (torch.randn(experts, 2 * inter, d, generator=g) * 0.3).to(dtype),
        "down_proj": (torch.randn(experts, d, inter, generator=g) * 0.3).to(dtype),
    }
    elem = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[dtype]
    info = [
        helper.make_tensor_value_info(n, TensorProto.INT64 if n == "expert_ids" else elem, list(t.shape))
        for n, t in inputs.items()
    ]
    graph = helper.make_graph(
        [helper.make_node("Moe", list(inputs), ["y"], domain=DOMAIN)],
        "moe",
        info,
        [helper.make_tensor_value_info("y", elem, [tokens, d])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[Moe.to_function_proto()],
    )
    onnx.checker.check_model(model, full_check=True)  # the body's types, as onnxruntime checks them on load
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {n: t.numpy() for n, t in inputs.items()})
    ref = moe_reference(*inputs.values()).float().numpy()
    assert got.dtype == np.dtype(str(dtype).removeprefix("torch."))
    limit = (1e-5 if dtype == torch.float32 else FP16_ATOL) * max(1.0, float(np.abs(ref).max()))
    assert np.abs(got.astype(np.float32) - ref).max() <= limit


def test_bf16_precision_writes_valid_bf16_graphs(prefix_model, tmp_path):
    out = tmp_path / "bf16"
    report = export_tensorrt(prefix_model, out, [2], precision="bf16", build_on_target=True)
    assert all(b.composed for b in report.budgets)  # from layer functions, not the flat fallback
    manifest = Manifest.read(out)
    assert manifest.tensorrt.precision == "bf16"
    dtypes = {name: t.dtype for name, t in manifest.weights.tensors.items()}
    assert all(d == "BFLOAT16" or "inv_freq" in n for n, d in dtypes.items()), dtypes
    for path in out.glob("*.onnx"):
        onnx.checker.check_model(onnx.load(str(path)))


def test_build_on_target_writes_variants_manifest_and_build_script(on_target):
    manifest = Manifest.read(on_target)
    section = manifest.tensorrt
    assert section.precision == "fp16" and section.engines is None
    assert section.profiles == Profiles(max_batch=4, max_prefill=64, max_capacity=128)
    entry = section.graphs[2]["per-loop"]
    variant = onnx.load(str(on_target / entry.file))
    onnx.checker.check_model(variant)
    assert entry.file == trt_graph_file(2, "per-loop") and entry.plugins == {"GatedResidual": 4}
    assert section.graphs[0]["per-loop"].plugins == {}
    names = {i.name for i in variant.graph.input}
    assert set(entry.weight_inputs) <= names and set(entry.weight_inputs) <= set(manifest.weights.tensors)
    assert not [i for i in variant.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert not [f for f in variant.functions if f.domain != PLUGIN_NAMESPACE]  # layer functions inlined
    plugin_nodes = [n for n in variant.graph.node if n.domain == PLUGIN_NAMESPACE]
    for node in plugin_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"looptool" and attrs["plugin_version"] == b"1" and attrs["aot"] == 1
    assert len(plugin_nodes) == 4
    build = (on_target / BUILD_SCRIPT).read_text()
    compile(build, BUILD_SCRIPT, "exec")
    assert "build_engines" in build
    assert not list(on_target.glob("*.engine"))


def test_runtime_checks_before_it_needs_tensorrt(on_target, tmp_path):
    with pytest.raises(EngineError, match="no TensorRT engines; run python .*build.py"):
        Runtime(on_target)
    import shutil

    copy = tmp_path / "e"
    shutil.copytree(on_target, copy)
    manifest = Manifest.read(copy)
    manifest.tensorrt.engines = {2: {"per-loop": FileEntry("budget_2.per-loop.fp16.engine", "0")}}
    manifest.tensorrt.built_on = BuiltOn("NVIDIA H200", (9, 0), "11.0")
    manifest.write(copy)
    with open(copy / WEIGHTS, "r+b") as f:  # one byte changed: same size, other sha256
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(EngineError, match="does not match the manifest"):
        Runtime(copy)
    if not torch.cuda.is_available():
        with open(copy / WEIGHTS, "r+b") as f:
            f.write(first)
        with pytest.raises(EngineError, match="need an NVIDIA GPU"):
            Runtime(copy)


def test_engines_for_another_gpu_are_refused(tmp_path):
    built = BuiltOn(gpu="NVIDIA H200", compute_capability=(9, 0), tensorrt="11.0")
    check_built_for(built, (9, 0), "NVIDIA H100", tmp_path)  # same architecture: fine
    with pytest.raises(
        EngineError, match=r"built for NVIDIA H200 \(sm_90\), this GPU is NVIDIA A100 \(sm_80\); rebuild"
    ):
        check_built_for(built, (8, 0), "NVIDIA A100", tmp_path)


@pytest.mark.skipif(_has_tensorrt(), reason="TensorRT is installed here")
def test_without_tensorrt_export_fails_in_one_sentence_and_writes_nothing(prefix_model, tmp_path):
    with pytest.raises(ExportError, match=re.escape(install_command("tensorrt")) + ".*build_on_target=True"):
        export_tensorrt(prefix_model, tmp_path / "out", [2])
    assert not (tmp_path / "out").exists()


def test_bad_precision_and_limits(prefix_model, tmp_path):
    with pytest.raises(ExportError, match="precision 'int8' is not supported; choose one of fp32, fp16, bf16"):
        export_tensorrt(prefix_model, tmp_path / "out", [2], precision="int8", build_on_target=True)
    with pytest.raises(ExportError, match="max_prefill .* exceeds max_capacity"):
        export_tensorrt(prefix_model, tmp_path / "out", [2], build_on_target=True, max_prefill=512, max_capacity=256)
    assert not (tmp_path / "out").exists()


def test_cli_backend_tensorrt_errors(prefix_model, tmp_path):
    prefix_model.save_pretrained(tmp_path / "m")
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "export",
            str(tmp_path / "m"),
            "-o",
            str(tmp_path / "o"),
            "--backend",
            "tensorrt",
            "--precision",
            "fp8",
            "--build-on-target",
        ],
    )
    assert res.exit_code == 1 and "precision 'fp8' is not supported" in res.output
    if not _has_tensorrt():
        res = runner.invoke(app, ["export", str(tmp_path / "m"), "-o", str(tmp_path / "o"), "--backend", "tensorrt"])
        assert res.exit_code == 1 and install_command("tensorrt") in res.output
    assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["run", str(tmp_path / "m"), "-p", "hi", "--backend", "tensorrt"])
    assert res.exit_code == 1 and "error:" in res.output


_AOT_SCRIPT = """
import json, re, sys
from looptool.backends.tensorrt.kernels import AOT_OPS, aot_compile
out = []
cases = [(op, dtype, 8) for op in AOT_OPS for dtype in ("fp32", "bf16")] + [("MoeAlign", "fp16", 128), ("MoeAlign", "fp16", 512)]
for op, dtype, experts in cases:
    k = aot_compile(op, dtype, rank=24, num_experts=experts)
    out.append(dict(op=op, dtype=dtype, name=k.name, ptx=k.ptx, threads=k.threads, shared=k.shared, scalars=k.scalars))
print(json.dumps(out))
"""


def test_aot_ptx_for_sm90_has_tensorrts_argument_order():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the compiler, not the interpreter the suite runs
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    kernels = json.loads(res.stdout.strip().splitlines()[-1])
    inputs = {"GatedResidual": 3, "AdaptiveDeltaUpdate": 5, "Modulate": 5}
    inputs |= {"MoeAlign": 1, "MoeGateUp": 5, "MoeDown": 4, "MoeCombine": 3}
    outputs = {"MoeAlign": 4}  # rows, block_expert, used, pair_row; the others: one
    assert {k["op"] for k in kernels} == set(AOT_OPS)
    for k in kernels:
        ptx = k["ptx"]
        assert re.search(r"^\.version 8\.7$", ptx, re.M) and re.search(r"^\.target sm_90a?$", ptx, re.M), k["op"]
        entry = re.search(r"\.visible \.entry (\w+)\((.*?)\)", ptx, re.S)
        assert entry and entry.group(1) == k["name"]
        params = re.findall(r"\.param \.(\w+)", entry.group(2))
        n_in, n_scalar = inputs[k["op"]], len(k["scalars"])
        n_out = outputs.get(k["op"], 1)
        # TensorRT passes: input pointers, i32 scalars, the output pointers; Triton appends its
        # (unused, size 0) scratch pointers after them
        assert params[:n_in] == ["u64"] * n_in, (k["op"], params)
        assert params[n_in : n_in + n_scalar] == ["u32"] * n_scalar, (k["op"], params)
        assert set(params[n_in + n_scalar :]) == {"u64"}
        assert n_out <= len(params) - (n_in + n_scalar) <= n_out + 2
        assert k["threads"] == 128 and k["shared"] <= 48 * 1024, (k["op"], k["dtype"], k["shared"])


@pytest.mark.skipif(
    not _has_tensorrt(), reason='TensorRT is not installed (pip install "looptool[tensorrt]" on an NVIDIA machine)'
)
def test_plugin_definitions_register_against_tensorrt():  # pragma: no cover - no TensorRT on the project's machines
    from looptool.backends.tensorrt import plugins as trt_plugins

    trt_plugins.register()
    trt_plugins.register()  # idempotent


def test_build_and_runtime_decode_like_onnxruntime_through_a_tensorrt_test_double(
    on_target, prefix_model, monkeypatch, tmp_path
):
    """build_engines' profiles and Runtime's bookkeeping end to end on CPU: one weight store
    bound by name into every budget's context (the same pointers), one shared activation
    buffer, prefill/decode profiles, cache buffers swapped each step; the fake engines run
    the TensorRT variants with onnxruntime. Tokens must equal the onnxruntime Runtime's at
    both budgets."""
    import shutil

    import fake_tensorrt

    from looptool.backends.ort.runtime import Runtime as OrtRuntime
    from looptool.backends.tensorrt import plugins as trt_plugins

    trt = fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(trt_plugins, "register", functools.cache(trt_plugins.register.__wrapped__))  # registers anew
    fake_tensorrt.pretend_gpu(monkeypatch)
    directory = tmp_path / "e"
    shutil.copytree(on_target, directory)
    engines = build_engines(directory)  # what build.py runs
    manifest = Manifest.read(directory)
    assert manifest.tensorrt.engines == engines and manifest.tensorrt.built_on.compute_capability == (9, 0)
    _, profiles = trt.Builder.built[-1]
    assert profiles[0]["input_ids"] == ((1, 1), (1, 64), (4, 64)) and profiles[1]["input_ids"] == (
        (1, 1),
        (1, 1),
        (4, 1),
    )
    assert profiles[0]["attention_mask"][2] == (4, 128)  # max batch 4, max capacity 128

    rt = Runtime(directory, device="cpu")
    assert set(trt.plugin.registered) == {f"looptool::{op}" for op in AOT_OPS}
    assert all(set(trt.plugin.registered[f"looptool::{op}"]) == {"register", "autotune", "aot_impl"} for op in AOT_OPS)
    assert rt.device_bytes()["weights"] == manifest.weights.bytes
    contexts = {b: rt.engines[b, "per-loop"].contexts[0] for b in (0, 2)}
    names = {b: manifest.tensorrt.graphs[b]["per-loop"].weight_inputs for b in (0, 2)}
    for b, ctx in contexts.items():
        assert {n: ctx.addresses[n] for n in names[b]} == {n: rt._weights[n].data_ptr() for n in names[b]}
        assert ctx.device_memory == (rt._activations.data_ptr(), rt.activation_bytes)
    shared = set(names[0]) & set(names[2])
    assert len(shared) >= len(names[0]) - 1  # the source weights: one device copy for both budgets
    assert all(contexts[0].addresses[n] == contexts[2].addresses[n] for n in shared)

    ids = torch.randint(0, prefix_model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ort_rt = OrtRuntime(directory)
    for b in (0, 2):
        ref = ort_rt.generate(ids, attention_mask=mask, budget=b, max_new_tokens=5)
        got = rt.generate(ids, attention_mask=mask, budget=b, max_new_tokens=5)
        assert torch.equal(got.sequences, ref.sequences), b
        assert contexts[b].profiles == [0, 1]  # prefill profile, then decode for every later step
        assert rt.engines[b, "per-loop"].runs == 5
