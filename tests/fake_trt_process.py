"""``python tests/fake_trt_process.py ARGS...``: the looptool CLI in a process that has the
TensorRT test double (``fake_tensorrt``) in place of TensorRT and pretends to have a CUDA GPU
(sm_90; tensors stay on the CPU), so a server subprocess serves built test-double engines."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_tensorrt  # noqa: E402


class _Patch:
    """The ``monkeypatch`` methods the test double uses, for the whole process."""

    @staticmethod
    def setitem(mapping, key, value) -> None:
        mapping[key] = value

    @staticmethod
    def setattr(target, name, value) -> None:
        setattr(target, name, value)


fake_tensorrt.install(_Patch())
fake_tensorrt.pretend_gpu(_Patch())

if __name__ == "__main__":
    sys.argv = ["looptool", *sys.argv[1:]]
    runpy.run_module("looptool", run_name="__main__", alter_sys=True)
