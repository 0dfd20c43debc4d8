"""A TensorRT variant's MoE without Python at run time: each ``looptool.Moe`` node split into
the ``MoeAlign``, ``MoeGateUp``, ``MoeDown`` and ``MoeCombine`` AOT plugin nodes. Their ONNX
function bodies (what onnxruntime runs) against the Triton kernels (what the engine runs,
here under ``TRITON_INTERPRET=1``) and ``moe_reference``; the plugin definitions under the
TensorRT test double: output shapes against the bodies', and each AOT launch (grid, scalar
arguments, argument order) run under the interpreter against the bodies' outputs. The PTX
of the four kernels: tests/test_tensorrt.py. A whole MoE model built and decoded through the
test double here; its variants against the ONNX graphs: test_export_defaults, test_ort_generate."""

from __future__ import annotations

import functools
import types

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from looptool.backends.onnx.functions import DOMAIN, DOMAIN_VERSION, OPSET, Moe
from looptool.backends.tensorrt.moe import BLOCK_M, MOE_OPS, split_moe
from looptool.ops import moe_reference

ort = pytest.importorskip("onnxruntime")
_ELEM = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
CASES = [(37, 48, 40, 6, 2, False), (50, 32, 16, 5, 2, True), (3, 16, 16, 8, 4, False)]  # T, d, I, E, k, skew


def _case(tokens, d, inter, experts, top_k, skew, dtype):
    g = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, d, generator=g)
    gate_up = torch.randn(experts, 2 * inter, d, generator=g) * d**-0.5
    down = torch.randn(experts, d, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=g)
    if skew:  # expert 0 never chosen, expert 1 by every token
        logits[:, 0], logits[:, 1] = -1e4, 1e4
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x.to(dtype), weights.to(dtype), ids, gate_up.to(dtype), down.to(dtype)


def _split_graph(x, weights, ids, gate_up, down):
    """A one-``Moe``-node graph (expert weights as initializers, as exported), split; every
    step's output is also a graph output."""
    elem = _ELEM[x.dtype]
    inputs = [
        helper.make_tensor_value_info("x", elem, list(x.shape)),
        helper.make_tensor_value_info("routing_weights", elem, list(weights.shape)),
        helper.make_tensor_value_info("expert_ids", TensorProto.INT64, list(ids.shape)),
    ]
    inits = [onnx.numpy_helper.from_array(t.numpy(), n) for n, t in (("gate_up_proj", gate_up), ("down_proj", down))]
    node = helper.make_node(
        "Moe", ["x", "routing_weights", "expert_ids", "gate_up_proj", "down_proj"], ["y"], domain=DOMAIN, name="moe"
    )
    graph = helper.make_graph(
        [node], "moe", inputs, [helper.make_tensor_value_info("y", elem, list(x.shape))], initializer=inits
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[Moe.to_function_proto()],
    )
    assert split_moe(model, DOMAIN) == 1
    onnx.checker.check_model(model, full_check=True)  # the bodies' types, as onnxruntime checks them on load
    for name in [o for n in model.graph.node for o in n.output][:-1]:
        model.graph.output.append(onnx.ValueInfoProto(name=name))
    return model


