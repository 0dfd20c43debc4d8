"""Export every budget of a looped model to ONNX serving engines sharing one weights.bin, then
decode from them with onnxruntime and a KV cache.

Run: python examples/export_onnx.py [OUTPUT_DIR]
Uses a tiny random Qwen3-MoE (its experts lower through the fused looptool::moe op) with
fixed-prefix looping, so it runs in seconds; the same calls work for SmolLM2 or any
converted model (`looptool export ./looped -o ./engines --kv all` on the command line).
"""

import sys
import tempfile
from pathlib import Path

import torch

import looptool
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.runtime.generation import generate
from looptool.testing import tiny_model

source = tiny_model("qwen3_moe", num_layers=3)
model = looptool.convert(source, looptool.PrefixLoop(window=(1, 2), budgets=(0, 1)))
with torch.no_grad():  # pretend training moved the zero-initialised gates
    for _, p in model.new_parameters():
        p.fill_(0.3)

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()) / "engines"
# both KV policies; each distinct layer body is exported once and the budget graphs call it;
# every graph is validated against PyTorch (prefill + decode steps) before the directory is committed
report = export_onnx(model, out_dir, "all", kv="all")
for b in report.budgets:
    print(
        f"budget {b.budget} ({b.kv}): {b.file} {b.bytes / 1024:.0f} KiB, {sum(b.layer_calls.values())} layer calls, "
        f"fused {b.fused}, max |ORT - PyTorch| {max(b.max_abs_diff.values()):.1e}"
    )
print(
    f"weights.bin {report.weights_bytes / 1024:.0f} KiB for {report.parameter_bytes / 1024:.0f} KiB of parameters; "
    f"{report.layer_functions} bodies exported in {report.layer_seconds:.1f} s"
)

rt = Runtime(out_dir)  # one InferenceSession per graph, created on first use, one copy of the weights
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
for kv in rt.kv_policies:
    for k in rt.budgets:
        ours = rt.generate(ids, budget=k, kv=kv, max_new_tokens=8)  # caches bound in place (IOBinding)
        ref = generate(model, ids, budget=k, kv=kv, max_new_tokens=8)
        assert torch.equal(ours.sequences, ref.sequences)
        print(
            f"budget {k} ({kv}): {ours.sequences[0, 6:].tolist()}, KV {ours.kv_bytes} bytes, "
            f"prefill {ours.prefill_seconds * 1e3:.1f} ms, decode {ours.decode_seconds * 1e3 / 7:.2f} ms/token"
        )
