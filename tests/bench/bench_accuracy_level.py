"""int4 accuracy levels on SmolLM2-135M (CPU): what float activations (``accuracy_level=1``, the
default) cost in decode speed against int8 activations (``accuracy_level=4``, onnxruntime-genai's
CPU setting), and what int8 activations cost in batch invariance.

SmolLM2-135M-Instruct (the ``smollm2`` source: its Q4_1 GGUF dequantised to fp32) is converted
with the benchmarks' plan (window 8:20, budgets 0, 3, 6, 9, 12) and exported twice at int4
(``export_onnx(..., quantize="int4", accuracy_level=level)``, per-loop caches, the graphs of
budgets 0 and 12 and the row-wise graph, validated: the relative logit error each level gives
against PyTorch's float path is kept). The two engines hold the same int4 blocks; only the
``accuracy_level`` of their ``MatMulNBits`` differs. Engines are kept under ``--work`` and reused
while their manifest records the level.

1. Speed: greedy decoding of ``--new`` tokens from the first ``--prompt`` tokens of the demo
   text (``looptool.eval.demo.DEMO_TEXT``), the same prompt in every row, at batch 1 and 8, by
   budget 0's own graph (``Runtime.generate``, the runtime's defaults: weights pre-packed, as
   for every quantized engine), ``--threads`` intra-op threads. ms per decode step = the time
   from the first new token to the last over the ``--new`` - 1 steps between them (the prefill
   left out). Interleaved rounds (``looptool.eval.timing.interleaved``): one untimed warm-up
   round, then ``--rounds`` rounds each running every arm once in a rotated order; min / median
   / max per arm and the round-by-round ratio level 1 ÷ level 4 per batch size.
2. Batch invariance: 8 prompts (the first 6 to 20 tokens of the 8 latest SOTU addresses) at budgets 0 and 12 in
   turn, ``--answer`` greedy tokens each, generated alone, then all 8 in one left-padded batch
   (the row-wise graph), then as batches of 3, 3 and 2: per level, the prompts whose tokens
   differ from their alone answer in any batch, and the largest logit difference (over the steps
   up to a row's first different token: after it the inputs differ).

Run: python tests/bench/bench_accuracy_level.py [--rounds 5] [--new 64] [--prompt 21]
[--threads 2] [--answer 24] [--work DIR] [--out FILE]. Prints markdown tables and writes the JSON
(default tests/bench/results/bench_accuracy_level.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import tempfile
import time
from pathlib import Path

import onnxruntime
import torch
from shapes import prefix_plan

import looptool
from looptool.backends.manifest import MANIFEST, Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.onnx.quantize import ACCURACY_LEVEL, FAST_ACCURACY_LEVEL
from looptool.backends.ort.runtime import Runtime
from looptool.capture.sources import load_source
from looptool.eval.demo import DEMO_TEXT
from looptool.eval.timing import interleaved, ratio
from looptool.testing import batch_gaps

LEVELS = (ACCURACY_LEVEL, FAST_ACCURACY_LEVEL)
BATCHES = (1, 8)
RESULTS = Path(__file__).resolve().parent / "results" / "bench_accuracy_level.json"
SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"


def engine(model, directory: Path, level: int) -> tuple[Runtime, dict | None]:
    """The int4 engine of ``model`` at ``level`` in ``directory`` (exported unless it is there
    already) and, when exported now, its seconds and relative logit errors."""
    if (directory / MANIFEST).exists() and Manifest.read(directory).quantization["accuracy_level"] == level:
        return Runtime(directory), None
    t0 = time.perf_counter()
    report = export_onnx(
        model, directory, [0, model.budgets[-1]], quantize="int4", accuracy_level=level, overwrite=True
    )
    errors = [b.max_abs_diff["real"] for b in [*report.budgets, *report.rowwise]]
    export = {"seconds": time.perf_counter() - t0, "relative_error": [min(errors), max(errors)]}
    return Runtime(directory), export


def decode_seconds(rt: Runtime, ids: torch.Tensor, new: int) -> float:
    """Seconds per decode step of budget 0's graph on ``ids`` (the prefill left out)."""
    out = rt.generate(ids, budget=0, max_new_tokens=new)
    return out.decode_seconds / (out.new_tokens - 1)


