"""Per-token adaptive depth (``budget="auto"``) against fixed budgets: held-out loss against
mean depth, on SmolLM2-135M after a short mixed-depth retrofit.

Models: the ones ``bench_speculative.py`` trains and keeps under ``--work`` (SmolLM2-135M-Instruct,
fixed-prefix window 8:20 with budgets 0–12, and ELR 8:22 with loop counts 1–4, each after
``--train-steps`` mixed-depth steps; run that script first, or this one trains them the same
way). Text: ``--rows`` rows of ``--length`` tokens of the SOTU validation split (2000–2021).

Each arm teacher-forces the text through the cached decode step under last-loop KV (what
``budget="auto"`` runs on): a prefill of ``--prompt`` tokens, then one token per step; the loss
is the mean next-token NLL of every token after the prompt. Arms: every fixed budget of the menu
(its cached path) and ``auto`` at each of ``--thresholds`` (the ``adaptive_depth`` path over the
whole menu, rule ``--rule``), whose mean depth per token is the realised depth the path reports.
The frontier plot puts both on loss against mean depth.

``--timing`` measures wall-clock instead (results ``bench_auto_timing.json``): batch 1, one row
of the same text, a ``--prompt``-token prefill (not timed), then ``--steps`` teacher-forced
decode steps, timed together and reported in ms per step. Arms: every fixed budget's cached path
under last-loop KV, and ``auto`` at each of ``--timing-thresholds``, once on the path that stops
looping once every row has exited (``skip_exited``, what ``generate`` runs) and once on the
masked path (every step to ``max_budget``). The arms run interleaved, each once per round, over
``--rounds`` rounds; each arm reports the min / median / max of its rounds' ms per step.

Run: python tests/bench/bench_auto.py [--work DIR] [--models prefix,elr] [--train-steps 30]
[--thresholds 0,1e-3,...] [--out FILE] [--png FILE]
     python tests/bench/bench_auto.py --timing [--rounds 5] [--steps 32] [--timing-thresholds 0,0.01,0.03,inf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from bench_speculative import SOTU, _trained  # noqa: E402

from looptool.capture.sources import load_source  # noqa: E402
from looptool.runtime.adaptive import AutoDepth  # noqa: E402
from looptool.runtime.decode_graphs import allocate_cache, cached_paths  # noqa: E402
from looptool.testing import AutoStep  # noqa: E402

KV = "last-loop"


@torch.inference_mode()
def forced_nll(step, ids: torch.Tensor, prompt: int) -> float:
    """Mean NLL of ``ids[:, prompt:]`` teacher-forced through ``step(ids, mask, position_ids,
    cache_position) -> logits [batch, vocab]`` (one prefill, then one token per step)."""
    batch, length = ids.shape
    mask = torch.zeros(batch, length, dtype=torch.long)
    mask[:, :prompt] = 1
    logits = step(ids[:, :prompt], mask, torch.arange(prompt)[None].expand(batch, -1), torch.arange(prompt))
    total = 0.0
    for t in range(prompt, length):
        total += float(torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="sum"))
        if t + 1 == length:
            break
        mask[:, t] = 1
        pos = torch.full((batch, 1), t)
        logits = step(ids[:, t : t + 1], mask, pos, torch.tensor([t]))
    return total / (batch * (length - prompt))


def fixed_step(model, k: int, batch: int, length: int):
    """Budget ``k``'s cached path under last-loop KV as a step callable over fresh caches."""
    path = cached_paths(model, KV, [k])[k]
    caches = allocate_cache(path, batch, length, dtype=torch.float32, device="cpu")
    return lambda *a: path.module(*a, *caches)[:, -1]


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


@torch.inference_mode()
def timed_decode(step, ids: torch.Tensor, prompt: int) -> float:
    """Seconds for the decode steps of ``ids[:, prompt:]`` teacher-forced through ``step``
    (the prefill of ``prompt`` tokens before them is not timed)."""
    batch, length = ids.shape
    mask = torch.zeros(batch, length, dtype=torch.long)
    mask[:, :prompt] = 1
    step(ids[:, :prompt], mask, torch.arange(prompt)[None].expand(batch, -1), torch.arange(prompt))
    start = time.perf_counter()
    for t in range(prompt, length):
        mask[:, t] = 1
        step(ids[:, t : t + 1], mask, torch.full((batch, 1), t), torch.tensor([t]))
    return time.perf_counter() - start


