"""Reading a saved weight file in one pass: every tensor into its own aligned CPU storage,
and the sha256 of the whole file, on a background thread.

``looptool.load`` used to hash ``model.safetensors`` (one read), map it with safetensors and
clone every tensor into aligned storage (a second read and a copy). :class:`WeightReader`
reads the file once, straight into freshly allocated tensors (``torch.empty`` is 64-byte
aligned, so CPU kernels see what they see after a clone: outputs stay bit-identical),
hashing every byte as it goes. File reads and ``hashlib`` release the GIL, so the reader
overlaps the rest of the load (tokenizer, capture, passes).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from pathlib import Path

import torch

from looptool.core.dtypes import named


class WeightReader:
    """Reads ``path`` (safetensors): the header and the tensors' allocation at construction,
    the data on a thread started then; :meth:`result` waits for it and returns ``(tensors by
    stored name, header metadata, sha256 hex)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._out: tuple[dict[str, torch.Tensor], dict, str] | None = None
        self._error: BaseException | None = None
        try:
            plan = _Plan(self.path)
        except BaseException as exc:  # re-raised by result(), like the reading's own errors
            self._error = exc
            plan = None
        self._thread = threading.Thread(target=self._run, args=(plan,), name="looptool-weights", daemon=True)
        self._thread.start()

    def _run(self, plan: _Plan | None) -> None:
        if plan is None:
            return
        try:
            self._out = plan.read()
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> tuple[dict[str, torch.Tensor], dict, str]:
        """The tensors, metadata and sha256; re-raises what the reading raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict, str]:
    """Every tensor of the safetensors file ``path`` in its own CPU storage, the header's
    ``__metadata__``, and the sha256 of the whole file (raises ``ValueError`` on a malformed
    file)."""
    return _Plan(Path(path)).read()


CHUNK_BYTES = 64 << 20  # the data is read a chunk of consecutive tensors at a time (a larger one alone)


class _Plan:
    """How to read one file: its header parsed and hashed, every tensor allocated, and the data
    section cut into steps. Each step is one ``readinto`` of a chunk of consecutive tensors
    (:data:`CHUNK_BYTES`), one hash update and one ``torch._foreach_copy_`` from the chunk
    into its tensors, or, for a tensor larger than a chunk, a read straight into it.

    Everything that calls into torch per tensor happens here, before the reading thread
    starts: every torch call releases the GIL, and a thread that takes it back waits for a
    busy main thread (up to its switch interval) each time, so reading one tensor per call
    beside a load's rebuild held most of the read back until the rebuild ended; the thread
    takes the GIL a few times per chunk instead."""

    def __init__(self, path: Path):
        self.hash = hashlib.sha256()
        self.tensors: dict[str, torch.Tensor] = {}
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115  (closed by read)
        try:
            (n,) = struct.unpack("<Q", _read(self.file, 8, self.hash))
            if n > 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(_read(self.file, n, self.hash))
            self.metadata = header.pop("__metadata__", None) or {}
            spans: list[tuple[torch.Tensor, int, int]] = []
            pos = 0  # in the data section
            for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = spec["data_offsets"]
                if begin < pos:
                    raise ValueError(f"tensor '{name}' overlaps another")
                t = torch.empty(spec["shape"], dtype=named(spec["dtype"]).torch)
                if t.numel() * t.element_size() != end - begin:
                    raise ValueError(f"tensor '{name}' has {end - begin} bytes for shape {spec['shape']}")
                self.tensors[name] = t
                spans.append((t, begin, end))
                pos = end
            self.steps = self._steps(spans)
        except BaseException:
            self.file.close()
            raise

    def _steps(self, spans: list[tuple[torch.Tensor, int, int]]) -> list[tuple]:
        """``(bytes to read, memoryview to read them into, copy destinations, copy sources)``."""
        steps: list[tuple] = []
        buffer: torch.Tensor | None = None
        pos, i = 0, 0
        while i < len(spans):
            j = i + 1
            while j < len(spans) and spans[j][2] - pos <= CHUNK_BYTES:
                j += 1
            t, begin, end = spans[i]
            if j == i + 1 and end - pos > CHUNK_BYTES:  # larger than a chunk: the gap, then straight into it
                if begin > pos:
                    steps.append((begin - pos, None, [], []))
                steps.append((end - begin, memoryview(t.reshape(-1).view(torch.uint8).numpy()), [], []))
            else:
                end = spans[j - 1][2]
                if buffer is None:
                    buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                dsts, srcs = [], []
                for dst, b, e in spans[i:j]:
                    if e > b:  # (an empty tensor has nothing to copy)
                        dsts.append(dst.reshape(-1).view(torch.uint8))
                        srcs.append(buffer[b - pos : e - pos])
                steps.append((end - pos, memoryview(buffer.numpy())[: end - pos], dsts, srcs))
            pos, i = end, j
        return steps

    def read(self) -> tuple[dict[str, torch.Tensor], dict, str]:
        """Run the steps (on the calling thread); the tensors, metadata and sha256."""
        with self.file as f:
            for n, view, dsts, srcs in self.steps:
                if view is None:
                    _read(f, n, self.hash)
                    continue
                _read_into(f, view)
                self.hash.update(view)
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
            while block := f.read(1 << 20):  # anything after the last tensor
                self.hash.update(block)
        return self.tensors, self.metadata, self.hash.hexdigest()


def _read_into(f, view: memoryview) -> None:
    done = 0
    while done < len(view):  # one read() returns at most ~2 GiB
        got = f.readinto(view[done:])
        if not got:
            raise ValueError("the file ends early")
        done += got


def _read(f, n: int, h) -> bytes:
    data = f.read(n) if n else b""
    if len(data) != n:
        raise ValueError("the file ends early")
    h.update(data)
    return data
