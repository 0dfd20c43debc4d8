"""Load and CLI start-up cost of a saved SmolLM2 looped model (window 8:20, budgets 0,3,6,9,12).

1. ``looptool.load`` with ``LOOPTOOL_CACHE=off``, from a warm disk cache in a fresh process,
   and from the in-process cache (a second load in that process). Each is timed inside a
   child process, after ``import looptool`` (whose time is reported apart). Target: warm ≤ 2 s.
2. ``looptool generate DIR --budget 0 --prompt ... --max-new-tokens 16``: the wall time of a
   first process (an empty capture cache) and of a second one (the cache it left), and their
   ratio. Target: second ÷ first ≤ 0.3.

Rounds interleave every measurement; each round starts from a fresh, empty cache folder.
``--compare DIR`` measures another looptool side by side, in the same rounds (e.g. a
``git worktree`` of the commit before a change): DIR goes first on ``PYTHONPATH``, so it must
hold an importable ``looptool`` package (in a checkout, link ``looptool/passes`` and
``looptool/backends`` to the top-level ``passes`` and ``backends`` folders). Writes tests/bench/results/load.json
(``--out``) and prints one JSON line.

Run: python tests/bench/bench_load.py [--rounds 3] [--model DIR] [--compare DIR]
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

HERE = Path(__file__).resolve().parent
PROMPT = "The capital of France is"

_LOAD_SCRIPT = r"""
import json, os, sys, time
t0 = time.perf_counter()
import looptool
t1 = time.perf_counter()
out = {"import_s": t1 - t0}
for name in sys.argv[2:]:
    t = time.perf_counter()
    looptool.load(sys.argv[1])
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _env(tree: Path | None, cache: str) -> dict:
    env = {**os.environ, "LOOPTOOL_CACHE": cache, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def _load_times(model: Path, tree: Path | None, cache: str, names: list[str]) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(model), *names],
        env=_env(tree, cache),
        cwd=model.parent,  # not the repository root: PYTHONPATH (--compare) decides the looptool
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def _generate_wall(model: Path, tree: Path | None, cache: str) -> float:
    cmd = [sys.executable, "-m", "looptool", "generate", str(model), "--budget", "0"]
    cmd += ["--prompt", PROMPT, "--max-new-tokens", "16"]
    t = time.perf_counter()
    subprocess.run(cmd, env=_env(tree, cache), cwd=model.parent, capture_output=True, text=True, check=True)
    return time.perf_counter() - t


def _convert(out: Path) -> None:
    cmd = [sys.executable, "-m", "looptool", "convert", "smollm2", "-o", str(out)]
    cmd += ["--window", "8:20", "--budgets", "0,3,6,9,12"]
    subprocess.run(cmd, env=_env(None, "off"), check=True, capture_output=True, text=True)


def _round(model: Path, tree: Path | None, work: Path, r: int, times: dict) -> None:
    cache = work / f"cache-{r}"
    # load: off, then the first process fills the cache (a miss, not reported), then a
    # fresh process reads the warm disk cache and loads a second time from memory
    times["load_off"].append(_load_times(model, tree, "off", ["off"])["off"])
    _load_times(model, tree, str(cache), ["miss"])
    got = _load_times(model, tree, str(cache), ["warm_disk", "warm_memory"])
    times["load_warm_disk"].append(got["warm_disk"])
    times["load_warm_memory"].append(got["warm_memory"])
    times["import"].append(got["import_s"])
    # generate: a first process on an empty cache, then a second one
    gen_cache = work / f"gen-cache-{r}"
    first = _generate_wall(model, tree, str(gen_cache))
    second = _generate_wall(model, tree, str(gen_cache))
    times["generate_first"].append(first)
    times["generate_second"].append(second)
    times["generate_ratio"].append(second / first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, help="a saved SmolLM2 looped model (default: converted here)")
    ap.add_argument("--compare", type=Path, help="another looptool checkout, measured side by side")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "load.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="looptool-bench-load-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "smollm2-looped"
            _convert(model)
        trees = {"this": None}
        if args.compare is not None:
            trees["compare"] = args.compare.resolve()
        keys = ("load_off", "load_warm_disk", "load_warm_memory", "import", "generate_first", "generate_second")
        times = {t: {k: [] for k in (*keys, "generate_ratio")} for t in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                _round(model, trees[name], work / name, r, times[name])
    result = {
        "bench": "load",
        "model": "smollm2-135m looped, PrefixLoop window 8:20, budgets 0,3,6,9,12",
        "rounds": args.rounds,
        "load_s": {k.removeprefix("load_"): _stats(v) for k, v in times["this"].items() if k.startswith("load_")},
        "import_s": _stats(times["this"]["import"]),
        "generate_s": {k: _stats(times["this"][f"generate_{k}"]) for k in ("first", "second")},
        "generate_ratio": _stats(times["this"]["generate_ratio"]),
        "targets": {"load_warm_disk_s": 2.0, "generate_ratio": 0.3},
        "torch": __import__("torch").__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_end": os.getloadavg()},
    }
    if "compare" in times:
        c = times["compare"]
        result["compare"] = {
            "load_s": {k.removeprefix("load_"): _stats(v) for k, v in c.items() if k.startswith("load_")},
            "import_s": _stats(c["import"]),
            "generate_s": {k: _stats(c[f"generate_{k}"]) for k in ("first", "second")},
            "generate_ratio": _stats(c["generate_ratio"]),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
