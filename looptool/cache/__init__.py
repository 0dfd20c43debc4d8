"""looptool's caches: one keyed, checked store type, an instance per kind of entry.

:class:`Store` (:mod:`looptool.cache.store`) keeps the entries of one :class:`Kind` on disk
(a sidecar holding key, format, versions and the data's sha256; atomic writes; one builder
per entry across processes through a :class:`filelock.FileLock`) and its most recently used
entries in process (a :class:`cachetools.LRUCache`), and counts what served its callers.
:class:`Caches` (:mod:`looptool.cache.registry`) holds one store per kind (``captures``,
``configs``, ``tokenizers``, ``gguf``, ``onnx_bodies``) under the root ``$LOOPTOOL_CACHE``
(default ``~/.cache/looptool``; ``LOOPTOOL_CACHE=off`` turns them off). What a key is made of
and how an entry is encoded and checked stays with each kind's module
(:mod:`looptool.capture.cache`, :mod:`~looptool.capture.config_cache`,
:mod:`~looptool.capture.tokenizer_cache`, :mod:`~looptool.capture.gguf_cache`,
:mod:`looptool.backends.onnx.body_cache`).

Use :func:`caches` for the process's stores (``caches().captures.stats["miss"]``) and
``with scoped(path):`` for fresh ones under ``path`` (a test's own cache).
"""

from looptool.cache.registry import (
    CAPTURES,
    CONFIGS,
    ENV,
    GGUF,
    ONNX_BODIES,
    TOKENIZERS,
    Caches,
    caches,
    default_root,
    enabled,
    file_sha256,
    root,
    scoped,
)
from looptool.cache.store import Kind, Store, atomic_write, canonical, digest, exclusive, sha256

__all__ = (
    "CAPTURES",
    "CONFIGS",
    "ENV",
    "GGUF",
    "ONNX_BODIES",
    "TOKENIZERS",
    "Caches",
    "Kind",
    "Store",
    "atomic_write",
    "caches",
    "canonical",
    "default_root",
    "digest",
    "enabled",
    "exclusive",
    "file_sha256",
    "root",
    "scoped",
    "sha256",
)
