"""ONNX / onnxruntime serving engines of SmolLM2-135M (CPU): decode speed, memory, disk, export time.

Fixed-prefix looping (window 8:20, budgets 0,3,6,9,12), every budget exported with both KV
policies to one engine directory. Measured in one run:

* KV-cached generation, batch 1, a ``--prompt``-token prompt of real text (SOTU), ``--new``
  greedy tokens: onnxruntime (``Runtime.generate``, IOBinding; and with ``prepack=True``,
  a packed weight copy per session) and PyTorch eager (``looptool.runtime.generation.generate``)
  at every budget, interleaved over ``--rounds`` rounds:
  prefill ms and decode ms/token (min/median/max), ORT ÷ eager, and whether the tokens are
  identical; the same for last-loop caches (tokens only);
* decode linearity: ORT decode time for ``2 × --new`` vs ``--new`` new tokens (2.0 = linear);
* KV bytes the runtime allocates ÷ the cost model's (per-loop (L+k)/L, last-loop 1×);
* resident memory of a process holding all five sessions ÷ one holding one session;
* disk bytes of the engine directory ÷ the model's parameter bytes (target ≤ 1.02);
* wall time of the whole export (ten graphs, validation included and excluded) ÷ one plain
  ``torch.onnx.export`` of the source model.

Run: python tests/bench/bench_ort.py [--prompt 128] [--new 128] [--rounds 3] [--threads N].
Prints one JSON line and writes tests/bench/results/bench_ort.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import looptool
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.capture.sources import load_source
from looptool.runtime.generation import generate

RESULTS = Path(__file__).resolve().parent / "results" / "bench_ort.json"
SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"

_RSS_PROBE = """
import json, sys
import numpy as np
from looptool.backends.ort.runtime import Runtime

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

rt = Runtime(sys.argv[1], verify=False)
before = status("VmRSS")
ids = np.arange(int(sys.argv[3]))[None] % 1000
for budget in json.loads(sys.argv[2]):
    rt.generate(ids, budget=budget, max_new_tokens=2)
