"""One table of element-type names (looptool.core.dtypes): every name finds its row, no
name means two types, and each column agrees with its library."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looptool.core.dtypes import DTYPES, named, of_torch, raw_numpy


def test_every_name_finds_its_row_and_no_name_means_two():
    for d in DTYPES:
        names = [n for n in (d.name, d.short, d.onnx, d.safetensors) if n is not None]
        assert all(named(n) is d for n in names)
        assert named(f"torch.{d.name}") is d and of_torch(d.torch) is d
        assert d.torch == getattr(torch, d.name)
    assert named("fp16") is named("FLOAT16") is named("F16") is named("float16")
    with pytest.raises(KeyError):
        named("float8")


def test_columns_agree_with_their_libraries():
    onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
    for d in DTYPES:
        assert onnx.helper.tensor_dtype_to_np_dtype(getattr(onnx.TensorProto, d.onnx)).itemsize == d.torch.itemsize
        if d.numpy is not None:
            assert np.dtype(d.numpy) == torch.empty(0, dtype=d.torch).numpy().dtype
    assert named("bf16").numpy is None and raw_numpy(named("bf16")) is np.uint16
    assert raw_numpy(named("fp32")) is np.float32
    assert {d.short for d in DTYPES if d.tensorrt and d.short} == {"fp32", "fp16", "bf16"}
