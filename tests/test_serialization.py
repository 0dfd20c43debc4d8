"""save_pretrained / looptool.load: bit-identical round trips and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_PLAN
from safetensors import safe_open

import looptool
from looptool.core.errors import CheckpointError, LooptoolError
from looptool.testing import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "olmo2", "gemma3_text", "qwen2_moe"])
def test_round_trip_is_bit_identical_with_trained_gates(arch, tmp_path, input_ids):
    looped = looptool.convert(tiny_model(arch), TINY_PLAN)
    with torch.no_grad():
        for _, p in looped.new_parameters():
            p.normal_(0, 0.3)
    want = {k: looped(input_ids, budget=k).logits for k in looped.budgets}
    looped.save_pretrained(tmp_path / "m")
    loaded = looptool.load(tmp_path / "m")
    assert loaded.budgets == looped.budgets and loaded.plan == looped.plan
    assert loaded.recipe == looped.recipe
    for k in looped.budgets:
        assert torch.equal(want[k], loaded(input_ids, budget=k).logits), f"{arch} budget {k}"
    gates = dict(loaded.new_parameters())
    assert all(g.abs().sum() > 0 for g in gates.values())
    assert all(g.requires_grad for g in gates.values())


def test_saved_file_holds_each_tensor_once(tmp_path):
    source = tiny_model("llama")
    source.config.tie_word_embeddings = True
    source.tie_weights()
    looped = looptool.convert(source, TINY_PLAN)
    looped.save_pretrained(tmp_path / "m")
    unique = {id(t): t for t in list(looped.parameters()) + list(looped.buffers())}
    expected = sum(t.numel() * t.element_size() for t in unique.values())
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert stored == expected
    size = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert expected <= size <= expected + 64 * 1024  # plus the JSON header
    reloaded = looptool.load(tmp_path / "m")
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(looped(ids, budget=2).logits, reloaded(ids, budget=2).logits)


def test_save_refuses_existing_dir_and_leaves_nothing(tmp_path):
    _, looped = _converted_llama()
    target = tmp_path / "m"
    target.mkdir()
    with pytest.raises(LooptoolError, match="already exists; pass overwrite=True"):
        looped.save_pretrained(target)
    assert list(target.iterdir()) == []
    looped.save_pretrained(target, overwrite=True)
    assert (target / "looptool.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


def _converted_llama():
    from conftest import converted

    return converted("llama")


@pytest.fixture
def saved(tmp_path):
    _, looped = _converted_llama()
    return looped.save_pretrained(tmp_path / "m")


def test_refuses_wrong_format_version(saved):
    meta = json.loads((saved / "looptool.json").read_text())
    meta["format_version"] = 42
    (saved / "looptool.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format version 42"):
        looptool.load(saved)


def test_refuses_corrupted_json(saved):
    (saved / "looptool.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        looptool.load(saved)


def test_refuses_missing_and_corrupted_weights(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        looptool.load(saved)
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        looptool.load(saved)


def test_refuses_mismatched_tensors(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    meta = json.loads((saved / "looptool.json").read_text())
    del meta["files"]  # the sha256 check would refuse first; these are the header checks
    (saved / "looptool.json").write_text(json.dumps(meta))
    tensors = load_file(saved / "model.safetensors")
    name = "loop.prefix.1.attention_gate"
    tensors[name] = torch.zeros(7)
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}'.*shape \\(7,\\)"):
        looptool.load(saved)
    del tensors[name]
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing"):
        looptool.load(saved)


def test_refuses_plain_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no looptool.json"):
        looptool.load(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        looptool.load(tmp_path / "absent")


def test_load_inside_inference_mode_returns_ordinary_trainable_weights(saved, input_ids):
    """A user's ``with torch.inference_mode(): looptool.load(...)`` loads (it was refused as a
    corrupt file) and gives ordinary tensors equal to a plain load's."""
    plain = looptool.load(saved)
    with torch.inference_mode():
        model = looptool.load(saved)
    assert not any(p.is_inference() for p in model.parameters())
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.inference_mode():
        assert torch.equal(model(input_ids, budget=1).logits, plain(input_ids, budget=1).logits)


