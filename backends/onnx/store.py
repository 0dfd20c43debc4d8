"""The weight store of an engine: every tensor once in ``weights.bin`` (deduplicated by content,
aligned), and graphs whose initializers point into it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from looptool.backends.errors import ExportError
from looptool.backends.manifest import WEIGHTS, TensorEntry

ALIGN = 64  # bytes; every tensor starts on a cache-line (and SIMD) boundary
ALIGN_LARGE = 4096  # tensors of 1 MiB or more start on a page, so they can be mapped as is
LARGE = 1 << 20
INLINE_LIMIT = 1024  # exporter constants smaller than this stay inside the .onnx file


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor as a contiguous numpy array with the same bytes; bfloat16 (which numpy
    lacks) becomes ``ml_dtypes.bfloat16``, the type onnx and onnx-ir use for it."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class WeightStore:
    """Appends tensors to one file, once per distinct content, at aligned offsets."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115  (closed by close(), one file for all budgets)
        self._by_digest: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
        self.tensors: dict[str, TensorEntry] = {}  # initializer name → where it lies
        self.size = 0

    def add(self, name: str, array: np.ndarray, dtype: str) -> TensorEntry:
        """Store ``array`` (or find identical bytes already stored); returns its entry."""
        data = np.ascontiguousarray(array).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        span = self._by_digest.get(digest)
        if span is None:
            align = ALIGN_LARGE if len(data) >= LARGE else ALIGN
            offset = -(-self.size // align) * align
            self._file.write(b"\0" * (offset - self.size))
            self._file.write(data)
            self.size = offset + len(data)
            span = self._by_digest[digest] = (offset, len(data))
        if name in self.tensors and self.tensors[name].sha256 != digest:
            raise ExportError(
                f"two different tensors are both named '{name}' in the exported graphs; please report this as a bug."
            )
        self.tensors[name] = TensorEntry(*span, digest, dtype, tuple(array.shape))
        return self.tensors[name]

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


def externalize(onnx_model, directory: Path, store: WeightStore, known: dict[str, str], budget: int) -> list[str]:
    """Point every large or model-owned initializer at ``weights.bin``; refuse folded
    copies of weights (an initializer that is big but no model tensor)."""
    import onnx_ir as ir

    known_digests = set(known.values())
    names: list[str] = []
    for name, value in list(onnx_model.graph.initializers.items()):
        tensor = value.const_value
        if tensor is None:
            continue
        array = tensor.numpy()
        nbytes = array.nbytes
        is_model_tensor = name in known
        if not is_model_tensor and nbytes < INLINE_LIMIT:
            continue  # a small exporter constant: stays in the graph file
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        if is_model_tensor and known[name] != digest:
            raise ExportError(
                f"initializer '{name}' of budget {budget} differs from the model tensor of that name; please report this as a bug."
            )
        if not is_model_tensor and digest not in known_digests:
            raise ExportError(
                f"budget {budget} has a {nbytes}-byte initializer '{name}' that is no model tensor "
                "(a constant-folded copy would duplicate weights); please report this as a bug."
            )
        entry = store.add(name, array, str(tensor.dtype))
        value.const_value = ir.ExternalTensor(
            WEIGHTS,
            entry.offset,
            entry.length,
            tensor.dtype,
            shape=tensor.shape,
            name=name,
            base_dir=directory,
        )
        names.append(name)
    return names
