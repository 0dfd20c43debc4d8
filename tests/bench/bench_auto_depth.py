"""Per-question adaptive depth (``budget="auto"``) on pointer chasing, where depth pays: the
accuracy–mean-loops frontier of ``auto`` over exit thresholds against the fixed budgets'.

Model: the depth benchmark's ELR arm trained 10k steps (``bench_depth.py --arms elr-long``; a
3-layer d=64 Llama, recurrent block 1:2, paper init, re-injection, trained on k = 1..3, evaluated
also at k = 4). ``bench_depth.py`` keeps each trained arm in a temporary directory
``depth-<arm>-*/trained``; give it with ``--model`` (default: the newest
``$TMPDIR/depth-elr-long-*/trained``).

Test set: the depth benchmark's own (``--test-per-tier`` questions per hop count 1–6, same
seeds). Each question is one prompt of 19 tokens; its answer is the greedy token at the last
position, so one prefill decides it. Fixed budget ``k``: the cached path at ``k``. ``auto``: the
``adaptive_depth`` path (last-loop KV, each exit rule of ``--rules``) over the whole menu at each of
``--thresholds``; a row's depth is the loop count it ran (its criterion is read at the last
position, see ``passes/adaptive_depth.py``). Reports accuracy and mean loops over all questions
and over the hard tiers (3–6 hops), the fixed frontier, whether every ``auto`` point lies on or
above it (linear interpolation between fixed budgets, within 2 standard errors), and the least
mean depth at which ``auto`` reaches the best fixed budget's accuracy (the issue's target:
≤ 75% of that budget's loops).

The learned exits (``--rules gate``: q over [0, 1], ``exit_rule="gate"``) need a model trained
with them: ``bench_depth.py --arms elr-gate`` (``looptool train --exit-gate`` then
``--exit-gate-only``), given with ``--model $TMPDIR/depth-elr-gate-*/trained --max-budget 3``.
Each point is also compared, question by question, with the mix of the two fixed budgets around
its mean depth (``paired``: mean difference and standard error).

Run: python tests/bench/bench_auto_depth.py [--model DIR]
[--rules state,kl] [--out tests/bench/results/bench_auto_depth.json] [--png tests/bench/results/bench_auto_depth.png]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from bench_depth import HARD, TIERS, encode, example, tokenizer  # noqa: E402

import looptool  # noqa: E402
from looptool.runtime.adaptive import AutoDepth  # noqa: E402
from looptool.runtime.decode_graphs import allocate_cache, cached_paths  # noqa: E402
from looptool.testing import AutoStep  # noqa: E402

KV = "last-loop"
THRESHOLDS = {
    "state": "0,0.1,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.6,0.7,0.8,0.9,1,inf",
    "kl": "0,1e-4,1e-3,0.01,0.03,0.1,0.3,0.5,1,2,3,inf",
    "gate": "0,0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95,1",
}


def newest_model() -> Path:
    """The newest ``depth-elr-long-*/trained`` directory ``bench_depth.py`` left behind."""
    found = sorted(glob.glob(os.path.join(tempfile.gettempdir(), "depth-elr-long-*", "trained")), key=os.path.getmtime)
    if not found:
        raise SystemExit("no trained ELR arm found: run bench_depth.py --arms elr-long first, or give --model")
    return Path(found[-1])


def summary(hits: torch.Tensor, depths: torch.Tensor, tiers: torch.Tensor, subset: tuple[int, ...]) -> dict:
    """Accuracy (mean over the tiers in ``subset``, equal weight), its standard error and the mean depth."""
    accs, ses, ds = [], [], []
    for t in subset:
        h = hits[tiers == t].float()
        p = float(h.mean())
        accs.append(p)
        ses.append(math.sqrt(max(p * (1 - p), 1e-12) / len(h)))
        ds.append(float(depths[tiers == t].float().mean()))
    return {
        "acc": sum(accs) / len(accs),
        "se": math.sqrt(sum(s * s for s in ses)) / len(ses),
        "mean_depth": sum(ds) / len(ds),
        "per_tier": {str(t): round(a, 4) for t, a in zip(subset, accs)},
    }


def paired(hits: torch.Tensor, depth: float, by_budget: dict[int, torch.Tensor]) -> dict | None:
    """``hits`` against the straight line between the two fixed budgets around ``depth`` (a mix
    of them with the same mean depth), question by question: the mean difference and its
    standard error (None outside the menu's range)."""
    menu = sorted(by_budget)
    below = [k for k in menu if k <= depth]
    above = [k for k in menu if k >= depth]
    if not below or not above:
        return None
    a, b = below[-1], above[0]
    w = 0.0 if b == a else (depth - a) / (b - a)
    diff = hits.double() - ((1 - w) * by_budget[a].double() + w * by_budget[b].double())
    return {"margin": float(diff.mean()), "se": float(diff.std() / math.sqrt(len(diff))), "n": len(diff)}


def interpolate(fixed: list[dict], depth: float) -> float:
    """The fixed frontier's accuracy at ``depth`` (linear between budgets, flat past the ends)."""
    pts = sorted((f["mean_depth"], f["acc"]) for f in fixed)
    best = []
    for d, a in pts:  # the frontier: the best accuracy reachable at that depth or less
        best.append((d, max(a, best[-1][1]) if best else a))
    if depth <= best[0][0]:
        return best[0][1]
    for (d0, a0), (d1, a1) in zip(best, best[1:]):
        if depth <= d1:
            return a0 + (a1 - a0) * (depth - d0) / (d1 - d0)
    return best[-1][1]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--rules", default="state,kl", help="exit rules, each over its default thresholds (gate: learned exits)"
    )
    ap.add_argument("--max-budget", type=int, default=None, help="auto's deepest budget (default: the menu's)")
    ap.add_argument("--thresholds", default=None, help="thresholds for every rule (default: each rule's grid)")
    ap.add_argument("--test-per-tier", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else newest_model()
    model = looptool.load(path).eval()
    rows = [
        (t, *example(random.Random(f"test:{args.seed}:{t}:{i}"), t)) for t in TIERS for i in range(args.test_per_tier)
    ]
    tiers, ids, answers = encode(tokenizer(), rows)
    n, length = ids.shape
    mask = torch.ones(n, length, dtype=torch.long)
    position = torch.arange(length)[None].expand(n, -1)
    cache_position = torch.arange(length)
    rules = args.rules.split(",")
    report: dict[str, dict] = {
        name: {"fixed": [], "oracle": None, **{r: [] for r in rules}} for name in ("all", "hard")
    }
    hits_by_budget = {}
    for k in model.budgets:
        path_k = cached_paths(model, KV, [k])[k]
        caches = allocate_cache(path_k, n, length, dtype=torch.float32, device="cpu")
        logits = path_k.module(ids, mask, position, cache_position, *caches)[:, -1]
        hits_by_budget[k] = logits.argmax(-1) == answers
        for name, subset in (("all", TIERS), ("hard", HARD)):
            report[name]["fixed"].append(
                {"budget": k, **summary(hits_by_budget[k], torch.full((n,), k), tiers, subset)}
            )
        print("fixed", k, report["all"]["fixed"][-1]["acc"], report["hard"]["fixed"][-1]["acc"], flush=True)
    # the oracle: each question at the shallowest budget that answers it (the shallowest if none does)
    hits = torch.stack([hits_by_budget[k] for k in model.budgets])
    first = torch.where(hits.any(0), hits.float().argmax(0), 0)
    oracle_depth = torch.tensor(model.budgets)[first]
    for name, subset in (("all", TIERS), ("hard", HARD)):
        report[name]["oracle"] = summary(hits.any(0), oracle_depth, tiers, subset)
    for rule in rules:
        for thr in [float(x) for x in (args.thresholds or THRESHOLDS[rule]).split(",")]:
            settings = AutoDepth.resolve(model, max_budget=args.max_budget, exit_threshold=thr, exit_rule=rule)
            step = AutoStep(model, n, length, settings, KV)
            hits = step(ids, mask, position, cache_position).argmax(-1) == answers
            depths = step.depths(1)[:, 0]
            for name, subset in (("all", TIERS), ("hard", HARD)):
                point = {"threshold": thr, **summary(hits, depths, tiers, subset)}
                chosen = torch.isin(tiers, torch.tensor(subset))
                point["paired"] = paired(
                    hits[chosen],
                    float(depths[chosen].float().mean()),
                    {k: h[chosen] for k, h in hits_by_budget.items()},
                )
                report[name][rule].append(point)
            a = report["all"][rule][-1]
            print(rule, thr, a["mean_depth"], a["acc"], report["hard"][rule][-1]["acc"], flush=True)
    verdict = {}
    for name, r in report.items():
        best = max(r["fixed"], key=lambda f: f["acc"])
        verdict[name] = {"best_fixed_budget": best["budget"], "best_fixed_acc": best["acc"]}
        for rule in rules:
            margins = [a["acc"] - interpolate(r["fixed"], a["mean_depth"]) for a in r[rule]]
            reaching = [a["mean_depth"] for a in r[rule] if a["acc"] >= best["acc"]]
            v = {
                "on_or_above_frontier": all(m >= -2 * a["se"] for m, a in zip(margins, r[rule])),
                "worst_margin": min(margins),
                "least_depth_reaching_best": min(reaching) if reaching else None,
                "depth_ratio": (min(reaching) / best["mean_depth"]) if reaching else None,
            }
            v["target_met"] = v["on_or_above_frontier"] and v["depth_ratio"] is not None and v["depth_ratio"] <= 0.75
            # between one and two loops: above the line between them, question by question
            low = [a["paired"] for a in r[rule] if 1 < a["mean_depth"] < 2 and a["paired"] is not None]
            v["paired_between_1_and_2"] = {
                "points": len(low),
                # below by less than one question of the set counts as on the line (the mix gives fractional credit)
                "none_below": bool(low) and all(p["margin"] >= -1 / n for p in low),
                "best_margin_in_se": max((p["margin"] / p["se"] for p in low if p["se"] > 0), default=None),
            }
            verdict[name][rule] = v
    doc = {
        "bench": "auto_depth",
        "model": f"bench_depth.py arm {path.parent.name.rsplit('-', 1)[0]}",
        "plan": str(model.plan),
        "settings": vars(args),
    }
    doc.update(report=report, verdict=verdict)
    print(json.dumps(verdict))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (name, r) in zip(axes, report.items()):
            fx = sorted(r["fixed"], key=lambda f: f["mean_depth"])
            ax.errorbar(
                [f["mean_depth"] for f in fx],
                [f["acc"] for f in fx],
                [2 * f["se"] for f in fx],
                fmt="o-",
                label="fixed",
            )
            for rule, style in zip(rules, ("s--", "^:", "D-.")):
                au = sorted(r[rule], key=lambda a: a["mean_depth"])
                ax.plot([a["mean_depth"] for a in au], [a["acc"] for a in au], style, label=f"auto ({rule} rule)")
            ax.plot([r["oracle"]["mean_depth"]], [r["oracle"]["acc"]], "k*", label="oracle (shallowest correct)")
            ax.set_xlabel("mean loops per question")
            ax.set_ylabel("accuracy" + (" (tiers 3-6)" if name == "hard" else " (tiers 1-6)"))
            ax.set_title(f"pointer chasing, {doc['model'].split()[-1]}: {name} questions", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
