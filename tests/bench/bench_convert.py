"""Conversion cost.

1. SmolLM2-135M: ``looptool.runtime.convert`` time ÷ one plain ``torch.export`` of the source,
   interleaved in the same run (target ≤ 1.3).
2. A Llama-3-70B-shaped config (80 layers, hidden 8192) on ``meta``: wall time and peak
   RSS of ``looptool.runtime.convert`` in a fresh process (targets ≤ 90 s, ≤ 4 GB).

Run: python tests/bench/bench_convert.py [--rounds 3] [--skip-70b]. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

import looptool
from looptool.capture import export_source
from looptool.capture.sources import load_source

_70B_SCRIPT = r"""
import json, resource, time, torch, transformers, looptool
cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192)
t0 = time.perf_counter()
with torch.device("meta"):
    src = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
t1 = time.perf_counter()
model = looptool.convert(src, looptool.PrefixLoop())
t2 = time.perf_counter()
print(json.dumps({"build_meta_s": t1 - t0, "convert_s": t2 - t1,
    "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    "params": sum(p.numel() for p in model.parameters()), "window": list(model.plan.window),
    "budgets": list(model.budgets), "nodes_captured": len(model.layer_graph.graph.nodes)}))
"""


def bench_smollm2(rounds: int) -> dict:
    src = load_source("smollm2").model
    plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
    times: dict[str, list[float]] = {"export": [], "convert": []}
    for r in range(rounds):
        order = ["export", "convert"] if r % 2 == 0 else ["convert", "export"]
        for name in order:
            t0 = time.perf_counter()
            if name == "export":
                export_source(src)
            else:
                looptool.convert(src, plan)
            times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {
        "export_s": _stats(times["export"]),
        "convert_s": _stats(times["convert"]),
        "convert_over_export": med["convert"] / med["export"],
    }


def bench_70b() -> dict:
    res = subprocess.run([sys.executable, "-c", _70B_SCRIPT], capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "n": len(s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-70b", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {
        "bench": "convert",
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
    result["smollm2"] = bench_smollm2(args.rounds)
    if not args.skip_70b:
        result["llama3_70b_meta"] = bench_70b()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
