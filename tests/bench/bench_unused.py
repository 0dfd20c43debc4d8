"""No cost when unused: decoding without ``budget="auto"`` or a draft budget runs as fast as
the code before either existed (the issue's ±3%).

Two source trees of looptool decode the same saved model: this checkout and ``--baseline``
(a git revision, default the last commit before per-token depth and speculation, extracted
with ``git archive``). Each round runs one child process per tree (order alternating between
rounds; each child loads the model, warms up, then times its arms), so the trees share the
machine's state round by round. Arms (SmolLM2-135M-Instruct converted with ``looptool
convert``'s default plan, untrained new parameters; greedy, ``--new`` tokens after a 16-token
prompt, EOS never stops a row, ``--threads`` threads): ``generate`` at the shallowest and at
the deepest budget (batch 1, each budget's own cached path), and a mixed batch of 4 rows at
shallowest, deepest, shallowest, deepest (the row-wise path). Reports ms per generated
token per arm and tree (min/median/max over ``--rounds``) and three ratios, this checkout ÷
baseline: of the medians, of the minimums, and the median of the round-by-round ratios (the
two trees of one round ran back to back).

Run: python tests/bench/bench_unused.py [--baseline REV] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "1ac688d"  # the last commit before budget="auto" and self-speculative decoding

CHILD = r"""
import json, sys, time, torch
threads, new, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
import looptool
from looptool.runtime.generation import generate
model = looptool.load(model_dir)
ids = torch.arange(100, 116)[None]
lo, hi = min(model.budgets), max(model.budgets)
arms = {"shallowest": (ids, lo), "deepest": (ids, hi), "mixed x4": (ids.expand(4, -1), [lo, hi, lo, hi])}
out = {}
for name, (x, budget) in arms.items():
    generate(model, x, budget=budget, max_new_tokens=4, eos_token_id=-1)  # warm-up: builds the path
    t = time.perf_counter()
    generate(model, x, budget=budget, max_new_tokens=new, eos_token_id=-1)
    out[name] = 1000 * (time.perf_counter() - t) / new
print(json.dumps(out))
"""


def shim(tree: Path, into: Path) -> Path:
    """A package directory making ``import looptool`` resolve to ``tree`` (its top-level
    ``passes`` and ``backends`` mapped into the package, as the installed layout does)."""
    pkg = into / "looptool"
    pkg.mkdir(parents=True)
    for f in (tree / "looptool").iterdir():
        (pkg / f.name).symlink_to(f)
    for sub in ("passes", "backends"):
        (pkg / sub).symlink_to(tree / sub)
    return into


def child(path: Path, threads: int, new: int, model: Path, code: str = CHILD, *extra: Path) -> dict:
    """The arms' ms per token that ``code`` prints, run with ``import looptool`` resolving to
    ``path`` (its arguments: threads, new tokens, the model directory, then ``extra``)."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    res = subprocess.run(
        [sys.executable, "-c", code, str(threads), str(new), str(model), *map(str, extra)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def interleaved(baseline: str, work: Path, rounds: int, threads: int, new: int, *child_args) -> dict:
    """``rounds`` rounds of one :func:`child` per tree (``baseline`` extracted under ``work``, and
    this checkout), the order alternating; each arm's ms per token by tree."""
    old = work / f"tree-{baseline}"
    if not old.exists():
        old.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    trees = {"baseline": shim(old, Path(tempfile.mkdtemp())), "this": shim(ROOT, Path(tempfile.mkdtemp()))}
    times: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for r in range(rounds):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
            for arm, ms in child(trees[name], threads, new, *child_args).items():
                times[name].setdefault(arm, []).append(ms)
        print(f"round {r + 1}: " + json.dumps({t: {a: round(v[-1], 2) for a, v in times[t].items()} for t in times}))
    return times


def compare(times: dict[str, dict[str, list[float]]]) -> dict:
    """Per arm: each tree's ms per token (min, median, max over the rounds) and this tree ÷ the
    baseline: of the medians, of the minimums, and the median of the round-by-round ratios."""
    arms = {}
    for arm in times["this"]:
        stats = {
            t: {"min_ms": min(v), "median_ms": statistics.median(v), "max_ms": max(v), "n": len(v)}
            for t, v in ((t, times[t][arm]) for t in times)
        }
        stats["ratio_of_medians"] = stats["this"]["median_ms"] / stats["baseline"]["median_ms"]
        stats["ratio_of_mins"] = stats["this"]["min_ms"] / stats["baseline"]["min_ms"]
        rounds = [a / b for a, b in zip(times["this"][arm], times["baseline"][arm])]
        stats["round_ratios"] = rounds
        stats["median_round_ratio"] = statistics.median(rounds)
        arms[arm] = stats
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_unused"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    model = work / "model"
    if not (model / "looptool.json").exists():
        import looptool

        looptool.convert("smollm2").save_pretrained(model)
    times = interleaved(args.baseline, work, args.rounds, args.threads, args.new, model)
    arms = compare(times)
    doc = {"bench": "unused", "baseline": args.baseline, "settings": vars(args), "arms": arms}
    print(
        json.dumps(
            {
                a: [round(s[k], 3) for k in ("ratio_of_medians", "ratio_of_mins", "median_round_ratio")]
                for a, s in arms.items()
            }
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
