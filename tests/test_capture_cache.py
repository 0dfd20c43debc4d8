"""The capture cache (looptool.capture.cache): cached loads, captures and cached decoding are
bit-identical to uncached ones; bad entries are rebuilt; every key field misses."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import threading

import pytest
import torch
from conftest import TINY_PLAN

import looptool
from looptool.cache import caches, digest, scoped, sha256
from looptool.capture import cache
from looptool.capture import capture as capture_graph
from looptool.capture.export import build_skeleton, export_decode_step, export_source
from looptool.runtime.generation import generate
from looptool.testing import tiny_config, tiny_model

ELR = looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)
SKELETON_LAYERS = 1  # the cache's mechanics do not depend on depth; a one-layer capture is the cheapest


@pytest.fixture(autouse=True)
def cache_dir(own_caches):
    """The capture folder of a cache of this test's own (never the user's or the session's)."""
    return own_caches.captures.directory()


def stats():
    """What served the captures so far (the test's own counts)."""
    return caches().captures.stats


def _off(monkeypatch):
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")


def _tensors(module) -> dict:
    return {
        **dict(module.named_buffers(remove_duplicate=False)),
        **dict(module.named_parameters(remove_duplicate=False)),
    }


def _saved(arch: str, plan, path, monkeypatch):
    """Save a looped tiny ``arch`` whose new parameters are non-zero (converted uncached)."""
    with monkeypatch.context() as m:
        _off(m)
        looped = looptool.convert(tiny_model(arch), plan)
    with torch.no_grad():
        for _, p in looped.new_parameters():
            p.normal_(0, 0.3)
    looped.save_pretrained(path)
    return path


def _logits(model, ids) -> dict:
    with torch.no_grad():
        return {k: model(ids, budget=k).logits for k in model.budgets}


def _generations(model, prompt) -> dict:
    return {
        (k, kv): generate(model, prompt, budget=k, max_new_tokens=3, kv=kv, output_logits=True)
        for k in model.budgets
        for kv in ("per-loop", "last-loop")
    }


@pytest.mark.parametrize(
    "arch,plan,decode",
    [("llama", TINY_PLAN, False), ("llama", ELR, True), ("qwen3_moe", ELR, False)],
    ids=["prefix-llama", "recurrent-llama-generate", "recurrent-qwen3_moe"],
)
def test_cached_load_is_bit_identical(arch, plan, decode, tmp_path, monkeypatch, cache_dir, input_ids):
    """A load served by a fresh export (writing the cache), then from disk, then from memory,
    equals a load with the cache off at every budget; with ``decode`` so does cached
    generation under both KV policies (its decode-step capture is cached too). The loads from
    disk and memory build no model: the config cache's records serve them."""
    saved = _saved(arch, plan, tmp_path / "m", monkeypatch)
    prompt = input_ids[:, :5]
    with monkeypatch.context() as m:
        _off(m)
        fresh = looptool.load(saved)
        want = _logits(fresh, input_ids), _generations(fresh, prompt) if decode else {}
    code = fresh.layer_graph.module.code
    assert not cache_dir.exists()
    for path in ("miss", "disk", "memory"):
        if path == "disk":
            caches().clear_memory()
        loaded = looptool.load(saved)
        assert loaded.layer_graph.module.code == code
        got = _logits(loaded, input_ids), _generations(loaded, prompt) if decode else {}
        assert stats()[path] == (2 if decode else 1), (path, dict(stats()))  # the forward (and the decode step)
        assert caches().configs.stats[path] == (2 if decode else 1), (path, dict(caches().configs.stats))
        for k in want[0]:
            assert torch.equal(want[0][k], got[0][k]), f"{arch} {path} budget {k}"
        for key, out in want[1].items():
            assert torch.equal(out.sequences, got[1][key].sequences), (path, key)
            assert all(torch.equal(a, b) for a, b in zip(out.logits, got[1][key].logits, strict=True)), (path, key)
    records = caches().configs.stats
    assert stats()["dropped"] == records["dropped"] == records["stale"] == 0


