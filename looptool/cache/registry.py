"""The caches of this process: one :class:`~looptool.cache.store.Store` per kind of entry.

looptool keeps downloads (the SmolLM2 demo model) and its caches under one root:
``$LOOPTOOL_CACHE``, default ``~/.cache/looptool``; ``LOOPTOOL_CACHE=off`` turns every cache
off (downloads still go to the default root). Each kind has its folder there:

* ``captures/`` (:data:`CAPTURES`): ``torch.export`` programs (:mod:`looptool.capture.cache`);
* ``configs/`` (:data:`CONFIGS`): what a capture reads from a config's architecture
  (:mod:`looptool.capture.config_cache`);
* ``tokenizers/`` (:data:`TOKENIZERS`): loaded tokenizers (:mod:`looptool.capture.tokenizer_cache`);
* ``gguf/`` (:data:`GGUF`): dequantised GGUF sources (:mod:`looptool.capture.gguf_cache`);
* ``onnx-bodies/`` (:data:`ONNX_BODIES`): exported layer bodies
  (:mod:`looptool.backends.onnx.body_cache`).

A :class:`Caches` holds the five stores (their in-process entries and counts) and a memo of
file hashes. :func:`caches` gives the process's one, made on first use; :func:`scoped` puts
fresh ones under another root for a ``with`` block (a test's own cache) and restores the
previous after.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import cachetools

from looptool.cache.store import Kind, Store

ENV = "LOOPTOOL_CACHE"
FILE_HASHES = 128  # files whose sha256 a process remembers (by path, size and modification time)

CAPTURES = Kind("captures", 2, ".fx", "capture cache", "looptool.capture.cache", memory=8)
CONFIGS = Kind(
    "configs", 1, ".json", "config capture cache", "looptool.capture.config_cache", "building the model", memory=16
)
TOKENIZERS = Kind("tokenizers", 1, ".pkl", "tokenizer cache", "looptool.capture.tokenizer_cache", "loading", memory=4)
GGUF = Kind("gguf", 1, ".safetensors", "GGUF cache", "looptool.capture.gguf_cache", "dequantising the file")
ONNX_BODIES = Kind("onnx-bodies", 1, ".onnx", "ONNX body cache", "looptool.backends.onnx.body_cache")


def enabled() -> bool:
    """False when ``LOOPTOOL_CACHE=off``."""
    return os.environ.get(ENV, "").strip().lower() != "off"


def default_root() -> Path:
    """``$LOOPTOOL_CACHE``, or ``~/.cache/looptool`` (also when it is ``off``, which turns off
    the caches only)."""
    value = os.environ.get(ENV, "").strip()
    if not value or value.lower() == "off":
        return Path.home() / ".cache" / "looptool"
    return Path(value)


class Caches:
    """The stores of every kind under one root (``root``; None: :func:`default_root`, read at
    each use), each with its in-process entries and its counts, and a memo of file hashes."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self._root = None if root is None else Path(root)
        self.captures = Store(CAPTURES, self.root)
        self.configs = Store(CONFIGS, self.root)
        self.tokenizers = Store(TOKENIZERS, self.root)
        self.gguf = Store(GGUF, self.root)
        self.onnx_bodies = Store(ONNX_BODIES, self.root)
        self._hashes: cachetools.LRUCache = cachetools.LRUCache(FILE_HASHES)
        self._lock = threading.Lock()

    def root(self) -> Path:
        """Where the stores' folders (and downloads) live."""
        return default_root() if self._root is None else self._root

    def stores(self) -> tuple[Store, ...]:
        """Every store, one per kind."""
        return self.captures, self.configs, self.tokenizers, self.gguf, self.onnx_bodies

    def clear_memory(self) -> None:
        """Drop every store's in-process entries."""
        for store in self.stores():
            store.clear_memory()

    def file_sha256(self, path: str | os.PathLike) -> str:
        """Hex sha256 of a file's contents, remembered by path, size and modification time: a
        cache key that names a file (a model's source code, a GGUF source) hashes it once until
        it changes. Raises OSError when it cannot be read."""
        st = os.stat(path)
        return self._file_sha256(os.fspath(path), st.st_mtime_ns, st.st_size)

    @cachetools.cachedmethod(lambda self: self._hashes, lock=lambda self: self._lock)
    def _file_sha256(self, path: str, mtime_ns: int, size: int) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        return h.hexdigest()


class _Current:
    """Which :class:`Caches` this process uses now."""

    def __init__(self) -> None:
        self.caches: Caches | None = None
        self.lock = threading.Lock()


@functools.cache
def _current() -> _Current:
    return _Current()


def caches() -> Caches:
    """The caches this process uses: made on first use (following ``$LOOPTOOL_CACHE``), or
    the innermost :func:`scoped` ones."""
    current = _current()
    with current.lock:
        if current.caches is None:
            current.caches = Caches()
        return current.caches


@contextlib.contextmanager
def scoped(root: str | os.PathLike | None = None) -> Iterator[Caches]:
    """Fresh caches (empty in-process entries and counts) under ``root`` (None: follow
    ``$LOOPTOOL_CACHE``) for the ``with`` block, in every thread of this process; the previous
    ones are back after. Processes started meanwhile follow ``$LOOPTOOL_CACHE``, not ``root``;
    ``LOOPTOOL_CACHE=off`` still turns the caches off."""
    fresh, current = Caches(root), _current()
    with current.lock:
        previous, current.caches = current.caches, fresh
    try:
        yield fresh
    finally:
        with current.lock:
            current.caches = previous


def root() -> Path:
    """Where looptool keeps downloads and its caches now (:meth:`Caches.root`)."""
    return caches().root()


def file_sha256(path: str | os.PathLike) -> str:
    """:meth:`Caches.file_sha256` of the process's caches."""
    return caches().file_sha256(path)
