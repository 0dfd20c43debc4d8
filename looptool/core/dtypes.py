"""One table of tensor element types and every name they go by: torch's (``float16``), the
short precision names that Triton also uses (``fp16``), ONNX's ``TensorProto`` / onnx-ir's
``DataType`` name (``FLOAT16``: what engine manifests record), safetensors' (``F16``),
numpy's type and TensorRT's (the attribute of the ``tensorrt`` module, ``float16``).

:func:`named` finds a row by any of its names. numpy has no bfloat16, so that row has no
numpy type (:func:`raw_numpy` gives an unsigned integer of its width, for its bits); float64
has no TensorRT type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    """One element type under each library's name."""

    name: str  # torch's: torch.<name>
    short: str | None  # the precision name, and Triton's pointer element type ("fp16")
    onnx: str  # TensorProto / onnx_ir.DataType name
    safetensors: str
    torch: torch.dtype
    numpy: type | None  # None: numpy has no such type (bfloat16)
    tensorrt: str | None  # attribute of the tensorrt module; None: TensorRT has no such type


DTYPES: tuple[DType, ...] = (
    DType("float32", "fp32", "FLOAT", "F32", torch.float32, np.float32, "float32"),
    DType("float16", "fp16", "FLOAT16", "F16", torch.float16, np.float16, "float16"),
    DType("bfloat16", "bf16", "BFLOAT16", "BF16", torch.bfloat16, None, "bfloat16"),
    DType("float64", "fp64", "DOUBLE", "F64", torch.float64, np.float64, None),
    DType("int64", None, "INT64", "I64", torch.int64, np.int64, "int64"),
    DType("int32", None, "INT32", "I32", torch.int32, np.int32, "int32"),
    DType("int16", None, "INT16", "I16", torch.int16, np.int16, None),
    DType("int8", None, "INT8", "I8", torch.int8, np.int8, "int8"),
    DType("uint8", None, "UINT8", "U8", torch.uint8, np.uint8, "uint8"),
    DType("bool", None, "BOOL", "BOOL", torch.bool, np.bool_, "bool"),
)


def _index() -> dict[str, DType]:
    out: dict[str, DType] = {}
    for d in DTYPES:
        for key in (d.name, d.short, d.onnx, d.safetensors):
            if key is not None:
                assert out.get(key, d) is d, f"{key!r} names two dtypes"
                out[key] = d
    return out


_BY_NAME = _index()


def named(name: str) -> DType:
    """The element type that ``name`` names: torch's name (``"float16"``, also
    ``"torch.float16"``), the short one (``"fp16"``), ONNX's (``"FLOAT16"``) or
    safetensors' (``"F16"``); ``KeyError`` for any other."""
    return _BY_NAME[name.removeprefix("torch.")]


def of_torch(dtype: torch.dtype) -> DType:
    """The row of a torch dtype (``KeyError`` for one the table lacks)."""
    return named(str(dtype))


def raw_numpy(dtype: DType) -> type:
    """``dtype``'s numpy type, or for bfloat16 (which numpy lacks) the unsigned integer of its
    width, to hold its bits."""
    if dtype.numpy is not None:
        return dtype.numpy
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.torch.itemsize]