@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
def test_cached_export_holds_the_models_own_tensors(decode, monkeypatch):
    """Served from disk or memory, the unlifted module equals a fresh export's: same code, and
    every parameter and buffer (rotary inv_freq, a non-persistent buffer, too) is the model's
    own tensor object; no module or metadata container is shared between two captures."""
    model = tiny_model("llama", num_layers=SKELETON_LAYERS)
    fn = export_decode_step if decode else export_source
    with monkeypatch.context() as m:
        _off(m)
        fresh = fn(model)
    own = _tensors(model)
    assert any(name not in model.state_dict() for name in own)  # a non-persistent buffer (rotary inv_freq)
    got = [fn(model)]
    caches().clear_memory()
    got += [fn(model), fn(model)]
    assert (stats()["miss"], stats()["disk"], stats()["memory"]) == (1, 1, 1)
    for gm in got:
        assert gm.code == fresh.code
        tensors = _tensors(gm)
        assert tensors.keys() == _tensors(fresh).keys()
        assert all(t is own[name] for name, t in tensors.items())
    a, b = got[1], got[2]
    assert a is not b and a.graph is not b.graph
    nodes = {id(n) for n in a.graph.nodes}
    assert not nodes & {id(n) for n in b.graph.nodes}
    for x, y in zip(a.graph.nodes, b.graph.nodes):
        assert x.meta is not y.meta
        assert all(v is not y.meta[k] for k, v in x.meta.items() if isinstance(v, (dict, list)))


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """A cache holding the forward export of the tiny Llama skeleton, and the fresh code."""
    with scoped(tmp_path_factory.mktemp("populated")) as filled:
        code = export_source(_skeleton()).code
    return filled.captures.directory(), code


def _config(**overrides):
    return tiny_config("llama", **{"num_layers": SKELETON_LAYERS, **overrides})


def _skeleton(**overrides):
    return build_skeleton(_config(**overrides), torch.float32)


def _entry(folder):
    (sidecar,) = folder.glob("*.json")
    return sidecar, folder / json.loads(sidecar.read_text())["file"]