def prompts(tokenizer, count: int = 8) -> list[list[int]]:
    """``count`` prompts of 6 to 20 tokens: the start of one SOTU address each (the latest)."""
    files = sorted(SOTU.glob("*.txt"))[-count:]
    return [tokenizer(f.read_text()).input_ids[: 6 + 2 * i] for i, f in enumerate(files)]


def invariance(rt: Runtime, rows: list[list[int]], budgets: list[int], answer: int) -> dict:
    """Each prompt alone against the same prompt in a batch of all and in batches of 3, 3, 2."""
    groups = [list(range(len(rows))), [0, 1, 2], [3, 4, 5], [6, 7]]
    worst, differ = batch_gaps(rt.generate, rows, budgets, groups, answer)
    return {"prompts": len(rows), "differ": differ, "max_logit_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answer", type=int, default=24, help="greedy tokens per prompt in the invariance check")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_accuracy_level")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_source("smollm2")
    model = looptool.convert(src.model, prefix_plan(src.model.config.num_hidden_layers), tokenizer=src.tokenizer)
    runtimes, exports = {}, {}
    for level in LEVELS:
        rt, exported = engine(model, args.work / f"int4-level{level}", level)
        runtimes[level] = Runtime(rt.directory, threads=args.threads)
        exports[level] = exported
    prompt = src.tokenizer(DEMO_TEXT, return_tensors="pt").input_ids[:, : args.prompt]
    arms = {
        f"level{level}_batch{b}": functools.partial(decode_seconds, runtimes[level], prompt.repeat(b, 1), args.new)
        for b in BATCHES
        for level in LEVELS
    }
    timings = interleaved(arms, repeats=args.rounds, measured=True)
    ratios = {b: ratio(timings[f"level{LEVELS[0]}_batch{b}"], timings[f"level{LEVELS[1]}_batch{b}"]) for b in BATCHES}
    rows = prompts(src.tokenizer)
    budgets = [(0, model.budgets[-1])[i % 2] for i in range(len(rows))]
    checks = {level: invariance(runtimes[level], rows, budgets, args.answer) for level in LEVELS}
    result = {
        "bench": "accuracy_level",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised), int4, window 8:20",
        "threads": args.threads,
        "prompt_tokens": prompt.shape[1],
        "new_tokens": args.new,
        "rounds": args.rounds,
        "decode_ms": {name: t.as_dict() for name, t in timings.items()},
        "ratio_level1_over_level4": {
            str(b): {"min": r.min, "median": r.median, "max": r.max, "cell": r.cell()} for b, r in ratios.items()
        },
        "invariance": {str(level): c for level, c in checks.items()},
        "invariance_budgets": budgets,
        "export": {str(level): e for level, e in exports.items()},
        "versions": {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__},
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| arm (ms per decode step) | batch 1: min / median / max | batch 8: min / median / max |")
    print("|---|---|---|")
    for level in LEVELS:
        cells = [timings[f"level{level}_batch{b}"] for b in BATCHES]
        print(
            f"| int4, accuracy level {level} | "
            + " | ".join(f"{t.min * 1e3:.1f} / {t.median * 1e3:.1f} / {t.max * 1e3:.1f}" for t in cells)
            + " |"
        )
    print("| level 1 ÷ level 4 (round by round) | " + " | ".join(ratios[b].cell() for b in BATCHES) + " |")
    for level, c in checks.items():
        print(
            f"level {level}: {len(c['differ'])} of {c['prompts']} prompts answer differently in a batch "
            f"(prompts {c['differ']}); largest logit difference {c['max_logit_diff']:.2e}"
        )
    for level, e in exports.items():
        if e:
            print(
                f"level {level}: exported in {e['seconds']:.0f} s, relative logit error "
                f"{e['relative_error'][0]:.3f}-{e['relative_error'][1]:.3f}"
            )


if __name__ == "__main__":
    main()
