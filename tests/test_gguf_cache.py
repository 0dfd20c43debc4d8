"""The GGUF cache (:mod:`looptool.capture.gguf_cache`): a dequantised source is stored once
and served bit for bit (weights, ties, config, tokenizer); a bad entry is dropped and the file
loaded afresh; another file, dtype or ``LOOPTOOL_CACHE=off`` misses. The real SmolLM2 GGUF is
checked in tests/test_smollm2.py (a hit equals transformers' own load of the file)."""

from __future__ import annotations

import logging

import pytest
import torch

from looptool.cache import caches
from looptool.capture import gguf_cache
from looptool.testing import byte_tokenizer, tiny_model


@pytest.fixture
def cache(own_caches):
    """The GGUF folder of a cache of this test's own."""
    return own_caches.gguf.directory()


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"  # the cache keys on the file's bytes, not on what they mean
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return path


class _Loads:
    """A ``load`` callable that counts its calls: the tiny model transformers would have
    dequantised (tied embeddings, so the aliases are exercised), and a real fast tokenizer."""

    def __init__(self, seed: int = 0):
        self.calls, self.seed = 0, seed

    def __call__(self):
        self.calls += 1
        return tiny_model("llama", seed=self.seed, tie_word_embeddings=True), byte_tokenizer()


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    assert b.lm_head.weight is b.model.embed_tokens.weight  # the tie is kept, not a copy
    da, db = a.config.to_dict(), b.config.to_dict()
    for d in (da, db):  # the hit names the GGUF's folder, as transformers' load of the file does
        d.pop("_name_or_path")
    assert da == db
    ids = torch.tensor([[5, 17, 200, 3, 9]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_second_load_is_served_bit_for_bit(cache, gguf):
    load = _Loads()
    first, tok1 = gguf_cache.cached_load(gguf, torch.float32, load)
    before = dict(caches().gguf.stats)
    second, tok2 = gguf_cache.cached_load(gguf, torch.float32, load)
    assert load.calls == 1 and caches().gguf.stats["disk"] == before.get("disk", 0) + 1
    _same(first, second)
    assert second.config._name_or_path == str(gguf.parent)  # as a load of the file names it
    text = "Hello, wörld!\n"
    assert tok1(text).input_ids == tok2(text).input_ids and tok2.eos_token == tok1.eos_token
    assert tok2.pad_token == tok1.pad_token and tok2.decode(tok2(text).input_ids) == text
    assert len(list(cache.glob("*.safetensors"))) == 1


def test_another_file_dtype_or_cache_off_misses(cache, gguf, monkeypatch):
    load = _Loads()
    gguf_cache.cached_load(gguf, torch.float32, load)
    gguf_cache.cached_load(gguf, torch.float64, load)  # another dtype: its own entry
    assert load.calls == 2
    gguf.write_bytes(gguf.read_bytes() + b"\0")  # the file changed: its sha256 differs
    gguf_cache.cached_load(gguf, torch.float32, load)
    assert load.calls == 3
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    gguf_cache.cached_load(gguf, torch.float32, load)
    gguf_cache.cached_load(gguf, torch.float32, load)
    assert load.calls == 5


def test_corrupt_entry_is_dropped_and_the_file_loaded_again(cache, gguf, caplog):
    load = _Loads()
    want, _ = gguf_cache.cached_load(gguf, torch.float32, load)
    (data,) = cache.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # one weight byte flipped
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="looptool.capture.gguf_cache"):
        got, _ = gguf_cache.cached_load(gguf, torch.float32, load)
    assert load.calls == 2 and "dequantising the file afresh" in caplog.text
    _same(want, got)
    gguf_cache.cached_load(gguf, torch.float32, load)  # stored again, whole
    assert load.calls == 2


def test_an_entry_whose_model_rebuilds_differently_is_refused(cache, gguf, monkeypatch, caplog):
    """The rebuilt model is checked against the stored tensors: a rebuild that ties other
    tensors (or changes a value) drops the entry instead of returning another model."""
    load = _Loads()
    gguf_cache.cached_load(gguf, torch.float32, load)
    real = gguf_cache._unique_tensors
    monkeypatch.setattr(gguf_cache, "_unique_tensors", lambda m: (real(m)[0], {}))  # as if untied
    with caplog.at_level(logging.WARNING, logger="looptool.capture.gguf_cache"):
        gguf_cache.cached_load(gguf, torch.float32, load)
    assert load.calls == 2 and "ties other tensors" in caplog.text


def test_a_failing_load_reaches_the_caller_and_stores_nothing(cache, gguf):
    def broken():
        raise RuntimeError("not a GGUF file")

    with pytest.raises(RuntimeError, match="not a GGUF file"):
        gguf_cache.cached_load(gguf, torch.float32, broken)
    assert not list(cache.glob("*.json"))


def test_a_gguf_parsed_once_loads_what_transformers_loads(tmp_path, monkeypatch):
    """A cache miss dequantises the file with gguf's reader built once per file and its tensor
    name map once per architecture (transformers would build the reader three times and the
    map once per module); what it loads equals transformers' own load of the file: every
    tensor, the config, the tokenizer and the logits. The patched names are restored after."""
    gguf = pytest.importorskip("gguf", reason="needs the gguf package (pip install 'looptool[gguf]')")
    import transformers

    from looptool.capture import sources
    from looptool.testing import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    built = {"readers": 0, "name maps": 0}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountingReader(reader_class):
        def __init__(self, *args, **kwargs):
            built["readers"] += 1
            super().__init__(*args, **kwargs)

    def counting_name_map(*args):
        built["name maps"] += 1
        return name_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    got = sources.load_source(path)
    assert built == {"readers": 1, "name maps": 1}
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_name_map
    sa, sb = ref.state_dict(), got.model.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ref.config.to_dict() == got.model.config.to_dict()
    assert ref_tok.get_vocab() == got.tokenizer.get_vocab()
    assert ref_tok("abc ab cab").input_ids == got.tokenizer("abc ab cab").input_ids
    ids = torch.tensor([[0, 3, 5, 2, 1]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got.model(ids).logits)
