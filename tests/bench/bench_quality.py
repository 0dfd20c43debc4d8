"""Quality benchmark: does depth pay after a short retrofit? (about 45 min on 2 cores)

SmolLM2-135M, fixed-prefix looping (window 8:20, budgets 0,3,6,9,12), trained with mixed
depth on ``--data`` (default: the training split of the in-repo SOTU subset,
addresses before 2000), against (b) the same source
fine-tuned plainly on the same tokens with the same optimizer (budget 0 only: the source
graph, no gates in play), and the untrained source. All evaluated on the first
``--eval-tokens`` tokens of ``--val-data`` (default: the subset's addresses from 2000 on). Also reports training
throughput of mixed-depth ÷ plain training measured in this run, next to the expected
ratio from the mean depth.

Run: python tests/bench/bench_quality.py [--steps 120] [--out DIR]. Prints one JSON line.
A retrofit recipe applies to the mixed arm: ``--gate-floor 0.5 --depth-curriculum 0.5`` (the
``looptool train`` options of the same names).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import looptool
from looptool.capture.sources import load_source
from looptool.eval.evaluate import gain_shares, mean_loss
from looptool.report.plots import plot_frontier
from looptool.train.data import PackedTokens, find_files, tokenize_files
from looptool.train.trainer import TrainConfig, Trainer

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"  # the in-repo subset; --data for more


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--new-lr", type=float, default=1e-2)
    ap.add_argument("--override", type=float, default=0.0)
    ap.add_argument("--gate-floor", type=float, default=0.0, help="recipe: looptool train --gate-floor (mixed arm)")
    ap.add_argument("--gate-floor-until", type=float, default=0.5)
    ap.add_argument("--depth-curriculum", type=float, default=0.0, help="recipe: looptool train --depth-curriculum")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--data", default=str(SOTU / "1*.txt"), help="training text (files, folders, globs)")
    ap.add_argument("--val-data", default=str(SOTU / "2*.txt"), help="validation text")
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_quality_"))
    work.mkdir(parents=True, exist_ok=True)
    src = load_source("smollm2")
    plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
    looped = looptool.convert(src.model, plan, tokenizer=src.tokenizer)
    if not (work / "converted").exists():
        looped.save_pretrained(work / "converted")
    val = PackedTokens(tokenize_files(find_files(args.val_data), src.tokenizer)[: args.eval_tokens], args.seq_len)
    with torch.inference_mode():
        source_loss = mean_loss(lambda ids, m=src.model: m(input_ids=ids, labels=ids).loss, val, 4)
    del looped, src
    tokens = args.steps * args.seq_len * args.batch
    common = dict(
        data=[args.data],
        tokens=tokens,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        new_lr=args.new_lr,
        warmup=0.05,
        freeze_below_window=True,
        seed=0,
    )
    runs = {}
    recipe = {
        "gate_floor": args.gate_floor,
        "gate_floor_until": args.gate_floor_until,
        "depth_curriculum": args.depth_curriculum,
    }
    for name, extra in (("mixed", {"override": args.override, **recipe}), ("plain", {"budgets": [0]})):
        out = work / name
        t0 = time.perf_counter()
        trainer = Trainer(work / "converted", TrainConfig(output=str(out), resume=out.exists(), **common, **extra))
        summary = trainer.run()
        runs[name] = {
            "wall_s": time.perf_counter() - t0,
            "summary": summary,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in trainer.records),
        }
    mixed = looptool.load(work / "mixed")
    plain = looptool.load(work / "plain")
    with torch.inference_mode():
        losses = {k: mean_loss(lambda ids, k=k: mixed(ids, labels=ids, budget=k).loss, val, 4) for k in mixed.budgets}
        plain_loss = mean_loss(lambda ids: plain(ids, labels=ids, budget=0).loss, val, 4)
    ks = mixed.budgets
    shares = gain_shares(losses)
    rows = [
        {"budget": k, "loss": losses[k], "delta_vs_plain": losses[k] - plain_loss, "share_of_endpoint_gain": shares[k]}
        for k in ks
    ]
    L = 30
    exp = runs["mixed"]["summary"]["expected"]
    result = {
        "bench": "quality",
        "model": "SmolLM2-135M-Instruct",
        "train_tokens": tokens,
        "eval_tokens": val.tokens.numel(),
        "settings": vars(args),
        "source_loss": source_loss,
        "plain_finetune_loss": plain_loss,
        "mixed": rows,
        "monotone": all(losses[a] > losses[b] for a, b in zip(ks, ks[1:])),
        "no_one_loop_tax": losses[ks[0]] - plain_loss <= 0.01,
        "throughput_mixed_over_plain": runs["mixed"]["tokens_per_s"] / runs["plain"]["tokens_per_s"],
        "expected_throughput_ratio": L / (L + exp["mean_budget"]),
        "wall_s": {k: v["wall_s"] for k, v in runs.items()},
        "realised": runs["mixed"]["summary"].get("realised"),
        "expected": exp,
    }
    (work / "bench_quality.json").write_text(json.dumps(result, indent=2))
    plot_frontier(
        {
            "budgets": [{"budget": k, "loss": losses[k], "ideal_layer_ratio": (L + k) / L} for k in ks],
            "source_loss": plain_loss,
        },
        work / "quality_frontier.png",
        title="SmolLM2, window 8:20, mixed-depth retrofit",
        reference_label="plain fine-tune",
        x="ideal_layer_ratio",
        xlabel="layer executions ÷ budget 0, (L+k)/L",
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
