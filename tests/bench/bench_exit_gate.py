"""Learned exits on a real model: SmolLM2-135M's held-out loss against mean depth, ``budget="auto"``
with the gate rule over exit thresholds q against the fixed budgets.

Model: SmolLM2-135M converted with fixed-prefix looping (window 8:20, budgets 0,3,6,9,12) and
retrofitted with the quality benchmark's recipe (``bench_quality.py``'s mixed arm: ``--steps``
mixed-depth steps of 2 x 512 tokens of the in-repo SOTU training split, lr 5e-5, loop LR 1e-2),
then the gate-only stage (``looptool train --exit-gate-only``: the model frozen, ``--fit-steps``
steps on the same text, exit-head LR ``--fit-lr``, gamma ``--gamma``). The retrofit is kept in
``--work`` and reused.

Evaluation: the first ``--rows`` x ``--length`` tokens of the SOTU validation split (addresses
from 2000 on), teacher-forced one token at a time through the adaptive-depth decode path under
last-loop KV (every token decides its own depth, exactly as ``generate``/``serve`` run
``budget="auto"``). A fixed budget k is the same path with ``min_budget = max_budget = k`` (the
same KV policy); the exact per-loop-KV forward loss of each budget is reported beside it. Depth
is the number of window layers run twice (0-12). Reports mean loss and mean depth per point,
the one-loop tax of the gate stage (budget 0's forward loss after it minus before), and the
issue's target: some ``auto`` point within 0.01 nats of the deepest budget's loss at <= 0.7 x its
depth.

Run: python tests/bench/bench_exit_gate.py [--work DIR] [--out tests/bench/results/bench_exit_gate.json]
[--png tests/bench/results/bench_exit_gate.png]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import looptool  # noqa: E402
from looptool.capture.sources import load_source  # noqa: E402
from looptool.runtime.adaptive import AutoDepth  # noqa: E402
from looptool.testing import AutoStep  # noqa: E402
from looptool.train.data import find_files, tokenize_files  # noqa: E402
from looptool.train.trainer import TrainConfig, Trainer  # noqa: E402

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"
THRESHOLDS = "0,0.2,0.4,0.5,0.6,0.7,0.8,0.9,0.95,1"


def train(work: Path, args) -> Path:
    """The retrofit (kept) and the gate-only stage on it; returns the gated model's directory."""
    src = load_source("smollm2")
    if not (work / "mixed").exists():
        plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
        looptool.convert(src.model, plan, tokenizer=src.tokenizer).save_pretrained(work / "converted")
        cfg = TrainConfig(
            data=[args.data], output=str(work / "mixed"), steps=args.steps, seq_len=512, batch=2, lr=5e-5,
            new_lr=1e-2, device="cpu", save_optimizer=False,
        )  # fmt: skip
        Trainer(work / "converted", cfg).run()
    gated = work / f"gated-{args.fit_steps}-{args.fit_lr:g}-{args.gamma:g}"
    if not gated.exists():
        cfg = TrainConfig(
            data=[args.data], output=str(gated), steps=args.fit_steps, seq_len=512, batch=2, lr=5e-5,
            new_lr=args.fit_lr, device="cpu", exit_gate_only=True, exit_gamma=args.gamma, save_optimizer=False,
            seed=1,
        )  # fmt: skip
        t0 = time.perf_counter()
        Trainer(work / "mixed", cfg).run()
        (gated / "fit_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return gated


def held_out(model, rows: int, length: int, data: str) -> torch.Tensor:
    """``[rows, length]`` validation tokens (consecutive, from the start of the split)."""
    tokens = tokenize_files(find_files(data), model.tokenizer)
    if tokens.numel() < rows * length:
        raise SystemExit(f"the validation text has {tokens.numel()} tokens, fewer than {rows * length}")
    return tokens[: rows * length].view(rows, length)


@torch.inference_mode()
def teacher_forced(model, ids: torch.Tensor, settings: AutoDepth) -> tuple[float, float]:
    """Mean next-token loss and mean depth, one token per step through the adaptive decode path."""
    rows, length = ids.shape
    step = AutoStep(model, rows, length, settings, "last-loop")
    total = 0.0
    mask = torch.zeros(rows, length, dtype=model.mask_dtype)  # the cache's slots, filled as tokens arrive
    for t in range(length - 1):
        mask[:, t] = 1
        logits = step(ids[:, t : t + 1], mask, torch.full((rows, 1), t), torch.tensor([t]))
        total += float(F.cross_entropy(logits.float(), ids[:, t + 1], reduction="sum"))
    depths = step.depths(length - 1)
    return total / (rows * (length - 1)), float(depths.float().mean())


@torch.inference_mode()
def forward_loss(model, ids: torch.Tensor, budget: int) -> float:
    return float(model(ids, labels=ids, budget=budget).loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench_exit_gate"))
    ap.add_argument("--steps", type=int, default=120, help="retrofit steps (the quality benchmark's)")
    ap.add_argument("--fit-steps", type=int, default=60, help="gate-only steps")
    ap.add_argument("--fit-lr", type=float, default=1e-2)
    ap.add_argument("--gamma", type=float, default=0.005)
    ap.add_argument("--data", default=str(SOTU / "1*.txt"))
    ap.add_argument("--val-data", default=str(SOTU / "2*.txt"))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--thresholds", default=THRESHOLDS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--replot", default=None, help="redraw --png from this results file, no run")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.png)
        return
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gated_dir = train(work, args)
    model = looptool.load(gated_dir).eval()
    mixed = looptool.load(work / "mixed").eval()
    ids = held_out(model, args.rows, args.length, args.val_data)
    lo, hi = min(model.budgets), max(model.budgets)
    fixed = []
    for k in model.budgets:
        loss, depth = teacher_forced(model, ids, AutoDepth(k, k, 0.0, "gate"))
        fixed.append({"budget": k, "loss": loss, "mean_depth": depth, "forward_loss": forward_loss(model, ids, k)})
        print("fixed", fixed[-1], flush=True)
    auto = []
    for q in [float(x) for x in args.thresholds.split(",")]:
        loss, depth = teacher_forced(model, ids, AutoDepth(lo, hi, q, "gate"))
        auto.append({"threshold": q, "loss": loss, "mean_depth": depth})
        print("auto", auto[-1], flush=True)
    deepest = next(f for f in fixed if f["budget"] == hi)
    near = [a for a in auto if a["loss"] <= deepest["loss"] + 0.01]
    least = min(near, key=lambda a: a["mean_depth"]) if near else None
    tax = forward_loss(model, ids, lo) - forward_loss(mixed, ids, lo)
    verdict = {
        "deepest_loss": deepest["loss"],
        "best_fixed": min(fixed, key=lambda f: f["loss"]),
        "least_depth_within_0.01_of_deepest": least["mean_depth"] if least else None,
        "depth_ratio": least["mean_depth"] / hi if least else None,
        "one_loop_tax": tax,
        "depth_pays": deepest["loss"] < fixed[0]["loss"] - 0.01,
    }
    verdict["target_met"] = verdict["depth_ratio"] is not None and verdict["depth_ratio"] <= 0.7 and tax <= 0.01
    doc = {
        "bench": "exit_gate",
        "model": "SmolLM2-135M, window 8:20, budgets 0,3,6,9,12",
        "settings": vars(args),
        "fit_seconds": float((gated_dir / "fit_seconds.txt").read_text())
        if (gated_dir / "fit_seconds.txt").exists()
        else None,
        "fixed": fixed,
        "auto_gate": auto,
        "verdict": verdict,
    }
    print(json.dumps(verdict))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        plot(doc, args.png)


def plot(doc: dict, png: str) -> None:
    """Held-out loss against mean depth: the fixed budgets (the decode path and exact), auto."""
    fixed, auto = doc["fixed"], sorted(doc["auto_gate"], key=lambda a: a["mean_depth"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot([f["mean_depth"] for f in fixed], [f["loss"] for f in fixed], "o-", label="fixed budgets, last-loop KV")
    ax.plot([a["mean_depth"] for a in auto], [a["loss"] for a in auto], "s--", label="auto (learned exits, q grid)")
    ax.plot([f["mean_depth"] for f in fixed], [f["forward_loss"] for f in fixed], "^:", label="fixed budgets, exact")
    ax.set_xlabel("mean depth (window layers run twice)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("SmolLM2-135M + learned exits: loss vs depth", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
