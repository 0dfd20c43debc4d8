"""Export every budget of a looped model to ONNX engines sharing one weights.bin, then run
them with onnxruntime.

Run: python examples/export_onnx.py [OUTPUT_DIR]
Uses a tiny random Qwen3-MoE (its experts lower through the fused looptool::moe op) with
fixed-prefix looping, so it runs in seconds; the same calls work for SmolLM2 or any
converted model (`looptool export ./looped -o ./engines --budget all` on the command line).
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from looptool.backends.onnx import export_onnx
from looptool.backends.ort import Runtime

import looptool
from looptool.testing import tiny_model

source = tiny_model("qwen3_moe", num_layers=3)
model = looptool.convert(source, looptool.PrefixLoop(window=(1, 2), budgets=(0, 1)))
with torch.no_grad():  # pretend training moved the zero-initialised gates
    for _, p in model.new_parameters():
        p.fill_(0.3)

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()) / "engines"
report = export_onnx(model, out_dir, "all")  # fuses, exports, validates with onnxruntime, commits atomically
for b in report.budgets:
    print(f"budget {b.budget}: {b.file} {b.bytes / 1024:.0f} KiB, fused {b.fused}, "
          f"max |ORT - PyTorch| {max(b.max_abs_diff.values()):.1e}")
print(f"weights.bin {report.weights_bytes / 1024:.0f} KiB for {report.parameter_bytes / 1024:.0f} KiB of parameters; "
      f"files: {sorted(p.name for p in out_dir.iterdir())}")

rt = Runtime(out_dir)  # one InferenceSession per budget, created on first use, one copy of the weights
ids = np.array([[1, 2, 3, 4, 5, 6]])
for k in rt.budgets:
    logits = rt(ids, budget=k)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), budget=k).logits.numpy()
    print(f"budget {k}: next token {int(logits[0, -1].argmax())}, max |ORT - PyTorch| {np.abs(logits - ref).max():.1e}")
    assert np.abs(logits - ref).max() < 1e-4
print("greedy continuation at the deepest budget:", rt.greedy(ids, max_new_tokens=5)[0, 6:].tolist())
