"""Self-speculative decoding on SmolLM2-135M (CPU, PyTorch runtime): measured speed-up against
the speed-up predicted from the measured acceptance and step costs.

Models: SmolLM2-135M-Instruct from PyPI converted with the benchmarks' fixed-prefix plan
(window 8:20, budgets 0, 3, 6, 9, 12) and with ELR (recurrent block 8:22, loop counts 1–4),
then, with ``--train-steps N`` (default 30), trained for N mixed-depth steps on the SOTU
training split with ``bench_quality.py``'s settings (seq 512, batch 2, LR 5e-5, new-parameter
LR 1e-2, layers below the window frozen) so that budgets disagree on some tokens; at
``--train-steps 0`` every budget still computes the source model (acceptance 1: the
ceiling of the mechanism, set by the step costs alone).

Pairs (target ← draft): fixed-prefix 12 ← 0, ELR 4 ← 1. Arms, each greedy-decoding ``--new``
tokens at batch 1 from the first ``--prompt`` tokens of the SOTU validation text: ``plain_k``
(budget k alone), ``plain_j`` (the draft budget alone), ``spec_n{n}`` (budget k drafted at j,
``n`` drafts per verify step, for each of ``--draft-tokens``). Timing: decode time (first new
token to the last) per new token after the first; interleaved rounds
(``looptool.eval.timing.interleaved``), min / median / max.

With ``--onnx`` each model is also exported (``export_onnx(..., speculative=True)``: every
budget's graph and the verify graphs, fused onnxruntime lowering, one ``weights.bin``; kept
under ``--work``) and the same arms run on onnxruntime (``Runtime.generate``, ``--threads``
intra-op threads, default session settings) as ``onnx_plain_k``, ``onnx_plain_j`` and
``onnx_spec_n{n}``.

Prediction (per token, in units of the target's own step ``c_k``): with ``a`` the mean tokens
a verify step yields (kept drafts + 1, measured), ``c_j`` the draft budget's decode step and
``c_v`` the verify step (measured inside the speculative run: its verify seconds per round),
``speedup = a · c_k / (n · c_j + c_v)``. Measured: plain_k's ms per token ÷ spec's. Every
speculative arm's tokens are checked against plain_k's (greedy: they must be equal).

Run: python tests/bench/bench_speculative.py [--rounds 3] [--new 64] [--train-steps 30]
[--draft-tokens 2,4] [--threads 2] [--onnx] [--work DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import looptool
from looptool.capture.sources import load_source
from looptool.eval.timing import interleaved, ratio
from looptool.runtime.generation import generate
from looptool.train.trainer import TrainConfig, Trainer

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"
PLANS = {
    "prefix": (looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)), 12, 0),
    "elr": (looptool.RecurrentLoop(recurrent=(8, 22), max_loops=4), 4, 1),
}


def _trained(name: str, work: Path, steps: int, src) -> looptool.LoopedModel:
    """``name``'s plan on SmolLM2, after ``steps`` mixed-depth training steps (kept under ``work``)."""
    plan = PLANS[name][0]
    out = work / f"{name}-{steps}"
    if (out / "looptool.json").exists():
        return looptool.load(out)
    converted = work / f"{name}-converted"
    if not (converted / "looptool.json").exists():
        looptool.convert(src.model, plan, tokenizer=src.tokenizer).save_pretrained(converted)
    if steps == 0:
        return looptool.load(converted)
    config = TrainConfig(
        output=str(out),
        data=[str(SOTU / "1*.txt")],
        tokens=steps * 512 * 2,
        seq_len=512,
        batch=2,
        lr=5e-5,
        new_lr=1e-2,
        warmup=0.05,
        freeze_below_window=True,
        seed=0,
    )
    Trainer(converted, config).run()
    return looptool.load(out)


def _decode(run, ids, budget, new, **kw):
    """(decode seconds per token after the first, the output) of one greedy run of
    ``run(ids, budget=, max_new_tokens=, on_step=, ...)``."""
    stamps = []
    out = run(ids, budget=budget, max_new_tokens=new, on_step=lambda t: stamps.append(time.perf_counter()), **kw)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), out


