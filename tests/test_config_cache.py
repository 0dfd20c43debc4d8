"""The config cache (looptool.capture.config_cache): a warm load in a fresh process builds no
model and imports no modeling module, and equals a load with the caches off at every budget;
a changed module source file or a missing program builds the model again; every key field
misses; what cannot be keyed is not cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY_PLAN

import looptool
from looptool.cache import caches
from looptool.capture import cache, capture_config, config_cache
from looptool.capture.export import build_skeleton
from looptool.testing import byte_tokenizer, tiny_config, tiny_model


@pytest.fixture(autouse=True)
def cache_root(own_caches):
    """The root of a cache of this test's own, in-process entries and counts fresh."""
    return own_caches.root()


def stats():
    """What served the config records so far (the test's own counts)."""
    return caches().configs.stats


def capture_stats():
    """What served the captures so far (the test's own counts)."""
    return caches().captures.stats


@pytest.fixture
def saved(tmp_path):
    """A tiny looped Llama with trained-like gates and a tokenizer, saved."""
    model = looptool.convert(tiny_model("llama"), TINY_PLAN, tokenizer=byte_tokenizer())
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


_FRESH_LOAD = textwrap.dedent(
    """
    import json, sys, torch, looptool
    from looptool.cache import caches
    model = looptool.load(sys.argv[1])
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save({k: model(ids, budget=k).logits for k in model.budgets}, sys.argv[3])
    print(json.dumps({
        "modeling": sorted(
            m for m in sys.modules
            if m.startswith("transformers.models.") and ".modeling_" in m and not m.startswith("transformers.models.auto.")
        ),
        "config": dict(caches().configs.stats), "capture": dict(caches().captures.stats),
        "tokenizer": dict(caches().tokenizers.stats),
        "text": model.tokenizer.decode(model.tokenizer("We the People").input_ids),
    }))
    """
)