def timing(model, ids: torch.Tensor, args) -> list[dict]:
    """ms per decode step of every arm (fixed budgets; auto skipping and masked per threshold),
    the arms interleaved within each of ``args.rounds`` rounds."""
    length = ids.shape[1]
    arms: dict[str, tuple[dict, object]] = {}
    for k in model.budgets:
        arms[f"budget {k}"] = ({"arm": "fixed", "budget": k}, lambda k=k: fixed_step(model, k, 1, length))
    for thr in (float(x) for x in args.timing_thresholds.split(",")):
        settings = AutoDepth.resolve(model, exit_threshold=thr, exit_rule=args.rule)
        for skip in (True, False):
            label = {"arm": "auto", "threshold": thr, "path": "skip" if skip else "masked"}
            arms[f"auto {thr:g} {label['path']}"] = (
                label,
                lambda s=settings, skip=skip: AutoStep(model, 1, length, s, KV, skip=skip),
            )
    steps = length - args.prompt
    times: dict[str, list[float]] = {name: [] for name in arms}
    depth: dict[str, float] = {}
    for _, make in arms.values():  # warm-up: build every path once
        timed_decode(make(), ids, args.prompt)
    for r in range(args.rounds):
        for name, (label, make) in arms.items():
            step = make()
            times[name].append(timed_decode(step, ids, args.prompt) * 1e3 / steps)
            if label["arm"] == "auto":
                depth[name] = float(step.depths(steps + 1)[:, 1:].float().mean())  # the decode steps' tokens
        print(f"round {r + 1}/{args.rounds}", {n: round(t[-1], 1) for n, t in times.items()}, flush=True)
    out = []
    for name, (label, _) in arms.items():
        entry = {**label, "ms_per_step": _stats(times[name]), "rounds": times[name]}
        if name in depth:
            entry["mean_depth"] = depth[name]
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_speculative")
    ap.add_argument("--models", default="prefix,elr")
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--thresholds", default="0,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,inf")
    ap.add_argument("--rule", default="state")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--timing", action="store_true", help="wall-clock per decode step instead of the loss")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--timing-thresholds", default="0,0.01,0.03,inf")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = load_source("smollm2")
    text = " ".join(p.read_text() for p in sorted(SOTU.glob("2*.txt")))
    flat = src.tokenizer(text, return_tensors="pt")["input_ids"][0]
    ids = flat[: args.rows * args.length].reshape(args.rows, args.length)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    if args.timing:
        results = {}
        for name in args.models.split(","):
            model = _trained(name, work, args.train_steps, src)
            results[name] = timing(model, flat[: args.prompt + args.steps][None], args)
        doc = {"bench": "auto_timing", "model": "SmolLM2-135M-Instruct", "settings": vars(args), "models": results}
        out = Path(args.out) if args.out else work / "bench_auto_timing.json"
        out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {out}")
        return
    results = {}
    for name in args.models.split(","):
        model = _trained(name, work, args.train_steps, src)
        fixed = {k: forced_nll(fixed_step(model, k, args.rows, args.length), ids, args.prompt) for k in model.budgets}
        auto = []
        for thr in thresholds:
            settings = AutoDepth.resolve(model, exit_threshold=thr, exit_rule=args.rule)
            step = AutoStep(model, args.rows, args.length, settings, KV)
            loss = forced_nll(step, ids, args.prompt)
            depths = step.depths(args.length - args.prompt).float()
            auto.append({"threshold": thr, "loss": loss, "mean_depth": float(depths.mean())})
            print(name, auto[-1], flush=True)
        results[name] = {"fixed": [{"budget": k, "loss": v} for k, v in fixed.items()], "auto": auto}
        print(name, results[name]["fixed"], flush=True)
    doc = {"bench": "auto", "model": "SmolLM2-135M-Instruct", "settings": vars(args), "models": results}
    out = Path(args.out) if args.out else work / "bench_auto.json"
    out.write_text(json.dumps(doc, indent=2))
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot([f["budget"] for f in r["fixed"]], [f["loss"] for f in r["fixed"]], "o-", label="fixed budgets")
        ax.plot([a["mean_depth"] for a in r["auto"]], [a["loss"] for a in r["auto"]], "s--", label="auto (thresholds)")
        ax.set_xlabel("mean depth per token (repeated layers / loops)")
        ax.set_ylabel("held-out NLL (nats/token)")
        ax.set_title(f"{name}: SmolLM2, {args.train_steps} retrofit steps")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png or work / "bench_auto.png", dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