def _engine(model, directory: Path, threads: int):
    """``model``'s onnxruntime engine with verify graphs (exported once into ``directory``)."""
    from looptool.backends.onnx.export import export_onnx
    from looptool.backends.ort.runtime import Runtime

    if not (directory / "manifest.json").exists():
        export_onnx(model, directory, "all", rowwise=False, speculative=True, validate=False, overwrite=True)
    return Runtime(directory, threads=threads)


def _report(prefix: str, timings, stats, outs, ns) -> dict:
    """Each speculative arm's acceptance, predicted and measured speed-up (``prefix``: the
    arms' name prefix, "" for PyTorch, "onnx_" for onnxruntime)."""
    c_k, c_j = timings[f"{prefix}plain_k"].median, timings[f"{prefix}plain_j"].median
    rows = {}
    for n in ns:
        key = f"{prefix}spec_n{n}"
        s = stats[key][-1]
        per_round = (s.accepted + s.rounds) / s.rounds  # tokens a verify step yields, kept drafts + 1
        c_v = statistics.median(x.verify_seconds / x.rounds for x in stats[key][1:])  # timed rounds only
        predicted = per_round * c_k / (n * c_j + c_v)
        measured = ratio(timings[f"{prefix}plain_k"], timings[key])
        rows[key] = {
            "draft_tokens": n,
            "acceptance": s.acceptance,
            "tokens_per_verify": per_round,
            "verify_ms": c_v * 1e3,
            "predicted_speedup": predicted,
            "measured_speedup": measured.median,
            "measured_speedup_min_max": [measured.min, measured.max],
            "measured_over_predicted": measured.median / predicted,
            "tokens_equal_plain_k": bool(torch.equal(outs[key].sequences, outs[f"{prefix}plain_k"].sequences)),
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--draft-tokens", default="2,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="prefix,elr")
    ap.add_argument(
        "--onnx", action="store_true", help="also time the onnxruntime engine (exported with verify graphs)"
    )
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_speculative_"))
    work.mkdir(parents=True, exist_ok=True)
    src = load_source("smollm2")
    text = " ".join(p.read_text() for p in sorted(SOTU.glob("2*.txt")))
    ids = src.tokenizer(text, return_tensors="pt")["input_ids"][:, : args.prompt]
    ns = [int(x) for x in args.draft_tokens.split(",")]
    results = {}
    for name in args.models.split(","):
        model = _trained(name, work, args.train_steps, src)
        _, k, j = PLANS[name]
        outs, stats = {}, {}

        def arm(key, run, budget, outs=outs, stats=stats, **kw):
            def timed():
                dt, out = _decode(run, ids, budget, args.new, **kw)
                outs[key] = out
                if out.speculation is not None:
                    stats.setdefault(key, []).append(out.speculation)
                return dt

            return timed

        runs = {"": functools.partial(generate, model)}
        if args.onnx:
            runs["onnx_"] = _engine(model, work / f"{name}-{args.train_steps}-onnx", args.threads).generate
        fns = {}
        for prefix, run in runs.items():
            fns[f"{prefix}plain_k"] = arm(f"{prefix}plain_k", run, k)
            fns[f"{prefix}plain_j"] = arm(f"{prefix}plain_j", run, j)
            for n in ns:
                fns[f"{prefix}spec_n{n}"] = arm(f"{prefix}spec_n{n}", run, k, draft_budget=j, draft_tokens=n)
        timings = interleaved(fns, repeats=args.rounds, warmup=1, measured=True)
        rows = {}
        for prefix in runs:
            rows.update(_report(prefix, timings, stats, outs, ns))
        c_k, c_j = timings["plain_k"].median, timings["plain_j"].median
        results[name] = {
            "target": k,
            "draft": j,
            "ms_per_token": {key: t.as_dict() for key, t in timings.items()},
            "draft_over_target_step": c_j / c_k,
            "speculation": rows,
        }
        print(json.dumps({name: results[name]}, indent=1))
    doc = {
        "bench": "speculative",
        "model": "SmolLM2-135M-Instruct",
        "settings": vars(args),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "models": results,
    }
    path = Path(args.out) if args.out else work / "bench_speculative.json"
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
