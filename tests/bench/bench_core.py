"""Generation through the engine core costs what the direct decode loop cost: ``generate`` on
PyTorch and onnxruntime's ``Runtime.generate``, per generated token, on this checkout and on the
revision before the core (``--baseline``, extracted with ``git archive``), in interleaved rounds
(the machinery of ``bench_unused.py``: one child process per tree per round, the order
alternating). Target: within 3% at batch 1 and batch 8.

Arms (SmolLM2-135M converted with ``--window 8:20 --budgets 0,3,6,9,12``, untrained new
parameters; its onnxruntime engine from ``looptool export``'s defaults; greedy, ``--new`` tokens
after a 16-token prompt, EOS never stops a row, ``--threads`` threads): each runtime at budget 0
and at budget 12 with one row, and at budget 0 with 8 rows. Reports ms per generated token per
arm and tree (min/median/max over ``--rounds``) and this checkout ÷ baseline (of the medians,
of the minimums, and the median of the round-by-round ratios).

Run: python tests/bench/bench_core.py [--baseline REV] [--rounds 5] [--new 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench_unused import compare, interleaved

BASELINE = "3796957"  # the last commit before the engine core (generate's own decode loop)

CHILD = r"""
import json, sys, time, torch
threads, new, model_dir, engine_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(threads)
import looptool
from looptool.backends.ort.runtime import Runtime
from looptool.runtime.generation import generate
model = looptool.load(model_dir)
rt = Runtime(engine_dir, threads=threads)
ids = torch.arange(100, 116)[None]
runs = {"pytorch": lambda x, b, n: generate(model, x, budget=b, max_new_tokens=n, eos_token_id=-1),
        "onnxruntime": lambda x, b, n: rt.generate(x, budget=b, max_new_tokens=n, eos_token_id=-1)}
arms = {"budget 0, 1 row": (ids, 0), "budget 12, 1 row": (ids, 12), "budget 0, 8 rows": (ids.expand(8, -1), 0)}
out = {}
for runtime, run in runs.items():
    for name, (x, budget) in arms.items():
        run(x, budget, 4)  # warm-up: builds the path or session
        t = time.perf_counter()
        run(x, budget, new)
        out[f"{runtime}: {name}"] = 1000 * (time.perf_counter() - t) / new
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_core"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    model, engine = work / "model", work / "engine"
    if not (model / "looptool.json").exists():
        import looptool

        plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
        looptool.convert("smollm2", plan).save_pretrained(model)
    if not (engine / "manifest.json").exists():
        subprocess.run(["looptool", "export", str(model), "-o", str(engine)], check=True)
    times = interleaved(args.baseline, work, args.rounds, args.threads, args.new, model, CHILD, engine)
    arms = compare(times)
    doc = {"bench": "core", "baseline": args.baseline, "settings": vars(args), "arms": arms}
    summary = {
        a: [round(s[k], 3) for k in ("ratio_of_medians", "ratio_of_mins", "median_round_ratio")]
        for a, s in arms.items()
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
