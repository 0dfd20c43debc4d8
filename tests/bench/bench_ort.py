"""ONNX / onnxruntime engines of SmolLM2-135M (CPU): latency, memory, disk, export time.

Fixed-prefix looping (window 8:20, budgets 0,3,6,9,12), all five budgets exported to one
engine directory. Measured in one run:

* forward latency (batch 1, ``--tokens`` tokens) of every budget with onnxruntime and with
  PyTorch eager, all ten contenders interleaved (median of ``--rounds``): ORT ÷ eager, and
  ORT budget k ÷ ORT budget 0 next to the ideal (L+k)/L and the cost table's FLOPs ratio;
* resident memory of a process holding all five sessions ÷ one holding one session
  (each in its own subprocess, after one forward per session; target ≤ 1.15), both for
  the whole process and for the increment above the process before any session exists;
* disk bytes of the engine directory ÷ the model's parameter bytes (target ≤ 1.02);
* wall time of the full export (five budgets, fusing, validation included) ÷ one plain
  ``torch.onnx.export`` of the source model.

Run: python tests/bench/bench_ort.py [--tokens 128] [--rounds 5] [--threads N]. Prints one JSON line and
writes tests/bench/results/bench_ort.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from looptool.backends.onnx import export_onnx
from looptool.backends.ort import Runtime

import looptool
from looptool.sources import load_source
from looptool.timing import interleaved

RESULTS = Path(__file__).resolve().parent / "results" / "bench_ort.json"

_RSS_PROBE = """
import json, sys
import numpy as np
from looptool.backends.ort import Runtime

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

rt = Runtime(sys.argv[1], verify=False)
before = status("VmRSS")
ids = np.arange(int(sys.argv[3]))[None] % 1000
for budget in json.loads(sys.argv[2]):
    rt(ids, budget=budget)
print(json.dumps({"before_sessions_mib": before, "rss_mib": status("VmRSS"), "peak_mib": status("VmHWM")}))
"""


def rss_probe(engine: Path, budgets: list[int], tokens: int) -> dict:
    """RSS of a fresh process holding sessions for ``budgets`` (after one forward each)."""
    res = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(engine), json.dumps(budgets), str(tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def source_export_seconds(model, directory: Path) -> float:
    """Wall time of one ``torch.onnx.export`` (dynamo) of the plain source model."""
    from torch.export import Dim

    class Logits(torch.nn.Module):  # plain full-sequence forward: logits only, no cache
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    ids = torch.zeros(2, 8, dtype=torch.long)
    dims = {0: Dim("batch"), 1: Dim("sequence")}
    t0 = time.perf_counter()
    program = torch.onnx.export(Logits(), (ids,), dynamo=True, dynamic_shapes=(dims,), verbose=False)
    program.save(str(directory / "source.onnx"), external_data=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="intra-op threads of both PyTorch and onnxruntime (use 1 on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_source("smollm2")
    model = looptool.convert(src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)),
                             tokenizer=src.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t_source = source_export_seconds(src.model, tmp)
        report = export_onnx(model, tmp / "engines", "all")
        engine = tmp / "engines"

        rt = Runtime(engine, threads=args.threads)
        ids = torch.randint(0, src.model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        ids_np = ids.numpy()
        fns = {f"ort_{k}": functools.partial(rt, ids_np, budget=k) for k in model.budgets}
        fns.update({f"eager_{k}": functools.partial(model, ids, budget=k) for k in model.budgets})
        t = interleaved(fns, repeats=args.rounds, warmup=1)
        diffs = {}
        with torch.inference_mode():
            for k in model.budgets:
                diffs[k] = float(np.abs(rt(ids_np, budget=k) - model(ids, budget=k).logits.numpy()).max())
        rt.close()

        one = rss_probe(engine, [model.budgets[0]], args.tokens)
        every = rss_probe(engine, list(model.budgets), args.tokens)

    costs = {c.budget: c for c in model.cost_table()}
    L = len(model.layer_graph.layers)
    base = t[f"ort_{model.budgets[0]}"].median
    budgets = {
        k: {
            "ort": t[f"ort_{k}"].as_dict(),
            "eager": t[f"eager_{k}"].as_dict(),
            "ort_over_eager": t[f"ort_{k}"].median / t[f"eager_{k}"].median,
            "ort_over_ort_budget0": t[f"ort_{k}"].median / base,
            "ideal_layers": (L + k) / L,
            "ideal_flops": costs[k].relative_flops,
            "max_abs_diff_vs_pytorch": diffs[k],
            "export_validation_max_abs_diff": next(b.max_abs_diff for b in report.budgets if b.budget == k),
            "export_seconds": next(b.seconds for b in report.budgets if b.budget == k),
        }
        for k in model.budgets
    }
    result = {
        "bench": "ort", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)", "plan": "prefix 8:20, budgets 0,3,6,9,12",
        "tokens": args.tokens, "batch": 1, "rounds": args.rounds, "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "onnxruntime": __import__("onnxruntime").__version__, "torch": torch.__version__,
        "budgets": budgets,
        "disk": {"weights_bytes": report.weights_bytes, "other_bytes": report.graph_bytes, "total_bytes": report.total_bytes,
                 "parameter_bytes": report.parameter_bytes, "ratio": report.disk_ratio},
        "rss": {"one_session": one, "all_sessions": every,
                "ratio_process": every["rss_mib"] / one["rss_mib"],
                "ratio_increment": (every["rss_mib"] - every["before_sessions_mib"]) / (one["rss_mib"] - one["before_sessions_mib"])},
        "export": {"all_budgets_seconds": report.seconds, "source_export_seconds": t_source,
                   "ratio": report.seconds / t_source},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
