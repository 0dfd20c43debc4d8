"""Resident memory of a process that has opened an engine and decoded, against onnxruntime-genai.

Uses the builds ``bench_peer.py`` keeps under ``--work`` (run it first, with ``--unrolled`` and
``--int4`` for those arms). Each arm runs in a fresh Python process, which imports its runtime,
opens the engine with its default settings, greedy-decodes one new token at batch 1 (looptool:
at every budget of the menu, then one batch whose rows take every budget: the row-wise path),
and reports ``VmRSS`` after that, ``VmHWM`` (its peak) and ``VmRSS`` right after its imports
(looptool's runtime imports torch; onnxruntime-genai's does not), all from ``/proc/self/status``:

* ``genai_fp32`` / ``genai_int4``: onnxruntime-genai's model of the source (one session);
* ``looped`` / ``looped_int4``: looptool's default engine (one looped graph, one session, weights
  packed once);
* ``unrolled``: the per-budget engine (a session per budget, packing off by default);
  ``unrolled_prepack``: the same with ``prepack=True`` (a packed copy per session).

Each arm runs ``--rounds`` times (processes interleaved); min / median / max in MiB and the ratio
of medians to genai's of the same precision. Run: python tests/bench/bench_peer_memory.py
[--work DIR] [--rounds 3] [--threads 2] [--out FILE].
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bench_peer_memory.json"

_STATUS = """
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
"""

GENAI = (
    _STATUS
    + """
import json, sys, numpy as np, onnxruntime_genai as og
imports = status("VmRSS")
config = og.Config(sys.argv[1])
config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(sys.argv[2])}}}}))
model = og.Model(config)
params = og.GeneratorParams(model)
params.set_search_options(do_sample=False, max_length=22, batch_size=1)
gen = og.Generator(model, params)
gen.append_tokens(np.arange(1, 22, dtype=np.int32)[None])
gen.generate_next_token()
print(json.dumps({"rss_mib": status("VmRSS"), "peak_mib": status("VmHWM"), "imports_mib": imports}))
"""
)

LOOPTOOL = (
    _STATUS
    + """
import json, sys, torch
from looptool.backends.ort.runtime import Runtime
imports = status("VmRSS")
rt = Runtime(sys.argv[1], threads=int(sys.argv[2]), prepack=(sys.argv[3] == "1") or None, spin=None)
menu = rt.rowwise_menu()
ids = torch.arange(1, 22)[None]
for k in menu:
    rt.generate(ids, budget=k, max_new_tokens=1)
rt.generate(ids.repeat(len(menu), 1), budget=list(menu), max_new_tokens=1)
print(json.dumps({"rss_mib": status("VmRSS"), "peak_mib": status("VmHWM"), "imports_mib": imports, "sessions": len(rt._sessions)}))
"""
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "looptool-bench-peer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = args.work.resolve()
    arms = {
        "genai_fp32": (GENAI, work / "genai-fp32", "0"),
        "genai_int4": (GENAI, work / "genai-int4", "0"),
        "looped": (LOOPTOOL, work / "looptool-engine", "0"),
        "looped_int4": (LOOPTOOL, work / "looptool-engine-int4", "0"),
        "unrolled": (LOOPTOOL, work / "looptool-engine-unrolled", "0"),
        "unrolled_prepack": (LOOPTOOL, work / "looptool-engine-unrolled", "1"),
    }
    arms = {k: v for k, v in arms.items() if v[1].is_dir()}
    if "genai_fp32" not in arms or "looped" not in arms:
        raise SystemExit(f"no bench_peer builds under {work}; run tests/bench/bench_peer.py --work {work} first")
    samples: dict[str, list[dict]] = {k: [] for k in arms}
    for r in range(args.rounds):
        for name, (code, path, prepack) in arms.items():
            out = subprocess.run(
                [sys.executable, "-c", code, str(path), str(args.threads), prepack],
                check=True,
                capture_output=True,
                text=True,
            )
            samples[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"[bench_peer_memory] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    result = {"bench": "peer_memory", "rounds": args.rounds, "threads": args.threads, "arms": {}}
    for name, runs in samples.items():
        rss = [s["rss_mib"] for s in runs]
        peak = [s["peak_mib"] for s in runs]
        engine = [s["rss_mib"] - s["imports_mib"] for s in runs]  # what opening and decoding added
        result["arms"][name] = {
            "rss_mib": {"min": min(rss), "median": statistics.median(rss), "max": max(rss)},
            "peak_mib": {"min": min(peak), "median": statistics.median(peak), "max": max(peak)},
            "imports_mib": statistics.median(s["imports_mib"] for s in runs),
            "engine_mib": statistics.median(engine),
            "sessions": runs[0].get("sessions", 1),
        }
    for name, arm in result["arms"].items():
        peer = "genai_int4" if "int4" in name else "genai_fp32"
        if peer in result["arms"] and not name.startswith("genai"):
            arm["rss_vs_genai"] = arm["rss_mib"]["median"] / result["arms"][peer]["rss_mib"]["median"]
            arm["engine_vs_genai"] = arm["engine_mib"] / result["arms"][peer]["engine_mib"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| arm | sessions | RSS MiB min / median / max | peak MiB | imports MiB | RSS − imports MiB "
        "| RSS ÷ genai · (RSS − imports) ÷ genai's (same precision) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, arm in result["arms"].items():
        r = arm["rss_mib"]
        ratio = f"{arm['rss_vs_genai']:.2f} · {arm['engine_vs_genai']:.2f}" if "rss_vs_genai" in arm else "-"
        print(
            f"| {name} | {arm['sessions']} | {r['min']:.0f} / {r['median']:.0f} / {r['max']:.0f} | "
            f"{arm['peak_mib']['median']:.0f} | {arm['imports_mib']:.0f} | {arm['engine_mib']:.0f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
