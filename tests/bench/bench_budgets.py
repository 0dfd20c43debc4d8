"""Runtime overhead of budget paths on SmolLM2-135M (CPU, batch 1).

Fixed-prefix (window 8:20, budgets 0,3,6,9,12): forward latency of each budget ÷ budget 0
next to the ideal (L+k)/L, and budget 0 ÷ the source model itself (target ≤ 1.03).
ELR (recurrent 8:22, adaptive delta, exact init, k = 1..4): latency of each loop count ÷
k=1 next to D_eff(k)/D_eff(1), and k=1 ÷ source without and with loop conditioning
(cond_dim 256, rank 64; target ≤ 1.05). All contenders are
interleaved in one run (median of N rounds).

Run: python tests/bench/bench_budgets.py [--tokens 256] [--rounds 7]. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform

import torch

import looptool
from looptool.capture.sources import load_source
from looptool.eval.timing import interleaved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    src = load_source("smollm2")
    model = looptool.convert(src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)))
    elr = looptool.convert(src.model, looptool.RecurrentLoop(recurrent=(8, 22), max_loops=4))
    elr_cond = looptool.convert(src.model, looptool.RecurrentLoop(recurrent=(8, 22), max_loops=4, conditioning=True))
    ids = torch.randint(0, src.model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    fns = {"source": lambda: src.model(input_ids=ids)}
    fns.update({f"budget_{k}": functools.partial(model, ids, budget=k) for k in model.budgets})
    fns.update({f"elr_{k}": functools.partial(elr, ids, budget=k) for k in elr.budgets})
    fns["elr_cond_1"] = functools.partial(elr_cond, ids, budget=1)
    t = interleaved(fns, repeats=args.rounds, warmup=2)
    L = len(model.layer_graph.layers)
    base = t["budget_0"].median
    rows = {
        k: {**t[f"budget_{k}"].as_dict(), "ratio_to_budget0": t[f"budget_{k}"].median / base, "ideal": (L + k) / L}
        for k in model.budgets
    }
    d_eff = {r.budget: r.layer_executions for r in elr.cost_table()}
    flops = {r.budget: r.relative_flops for r in elr.cost_table()}
    elr_rows = {
        k: {
            **t[f"elr_{k}"].as_dict(),
            "ratio_to_k1": t[f"elr_{k}"].median / t["elr_1"].median,
            "d_eff_ratio": d_eff[k] / d_eff[1],
            "flops_ratio": flops[k],
        }
        for k in elr.budgets
    }
    print(
        json.dumps(
            {
                "bench": "budgets",
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
                "tokens": args.tokens,
                "batch": 1,
                "rounds": args.rounds,
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
                "source": t["source"].as_dict(),
                "budget0_over_source": base / t["source"].median,
                "budgets": rows,
                "elr_k1_over_source": t["elr_1"].median / t["source"].median,
                "elr": elr_rows,
                "elr_conditioned_k1": t["elr_cond_1"].as_dict(),
                "elr_conditioned_k1_over_source": t["elr_cond_1"].median / t["source"].median,
            }
        )
    )


if __name__ == "__main__":
    main()