print(json.dumps({"before_sessions_mib": before, "rss_mib": status("VmRSS"), "peak_mib": status("VmHWM")}))
"""


def rss_probe(engine: Path, budgets: list[int], tokens: int) -> dict:
    """RSS of a fresh process holding sessions for ``budgets`` (after a short generation each)."""
    res = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(engine), json.dumps(budgets), str(tokens)],
        capture_output=True,
        text=True,
        check=True,
    )
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


def stats(values: list[float]) -> dict:
    """min / median / max of a list of milliseconds."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="intra-op threads of both PyTorch and onnxruntime"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_source("smollm2")
    model = looptool.convert(
        src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)), tokenizer=src.tokenizer
    )
    text = " ".join(p.read_text() for p in sorted(SOTU.glob("20*.txt")))
    ids = src.tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt]
    budgets = list(model.budgets)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t_source = source_export_seconds(src.model, tmp)
        engine = tmp / "engines"
        report = export_onnx(model, engine, "all", kv="all")
        rt = Runtime(engine, threads=args.threads)
        packed = Runtime(engine, threads=args.threads, prepack=True, verify=False)

        runs: dict[str, dict[str, list[float]]] = {}
        same: dict[str, bool] = {}
        linear: dict[int, list[float]] = {budgets[0]: [], budgets[-1]: []}
        for _ in range(args.rounds):
            for k in budgets:
                for name, fn in (
                    ("eager", lambda k=k: generate(model, ids, budget=k, max_new_tokens=args.new)),
                    ("ort", lambda k=k: rt.generate(ids, budget=k, max_new_tokens=args.new)),
                    ("ort_prepacked", lambda k=k: packed.generate(ids, budget=k, max_new_tokens=args.new)),
                ):
                    out = fn()
                    entry = runs.setdefault(f"{name}_{k}", {"prefill_ms": [], "decode_ms_per_token": []})
                    entry["prefill_ms"].append(out.prefill_seconds * 1e3)
                    entry["decode_ms_per_token"].append(out.decode_seconds * 1e3 / (out.new_tokens - 1))
                    runs[f"{name}_{k}"].setdefault("sequences", out.sequences)
                same[str(k)] = all(
                    torch.equal(runs[f"eager_{k}"]["sequences"], runs[f"{n}_{k}"]["sequences"])
                    for n in ("ort", "ort_prepacked")
                )
            for k in linear:
                short = rt.generate(ids, budget=k, max_new_tokens=args.new)
                long = rt.generate(ids, budget=k, max_new_tokens=2 * args.new)
                linear[k].append(long.decode_seconds / short.decode_seconds)
        last_loop_same = {}
        for k in budgets[1:]:
            ref = generate(model, ids, budget=k, kv="last-loop", max_new_tokens=64)
            last_loop_same[str(k)] = torch.equal(
                ref.sequences, rt.generate(ids, budget=k, kv="last-loop", max_new_tokens=64).sequences
            )
        capacity = args.prompt + args.new
        costs = {c.budget: c for c in model.cost_table()}
        kv = {
            str(k): {
                "per-loop": rt.kv_bytes(k, "per-loop", capacity=capacity) / (capacity * costs[k].kv_bytes_per_token),
                "last-loop": rt.kv_bytes(k, "last-loop", capacity=capacity)
                / (capacity * costs[k].kv_bytes_per_token_last_loop),
                "per-loop_over_budget0": costs[k].relative_kv,
            }
            for k in budgets
        }
        rt.close()
        packed.close()
        one = rss_probe(engine, budgets[:1], args.prompt)
        every = rss_probe(engine, budgets, args.prompt)

    per_budget = {}
    for k in budgets:
        e, o, pp = runs[f"eager_{k}"], runs[f"ort_{k}"], runs[f"ort_prepacked_{k}"]
        per_budget[str(k)] = {
            "ort_prepacked": {
                "prefill_ms": stats(pp["prefill_ms"]),
                "decode_ms_per_token": stats(pp["decode_ms_per_token"]),
            },
            "prefill_prepacked_over_eager": statistics.median(pp["prefill_ms"]) / statistics.median(e["prefill_ms"]),
            "decode_prepacked_over_eager": statistics.median(pp["decode_ms_per_token"])
            / statistics.median(e["decode_ms_per_token"]),
            "eager": {"prefill_ms": stats(e["prefill_ms"]), "decode_ms_per_token": stats(e["decode_ms_per_token"])},
            "ort": {"prefill_ms": stats(o["prefill_ms"]), "decode_ms_per_token": stats(o["decode_ms_per_token"])},
            "prefill_ort_over_eager": statistics.median(o["prefill_ms"]) / statistics.median(e["prefill_ms"]),
            "decode_ort_over_eager": statistics.median(o["decode_ms_per_token"])
            / statistics.median(e["decode_ms_per_token"]),
            "tokens_identical": same[str(k)],
            "export_max_abs_diff": {b.kv: b.max_abs_diff for b in report.budgets if b.budget == k},
        }
    export_seconds = report.seconds - report.validation_seconds
    result = {
        "bench": "ort",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
        "plan": "prefix 8:20, budgets 0,3,6,9,12",
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "batch": 1,
        "rounds": args.rounds,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "onnxruntime": __import__("onnxruntime").__version__,
        "torch": torch.__version__,
        "budgets": per_budget,
        "last_loop_tokens_identical_64": last_loop_same,
        "decode_time_2x_tokens_ratio": {str(k): stats(v) for k, v in linear.items()},
        "kv_bytes_over_cost_model": kv,
        "disk": {
            "weights_bytes": report.weights_bytes,
            "other_bytes": report.graph_bytes,
            "total_bytes": report.total_bytes,
            "parameter_bytes": report.parameter_bytes,
            "ratio": report.disk_ratio,
        },
        "rss": {
            "one_session": one,
            "all_sessions": every,
            "ratio_process": every["rss_mib"] / one["rss_mib"],
            "ratio_increment": (every["rss_mib"] - every["before_sessions_mib"])
            / (one["rss_mib"] - one["before_sessions_mib"]),
        },
        "export": {
            "graphs": len(report.budgets),
            "composed": sum(b.composed for b in report.budgets),
            "bodies": report.layer_functions,
            "bodies_seconds": report.layer_seconds,
            "seconds_with_validation": report.seconds,
            "validation_seconds": report.validation_seconds,
            "seconds_without_validation": export_seconds,
            "source_export_seconds": t_source,
            "ratio_with_validation": report.seconds / t_source,
            "ratio_without_validation": export_seconds / t_source,
            "per_graph_seconds": {f"{b.budget}/{b.kv}": b.seconds for b in report.budgets},
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
