"""One kind of cache entry, on disk and in process: :class:`Store`.

A kind (:class:`Kind`: the capture cache's exported programs, the ONNX export's layer bodies,
...) lives in its own folder under the looptool cache root. An entry is two files named by
the sha256 of its key (:func:`digest`):

* ``<digest>.json``, the sidecar: the format, the key, the versions it was written by, and
  the name, size and sha256 of its data file;
* ``<digest>-<sha256 prefix of the data><suffix>``, the data (content-named, so a sidecar
  always names a complete file).

Both are written to a temporary file and moved into place with ``os.replace``, the sidecar
last, so concurrent writers (pytest-xdist workers, a sweep's processes) never expose a
partial entry; a process that misses an entry another one is building waits on the entry's
lock file (``<digest>.lock``, a :class:`filelock.FileLock`) and reads it. A folder another
user can write to is not read (a warning says so, once). An entry that cannot be used
(unreadable, other key, format or versions, a bad sha256, or data its reader rejects) is
dropped with a warning and the caller rebuilds it: a cache never changes a result and never
raises to its caller.

A kind may also keep its most recently used entries in process (``Kind.memory`` of them, a
:class:`cachetools.LRUCache`). Each store counts what served its callers in :attr:`Store.stats`
(``"memory"``, ``"disk"``, ``"miss"``, ``"dropped"``, and what its kind adds).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import cachetools
import filelock

T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """What one kind of entry is: its folder under the cache root (``subdir``), the format of
    its entries, its data files' ``suffix``, the ``label`` its warnings start with and the
    ``logger`` they go to, what its callers do on a miss (``rebuild``, for the warnings), and
    how many entries it keeps in process (``memory``; 0: none)."""

    subdir: str
    format: int
    suffix: str
    label: str
    logger: str
    rebuild: str = "exporting"
    memory: int = 0


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical(obj, default: Callable | None = None) -> str:
    """``obj`` as compact JSON with sorted keys (the form keys are hashed and compared in)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=default)


def digest(key, default: Callable | None = None) -> str:
    """The name of ``key``'s entry: the sha256 of its :func:`canonical` JSON."""
    return sha256(canonical(key, default).encode())


def exclusive(path: str | os.PathLike) -> filelock.FileLock:
    """An exclusive lock on ``path`` (created if missing) for a ``with`` block: other processes
    and threads that take it wait at its start (``flock`` where the OS has it)."""
    return filelock.FileLock(path)


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


