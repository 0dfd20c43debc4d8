"""Hugging Face tokenizers loaded from a folder, served from a cache of their pickles.

``AutoTokenizer.from_pretrained`` of a BPE tokenizer parses ``tokenizer.json`` in Python
twice and once more in Rust: 0.6 s of every warm ``looptool.load`` of SmolLM2 (a 3.5 MB
``tokenizer.json``), a third of it. Unpickling the loaded tokenizer (its Rust part travels
as its own serialisation) takes 0.06 s. Entries live under ``$LOOPTOOL_CACHE/tokenizers``
(:data:`looptool.cache.TOKENIZERS`; ``LOOPTOOL_CACHE=off`` disables them),
keyed by the sha256 of every file of the folder that is not a weight file (the tokenizer's
own files, ``config.json``, chat templates, anything else a tokenizer class may read) and
by the transformers / tokenizers / Python versions; an in-process LRU holds the pickles of
the last ``TOKENIZERS.memory`` folders, so each load still gets an object of its own.

A miss loads with transformers, pickles the result and keeps the pickle only when what it
unpickles to equals the loaded tokenizer in every attribute (the Rust tokenizer compared by
its serialisation): a hit returns what transformers' own load returns, with
``name_or_path`` set to the folder asked for. Loads with keyword arguments are not cached.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from pathlib import Path

from looptool.cache import TOKENIZERS, Store, caches, digest, enabled, file_sha256

log = logging.getLogger(__name__)

# files a tokenizer never reads (weights, engines, exported graphs): not hashed into the key
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".data", ".engine", ".plan")
MAX_FILE_BYTES = 256 << 20  # a folder holding a larger non-weight file is not cached (hashing it would cost more)


def _store() -> Store:
    """This process's tokenizer store (counts: "memory", "disk", "miss", "uncached", "dropped")."""
    return caches().tokenizers


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """``transformers.AutoTokenizer.from_pretrained(path, **kwargs)``, from the cache when
    ``path`` is a local folder and no keyword argument is given. Raises what transformers
    raises when the folder holds no tokenizer (a miss is transformers' own load)."""
    import transformers

    key = None if kwargs else key_of(path)
    if key is None:
        return transformers.AutoTokenizer.from_pretrained(path, **kwargs)
    store, name = _store(), digest(key)

    def find():
        tokenizer = store.recall(name, pickle.loads)  # every load gets an object of its own
        if tokenizer is None:
            tokenizer = store.load(name, key, versions(), lambda data: (pickle.loads(data), data))
        return None if tokenizer is None else _named(tokenizer, path)

    def keep(tokenizer) -> None:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        differs = _differing_attribute(tokenizer, pickle.loads(data))
        if differs is not None:
            raise ValueError(f"its pickle does not reproduce the attribute {differs!r}")
        store.remember(name, data)
        store.write(name, key, versions(), data)

    return store.get_or_build(
        name, find, lambda: transformers.AutoTokenizer.from_pretrained(path), keep, f"the tokenizer of {path}"
    )


def key_of(path: str | os.PathLike) -> dict | None:
    """The key of the tokenizer in folder ``path``: the sha256 of each of its files but weight
    files (and of ``additional_chat_templates/``); None when not cached (the cache is off,
    ``path`` is not a local folder, or it holds a non-weight file over :data:`MAX_FILE_BYTES`)."""
    folder = Path(path)
    if not enabled() or not folder.is_dir():
        return None
    files: dict[str, str] = {}
    try:
        for sub in (folder, folder / "additional_chat_templates"):
            if not sub.is_dir():
                continue
            for entry in sorted(sub.iterdir()):
                if not entry.is_file() or entry.name.endswith(WEIGHT_SUFFIXES):
                    continue
                if entry.stat().st_size > MAX_FILE_BYTES:
                    _store().count("uncached")
                    return None
                files[entry.relative_to(folder).as_posix()] = file_sha256(entry)
    except OSError as exc:
        log.debug("tokenizer cache: not caching %s (%s)", folder, exc)
        _store().count("uncached")
        return None
    return {"format": TOKENIZERS.format, "files": files}


def versions() -> dict[str, str]:
    """What an entry was written by (an entry of other versions is dropped and rebuilt)."""
    import tokenizers
    import transformers

    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def _named(tokenizer, path: str | os.PathLike):
    """``tokenizer`` as transformers' load of ``path`` names it (an entry may have been
    stored from another folder with the same files)."""
    tokenizer.name_or_path = str(path)
    if isinstance(getattr(tokenizer, "init_kwargs", None), dict) and "name_or_path" in tokenizer.init_kwargs:
        tokenizer.init_kwargs["name_or_path"] = str(path)
    return tokenizer


def _differing_attribute(a, b) -> str | None:
    """The first instance attribute of ``a`` that ``b`` lacks or holds another value of
    (a ``tokenizers.Tokenizer`` compared by its JSON serialisation); None when all agree."""
    import tokenizers

    if type(a) is not type(b) or vars(a).keys() != vars(b).keys():
        return "__class__ / __dict__"
    for name, value in vars(a).items():
        other = vars(b)[name]
        if isinstance(value, tokenizers.Tokenizer):
            same = isinstance(other, tokenizers.Tokenizer) and value.to_str() == other.to_str()
        else:
            try:
                same = bool(value == other)
            except Exception:
                same = False
        if not same:
            return name
    return None
