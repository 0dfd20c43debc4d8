"""The tokenizer cache (looptool.capture.tokenizer_cache): a cached load equals transformers'
own load in every attribute and every encoding; a folder with the same files is served under
its own name; a change of any file misses; a bad entry is dropped and rebuilt; a pickle that
does not reproduce the tokenizer is not kept; ``off`` and keyword loads bypass the cache."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import transformers

from looptool.cache import caches
from looptool.capture import tokenizer_cache
from looptool.capture.tokenizer_cache import load_tokenizer
from looptool.eval.demo import DEMO_TEXT

TEXTS = [DEMO_TEXT, "Hello, world! 123", " leading space and ünïcödé", ""]
CHAT = [{"role": "user", "content": "Who wrote it?"}, {"role": "assistant", "content": "We the People."}]


@pytest.fixture(autouse=True)
def cache_dir(own_caches):
    """The tokenizer folder of a cache of this test's own, in-process entries and counts fresh."""
    return own_caches.tokenizers.directory()


def stats():
    """What served the tokenizers so far (the test's own counts)."""
    return caches().tokenizers.stats


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A byte-level BPE tokenizer with merges trained on the demo text, special tokens and a
    chat template, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([DEMO_TEXT] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end|>{% endfor %}"
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    fast.save_pretrained(path)
    return path


def _assert_same(want, got) -> None:
    assert tokenizer_cache._differing_attribute(want, got) is None
    for text in TEXTS:
        assert got(text).input_ids == want(text).input_ids
        assert got.decode(want(text).input_ids) == want.decode(want(text).input_ids)
    assert got.apply_chat_template(CHAT, tokenize=False) == want.apply_chat_template(CHAT, tokenize=False)
    assert (got.eos_token_id, got.pad_token_id, len(got)) == (want.eos_token_id, want.pad_token_id, len(want))


def test_cached_loads_equal_transformers_own(folder, cache_dir):
    want = transformers.AutoTokenizer.from_pretrained(folder)
    got = [load_tokenizer(folder)]  # a miss: transformers' load, pickled and checked
    caches().tokenizers.clear_memory()
    got += [load_tokenizer(folder), load_tokenizer(folder)]  # from disk, then from memory
    assert dict(stats()) == {"miss": 1, "disk": 1, "memory": 1}
    assert len(list(cache_dir.glob("*.pkl"))) == 1
    for tok in got:
        assert tok.name_or_path == str(folder)
        _assert_same(want, tok)
    assert got[1] is not got[2]  # every load has an object of its own
    got[2].add_tokens(["<|new|>"])
    assert len(load_tokenizer(folder)) == len(want)


def test_a_copy_of_the_folder_is_served_under_its_own_name(folder, tmp_path):
    load_tokenizer(folder)
    copy = shutil.copytree(folder, tmp_path / "copy")
    tok = load_tokenizer(copy)
    assert stats()["memory"] == 1
    assert tok.name_or_path == str(copy)
    _assert_same(transformers.AutoTokenizer.from_pretrained(copy), tok)


def test_a_changed_file_misses(folder, tmp_path):
    copy = shutil.copytree(folder, tmp_path / "copy")
    assert load_tokenizer(copy).model_max_length != 77
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert load_tokenizer(copy).model_max_length == 77
    (copy / "notes.txt").write_text("any file but weights is part of the key")
    load_tokenizer(copy)
    (copy / "model.safetensors").write_bytes(b"weights are not")
    load_tokenizer(copy)
    assert (stats()["miss"], stats()["memory"]) == (3, 1)


def test_a_corrupt_entry_is_dropped_and_rebuilt(folder, cache_dir, caplog):
    want = load_tokenizer(folder)
    caches().tokenizers.clear_memory()
    (data,) = cache_dir.glob("*.pkl")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger=tokenizer_cache.__name__):
        got = load_tokenizer(folder)
    assert "dropping the corrupt or stale entry" in caplog.text
    assert (stats()["dropped"], stats()["miss"]) == (1, 2)
    _assert_same(want, got)
    caches().tokenizers.clear_memory()
    load_tokenizer(folder)
    assert stats()["disk"] == 1  # the rebuilt entry serves


def test_a_pickle_that_does_not_reproduce_the_tokenizer_is_not_kept(folder, cache_dir, monkeypatch, caplog):
    class Altered:  # pickle.loads gives a tokenizer whose padding side moved
        dumps = staticmethod(pickle.dumps)
        HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

        @staticmethod
        def loads(data):
            tok = pickle.loads(data)
            tok.padding_side = "left" if tok.padding_side == "right" else "right"
            return tok

    monkeypatch.setattr(tokenizer_cache, "pickle", Altered)
    with caplog.at_level("WARNING", logger=tokenizer_cache.__name__):
        tok = load_tokenizer(folder)
    assert "does not reproduce the attribute 'padding_side'" in caplog.text
    _assert_same(transformers.AutoTokenizer.from_pretrained(folder), tok)
    assert not list(cache_dir.glob("*.pkl")) and not caches().tokenizers.held()


def test_off_and_keyword_loads_bypass_the_cache(folder, cache_dir, monkeypatch):
    assert load_tokenizer(folder, padding_side="left").padding_side == "left"
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    _assert_same(transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder))
    assert not stats() and not cache_dir.exists()
    with pytest.raises(OSError):  # a folder without a tokenizer raises what transformers raises
        load_tokenizer(folder.parent / "missing")