class Store:
    """The entries of one :class:`Kind` under the cache root ``root()``, its in-process entries
    and its counts (:attr:`stats`). Thread-safe."""

    def __init__(self, kind: Kind, root: Callable[[], Path]) -> None:
        self.kind = kind
        self.log = logging.getLogger(kind.logger)
        self.stats: collections.Counter[str] = collections.Counter()
        self._root = root
        self._lock = threading.Lock()
        self._memory: cachetools.LRUCache | None = cachetools.LRUCache(kind.memory) if kind.memory else None
        self._warned: set[Path] = set()  # folders warned about (once each)

    def directory(self) -> Path:
        """``<cache root>/<subdir>``."""
        return self._root() / self.kind.subdir

    def count(self, event: str) -> None:
        """Count one ``event`` (``"miss"``, ``"uncached"``, ...) in :attr:`stats`."""
        with self._lock:
            self.stats[event] += 1

    # -- in process -------------------------------------------------------------------------

    def remember(self, digest: str, entry) -> None:
        """Keep ``entry`` (never None) as the most recently used in-process entry ``digest``,
        dropping the least recently used beyond ``Kind.memory``."""
        if self._memory is not None:
            with self._lock:
                self._memory[digest] = entry

    def forget(self, digest: str) -> None:
        """Drop the in-process entry ``digest`` (if held)."""
        if self._memory is not None:
            with self._lock:
                self._memory.pop(digest, None)

    def clear_memory(self) -> None:
        """Drop every in-process entry (the next caller reads the disk or rebuilds)."""
        if self._memory is not None:
            with self._lock:
                self._memory.clear()

    def held(self) -> list:
        """The in-process entries."""
        if self._memory is None:
            return []
        with self._lock:
            return list(self._memory.values())

    def recall(self, digest: str, use: Callable[[Any], T | None]) -> T | None:
        """``use(entry)`` of the in-process entry ``digest`` (counted as ``"memory"``), or None
        when none is held. An entry ``use`` returns None for (it is stale) is dropped, and one
        it raises on is dropped with a warning; None is returned for both."""
        if self._memory is None:
            return None
        with self._lock:
            entry = self._memory.get(digest)
        if entry is None:
            return None
        try:
            got = use(entry)
        except Exception as exc:  # never raises to the caller: it rebuilds
            self.log.warning(
                "%s: could not use the in-process entry %s (%s: %s); %s afresh.",
                self.kind.label,
                digest[:12],
                type(exc).__name__,
                exc,
                self.kind.rebuild,
            )
            got = None
        if got is None:
            self.log.debug("%s: dropped the in-process entry %s", self.kind.label, digest[:12])
            self.forget(digest)
            return None
        self.count("memory")
        return got

    # -- on disk ----------------------------------------------------------------------------

    def load(
        self, digest: str, key: dict, versions: dict, decode: Callable[[bytes], tuple[T, Any]], event: str = "disk"
    ) -> T | None:
        """The value of the entry ``digest`` (:meth:`read`; ``decode(data)`` gives the value and
        what to keep in process, or None), counted as ``event``; None when there is none."""
        found = self.read(digest, key, versions, decode)
        if found is None:
            return None
        value, held = found
        if held is not None:
            self.remember(digest, held)
        self.count(event)
        return value

    def read(self, digest: str, key: dict, versions: dict, decode: Callable[[bytes], T]) -> T | None:
        """``decode(data)`` of the entry ``digest`` when its sidecar holds ``key``, this format
        and ``versions`` and its data has the recorded sha256; None when there is none. A bad
        entry (or one ``decode`` raises on) is dropped with a warning (counted as
        ``"dropped"``), and None returned."""
        folder = self.directory()
        sidecar = folder / f"{digest}.json"
        try:
            raw = sidecar.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # not cached (yet)
            return None
        except OSError as exc:
            self.log.warning("%s: cannot read %s (%s); %s instead.", self.kind.label, sidecar, exc, self.kind.rebuild)
            return None
        if not self.private(folder):
            return None
        data_file = None
        try:
            meta = json.loads(raw)
            if meta.get("format") != self.kind.format or meta.get("key") != json.loads(canonical(key)):
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
                self.kind.label,
                sidecar,
                type(exc).__name__,
                exc,
                self.kind.rebuild,
            )
            _drop(sidecar, raw, data_file)
            self.count("dropped")
            return None

    def write(self, digest: str, key: dict, versions: dict, data: bytes) -> None:
        """Store ``data`` as the entry ``digest`` (raises OSError where the folder cannot be written)."""
        folder = self.directory()
        sha = sha256(data)
        name = f"{digest}-{sha[:16]}{self.kind.suffix}"
        meta = {
            "format": self.kind.format,
            "key": json.loads(canonical(key)),
            "versions": versions,
            "file": name,
            "bytes": len(data),
            "sha256": sha,
        }
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(folder / name, data)
        atomic_write(folder / f"{digest}.json", (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
        self.log.debug("%s: stored %s (%d bytes)", self.kind.label, name, len(data))

    @contextlib.contextmanager
    def one_builder(self, digest: str) -> Iterator[None]:
        """Hold the build of entry ``digest`` to one process (and thread) at a time: a caller
        that missed the entry builds it inside this block and looks it up again first, so
        concurrent callers that need the same entry (the ranks of a DDP/FSDP run, a sweep's
        workers, pytest-xdist workers) wait for the one building it and read its result instead
        of building it again. Where the lock cannot be taken (the folder cannot be written), the
        block runs unlocked."""
        folder = self.directory()
        with contextlib.ExitStack() as stack:
            try:
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                stack.enter_context(exclusive(folder / f"{digest}.lock"))
            except (OSError, filelock.Timeout) as exc:
                self.log.debug("%s: building %s unlocked (%s)", self.kind.label, digest[:12], exc)
            yield

    def get_or_build(
        self,
        digest: str,
        find: Callable[[], T | None],
        build: Callable[[], T],
        keep: Callable[[T], None],
        what: str,
    ) -> T:
        """``find()`` (the entry ``digest`` from process or disk), else ``build()`` (counted as
        ``"miss"``; its errors reach the caller) stored by ``keep(value)``, under
        :meth:`one_builder`. A ``keep`` that fails warns (:meth:`could_not_store`) and the
        built value is returned all the same."""
        found = find()
        if found is not None:
            return found
        with self.one_builder(digest):  # a caller building the same entry: wait, then read it
            found = find()
            if found is not None:
                return found
            self.count("miss")
            value = build()
            try:
                keep(value)
            except Exception as exc:  # the cache never fails its caller
                self.could_not_store(exc, what)
            return value

    def could_not_store(self, exc: BaseException, what: str) -> None:
        """Warn (once per folder) that ``what`` could not be stored; the caller goes on without it."""
        folder = self.directory()
        (self.log.debug if folder in self._warned else self.log.warning)(
            "%s: could not store %s in %s (%s: %s); continuing without it.",
            self.kind.label,
            what,
            folder,
            type(exc).__name__,
            exc,
        )
        self._warned.add(folder)

    def private(self, folder: Path) -> bool:
        """Whether only this user can write ``folder`` (never read an entry another user could
        have written); warns once per folder when not."""
        if not hasattr(os, "getuid"):
            return True
        st = folder.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return True
        if folder not in self._warned:
            self.log.warning(
                "%s: not reading %s: other users can write to it; make it private "
                "(chmod go-w) or set LOOPTOOL_CACHE to a private folder.",
                self.kind.label,
                folder,
            )
            self._warned.add(folder)
        return False


def _drop(sidecar: Path, raw: bytes, data_file: Path | None) -> None:
    """Remove a bad entry (the sidecar only if no other writer replaced it meanwhile)."""
    with contextlib.suppress(OSError):
        if sidecar.read_bytes() == raw:
            sidecar.unlink()
    if data_file is not None:
        with contextlib.suppress(OSError):
            data_file.unlink()
