"""A cache of exported layer bodies, so an ONNX export skips ``torch.onnx.export`` of a body
it has exported before.

Exporting one body (a layer's pass, a gated second pass, a recurrent loop step, the glue
around them) costs seconds of ``torch.onnx.export``, and the same bodies come back on every
export of the same architecture: re-exporting after training (weights are inputs of a body,
so new weights change no body), another budget list or KV policy, the TensorRT variant of
an engine, each worker of a sweep. A body's export is a function of its code and its inputs'
shapes and dtypes only, so it is kept, keyed by:

* the body's code, node for node (the layer library's canonical form: op targets and
  literal arguments, independent of node names), which inputs are weights;
* every input's shape and dtype (the example sizes fix which dimensions are dynamic);
* the export variant (onnxruntime fusions or not);
* the torch / onnx / onnxscript / onnx_ir / looptool / Python versions and the source of
  looptool's ONNX lowering code (``backends/**/*.py``, ``looptool/ops/*.py``) and the
  settings it traces under (``looptool/core/tracing.py``).

Entries live under ``$LOOPTOOL_CACHE/onnx-bodies`` (``LOOPTOOL_CACHE=off`` disables it) in
the store :data:`looptool.cache.ONNX_BODIES`: the data is the body's ONNX model and its
fusion counts. A bad entry is dropped with a warning and the body exported afresh;
the export's validation (onnxruntime against PyTorch) runs either way.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from looptool.cache import ONNX_BODIES, Store, caches, digest, enabled, sha256
from looptool.core.version import __version__

log = logging.getLogger(__name__)

Export = Callable[..., tuple[object, dict[str, int]]]  # (module, example, shapes) -> (onnx_ir model, fusions)


def _store() -> Store:
    """This process's body store (counts: "hit", "miss", "dropped", "uncached")."""
    return caches().onnx_bodies


def versions() -> dict[str, str]:
    """The versions an entry must have been written by."""
    import onnx
    import onnx_ir
    import onnxscript

    return {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnx_ir": onnx_ir.__version__,
        "looptool": __version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def cached(export: Export, module, example, shapes, *, code_key: str, variant: str) -> tuple[object, dict]:
    """``export(module, tuple(example), shapes)`` — a body's ``(onnx_ir model, fusion
    counts)`` — served from the cache when a body of the same ``code_key`` (the library's
    canonical form of its code), input shapes and dtypes (``example``), dynamic dimensions
    (``shapes``) and ``variant`` was exported before by the same versions and code."""
    store = _store()
    if not enabled():
        store.count("uncached")
        return export(module, tuple(example), shapes)
    key = {
        "format": ONNX_BODIES.format,
        "code": code_key,
        "inputs": [[list(t.shape), str(t.dtype)] for t in example],
        "dynamic": [None if s is None else sorted((int(d), str(v)) for d, v in s.items()) for s in shapes],
        "variant": variant,
        "lowering": _lowering_code_hash(),
    }
    name, written_by = digest(key), versions()

    def keep(exported: tuple[object, dict[str, int]]) -> None:
        store.write(name, key, written_by, _encode(*exported))

    return store.get_or_build(  # errors of the export reach the caller unchanged
        name,
        lambda: store.load(name, key, written_by, lambda data: (_decode(data), None), event="hit"),
        lambda: export(module, tuple(example), shapes),
        keep,
        "the exported body",
    )


def _encode(model, fusions: dict[str, int]) -> bytes:
    """One JSON line of fusion counts, then the serialized ModelProto."""
    import onnx_ir as ir

    return json.dumps(fusions, sort_keys=True).encode() + b"\n" + ir.serde.serialize_model(model).SerializeToString()


def _decode(data: bytes) -> tuple[object, dict[str, int]]:
    import onnx
    import onnx_ir as ir

    head, _, body = data.partition(b"\n")
    fusions = json.loads(head)
    proto = onnx.ModelProto()
    proto.ParseFromString(body)
    return ir.serde.deserialize_model(proto), {str(k): int(v) for k, v in fusions.items()}


@functools.lru_cache(maxsize=1)
def _lowering_code_hash() -> str:
    """What looptool's ONNX lowering code looks like (a change of it must miss)."""
    import looptool.ops

    backends = Path(__file__).resolve().parents[1]
    ops = Path(looptool.ops.__file__).resolve().parent
    files = [(f.relative_to(backends).as_posix(), f) for f in sorted(backends.rglob("*.py"))]
    files += [(f.name, f) for f in sorted(ops.glob("*.py"))] + [("tracing.py", ops.parent / "core" / "tracing.py")]
    return sha256(b"".join(name.encode() + b"\0" + f.read_bytes() for name, f in files))[:16]
