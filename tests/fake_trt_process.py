"""``python tests/fake_trt_process.py ARGS...``: the looptool CLI in a process that has the
TensorRT test double (``fake_tensorrt``) in place of TensorRT and pretends to have a CUDA GPU
(sm_90; tensors stay on the CPU), so a server subprocess serves built test-double engines."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_tensorrt  # noqa: E402


class _Patch:
    """The two ``monkeypatch`` methods ``fake_tensorrt.install`` uses, for the whole process."""

    @staticmethod
    def setitem(mapping, key, value) -> None:
        mapping[key] = value


fake_tensorrt.install(_Patch())
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "fake"
torch.cuda.Stream = lambda device=None: type("S", (), {"cuda_stream": 0, "synchronize": lambda self: None})()

if __name__ == "__main__":
    sys.argv = ["looptool", *sys.argv[1:]]
    runpy.run_module("looptool", run_name="__main__", alter_sys=True)
