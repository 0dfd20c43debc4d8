"""Scale-out on Ray Serve: the depth-aware router against Ray's default router on the same
replicas and load, and what one stream pays for going through Ray.

One local Ray cluster (every core of the machine) serves ``SERVED`` (an engine or looped model
directory) as one application per arm at once, each ``--replicas`` engine replicas of
``--max-batch`` rows, one torch/onnxruntime thread each, so every router drives identical
replicas: ``/depth`` (:class:`looptool.serve.ray.router.DepthAwareRouter` with its defaults),
``/hold`` (the same, but a request waits up to 10 s for a batch of its budget, a replica
draining for it after 0.5 s), ``/strict`` (that, and no riding: one-budget batches as far as
waiting allows) and ``/ray`` (Ray's power-of-two-choices router). Per round, in rotating order:

``depth`` / ``hold`` / ``strict`` / ``ray``  ``--requests`` streamed requests, ``--concurrency`` at once (more than the
                     replicas batch), request i at menu[i % len(menu)], a ``--prompt``-token SOTU
                     prompt and ``--new`` tokens each (``ignore_eos``): output tokens/s of wall
                     time, TTFT and TPOT, and the share of the replicas' decode steps whose batch
                     ran one budget (from the ingress's ``/metrics``, before and after);
``single``           one stream at a time at the middle budget, ``--single-requests`` of them,
                     through the ``/depth`` application and through a single-process
                     ``looptool serve`` (``--threads 1``) started here, alternating.

Arms other than ``ray`` are reported as tok/s ÷ ``ray``'s in the same round. Targets (issue: SmolLM2 8:20, budgets 0,3,6,9,12, 2 replicas): one-budget step share ≥ 0.8 and
output tok/s ≥ 1.2 × Ray's router; one stream through Ray ÷ the single server ≥ 0.85 tok/s.

Run: python tests/bench/bench_ray_serve.py SERVED [--model-dir MODEL_DIR] [--replicas 2]
[--runs 3] [--requests 48] [--concurrency 32] [--max-batch 8] [--prompt 64] [--new 64]
[--out FILE]. ``--model-dir`` (default: SERVED) gives the tokenizer of the prompt. Prints one
JSON line and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import SOTU, load, one_after_another, start_server  # noqa: E402

ARMS = {  # application (route prefix) -> its RayOptions beside the replicas
    "depth": {"router": "depth"},  # the defaults: same budget, idle, ride a deeper batch, least extra depth
    "hold": {"router": "depth", "hold_s": 0.5, "max_hold_s": 10.0},  # wait (then drain a replica) before mixing
    "strict": {"router": "depth", "hold_s": 0.5, "max_hold_s": 10.0, "ride": False},  # and never ride
    "ray": {"router": "ray"},  # Ray's power of two choices
}


def step_counts(base: str) -> dict[str, float]:
    """The replicas' decode steps by batch kind, summed, from an application's ``/metrics``."""
    page = httpx.get(f"{base}/metrics", timeout=60).text
    out = {"one-budget": 0.0, "mixed": 0.0}
    for line in page.splitlines():
        if line.startswith("looptool_replica_decode_steps_total{"):
            for kind in out:
                if f'batch="{kind}"' in line:
                    out[kind] += float(line.rpartition(" ")[2])
    return out


def _range(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("served", help="an engine directory (onnxruntime) or a looped model directory")
    ap.add_argument("--model-dir", default=None, help="the looped model directory (tokenizer; default: SERVED)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--arms", default="depth,hold,strict,ray", help="applications to compare (ray last: the baseline)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--single-requests", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_ray_serve.json"))
    args = ap.parse_args()

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from looptool.serve import ServeOptions
    from looptool.serve import ray as looptool_ray
    from looptool.serve.models import read_facts

    menu = list(read_facts(args.served).budgets)
    tok = AutoTokenizer.from_pretrained(args.model_dir or args.served)
    text = (SOTU / sorted(p.name for p in SOTU.glob("2*.txt"))[0]).read_text()
    prompt = tok(text)["input_ids"][: args.prompt]
    budgets = [menu[i % len(menu)] for i in range(args.requests)]
    middle = menu[len(menu) // 2]

    cpus = os.cpu_count() or 2
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="warning", log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # fmt: skip
    port = start_port = 8000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": start_port})
    options = ServeOptions(max_batch=args.max_batch, max_queue=args.requests)
    arms = args.arms.split(",")
    share = cpus / (len(arms) * args.replicas)  # every application's replicas fit the machine at once
    for arm in arms:
        placement = looptool_ray.RayOptions(replicas=args.replicas, replica_cpus=share, **ARMS[arm])
        application = looptool_ray.app(args.served, options, ray=placement, name="m", threads=1)
        serve.run(application, name=arm, route_prefix=f"/{arm}")
    bases = {arm: f"http://127.0.0.1:{port}/{arm}" for arm in arms}

    class Single:
        threads, device, concurrency, engine, spin = 1, "cpu", args.max_batch, True, None

    proc, single_url = start_server(args.served, Single)
    rounds = []
    try:
        for r in range(args.runs):
            record: dict = {"round": r}
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                before = step_counts(bases[arm])
                result = asyncio.run(load(f"{bases[arm]}/v1", "m", prompt, budgets, args.new, args.concurrency))
                after = step_counts(bases[arm])
                one, mixed = (after[k] - before[k] for k in ("one-budget", "mixed"))
                result["steps"] = {"one_budget": one, "mixed": mixed, "one_budget_share": one / max(one + mixed, 1)}
                record[arm] = result
            singles = {"ray": [], "single_process": []}
            for i in range(args.single_requests):
                order = [("ray", f"{bases['depth']}/v1"), ("single_process", single_url)]
                for name, url in order if i % 2 == 0 else order[::-1]:
                    (rec,) = asyncio.run(one_after_another(url, "m", [(prompt, middle)], args.new))
                    singles[name].append(rec["tokens"] / rec["e2e"])
            record["single"] = {name: statistics.median(v) for name, v in singles.items()}
            record["single"]["ray_over_single_process"] = record["single"]["ray"] / record["single"]["single_process"]
            for arm in arms[:-1]:
                record[f"{arm}_over_ray_tok_s"] = record[arm]["output_throughput"] / record["ray"]["output_throughput"]
            rounds.append(record)
            shown = {k: v for k, v in record.items() if k == "single" or k.endswith("_tok_s")}
            print(json.dumps(shown | {f"{x}_share": record[x]["steps"]["one_budget_share"] for x in arms}), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        serve.shutdown()
        ray.shutdown()
    summary = {
        "over_ray_tok_s": {x: _range([r[f"{x}_over_ray_tok_s"] for r in rounds]) for x in arms[:-1]},
        "tok_s": {x: _range([r[x]["output_throughput"] for r in rounds]) for x in arms},
        "one_budget_share": {x: _range([r[x]["steps"]["one_budget_share"] for r in rounds]) for x in arms},
        "ttft_p50_s": {x: _range([r[x]["ttft_s"]["p50"] for r in rounds]) for x in arms},
        "tpot_p50_s": {x: _range([r[x]["tpot_s"]["p50"] for r in rounds]) for x in arms},
        "failed": {x: sum(r[x]["failed"] for r in rounds) for x in arms},
        "single_tok_s": {x: _range([r["single"][x] for r in rounds]) for x in ("ray", "single_process")},
        "single_ray_over_single_process": _range([r["single"]["ray_over_single_process"] for r in rounds]),
    }
    out = {
        "served": str(args.served),
        "machine": f"{cpus} cores",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "menu": menu,
        "summary": summary,
        "rounds": rounds,
        "when": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
