"""The engine manifest (looptool.backends.manifest): a manifest.json written by an earlier
looptool (an ONNX engine with its TensorRT variants, tests/data/engine) reads into typed
entries and writes back byte for byte; malformed manifests are refused in one sentence;
``verify`` names what is wrong with a file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from looptool.backends.errors import EngineError
from looptool.backends.manifest import (
    MANIFEST,
    WEIGHTS,
    BuiltOn,
    FileEntry,
    GraphEntry,
    Manifest,
    Profiles,
    TensorEntry,
    VariantEntry,
)
from looptool.core.graph import ROWWISE
from looptool.core.plan import BudgetCost
from looptool.storage.files import sha256_file

WRITTEN = Path(__file__).resolve().parent / "data" / "engine"  # export_tensorrt(build_on_target=True), kv both


def test_a_written_manifest_reads_typed_and_writes_back_byte_for_byte(tmp_path):
    manifest = Manifest.read(WRITTEN)
    assert manifest.budgets == (0, 2) and manifest.kv_policies == ("last-loop", "per-loop")
    assert sorted(manifest.graphs, key=str) == [0, 2, ROWWISE]  # ints, and the row-wise graphs beside them
    entry = manifest.graph(2, "per-loop")
    assert isinstance(entry, GraphEntry) and entry.file == "budget_2.per-loop.onnx" and entry.menu is None
    assert entry.cache.dtype == "float16" and len(entry.cache.pairs) == 6 and entry.composed
    assert manifest.graph(ROWWISE, "last-loop").menu == (0, 1, 2) and manifest.graph(1, "per-loop") is None
    assert manifest.menu == (0, 1, 2) and all(isinstance(c, BudgetCost) for c in manifest.costs)
    assert [c.budget for c in manifest.row_costs((2, 0))] == [2, 0] and manifest.row_costs((5,)) == ()
    assert manifest.weights.file == WEIGHTS and all(
        isinstance(t, TensorEntry) for t in manifest.weights.tensors.values()
    )
    assert manifest.vocab_size == 256 and manifest.tokenizer and manifest.mask_dtype == "int64"
    trt = manifest.tensorrt
    assert trt.precision == "fp16" and trt.profiles == Profiles(max_batch=4, max_prefill=64, max_capacity=128)
    assert sorted(trt.graphs, key=str) == [0, 2, ROWWISE] and isinstance(trt.graphs[0]["per-loop"], VariantEntry)
    assert trt.engines is None and trt.built_on is None  # built on the target, not here
    manifest.write(tmp_path)
    assert (tmp_path / MANIFEST).read_text() == (WRITTEN / MANIFEST).read_text()


def test_built_engines_round_trip(tmp_path):
    manifest = Manifest.read(WRITTEN)
    manifest.tensorrt.engines = {
        2: {"per-loop": FileEntry("budget_2.per-loop.fp16.engine", "ab", 10)},
        ROWWISE: {"per-loop": FileEntry("rowwise.per-loop.fp16.engine", "cd", 20)},
    }
    manifest.tensorrt.built_on = BuiltOn("NVIDIA H200", (9, 0), "10.9")
    manifest.write(tmp_path)
    on_disk = json.loads((tmp_path / MANIFEST).read_text())["tensorrt"]
    assert list(on_disk["engines"]) == ["2", ROWWISE] and on_disk["built_on"]["compute_capability"] == [9, 0]
    again = Manifest.read(tmp_path)
    assert again.tensorrt == manifest.tensorrt and again.graphs == manifest.graphs


def _edited(tmp_path: Path, edit) -> Path:
    directory = tmp_path / "e"
    directory.mkdir(exist_ok=True)
    data = json.loads((WRITTEN / MANIFEST).read_text())
    edit(data)
    (directory / MANIFEST).write_text(json.dumps(data) if isinstance(data, dict) else data)
    return directory


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="other"), "is not a looptool engine manifest"),
        (lambda d: d.update(format_version=1), "has format version 1, this looptool reads version 2"),
        (lambda d: d.pop("weights"), "lacks the 'weights' entry"),
        (lambda d: d.pop("kv_policies"), "does not list its budgets and KV policies"),
        (lambda d: d["budgets"].update(two=d["budgets"]["2"]), "does not list its budgets and KV policies"),
        (lambda d: d["budgets"]["2"].pop("last-loop"), "lists budget 2 and policy last-loop but has no graph entry"),
        (lambda d: d["budgets"]["0"]["per-loop"].pop("cache"), r"cache layout of budget 0 \(per-loop\)"),
        (lambda d: d[ROWWISE]["per-loop"]["cache"].update(dtype="int8"), r"cache layout of budget rowwise"),
        (lambda d: d["weights"].update(file="other.bin"), "has no weights.bin"),
        (lambda d: d["weights"]["tensors"].update(x={"offset": 0}), "malformed 'weights' entry"),
        (lambda d: d["costs"][0].update(extra=1), "malformed 'costs' entry"),
        (lambda d: d["tensorrt"].pop("profiles"), "malformed 'tensorrt' entry"),
    ],
)
def test_malformed_manifests_are_refused_in_one_sentence(tmp_path, edit, message):
    with pytest.raises(EngineError, match=message):
        Manifest.read(_edited(tmp_path, edit))


def test_missing_and_unreadable_manifests(tmp_path):
    with pytest.raises(EngineError, match="is not a directory"):
        Manifest.read(tmp_path / "nowhere")
    with pytest.raises(EngineError, match="has no manifest.json"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(EngineError, match="is not valid JSON"):
        Manifest.read(tmp_path)


def test_verify_names_what_is_wrong_with_a_file(tmp_path):
    manifest = Manifest.read(WRITTEN)
    (tmp_path / "a.bin").write_bytes(b"abcd")
    good = FileEntry("a.bin", sha256_file(tmp_path / "a.bin"), 4)
    assert manifest.verify(tmp_path, good) is None
    assert manifest.verify(tmp_path, FileEntry("b.bin", good.sha256, 4)) == "missing"
    assert manifest.verify(tmp_path, FileEntry("a.bin", "0" * 64, 4)) == "modified"
    assert manifest.verify(tmp_path, FileEntry("a.bin", "0" * 64, 4), sha256=False) is None  # not hashed
    assert manifest.verify(tmp_path, FileEntry("a.bin", good.sha256, 5)) == "resized"
    assert manifest.verify(tmp_path, FileEntry("a.bin", good.sha256)) is None  # no size recorded
    assert manifest.verify(tmp_path) == "missing"  # default: weights.bin
    shutil.copy(tmp_path / "a.bin", tmp_path / WEIGHTS)
    manifest.weights.sha256, manifest.weights.bytes = good.sha256, 4
    assert manifest.verify(tmp_path) is None