def _run(model, x, weights, ids) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x.numpy(), "routing_weights": weights.numpy(), "expert_ids": ids.numpy()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_split_bodies_compute_what_the_kernels_compute(case, dtype):
    """The four nodes replace ``Moe`` (attributes: the experts from the weights, ``block_m``);
    in onnxruntime their bodies give the kernels' routing exactly, their activations and fp32
    down projections on the rows in use to float rounding (fp16: an activation may round to
    the neighbouring value), and ``y`` within rounding of ``moe_reference`` (fp32: 1e-5;
    fp16: ``FP16_ATOL`` × max(1, |y|))."""
    pytest.importorskip("triton")
    from looptool.backends.onnx.validate import FP16_ATOL
    from looptool.ops import moe_kernels

    x, weights, ids, gate_up, down = args = _case(*case, dtype)
    model = _split_graph(*args)
    nodes = model.graph.node
    assert [n.op_type for n in nodes] == list(MOE_OPS) and {f.name for f in model.functions} >= set(MOE_OPS)
    assert {a.name: a.i for a in nodes[0].attribute} == {"num_experts": case[3], "block_m": BLOCK_M}
    got = _run(model, x, weights, ids)
    rows, block_expert, used, pair_row = moe_kernels.moe_align(ids, case[3], BLOCK_M)
    for name, ref in (("rows", rows), ("blocks", block_expert), ("used", used), ("pair_row", pair_row)):
        assert got[f"_trt_moe0_{name}"].dtype == np.int32 and np.array_equal(got[f"_trt_moe0_{name}"], ref.numpy())
    n = int(used)
    act = moe_kernels.moe_gate_up(x, gate_up, rows, block_expert, used, BLOCK_M)
    out = moe_kernels.moe_down(act, down, block_expert, used, BLOCK_M)
    low = dtype != torch.float32
    np.testing.assert_allclose(
        got["_trt_moe0_act"][:n].astype(np.float32), act[:n].float().numpy(), rtol=1e-3 if low else 1e-5, atol=1e-5
    )
    assert got["_trt_moe0_out"].dtype == np.float32
    np.testing.assert_allclose(got["_trt_moe0_out"][:n], out[:n].numpy(), rtol=1e-3 if low else 1e-5, atol=1e-5)
    ref = moe_reference(*[t.float() if t.is_floating_point() else t for t in args]).numpy()
    limit = FP16_ATOL * max(1.0, float(np.abs(ref).max())) if low else 1e-5
    assert got["y"].dtype == x.numpy().dtype and np.abs(got["y"].astype(np.float32) - ref).max() <= limit


def test_split_refuses_expert_weights_of_unknown_size():
    from looptool.backends.errors import ExportError

    model = _split_graph(*_case(*CASES[2], torch.float32))
    node = helper.make_node("Moe", ["x", "routing_weights", "expert_ids", "w", "down_proj"], ["z"], domain=DOMAIN)
    model.graph.node.append(node)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, None))
    with pytest.raises(ExportError, match="number of experts"):
        split_moe(model, DOMAIN)