def _flip_bytes(sidecar, program):
    data = bytearray(program.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    program.write_bytes(bytes(data))


def _unloadable(sidecar, program):  # the sha256 recorded matches: reading it back raises
    import hashlib

    junk = b"not a stored program" * 100
    program.write_bytes(junk)
    meta = json.loads(sidecar.read_text())
    meta.update(bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    sidecar.write_text(json.dumps(meta))


def _other_versions(sidecar, program):
    meta = json.loads(sidecar.read_text())
    meta["versions"]["torch"] = "0.0.1"
    sidecar.write_text(json.dumps(meta))


def _bad_sidecar(sidecar, program):
    sidecar.write_text("{not json")


def _missing(sidecar, program):
    program.unlink()


@pytest.mark.parametrize(
    "corrupt", [_flip_bytes, _unloadable, _other_versions, _bad_sidecar, _missing], ids=lambda f: f.__name__.strip("_")
)
def test_bad_entry_is_rebuilt_with_a_warning(corrupt, populated, cache_dir, caplog):
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    corrupt(*_entry(cache_dir))
    with caplog.at_level("WARNING", logger="looptool.capture.cache"):
        gm = export_source(_skeleton())
    assert gm.code == code
    assert stats()["dropped"] == 1 and stats()["miss"] == 1
    assert "capture cache: dropping the corrupt or stale entry" in caplog.text
    sidecar, program = _entry(cache_dir)  # rewritten whole
    meta = json.loads(sidecar.read_text())
    assert meta["sha256"] == sha256(program.read_bytes()) and meta["versions"] == cache.versions()


def test_a_valid_entry_is_served_from_disk(populated, cache_dir):
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    assert export_source(_skeleton()).code == code
    assert (stats()["disk"], stats()["miss"]) == (1, 0)


def _digest(model, options=None) -> str:
    key = cache.key_of(model, options or {"decode": False, "seq_len": 8, "batch": 2})
    return digest(key)


def _subclassed(model):
    model.__class__ = type("MyLlama", (type(model),), {})
    return model


def test_every_key_field_changes_the_key(monkeypatch):
    base = _digest(_skeleton())
    assert _digest(_skeleton()) == base  # the same architecture: the same key
    named = _skeleton()
    named.config._name_or_path = "/somewhere/else"  # where a config came from does not matter
    assert _digest(named) == base
    others = {
        "dtype": _digest(build_skeleton(_config(), torch.bfloat16)),
        "config": _digest(_skeleton(rms_norm_eps=1e-3)),
        "layers": _digest(_skeleton(num_layers=SKELETON_LAYERS + 1)),
        "attention": _digest(build_skeleton(_config(), torch.float32, "eager")),
        "device": _digest(_skeleton().to_empty(device="cpu")),
        "class": _digest(_subclassed(_skeleton())),
        "seq_len": _digest(_skeleton(), {"decode": False, "seq_len": 9, "batch": 2}),
        "batch": _digest(_skeleton(), {"decode": False, "seq_len": 8, "batch": 3}),
        "decode": _digest(_skeleton(), {"decode": True, "seq_len": 8, "batch": 2}),
        "cache_len": _digest(_skeleton(), {"decode": True, "seq_len": 8, "batch": 2, "cache_len": 16}),
    }
    # transformers may replace its lazy module in sys.modules on first use: patch the current one
    for module in (torch, sys.modules["transformers"], cache):
        with monkeypatch.context() as m:
            m.setattr(module, "__version__", "0.0.1")
            others[f"{module.__name__} version"] = _digest(_skeleton())
    with monkeypatch.context() as m:
        m.setattr(cache, "_export_code_hash", lambda: "edited")
        others["export code"] = _digest(_skeleton())
    with monkeypatch.context() as m:
        m.setattr(cache, "file_sha256", lambda *a: "edited")  # an edited modeling_llama.py
        others["model code"] = _digest(_skeleton())
    trained = _skeleton()
    trained.train()
    others["training"] = _digest(trained)
    same = [field for field, digest in others.items() if digest == base]
    assert not same, f"these changes keep the key: {same}"
    assert len(set(others.values())) == len(others)


def test_a_changed_version_misses_and_the_old_entry_stays(populated, cache_dir, monkeypatch):
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    with monkeypatch.context() as m:
        m.setattr(cache, "__version__", "0.0.1")
        assert export_source(_skeleton()).code == code
    assert (stats()["miss"], stats()["disk"], stats()["dropped"]) == (1, 0, 0)
    assert len(list(cache_dir.glob("*.json"))) == 2
    caches().clear_memory()
    export_source(_skeleton())
    assert stats()["disk"] == 1


def test_hooked_models_are_not_cached(cache_dir):
    model = _skeleton()
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    assert cache.key_of(model, {}) is None
    handle.remove()
    assert cache.key_of(model, {}) is not None


def test_off_writes_nothing(tmp_path, monkeypatch):
    _off(monkeypatch)
    monkeypatch.chdir(tmp_path)  # "off" is not a directory name
    before = sorted(tmp_path.rglob("*"))
    capture_graph(_skeleton())
    assert sorted(tmp_path.rglob("*")) == before
    assert not caches().captures.held() and not stats()


def test_concurrent_writers_of_one_key_leave_a_valid_entry(populated, cache_dir):
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    sidecar, program = _entry(cache_dir)
    meta = json.loads(sidecar.read_text())
    data = program.read_bytes()
    key = meta["key"]
    name = sidecar.stem
    errors = []

    def write():
        try:
            caches().captures.write(name, key, cache.versions(), data)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert not list(cache_dir.glob(".*.tmp"))
    assert export_source(_skeleton()).code == code
    assert (stats()["disk"], stats()["dropped"]) == (1, 0)


def test_concurrent_misses_of_one_key_export_once(cache_dir, monkeypatch, all_missed):
    """Callers that miss one entry at the same time (the ranks of a DDP run, xdist workers)
    export it once: the others wait on its lock file, then read the entry it wrote."""
    real, exports = torch.export.export, []

    def slow_export(*args, **kwargs):
        exports.append(threading.current_thread().name)
        all_missed(len(models))  # the other callers missed the entry meanwhile and wait on its lock
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", slow_export)
    models = [_skeleton() for _ in range(3)]
    start, codes = threading.Barrier(len(models)), {}

    def capture_one(i):
        start.wait()
        codes[i] = export_source(models[i]).code

    threads = [threading.Thread(target=capture_one, args=(i,), name=f"caller{i}") for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(exports) == 1, exports
    assert len(codes) == len(models) and len(set(codes.values())) == 1
    assert (stats()["miss"], stats()["disk"] + stats()["memory"]) == (1, len(models) - 1)
    assert stats()["dropped"] == 0


def test_an_unwritable_cache_warns_once_and_captures(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with scoped(blocker), caplog.at_level("WARNING", logger="looptool.capture.cache"):  # captures/ cannot be made
        code = export_source(_skeleton()).code
        caches().clear_memory()
        assert export_source(_skeleton()).code == code
        assert stats()["miss"] == 2
    assert caplog.text.count("could not store the exported program") == 1
    assert len(caplog.records) == 1


def test_a_changed_in_process_entry_is_read_again(populated, cache_dir):
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    export_source(_skeleton())  # from disk, now also in memory
    ((program, _),) = caches().captures.held()
    env = program.shape_env()
    env.guards.append(env.guards[0] if env.guards else None)  # as if a caller had added a guard
    assert export_source(_skeleton()).code == code
    assert (stats()["disk"], stats()["memory"]) == (2, 0)


def test_a_stored_program_rebuilds_the_export(monkeypatch):
    """The stored form (programs) read back builds the exported module again: same code, the
    model's own tensors with their kinds and persistence, one node value per description."""
    from looptool.capture import programs

    model = tiny_model("llama", num_layers=SKELETON_LAYERS)
    with monkeypatch.context() as m:
        _off(m)
        gm = export_source(model)
    own = _tensors(model)
    program = programs.program_of(gm, own)
    from torch.fx._graph_pickler import GraphPickler

    fell_back = []
    with monkeypatch.context() as m:  # stored on the C pickler: GraphPickler's own is not used
        m.setattr(GraphPickler, "dumps", classmethod(lambda *a, **k: fell_back.append(True)))
        data = programs.dumps(program)
    assert not fell_back and isinstance(data, bytes)
    refused = []

    def no_fast_pickler():
        refused.append(True)
        raise pickle.PicklingError("a value the C pickler cannot hold")

    with monkeypatch.context() as m:  # the fallback (GraphPickler's own pickler) reads back the same
        m.setattr(programs, "_fast_pickler", no_fast_pickler)
        fallback = programs.build(programs.loads(programs.dumps(program)), own)
    assert refused and fallback.code == gm.code
    stored = programs.loads(data)
    built = programs.build(stored, own)
    assert built.code == gm.code
    assert all(t is own[name] for name, t in _tensors(built).items())
    assert dict(built.named_parameters(remove_duplicate=False)).keys() == dict(gm.named_parameters()).keys()
    assert set(built.state_dict()) == set(gm.state_dict())  # non-persistent buffers stay so
    vals = [n.meta["val"] for n in built.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert len({id(v) for v in vals}) < len(vals)  # shared per description
    wrong = dict(own)
    name = next(n for n, t in own.items() if t.dim() == 2)
    wrong[name] = torch.zeros(3, 3)
    with pytest.raises(programs.StaleProgram, match=name):
        programs.build(stored, wrong)


def test_a_folder_others_can_write_is_not_read(populated, cache_dir, caplog):
    """Entries are pickles: a cache folder another user could write is not read (one warning)."""
    folder, code = populated
    shutil.copytree(folder, cache_dir)
    cache_dir.chmod(0o777)
    try:
        with caplog.at_level("WARNING", logger="looptool.capture.cache"):
            assert export_source(_skeleton()).code == code
        assert "other users can write to it" in caplog.text
        assert (stats()["disk"], stats()["miss"]) == (0, 1)
    finally:
        cache_dir.chmod(0o700)


@pytest.mark.parametrize("chunk", [None, 64], ids=["one-chunk", "64-byte-chunks"])
def test_the_weight_reader_equals_safetensors(tmp_path, monkeypatch, chunk):
    """One pass reads every tensor into its own 64-byte-aligned storage, equal to what
    safetensors reads, and hashes the file as sha256_file does; a cut file is refused. With
    64-byte chunks the data is read in several chunks, and a tensor larger than one alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from looptool.storage import weights
    from looptool.storage.files import sha256_file
    from looptool.storage.weights import WeightReader, read_safetensors

    if chunk is not None:
        monkeypatch.setattr(weights, "CHUNK_BYTES", chunk)

    path = tmp_path / "w.safetensors"
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4, dtype=torch.bfloat16),
        "d": torch.tensor(1.5, dtype=torch.float16),
        "e": torch.zeros(0, 4),
        "f": torch.randn(50),  # 200 bytes: larger than a 64-byte chunk
        "g": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(path), metadata={"k": "v"})
    for got, metadata, sha in (read_safetensors(path), WeightReader(path).result()):
        assert sha == sha256_file(path) and metadata == {"k": "v"}
        with safe_open(str(path), framework="pt") as f:
            assert got.keys() == set(f.keys())
            for name in f.keys():
                want = f.get_tensor(name)
                assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        assert all(t.data_ptr() % 64 == 0 for t in got.values() if t.numel())
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="ends early"):
        read_safetensors(path)
    with pytest.raises(ValueError, match="ends early"):
        WeightReader(path).result()


def test_a_cut_weight_file_is_refused_as_corrupt(tmp_path, monkeypatch):
    saved = _saved("llama", TINY_PLAN, tmp_path / "m", monkeypatch)
    weights = saved / "model.safetensors"
    meta = json.loads((saved / "looptool.json").read_text())
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size, zeros
    with pytest.raises(looptool.LooptoolError, match="is corrupt: its contents differ from the sha256"):
        looptool.load(saved)
    del meta["files"]  # saved before checksums: the reader's errors still name the file
    (saved / "looptool.json").write_text(json.dumps(meta))
    weights.write_bytes(data[:-8])
    with pytest.raises(looptool.LooptoolError, match="could not be read as safetensors"):
        looptool.load(saved)
