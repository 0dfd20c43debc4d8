"""The ONNX body cache: an export served from it writes the same files as a fresh one, a
model with other (trained) weights reuses every body and still validates against PyTorch,
a bad entry is dropped and rebuilt, a change of any key field misses, and
``LOOPTOOL_CACHE=off`` writes nothing."""

from __future__ import annotations

import filecmp
import shutil
import threading

import pytest
import torch

import looptool
from looptool.backends.onnx import body_cache as onnx_body_cache
from looptool.backends.onnx.export import export_onnx
from looptool.cache import caches, scoped
from looptool.testing import tiny_model

PLAN = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))


@pytest.fixture(scope="module")
def model():
    return looptool.convert(tiny_model("llama"), PLAN)


@pytest.fixture(scope="module")
def populated(model, tmp_path_factory):
    """``(cache folder, engine)``: one fresh export (nothing cached) and the cache it filled."""
    root = tmp_path_factory.mktemp("body-cache")
    with scoped(root / "cache") as filled:
        _export(model, root / "fresh", validate=False)
        assert not stats()["hit"] and stats()["miss"] >= 3  # glue, layer, gated pass
    return filled.onnx_bodies.directory(), root / "fresh"


@pytest.fixture
def cache(populated, own_caches):
    """A copy of the populated cache in a cache of the test's own, and the counts from zero."""
    shutil.copytree(populated[0], own_caches.onnx_bodies.directory())
    return own_caches.onnx_bodies.directory()


def stats():
    """What served the bodies so far (the counts of the caches in use)."""
    return caches().onnx_bodies.stats


def _export(model, path, **kw):
    return export_onnx(model, path, [1], kv="per-loop", rowwise=False, **kw)


def _same_files(a, b) -> None:
    cmp = filecmp.dircmp(a, b)
    assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
    assert "budget_1.per-loop.onnx" in cmp.same_files


def test_a_cached_export_writes_the_same_files_and_trained_weights_reuse_every_body(model, populated, cache, tmp_path):
    bodies = len(list(cache.glob("*.json")))
    _export(model, tmp_path / "cached", validate=False)
    assert stats() == {"hit": bodies}
    _same_files(populated[1], tmp_path / "cached")

    trained = looptool.convert(tiny_model("llama"), PLAN)  # other weights, every gate non-zero
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    report = _export(trained, tmp_path / "trained")  # validated: onnxruntime against PyTorch
    assert stats() == {"hit": 2 * bodies}
    assert max(report.budgets[0].max_abs_diff.values()) < 1e-4


def test_a_bad_entry_is_dropped_with_a_warning_and_rebuilt(model, populated, cache, tmp_path, caplog):
    victim = sorted(p for p in cache.iterdir() if p.suffix == ".onnx")[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="looptool.backends.onnx.body_cache"):
        _export(model, tmp_path / "again", validate=False)
    assert "ONNX body cache: dropping the corrupt or stale entry" in caplog.text
    assert stats()["dropped"] == stats()["miss"] == 1
    _same_files(populated[1], tmp_path / "again")
    assert len(list(cache.glob("*.onnx"))) == len(list(cache.glob("*.json")))  # rebuilt, the bad file gone


def _tiny_body():
    """A one-node ONNX model, as an export of a body would return it."""
    import onnx_ir as ir

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 4]))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_every_key_field_misses_and_off_writes_nothing(cache, monkeypatch):
    calls = []

    def export(tag, example, shapes):  # the module argument stands for which call this is
        calls.append(tag)
        return _tiny_body(), {"SkipRMSNorm": len(calls)}

    example, shapes = [torch.zeros(11, 4)], [{0: "batch"}]
    first = onnx_body_cache.cached(export, "a", example, shapes, code_key="code", variant="v")
    again = onnx_body_cache.cached(export, "b", example, shapes, code_key="code", variant="v")
    assert calls == ["a"] and again[1] == first[1] == {"SkipRMSNorm": 1}
    assert [n.op_type for n in again[0].graph] == ["Relu"] and again[0].graph.inputs[0].shape[0] == "batch"
    for code, ex, dims, variant in [  # code, input shape, input dtype, dynamic dimensions, variant
        ("code2", example, shapes, "v"),
        ("code", [torch.zeros(11, 5)], shapes, "v"),
        ("code", [torch.zeros(11, 4, dtype=torch.float16)], shapes, "v"),
        ("code", example, [None], "v"),
        ("code", example, shapes, "ort_fusions=True"),
    ]:
        onnx_body_cache.cached(export, code, ex, dims, code_key=code, variant=variant)
    assert len(calls) == 6 and stats()["miss"] == 6
    entries = sorted(cache.iterdir())
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    onnx_body_cache.cached(export, "off", example, shapes, code_key="code", variant="v")
    assert calls[-1] == "off" and stats()["uncached"] == 1
    assert sorted(cache.iterdir()) == entries


def test_concurrent_misses_of_one_body_export_it_once(cache, all_missed):
    """Processes that miss the same body at once (pytest-xdist workers, a sweep) export it
    once: the others wait on its lock file, then read the entry it wrote."""
    calls, start, got = [], threading.Barrier(3), {}

    def export(tag, example, shapes):
        calls.append(tag)
        all_missed(3)  # the other callers missed the entry meanwhile and wait on its lock
        return _tiny_body(), {"SkipRMSNorm": 7}

    def one(i):
        start.wait()
        got[i] = onnx_body_cache.cached(export, i, [torch.zeros(3, 4)], [{0: "batch"}], code_key="same", variant="v")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (stats()["miss"], stats()["hit"]) == (1, 2)
    assert all(fusions == {"SkipRMSNorm": 7} for _, fusions in got.values()) and len(got) == 3
    assert [n.op_type for _, (model, _f) in sorted(got.items()) for n in model.graph] == ["Relu"] * 3


def test_the_torchlib_registry_is_built_once_and_each_export_gets_its_own_copy():
    """Inside ``reused_torchlib_registry`` every ``ONNXRegistry.from_torchlib`` returns a copy
    of one registry built once per opset, equal to torch's own build, whose per-op lists are
    its own; after the block torch's classmethod is back, the very same descriptor."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from looptool.core import compat

    own = vars(ONNXRegistry)["from_torchlib"]
    fresh = ONNXRegistry.from_torchlib()
    with compat.reused_torchlib_registry():
        a, b = ONNXRegistry.from_torchlib(), ONNXRegistry.from_torchlib()
        kept = compat._registries().kept[fresh.opset_version]
    assert vars(ONNXRegistry)["from_torchlib"] is own
    assert a is not b and a is not kept
    assert a.opset_version == fresh.opset_version
    assert a.functions.keys() == fresh.functions.keys()
    for target, metas in fresh.functions.items():
        assert [m.onnx_function for m in a.functions[target]] == [m.onnx_function for m in metas]
        assert a.functions[target] is not b.functions[target] is not kept.functions[target]
    target = next(iter(a.functions))
    a.functions[target].append("a custom translation")
    assert "a custom translation" not in b.functions[target] + kept.functions[target]
