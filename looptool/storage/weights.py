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

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightReader:
    """Reads ``path`` (safetensors) on a thread started at construction; :meth:`result`
    waits for it and returns ``(tensors by stored name, header metadata, sha256 hex)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._out: tuple[dict[str, torch.Tensor], dict, str] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="looptool-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = read_safetensors(self.path)
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
    h = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        size = _read(f, 8, h)
        (n,) = struct.unpack("<Q", size)
        if n > 100 << 20:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(_read(f, n, h))
        metadata = header.pop("__metadata__", None) or {}
        pos = 0  # in the data section
        for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = spec["data_offsets"]
            if begin < pos:
                raise ValueError(f"tensor '{name}' overlaps another")
            _read(f, begin - pos, h)  # padding, if any (hashed: the sha256 covers the whole file)
            t = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
            if t.numel() * t.element_size() != end - begin:
                raise ValueError(f"tensor '{name}' has {end - begin} bytes for shape {spec['shape']}")
            if end > begin:
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                _read_into(f, view)
                h.update(view)
            tensors[name] = t
            pos = end
        while block := f.read(1 << 20):  # anything after the last tensor
            h.update(block)
    return tensors, metadata, h.hexdigest()


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
