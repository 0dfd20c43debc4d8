"""Row-wise-budget decoding in onnxruntime on SmolLM2-135M (CPU): one batch, many depths.

Fixed-prefix looping (window 8:20, budgets 0,3,6,9,12), exported once (per-loop KV): one graph
per budget plus the row-wise graph (input ``budgets [batch]``). A batch of ``--batch`` rows of
one ``--prompt``-token SOTU prompt; decode ms/step (``--new`` greedy steps after the prefill,
IOBinding with caches bound in place) for, interleaved over ``--rounds`` rounds:

* ``rowwise_all_0`` / ``rowwise_all_12``: the row-wise graph with every row at budget 0 / 12;
* ``rowwise_spread``: the row-wise graph with the rows spread over all five budgets;
* ``own_0`` / ``own_12``: budget 0's / 12's own graph (what ``Runtime.generate`` runs for a
  uniform batch: the engine dispatches a batch whose rows share a budget to that graph);
* ``dispatch_all_0``: ``Runtime.generate(budget=[0] * batch)`` end to end (decode ms/step).

Ratios (of medians): (a) row-wise all-0 ÷ own budget-0 graph and dispatched all-0 ÷ own
budget-0 (target ≤ 1.05); (b) row-wise all-12 ÷ own budget-12; (c) spread ÷ row-wise all-12
and spread ÷ own budget-12 (target ≤ 1.0).

Run: python tests/bench/bench_rowwise_ort.py [--batch 8] [--prompt 32] [--new 32] [--rounds 3] [--threads 2]
[--engine DIR] (keep the exported engine there and reuse it on the next run).
Prints one JSON line and writes tests/bench/results/rowwise_ort.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch

import looptool
from looptool.backends.manifest import MANIFEST
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.capture.sources import load_source
from looptool.core.graph import ROWWISE
from looptool.engine.budgets import RowBudgets
from looptool.engine.outputs import GenerationOutput
from looptool.testing import decode_loop

RESULTS = Path(__file__).resolve().parent / "results" / "rowwise_ort.json"
SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"


def graph_generate(rt: Runtime, key, rows: list[int], ids: torch.Tensor, new: int, on_step=None) -> GenerationOutput:
    """Greedy decoding of ``new`` tokens through graph ``key`` (a budget or ROWWISE) itself, on
    ``ids`` with row budgets ``rows`` (per-loop caches bound in place; no dispatch: the
    row-wise graph runs even when every row has the same budget)."""
    batch, prompt = ids.shape
    capacity = prompt + new
    engine = rt.step_engine("per-loop")
    cache, budgets = engine.allocate(batch, capacity), RowBudgets(tuple(rows))

    def step(ids, mask, position, cache_position):  # graph ``key`` itself, whatever the rows' budgets
        logits, _ = engine._run(cache, key, 0, batch, (ids, mask, position, cache_position), budgets, steps=0)
        return torch.from_numpy(logits[:, -1].astype(np.float32))

    return decode_loop(
        step,
        ids,
        None,
        capacity=capacity,
        max_new_tokens=new,
        mask_dtype=getattr(torch, str(rt.mask_dtype)),
        on_step=on_step,
    )


def decode_ms(rt: Runtime, key, rows: list[int], ids: torch.Tensor, new: int) -> float:
    """Decode ms/step of graph ``key`` (a budget or ROWWISE) on ``ids`` with row budgets ``rows``."""
    out = graph_generate(rt, key, rows, ids, new)
    return out.decode_seconds * 1e3 / (out.new_tokens - 1)


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of onnxruntime")
    ap.add_argument("--engine", type=Path, default=None, help="engine directory to keep and reuse")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_source("smollm2")
    model = looptool.convert(
        src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)), tokenizer=src.tokenizer
    )
    text = " ".join(p.read_text() for p in sorted(SOTU.glob("20*.txt")))
    ids = src.tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt].repeat(args.batch, 1)
    menu = list(model.budgets)
    spread = [menu[i % len(menu)] for i in range(args.batch)]
    configs = {
        "rowwise_all_0": (ROWWISE, [menu[0]] * args.batch),
        "rowwise_all_12": (ROWWISE, [menu[-1]] * args.batch),
        "rowwise_spread": (ROWWISE, spread),
        "own_0": (menu[0], [menu[0]] * args.batch),
        "own_12": (menu[-1], [menu[-1]] * args.batch),
    }
    with tempfile.TemporaryDirectory() as tmp:
        engine = args.engine or Path(tmp) / "engine"
        export = None
        if not (engine / MANIFEST).exists():
            t0 = time.perf_counter()
            report = export_onnx(model, engine, "all", kv="per-loop")
            export = {
                "seconds": time.perf_counter() - t0,
                "rowwise_seconds": report.rowwise[0].seconds,
                "rowwise_composed": report.rowwise[0].composed,
                "rowwise_bytes": report.rowwise[0].bytes,
                "rowwise_max_abs_diff": report.rowwise[0].max_abs_diff,
                "weights_bytes": report.weights_bytes,
                "disk_ratio": report.disk_ratio,
            }
        rt = Runtime(engine, threads=args.threads)
        for key, rows in configs.values():  # sessions made and warmed before timing
            decode_ms(rt, key, rows, ids[:, :4], 3)
        runs: dict[str, list[float]] = {name: [] for name in [*configs, "dispatch_all_0"]}
        for _ in range(args.rounds):
            for name, (key, rows) in configs.items():
                runs[name].append(decode_ms(rt, key, rows, ids, args.new))
            out = rt.generate(ids, budget=[menu[0]] * args.batch, max_new_tokens=args.new)
            runs["dispatch_all_0"].append(out.decode_seconds * 1e3 / (out.new_tokens - 1))
        # each row of the spread batch equals that row alone at its budget (tokens)
        spread_out = rt.generate(ids[:, :8], budget=spread, max_new_tokens=8)
        alone = [rt.generate(ids[:1, :8], budget=k, max_new_tokens=8).sequences[0] for k in menu]
        rows_exact = all(torch.equal(spread_out.sequences[r], alone[menu.index(k)]) for r, k in enumerate(spread))
    med = {name: statistics.median(v) for name, v in runs.items()}
    result = {
        "bench": "rowwise_ort",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
        "plan": "prefix 8:20, budgets 0,3,6,9,12",
        "kv": "per-loop",
        "batch": args.batch,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "rounds": args.rounds,
        "threads": args.threads,
        "spread_budgets": spread,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "decode_ms_per_step": {name: summary(v) for name, v in runs.items()},
        "ratios_of_medians": {
            "a_rowwise_all_0_over_own_0": med["rowwise_all_0"] / med["own_0"],
            "a_dispatch_all_0_over_own_0": med["dispatch_all_0"] / med["own_0"],
            "b_rowwise_all_12_over_own_12": med["rowwise_all_12"] / med["own_12"],
            "c_spread_over_rowwise_all_12": med["rowwise_spread"] / med["rowwise_all_12"],
            "c_spread_over_own_12": med["rowwise_spread"] / med["own_12"],
        },
        "spread_rows_equal_alone_tokens": rows_exact,
        "export": export or json.loads(RESULTS.read_text()).get("export"),  # a reused engine: the last export's
    }
    line = json.dumps(result)
    print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