_TRT_DTYPES = {np.float32: "float32", np.float16: "float16", np.int32: "int32", np.int64: "int64"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plugin_launches_give_the_bodies_outputs(dtype, monkeypatch):
    """Under the TensorRT test double (TensorRT's signature rules, shapes as numbers), each MoE
    plugin's descriptor gives its body's output shapes and dtypes, and its AOT launch (grid,
    scalar arguments in order between the input and output pointers, the kernel compiled as
    ``aot_compile`` compiles it) run under Triton's interpreter writes the body's outputs
    (rows in use; the rest the kernels never write). The interpreter multiplies fp32 copies
    of 16-bit tiles (UPCAST), as the suite's kernel tests do."""
    pytest.importorskip("triton")
    import fake_tensorrt

    from looptool.backends.tensorrt import kernels as trt_kernels
    from looptool.backends.tensorrt import moe as trt_moe
    from looptool.backends.tensorrt import plugins as trt_plugins

    trt = fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(trt_plugins, "register", functools.cache(trt_plugins.register.__wrapped__))  # registers anew

    def fake_compile(op, dtype, *, num_experts=8, block_m=BLOCK_M, **_):
        fn, signature, constexprs, scalars, block, columns, options = trt_moe.aot_spec(
            op, "*" + dtype, num_experts=num_experts, block_m=block_m
        )
        constexprs = {**constexprs, **({"UPCAST": True} if "UPCAST" in constexprs else {})}
        kernel = trt_kernels.AOTKernel(op, fn.__name__, "", 32 * options["num_warps"], 0, block, scalars, columns)
        params = [name for name, kind in signature.items() if kind != "constexpr"]  # the PTX's, in order
        return types.SimpleNamespace(**vars(kernel), fn=fn, params=params, constexprs=constexprs)

    compiled = []
    monkeypatch.setattr(
        trt_kernels, "aot_compile", lambda *a, **k: compiled.append(fake_compile(*a, **k)) or compiled[-1]
    )
    trt_plugins.register()
    # I over three 64-column tiles (the gate-up grid's y axis), d in one
    x, weights, ids, gate_up, down = args = _case(37, 48, 144, 6, 2, False, dtype)
    model = _split_graph(*args)
    values = {**_run(model, x, weights, ids), "gate_up_proj": gate_up.numpy(), "down_proj": down.numpy()}
    values |= {"x": x.numpy(), "routing_weights": weights.numpy(), "expert_ids": ids.numpy()}
    used = int(values["_trt_moe0_used"][0])
    rtol = 1e-5 if dtype == torch.float32 else 1e-3  # fp16 results may differ by an ulp: fp32 sums in another order
    for node in model.graph.node:
        plugin = trt.plugin.registered[f"looptool::{node.op_type}"]
        inputs = [values[name] for name in node.input]
        descs = [fake_tensorrt.TensorDesc(a.shape, _TRT_DTYPES[a.dtype.type]) for a in inputs]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        outs = plugin["register"](*descs, **attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        expected = [values[name] for name in node.output]
        assert [(tuple(o.shape_expr), o.dtype) for o in outs] == [
            (e.shape, _TRT_DTYPES[e.dtype.type]) for e in expected
        ], node.op_type
        name, _, params, extra = plugin["aot_impl"](*descs, **attrs, outputs=outs, tactic=0)
        kernel = compiled[-1]
        assert name == kernel.name.encode() and len(extra) == len(kernel.scalars), node.op_type
        results = [torch.zeros(e.shape, dtype=torch.from_numpy(e).dtype) for e in expected]
        pointers_and_scalars = [torch.from_numpy(a) for a in inputs] + list(extra) + results
        assert len(pointers_and_scalars) == len(kernel.params), node.op_type
        kernel.fn[(params.grid_x, params.grid_y)](**dict(zip(kernel.params, pointers_and_scalars)), **kernel.constexprs)
        for result, e in zip(results, expected):
            rows = used if node.op_type in ("MoeGateUp", "MoeDown") else len(e)
            np.testing.assert_allclose(result.numpy()[:rows], e[:rows], rtol=rtol, atol=1e-6, err_msg=node.op_type)
    assert [k.op for k in compiled] == list(MOE_OPS)


def test_an_moe_model_builds_and_decodes_through_the_test_double(tmp_path, monkeypatch):
    """A looped tiny Qwen3-MoE exported for TensorRT (fp32, on target) and built by the test
    double: every ``Moe`` of its variants is split into the four AOT plugin nodes (all plugins
    AOT, none left for Python), and :class:`Runtime`, which registers no plugin definitions
    (an engine holds its kernels), decodes the same greedy tokens as the onnxruntime Runtime."""
    pytest.importorskip("onnxscript")
    import json

    import fake_tensorrt

    import looptool
    from looptool.backends.manifest import MANIFEST
    from looptool.backends.ort.runtime import Runtime as OrtRuntime
    from looptool.backends.tensorrt import plugins as trt_plugins
    from looptool.backends.tensorrt.export import build_engines, export_tensorrt
    from looptool.backends.tensorrt.runtime import Runtime
    from looptool.testing import tiny_model

    model = looptool.convert(tiny_model("qwen3_moe"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.1)
    out = tmp_path / "engine"
    export_tensorrt(model, out, [2], precision="fp32", build_on_target=True, rowwise=False, validate=False)
    section = json.loads((out / MANIFEST).read_text())["tensorrt"]
    assert section["plugins"]["aot"] == ["GatedResidual", "AdaptiveDeltaUpdate", "Modulate", *MOE_OPS]
    assert "jit" not in section["plugins"]
    plugins = section["graphs"]["2"]["per-loop"]["plugins"]  # 4 MoE layers, 2 of them run twice at budget 2
    assert "Moe" not in plugins and all(plugins[op] == 6 for op in MOE_OPS), plugins

    trt = fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(trt_plugins, "register", functools.cache(trt_plugins.register.__wrapped__))  # registers anew
    fake_tensorrt.pretend_gpu(monkeypatch)
    build_engines(out)
    assert all(set(trt.plugin.registered[f"looptool::{op}"]) == {"register", "autotune", "aot_impl"} for op in MOE_OPS)
    trt.plugin.registered.clear()
    rt = Runtime(out, device="cpu")
    assert trt.plugin.registered == {}
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = OrtRuntime(out).generate(ids, budget=2, max_new_tokens=4).sequences
    assert torch.equal(rt.generate(ids, budget=2, max_new_tokens=4).sequences, expected)
