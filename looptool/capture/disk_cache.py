"""Keyed entries of a cache on disk, shared by concurrent processes and never trusted blindly.

One kind of entry (the capture cache's exported programs, the ONNX export's layer bodies)
lives in its own folder under the looptool cache (``$LOOPTOOL_CACHE``, default
``~/.cache/looptool``; ``LOOPTOOL_CACHE=off`` turns every such cache off). An entry is two
files named by the sha256 of its key:

* ``<digest>.json``, the sidecar: the format, the key, the versions it was written by, and
  the name, size and sha256 of its data file;
* ``<digest>-<sha256 prefix of the data><suffix>``, the data (content-named, so a sidecar
  always names a complete file).

Both are written to a temporary file and moved into place with ``os.replace``, the sidecar
last, so concurrent writers (pytest-xdist workers, a sweep's processes) never expose a
partial entry. A folder another user can write to is not read (a warning says so, once). An
entry that cannot be used (unreadable, other key, format or versions, a bad sha256, or data
its reader rejects) is dropped with a warning and the caller rebuilds it: a cache never
changes a result and never raises to its caller.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def cache_dir() -> Path:
    """Where looptool keeps downloads (the SmolLM2 demo model) and its caches (this module's
    entries: captured programs, ONNX layer bodies): ``$LOOPTOOL_CACHE`` or
    ``~/.cache/looptool`` (also when it is ``off``, which turns off the caches only)."""
    value = os.environ.get("LOOPTOOL_CACHE", "").strip()
    if not value or value.lower() == "off":
        return Path.home() / ".cache" / "looptool"
    return Path(value)


def enabled() -> bool:
    """False when ``LOOPTOOL_CACHE=off``."""
    return os.environ.get("LOOPTOOL_CACHE", "").strip().lower() != "off"


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's contents (read in 4 MiB blocks), remembered per path, size and
    modification time: a cache key that names a file (a model's source code, a GGUF source)
    hashes it once per process until it changes. Raises OSError when it cannot be read."""
    st = os.stat(path)
    return _file_sha256(os.fspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=128)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def canonical(obj, default: Callable | None = None) -> str:
    """``obj`` as compact JSON with sorted keys (the form keys are hashed and compared in)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=default)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing) for the ``with`` block:
    other processes (and other open handles in this one) wait at its start. A no-op where
    ``fcntl`` does not exist (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class DiskCache:
    """The entries of one kind: ``subdir`` of the looptool cache, data files ending in
    ``suffix``, warnings on ``log`` prefixed with ``label`` (e.g. ``"capture cache"``)."""

    def __init__(
        self, subdir: str, fmt: int, suffix: str, label: str, log: logging.Logger, rebuild: str = "exporting"
    ) -> None:
        self.subdir, self.format, self.suffix, self.label, self.log = subdir, fmt, suffix, label, log
        self.rebuild = rebuild  # what the caller does on a miss, for the warnings ("exporting")
        self.unwritable: set[Path] = set()  # folders warned about (once each)

    def directory(self) -> Path:
        """``<looptool cache dir>/<subdir>``."""
        return cache_dir() / self.subdir

    def read(
        self,
        digest: str,
        key: dict,
        versions: dict,
        decode: Callable[[bytes], T],
        on_drop: Callable[[], None] | None = None,
    ) -> T | None:
        """``decode(data)`` of the entry ``digest`` when its sidecar holds ``key``, this format
        and ``versions`` and its data has the recorded sha256; None when there is none. A bad
        entry (or one ``decode`` raises on) is dropped with a warning (``on_drop`` is called),
        and None returned."""
        folder = self.directory()
        sidecar = folder / f"{digest}.json"
        try:
            raw = sidecar.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # not cached (yet)
            return None
        except OSError as exc:
            self.log.warning("%s: cannot read %s (%s); %s instead.", self.label, sidecar, exc, self.rebuild)
            return None
        if not self.private(folder):
            return None
        data_file = None
        try:
            meta = json.loads(raw)
            if meta.get("format") != self.format or meta.get("key") != json.loads(canonical(key)):
                raise ValueError("it was written for another key")
            if meta.get("versions") != versions:
                raise ValueError(f"it was written by other versions ({meta.get('versions')})")
            data_file = folder / str(meta["file"])
            if data_file.parent != folder:
                raise ValueError(f"it names a file outside the cache ({meta['file']!r})")
            data = data_file.read_bytes()
            if len(data) != meta["bytes"] or sha256(data) != meta["sha256"]:
                raise ValueError(f"{data_file.name} does not match the sha256 recorded")
            return decode(data)
        except Exception as exc:  # any failure: drop the entry, the caller rebuilds it
            self.log.warning(
                "%s: dropping the corrupt or stale entry %s (%s: %s); %s afresh.",
                self.label,
                sidecar,
                type(exc).__name__,
                exc,
                self.rebuild,
            )
            self._drop(sidecar, raw, data_file)
            if on_drop is not None:
                on_drop()
            return None

    def write(self, digest: str, key: dict, versions: dict, data: bytes) -> None:
        """Store ``data`` as the entry ``digest`` (raises OSError where the folder cannot be written)."""
        folder = self.directory()
        sha = sha256(data)
        name = f"{digest}-{sha[:16]}{self.suffix}"
        meta = {
            "format": self.format,
            "key": json.loads(canonical(key)),
            "versions": versions,
            "file": name,
            "bytes": len(data),
            "sha256": sha,
        }
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(folder / name, data)
        atomic_write(folder / f"{digest}.json", (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
        self.log.debug("%s: stored %s (%d bytes)", self.label, name, len(data))

    @contextlib.contextmanager
    def one_builder(self, digest: str) -> Iterator[None]:
        """Hold the build of entry ``digest`` to one process at a time: a caller that missed
        the entry builds it inside this block and re-reads the cache first, so concurrent
        processes that need the same entry (the ranks of a DDP/FSDP run, a sweep's workers,
        pytest-xdist workers) wait for the one building it and read its result instead of
        building it again. Where the lock cannot be taken (the folder cannot be written), the
        block runs unlocked."""
        folder = self.directory()
        with contextlib.ExitStack() as stack:
            try:
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                stack.enter_context(exclusive(folder / f"{digest}.lock"))
            except OSError as exc:
                self.log.debug("%s: building %s unlocked (%s)", self.label, digest[:12], exc)
            yield

    def could_not_store(self, exc: BaseException, what: str) -> None:
        """Warn (once per folder) that ``what`` could not be stored; the caller goes on without it."""
        folder = self.directory()
        (self.log.debug if folder in self.unwritable else self.log.warning)(
            "%s: could not store %s in %s (%s: %s); continuing without it.",
            self.label,
            what,
            folder,
            type(exc).__name__,
            exc,
        )
        self.unwritable.add(folder)

    def private(self, folder: Path) -> bool:
        """Whether only this user can write ``folder`` (never read an entry another user could
        have written); warns once per folder when not."""
        if not hasattr(os, "getuid"):
            return True
        st = folder.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return True
        if folder not in self.unwritable:
            self.log.warning(
                "%s: not reading %s: other users can write to it; make it private "
                "(chmod go-w) or set LOOPTOOL_CACHE to a private folder.",
                self.label,
                folder,
            )
            self.unwritable.add(folder)
        return False

    @staticmethod
    def _drop(sidecar: Path, raw: bytes, data_file: Path | None) -> None:
        """Remove a bad entry (the sidecar only if no other writer replaced it meanwhile)."""
        with contextlib.suppress(OSError):
            if sidecar.read_bytes() == raw:
                sidecar.unlink()
        if data_file is not None:
            with contextlib.suppress(OSError):
                data_file.unlink()


class MemoryLRU(Generic[T]):
    """The in-process level of a cache: the ``limit`` most recently used entries by digest
    (thread-safe; an entry is never None)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> T | None:
        """The entry ``digest`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
            return entry

    def put(self, digest: str, entry: T) -> None:
        """Keep ``entry`` as the most recently used, dropping the least recently used beyond the limit."""
        with self._lock:
            self._entries[digest] = entry
            self._entries.move_to_end(digest)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def pop(self, digest: str) -> None:
        """Forget the entry ``digest`` (if held)."""
        with self._lock:
            self._entries.pop(digest, None)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()

    def values(self) -> list[T]:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