def test_a_warm_load_in_a_fresh_process_builds_no_model(saved, tmp_path, monkeypatch, cache_root, input_ids):
    with monkeypatch.context() as m:
        m.setenv("LOOPTOOL_CACHE", "off")
        with torch.no_grad():
            want = {k: v.logits for k, v in ((k, looptool.load(saved)(input_ids, budget=k)) for k in TINY_PLAN.budgets)}
    looptool.load(saved)  # fills the caches
    assert (stats()["miss"], capture_stats()["miss"]) == (1, 1)
    torch.save(input_ids, tmp_path / "ids.pt")
    res = subprocess.run(
        [sys.executable, "-c", _FRESH_LOAD, str(saved), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LOOPTOOL_CACHE": str(cache_root)},  # the same cache as this process
    )
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["modeling"] == [], report  # no architecture was built
    assert (report["config"], report["capture"], report["tokenizer"]) == ({"disk": 1},) * 3, report
    assert report["text"] == "We the People"
    got = torch.load(tmp_path / "out.pt")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"budget {k}"


def test_a_changed_module_file_or_a_lost_program_builds_the_model(monkeypatch, cache_root):
    config = tiny_config("llama", num_layers=1)
    want = capture_config(config, torch.float32)
    assert stats()["miss"] == 1 and caches().configs.held()
    (record,) = caches().configs.held()
    modeling = next(p for p in record["model_files"] if p.endswith("modeling_llama.py"))
    real = config_cache.file_sha256
    with monkeypatch.context() as m:  # the architecture's source changed since the record
        m.setattr(config_cache, "file_sha256", lambda p: "edited" if str(p) == modeling else real(p))
        got = capture_config(tiny_config("llama", num_layers=1), torch.float32)
    assert stats()["stale"] == 1 and capture_stats()["memory"] == 1  # built, then the export served
    caches().captures.clear_memory()
    for data in caches().captures.directory().glob("*.fx"):
        data.unlink()  # the program is gone: the record cannot serve
    again = capture_config(tiny_config("llama", num_layers=1), torch.float32)
    assert stats()["stale"] == 2 and capture_stats()["miss"] == 2
    served = capture_config(tiny_config("llama", num_layers=1), torch.float32)
    assert stats()["memory"] == 3  # the rewritten record serves again
    for lg in (got, again, served):
        assert lg.module.code == want.module.code and lg.layers == want.layers and lg.source == want.source


def test_a_served_capture_equals_the_built_one(cache_root):
    """Served from the record: the same code, annotations, source facts and config state as the
    capture of the built skeleton; tied names share one fresh meta tensor, of the same kinds."""
    config = tiny_config("gemma3_text", num_layers=2)
    built_model = build_skeleton(tiny_config("gemma3_text", num_layers=2), torch.float32)
    built = capture_config(config, torch.float32)
    fresh = tiny_config("gemma3_text", num_layers=2)
    served = capture_config(fresh, torch.float32)
    assert stats()["memory"] == 1
    assert served.module.code == built.module.code
    assert served.layers == built.layers and served.source == built.source
    assert vars(fresh) == vars(built_model.config)  # the implementations transformers chose, set again
    for a, b in zip(served.module.graph.nodes, built.module.graph.nodes, strict=True):
        assert (a.name, a.meta.get("looptool")) == (b.name, b.meta.get("looptool"))
    mine = cache.own_tensors(served.module)
    theirs = cache.own_tensors(built.module)
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        ref = theirs[name]
        assert (t.shape, t.dtype, t.device.type, type(t), t.requires_grad) == (
            ref.shape,
            ref.dtype,
            "meta",
            type(ref),
            ref.requires_grad,
        )
    ties = {(a, b) for a in theirs for b in theirs if a < b and theirs[a] is theirs[b]}
    assert ties == {(a, b) for a in mine for b in mine if a < b and mine[a] is mine[b]}


def test_every_key_field_changes_the_key(monkeypatch):
    config = tiny_config("llama", num_layers=1)
    base = config_cache.key_of(config, torch.float32, None, False)
    changed = {
        "dtype": config_cache.key_of(config, torch.bfloat16, None, False),
        "attention": config_cache.key_of(config, torch.float32, "eager", False),
        "decode": config_cache.key_of(config, torch.float32, None, True),
        "config": config_cache.key_of(tiny_config("llama", num_layers=1, hidden_size=96), torch.float32, None, False),
    }
    other = tiny_config("llama", num_layers=1)
    other._attn_implementation_internal = "eager"  # chosen by an earlier build
    changed["private"] = config_cache.key_of(other, torch.float32, None, False)
    with monkeypatch.context() as m:
        m.setattr(config_cache.capture_cache, "versions", lambda: {"torch": "0"})
        changed["versions"] = config_cache.key_of(config, torch.float32, None, False)
    with monkeypatch.context() as m:
        m.setattr(config_cache, "_capture_code_hash", lambda: "edited")
        changed["code"] = config_cache.key_of(config, torch.float32, None, False)
    torch.set_default_dtype(torch.float64)
    try:
        changed["default dtype"] = config_cache.key_of(config, torch.float32, None, False)
    finally:
        torch.set_default_dtype(torch.float32)
    for field, key in changed.items():
        assert key is not None and key != base, field
    assert config_cache.key_of(tiny_config("llama", num_layers=1), torch.float32, None, False) == base


def test_what_cannot_be_keyed_is_not_cached(monkeypatch):
    import transformers

    composite = transformers.Gemma3Config()  # holds a text and a vision config
    assert config_cache.key_of(composite, torch.float32, None, False) is None
    assert stats() == {"uncached": 1}
    stats().clear()
    config = tiny_config("llama", num_layers=1)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert config_cache.key_of(config, torch.float32, None, False) is None
    finally:
        handle.remove()
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    assert config_cache.key_of(config, torch.float32, None, False) is None
    capture_config(config, torch.float32)
    assert not stats() and not caches().configs.held()
