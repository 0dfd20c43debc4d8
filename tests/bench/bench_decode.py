"""Cached decoding speed on SmolLM2-135M: ms per generated token at every budget.

Batch 1, a 128-token prompt of SOTU text, 64 new tokens, greedy. Contenders run in
interleaved rounds (the machine is noisy): looptool's cached decoding at every budget
(per-loop KV, and last-loop at the deepest budget) and the source model's own
transformers ``generate``. Decode ms/token is the time from the first to the last new
token divided by the tokens in between, timestamped the same way for every contender (a
streamer for transformers, the step callback for looptool), so prefill is excluded.

Reports per budget: decode ms/token min/median/max, ratio to budget 0, the ideal ratios
(layer executions (L+k)/L and Eq. 6 FLOPs), KV bytes per token; and looptool budget 0 ÷
transformers generate (target <= 1.1).

Run: python tests/bench/bench_decode.py [--rounds 5] [--new 64] [--prompt 128]. Prints one JSON line.
GPU check: --device cuda --shape smollm2-random --dtype bfloat16 (random weights, random prompt:
the same shapes and work, no download) --out FILE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from shapes import NAMES, prefix_plan, source_model
from transformers.generation.streamers import BaseStreamer

import looptool
from looptool.runtime.decode_graphs import cached_paths, kv_bytes_per_token
from looptool.runtime.devices import resolve_device
from looptool.runtime.generation import generate

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"  # the in-repo subset


class Stamps(BaseStreamer):
    """Records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def ms_per_token(times: list[float]) -> float:
    """ms per token from the times each new token arrived: first to last over the steps between."""
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--shape", default="smollm2", choices=NAMES, help="smollm2-random: its shape, random weights (no download)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_decode.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    device = resolve_device(args.device)
    source, tokenizer = source_model(args.shape, device, getattr(torch, args.dtype))
    model = looptool.convert(source, prefix_plan(source.config.num_hidden_layers), tokenizer=tokenizer)
    if tokenizer is not None:
        text = (SOTU / sorted(p.name for p in SOTU.glob("2*.txt"))[0]).read_text()
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt]
    else:
        ids = torch.randint(0, source.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    pad = tokenizer.eos_token_id if tokenizer is not None else 0
    t0 = time.perf_counter()
    for kv in ("per-loop", "last-loop"):
        cached_paths(model, kv)
    build_s = time.perf_counter() - t0

    def looptool_run(budget: int, kv: str):
        def run() -> float:
            stamps: list[float] = []
            generate(
                model,
                ids,
                budget=budget,
                max_new_tokens=args.new,
                kv=kv,
                eos_token_id=None,
                on_step=lambda _t: stamps.append(time.perf_counter()),
            )
            return ms_per_token(stamps)

        return run

    def hf_run() -> float:
        s = Stamps()
        source.generate(
            ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, streamer=s, pad_token_id=pad
        )
        return ms_per_token(s.times)

    contenders = {"hf_generate": hf_run}
    contenders.update({f"budget_{k}": looptool_run(k, "per-loop") for k in model.budgets})
    deepest = model.budgets[-1]
    contenders[f"budget_{deepest}_last_loop"] = looptool_run(deepest, "last-loop")
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        for fn in contenders.values():  # warm-up round
            fn()
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                samples[name].append(fn())
    med = {name: statistics.median(v) for name, v in samples.items()}
    L = len(model.layer_graph.layers)
    costs = {c.budget: c for c in model.cost_table()}
    base = med["budget_0"]
    rows = []
    for k in model.budgets:
        v = samples[f"budget_{k}"]
        rows.append(
            {
                "budget": k,
                "ms_per_token": {"min": min(v), "median": med[f"budget_{k}"], "max": max(v)},
                "ratio_to_budget_0": med[f"budget_{k}"] / base,
                "ideal_layers": (L + k) / L,
                "ideal_flops": costs[k].relative_flops,
                "kv_bytes_per_token": kv_bytes_per_token(model, k, "per-loop"),
                "kv_bytes_per_token_last_loop": kv_bytes_per_token(model, k, "last-loop"),
            }
        )
    hf = samples["hf_generate"]
    last = samples[f"budget_{deepest}_last_loop"]
    result = {
        "bench": "decode",
        "model": args.shape,
        "device": str(device),
        "dtype": args.dtype,
        "batch": 1,
        "prompt_tokens": ids.shape[1],
        "new_tokens": args.new,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "cached_path_build_s": build_s,
        "budgets": rows,
        "hf_generate_ms_per_token": {"min": min(hf), "median": med["hf_generate"], "max": max(hf)},
        "budget_0_over_hf_generate": base / med["hf_generate"],
        "deepest_last_loop_ms_per_token": {"min": min(last), "median": statistics.median(last), "max": max(last)},
        "deepest_last_loop_over_per_loop": statistics.median(last) / med[f"budget_{deepest}"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