def test_meta_load_reads_structure_only(saved):
    model = looptool.load(saved, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.budgets == (0, 1, 2)


def test_loaded_tensors_are_aligned(tmp_path):
    """Reloaded weights own 64-byte-aligned storage: CPU GEMMs round differently on data at
    other offsets, which broke bit-exact reloads of MoE models (grouped expert matmuls)."""
    source = tiny_model("qwen3_moe")
    model = looptool.convert(source, looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2))
    model.save_pretrained(tmp_path / "m")
    loaded = looptool.load(tmp_path / "m")
    assert all(t.data_ptr() % 64 == 0 for t in loaded.state_dict().values())
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in model.budgets:
            assert torch.equal(model(ids, budget=k).logits, loaded(ids, budget=k).logits)


@pytest.fixture(scope="module")
def saved_4mb(tmp_path_factory):
    """A looped tiny Llama with a 8192-token vocabulary (4.8 MB of weights) and a tokenizer."""
    from looptool.testing import byte_tokenizer

    path = tmp_path_factory.mktemp("saved") / "m"
    looptool.convert(tiny_model("llama", vocab_size=8192), TINY_PLAN, tokenizer=byte_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture
def corrupted(saved_4mb, tmp_path):
    """A copy of ``saved_4mb`` with 1 MiB in the middle of model.safetensors overwritten
    (the header, and so every shape and dtype, intact)."""
    import shutil

    path = shutil.copytree(saved_4mb, tmp_path / "m")
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size // 2 - (1 << 19))
        f.write(
            torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            .numpy()
            .tobytes()
        )
    assert weights.stat().st_size == size
    return path


def test_records_sha256_of_weights(saved_4mb):
    import hashlib

    files = json.loads((saved_4mb / "looptool.json").read_text())["files"]
    data = (saved_4mb / "model.safetensors").read_bytes()
    assert files == {"model.safetensors": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def test_refuses_corrupted_weight_data(corrupted):
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors is corrupt: its contents differ from the sha256 recorded in looptool.json",
    ):
        looptool.load(corrupted)
    assert looptool.load(corrupted, device="meta").budgets == (0, 1, 2)  # inspect reads headers only: not checked


def test_cli_generate_refuses_corrupted_weights(corrupted):
    from typer.testing import CliRunner

    from looptool.cli import app

    res = CliRunner().invoke(app, ["generate", str(corrupted), "-p", "We", "--max-new-tokens", "2"])
    text = " ".join(res.output.split())  # rich wraps long lines
    assert res.exit_code == 1 and text.count("error:") == 1 and "is corrupt" in text, res.output


def test_loads_model_saved_without_checksums(saved, input_ids):
    meta = json.loads((saved / "looptool.json").read_text())
    del meta["files"]  # as written before checksums were recorded
    (saved / "looptool.json").write_text(json.dumps(meta))
    _, looped = _converted_llama()
    with torch.no_grad():
        assert torch.equal(looptool.load(saved)(input_ids, budget=2).logits, looped(input_ids, budget=2).logits)


@pytest.mark.parametrize("umask, dirs, files", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)], ids=["022", "027"])
def test_saved_model_gets_the_umask(tmp_path, umask, dirs, files):
    """Not mkdtemp's 0700 nor safetensors' 0600: colleagues on a shared machine can read it."""
    import os
    import stat

    _, looped = _converted_llama()
    previous = os.umask(umask)
    try:
        path = looped.save_pretrained(tmp_path / "m")
        looped.save_pretrained(path, overwrite=True)  # replacing goes through the same helper
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == dirs
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()} == {p.name: files for p in path.iterdir()}
    assert "model.safetensors" in {p.name for p in path.iterdir()}
