"""Row-wise budgets on SmolLM2-135M (PyTorch): decode ms/step of one batch whose rows take
different budgets, against the per-budget cached paths at the same batch size.

PrefixLoop window (8, 20), budgets 0/3/6/9/12, per-loop KV, torch with 2 threads, batch 8,
a cache of 128 positions of which the first 96 hold context (random ids), T = 1 decode steps.
Contenders, in interleaved rounds (the machine is noisy), each timed over ``--steps`` steps:

* ``path_0`` / ``path_12``: the per-budget cached paths (``cached_paths``) on their own caches;
* ``engine_all_0`` / ``engine_all_12`` / ``engine_spread``: ``TorchStepEngine.step`` (what
  ``generate(budget=[...])`` and the server run) with all rows at 0, all at 12, and spread
  over the five budgets (2,2,1,1,2 rows at 0,3,6,9,12): uniform batches are dispatched to
  their budget's own path, mixed ones run the row-wise graph;
* ``rowwise_all_0`` / ``rowwise_all_12``: the row-wise graph itself with uniform budgets
  (no dispatch: what masking alone costs);
* the gather probe: ``path_12_batch_4`` (how much running half the rows saves) and
  ``cache_gather`` (copying out and back the second-pass caches of half the rows, the extra
  work a gathering design pays per step when rows are not contiguous).

Reports min/median/max ms/step and the targets: (a) engine_all_0 / path_0 <= 1.05,
(c) engine_spread / engine_all_12 <= 1.0.

Run: python tests/bench/bench_rowwise.py [--rounds 7] [--steps 10] [--out FILE]. Prints one JSON line
(and writes it to tests/bench/results/rowwise.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import looptool
from looptool.capture.sources import load_source
from looptool.engine.budgets import RowBudgets
from looptool.runtime.decode_graphs import cached_paths, rowwise_path
from looptool.runtime.step_engine import TorchStepEngine

RESULTS = Path(__file__).resolve().parent / "results" / "rowwise.json"
BATCH, LENGTH, CONTEXT = 8, 128, 96
SPREAD = [0, 0, 3, 3, 6, 9, 12, 12]


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_source("smollm2")
    model = looptool.convert(loaded.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero gates: every second pass does real work
        for _, p in model.new_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    engine = TorchStepEngine(model)
    paths, rowwise = cached_paths(model), rowwise_path(model)
    vocab = engine.vocab_size

    def inputs(batch: int):
        mask = torch.zeros(batch, LENGTH, dtype=engine.mask_dtype)
        mask[:, : CONTEXT + 1] = 1
        ids = torch.randint(0, vocab, (batch, 1), generator=g)
        return ids, mask, torch.full((batch, 1), CONTEXT), torch.tensor([CONTEXT])

    with torch.no_grad():  # fill the context of every cache with real keys and values
        cache = engine.allocate(BATCH, LENGTH)
        ctx = torch.randint(0, vocab, (BATCH, CONTEXT), generator=g)
        cmask = torch.zeros(BATCH, LENGTH, dtype=engine.mask_dtype)
        cmask[:, :CONTEXT] = 1
        pos = torch.arange(CONTEXT).expand(BATCH, -1)
        engine.step(cache, slice(0, BATCH), ctx, cmask, pos, torch.arange(CONTEXT), RowBudgets(tuple(SPREAD)))
        own = {
            (k, b): [cache.buffers[i][:b].clone() for i in engine.pairs[k]]
            for k in (0, 12)
            for b in (BATCH, BATCH // 2)
        }
    ids, mask, position, cache_pos = inputs(BATCH)
    half = inputs(BATCH // 2)
    second = [i for i, s in enumerate(rowwise.slots) if s.execution == 2]
    rows = torch.tensor([1, 3, 5, 7])  # every other row: not a contiguous slice

    def gather():
        for i in second:
            part = cache.buffers[i].index_select(0, rows)
            cache.buffers[i].index_copy_(0, rows, part)

    contenders = {
        "path_0": lambda: paths[0].module(ids, mask, position, cache_pos, *own[(0, BATCH)]),
        "path_12": lambda: paths[12].module(ids, mask, position, cache_pos, *own[(12, BATCH)]),
        "engine_all_0": lambda: engine.step(
            cache, slice(0, BATCH), ids, mask, position, cache_pos, RowBudgets((0,) * 8)
        ),
        "engine_all_12": lambda: engine.step(
            cache, slice(0, BATCH), ids, mask, position, cache_pos, RowBudgets((12,) * 8)
        ),
        "engine_spread": lambda: engine.step(
            cache, slice(0, BATCH), ids, mask, position, cache_pos, RowBudgets(tuple(SPREAD))
        ),
        "rowwise_all_0": lambda: rowwise.module(
            ids, mask, position, cache_pos, torch.zeros(8, dtype=torch.long), *cache.buffers
        ),
        "rowwise_all_12": lambda: rowwise.module(ids, mask, position, cache_pos, torch.full((8,), 12), *cache.buffers),
        "path_12_batch_4": lambda: paths[12].module(*half, *own[(12, BATCH // 2)]),
        "cache_gather": gather,
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    load_before = os.getloadavg()[0]  # other processes on the machine skew every contender
    with torch.no_grad():
        for fn in contenders.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    ms = {name: _stats(v) for name, v in times.items()}
    med = {name: s["median"] for name, s in ms.items()}
    result = {
        "bench": "rowwise",
        "backend": "pytorch",
        "model": "smollm2",
        "plan": {"window": [8, 20], "budgets": [0, 3, 6, 9, 12]},
        "kv": "per-loop",
        "threads": args.threads,
        "batch": BATCH,
        "cache_length": LENGTH,
        "context": CONTEXT,
        "spread": SPREAD,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "load_average": {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()},
        "ms_per_step": ms,
        "ratios_of_medians": {
            "a_all_0_vs_path_0": med["engine_all_0"] / med["path_0"],
            "b_all_12_vs_path_12": med["engine_all_12"] / med["path_12"],
            "c_spread_vs_all_12": med["engine_spread"] / med["engine_all_12"],
            "rowwise_all_0_vs_path_0": med["rowwise_all_0"] / med["path_0"],
            "rowwise_all_12_vs_path_12": med["rowwise_all_12"] / med["path_12"],
            "path_12_batch_4_vs_batch_8": med["path_12_batch_4"] / med["path_12"],
            "cache_gather_vs_path_12": med["cache_gather"] / med["path_12"],
        },
        "targets": {"a_max": 1.05, "c_max": 1.0},
    }
    result["targets"]["a_met"] = result["ratios_of_medians"]["a_all_0_vs_path_0"] <= 1.05
    result["targets"]["c_met"] = result["ratios_of_medians"]["c_spread_vs_all_12"] <= 1.0
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
