"""Serving load on ``looptool serve``: a bounded load generator (asyncio + httpx, a fixed number
of streamed requests, stops by itself) reporting what serving benchmarks report.

Per scenario: completed / failed requests, request and output-token throughput, and TTFT,
TPOT (time per output token after the first) and end-to-end latency (mean, p50, p99), overall
and per budget. Scenarios, run in interleaved rounds (the machine is noisy):

``single``  one stream at a time at ``--budget`` (default: the middle of the menu);
``mixed``   ``--concurrency`` streams at once spread over every budget (request i at
            menu[i % len(menu)]);
``inproc``  the same runtime in this process (``looptool.runtime.generation.generate``, or the
            onnxruntime ``Runtime.generate`` with ``--engine``), same prompt, budget and token
            count as ``single`` (tokens / (prefill + decode) seconds);
``capacity`` with ``--capacities A,B``: one stream at a time on two more servers, started with
            ``--capacity A`` and ``--capacity B``, alternating; their p50 TPOT ratio B ÷ A says
            whether the slot cache's capacity costs time;
``prefix``  two requests one after the other that share a ``--prefix``-token prompt prefix (a
            new one each round) and differ in their last ``--question`` tokens, at the single
            budget: the second's TTFT ÷ the first's (the prefix cache's reuse); then the same at
            budget 0 followed by the deepest budget (the looped layers are computed again).

The server runs with its own defaults (``--capacity`` only when given here), ``--max-batch``
the concurrency. ``--engine ENGINE_DIR`` serves that engine directory (looptool export of
MODEL_DIR) on onnxruntime instead of MODEL_DIR on PyTorch.

Targets (SmolLM2-135M 8:20, budgets 0,3,6,9,12, 2 cores): mixed output tok/s ≥ 5× single's on
the onnxruntime engine, ≥ 3× on PyTorch; p50 TPOT at capacity 4096 ≤ 1.1× at 256; single tok/s
÷ inproc tok/s ≥ 0.9; the second prefix request's TTFT ≤ 0.25× the first's. Every request uses ``ignore_eos`` so each one generates exactly
``--new`` tokens.

Run: python tests/bench/bench_serve.py MODEL_DIR [--engine ENGINE_DIR] [--runs 3] [--requests 16]
[--concurrency 8] [--prompt 64] [--new 64] [--capacity N] [--capacities 256,4096] [--device cpu]
[--threads N] [--out FILE]. Starts its own servers on free ports (``--url`` uses a running one
instead). GPU check: --shape llama-1b --device cuda --dtype bfloat16 (random weights of that
shape, byte tokenizer, no download). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered), "p99": p99}


def summarise(records: list[dict], wall: float) -> dict:
    """Serving metrics of one scenario's requests (seconds; throughput per second of wall time)."""
    ok = [r for r in records if r["ok"]]
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_throughput": sum(r["tokens"] for r in ok) / wall,
        "ttft_s": _stats([r["ttft"] for r in ok]),
        "tpot_s": _stats([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_s": _stats([r["e2e"] for r in ok]),
    }
    per = {}
    for budget in sorted({r["budget"] for r in records}):
        mine = [r for r in ok if r["budget"] == budget]
        per[str(budget)] = {
            "completed": len(mine),
            "ttft_s": _stats([r["ttft"] for r in mine]),
            "tpot_s": _stats([r["tpot"] for r in mine if r["tpot"] is not None]),
            "e2e_s": _stats([r["e2e"] for r in mine]),
        }
    out["per_budget"] = per
    return out


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], budget: int, new: int) -> dict:
    body = {
        "model": f"{model}@{budget}",
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "budget": budget, "error": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                elif first is None and data["choices"]:  # one chunk per token: the first token
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        return {"ok": False, "budget": budget, "error": type(exc).__name__}
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (tokens - 1) if tokens > 1 else None
    return {"ok": tokens > 0, "budget": budget, "ttft": first - t0, "e2e": end - t0, "tokens": tokens, "tpot": tpot}


async def one_after_another(url: str, model: str, asked: list[tuple[list[int], int]], new: int) -> list[dict]:
    """Send each ``(prompt, budget)`` once the one before it finished; their records."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return [await _one(client, url, model, prompt, budget, new) for prompt, budget in asked]


def prefix_pairs(url: str, tokens: list[int], budgets: tuple[int, int], run: int, prefix: int, question: int) -> dict:
    """The ``prefix`` scenario's pair at ``budgets``: a fresh prefix for round ``run`` (its own
    stretch of ``tokens``), two questions after it; both TTFTs and their ratio."""
    start = (2 * run + (budgets[0] != budgets[1])) * (prefix + 2 * question)
    shared = tokens[start : start + prefix]
    asks = [tokens[start + prefix + i * question : start + prefix + (i + 1) * question] for i in (0, 1)]
    first, second = asyncio.run(
        one_after_another(url, "m", [(shared + asks[0], budgets[0]), (shared + asks[1], budgets[1])], 4)
    )
    return {
        "budgets": list(budgets),
        "ttft_first_s": first["ttft"],
        "ttft_second_s": second["ttft"],
        "second_over_first": second["ttft"] / first["ttft"],
    }


async def load(url: str, model: str, prompt: list[int], budgets: list[int], new: int, concurrency: int) -> dict:
    """Send ``len(budgets)`` requests (request i at ``budgets[i]``), at most ``concurrency`` at once."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def run(budget: int) -> dict:
            async with gate:
                return await _one(client, url, model, prompt, budget, new)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(run(b) for b in budgets))
        wall = time.perf_counter() - t0
    return summarise(list(records), wall)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, args, capacity: int | None = None) -> tuple[subprocess.Popen, str]:
    """A ``looptool serve`` process over ``model_dir`` on a free port, and its /v1 URL."""
    port = _free_port()
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # the working directory never shadows looptool
    argv = [
        sys.executable,
        *safe_path,
        "-m",
        "looptool",
        "serve",
        model_dir,
        "--port",
        str(port),
    ]
    argv += ["--threads", str(args.threads)] if args.engine and args.threads else ["--device", args.device]
    argv += ["--max-batch", str(args.concurrency), "--served-model-name", "m"]
    argv += ["--capacity", str(capacity)] if capacity else []
    argv += {"on": ["--spin"], "off": ["--no-spin"]}.get(args.spin, [])
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    log = tempfile.NamedTemporaryFile("w+", prefix="looptool-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = "".join(log.readlines()[-20:])
            raise SystemExit(f"the server exited with {proc.returncode}; its log ends:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up within 600 s")


def random_model_dir(shape: str, device: str, dtype) -> Path:
    """A random-weight model of ``shape`` looped like SmolLM2's 8:20 (budgets 0, m/4, m/2, 3m/4, m),
    saved with the byte tokenizer in a temporary directory (no download)."""
    import torch
    from shapes import prefix_plan, source_model

    import looptool
    from looptool.testing import byte_tokenizer

    source, _ = source_model(shape, torch.device(device), dtype)
    model = looptool.convert(source, prefix_plan(source.config.num_hidden_layers), tokenizer=byte_tokenizer())
    return model.save_pretrained(Path(tempfile.mkdtemp(prefix="bench-serve-")) / shape)


def _range(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?", help="a looped model directory (or --shape)")
    ap.add_argument(
        "--shape", default=None, help="instead: a random-weight model of this shape (tests/bench/shapes.py)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests of the mixed scenario per run")
    ap.add_argument("--single-requests", type=int, default=3, help="requests of the single scenario per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budget", type=int, default=None, help="budget of single and inproc (default: the middle)")
    ap.add_argument("--capacity", type=int, default=None, help="the server's --capacity (default: its own)")
    ap.add_argument("--capacities", default=None, help="A,B: compare one stream's TPOT at two capacities")
    ap.add_argument("--engine", default=None, help="serve this engine directory (onnxruntime) instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server and of inproc alike")
    ap.add_argument("--url", default=None, help="a running server's /v1 URL (its model id: m)")
    ap.add_argument(
        "--spin",
        choices=["default", "on", "off"],
        default="default",
        help="onnxruntime's spinning threads: the server's default, --spin or --no-spin",
    )
    ap.add_argument("--prefix", type=int, default=512, help="tokens the prefix scenario's two requests share")
    ap.add_argument("--question", type=int, default=16, help="tokens after the shared prefix")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve.json"))
    args = ap.parse_args()

    import torch

    import looptool
    from looptool.runtime.generation import generate

    if args.threads:
        torch.set_num_threads(args.threads)

    if args.shape:
        args.model_dir = str(random_model_dir(args.shape, args.device, getattr(torch, args.dtype)))
    elif not args.model_dir:
        ap.error("give MODEL_DIR or --shape")
    model = looptool.load(args.model_dir, device=args.device)
    menu = list(model.budgets)
    budget = args.budget if args.budget is not None else menu[len(menu) // 2]
    text = (SOTU / sorted(p.name for p in SOTU.glob("2*.txt"))[0]).read_text()
    tokens = model.tokenizer(text)["input_ids"]
    prompt = tokens[: args.prompt]
    if len(tokens) < 2 * args.runs * (args.prefix + 2 * args.question):
        tokens = model.tokenizer(" ".join(p.read_text() for p in sorted(SOTU.glob("2*.txt"))))["input_ids"]
    ids = torch.tensor([prompt], device=args.device)
    if args.engine:
        from looptool.backends.ort.runtime import Runtime

        runtime = Runtime(args.engine, threads=args.threads)

        def inproc(new: int) -> float:
            t0 = time.perf_counter()
            out = runtime.generate(ids, budget=budget, max_new_tokens=new)
            return (out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
    else:

        def inproc(new: int) -> float:
            return generate(model, ids, budget=budget, max_new_tokens=new).tokens_per_second

    inproc(2)  # builds the cached paths or sessions
    served = args.engine or args.model_dir
    capacities = [int(c) for c in args.capacities.split(",")] if args.capacities else []
    procs: list[subprocess.Popen] = []
    try:
        if args.url:
            url = args.url
        else:
            proc, url = start_server(served, args, args.capacity)
            procs.append(proc)
        compared = []
        for capacity in capacities:
            proc, other = start_server(served, args, capacity)
            procs.append(proc)
            compared.append(other)
        load_before = os.getloadavg()[0]  # other work on the machine skews every number; say how much there was
        runs = []
        for _ in range(args.runs):
            single = asyncio.run(load(url, "m", prompt, [budget] * args.single_requests, args.new, 1))
            mixed_budgets = [menu[i % len(menu)] for i in range(args.requests)]
            mixed = asyncio.run(load(url, "m", prompt, mixed_budgets, args.new, args.concurrency))
            run = {"single": single, "mixed": mixed, "inproc_tok_s": inproc(args.new)}
            run["prefix"] = prefix_pairs(url, tokens, (budget, budget), len(runs), args.prefix, args.question)
            run["prefix_across_budgets"] = prefix_pairs(
                url, tokens, (menu[0], menu[-1]), len(runs), args.prefix, args.question
            )
            for capacity, other in zip(capacities, compared):
                run[f"single_capacity_{capacity}"] = asyncio.run(
                    load(other, "m", prompt, [budget] * args.single_requests, args.new, 1)
                )
            runs.append(run)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    single_tok_s = [r["single"]["output_throughput"] for r in runs]
    ratios = {
        "mixed_over_single_tok_s": _range([r["mixed"]["output_throughput"] / s for r, s in zip(runs, single_tok_s)]),
        "mixed_over_single_p50_tpot": _range(
            [r["mixed"]["tpot_s"]["p50"] / r["single"]["tpot_s"]["p50"] for r in runs]
        ),
        "http_over_inproc_tok_s": _range([s / r["inproc_tok_s"] for r, s in zip(runs, single_tok_s)]),
        "prefix_ttft_second_over_first": _range([r["prefix"]["second_over_first"] for r in runs]),
        "prefix_ttft_deepest_after_budget_0": _range([r["prefix_across_budgets"]["second_over_first"] for r in runs]),
    }
    if len(capacities) == 2:
        small, large = (f"single_capacity_{c}" for c in capacities)
        ratios[f"tpot_capacity_{capacities[1]}_over_{capacities[0]}"] = _range(
            [r[large]["tpot_s"]["p50"] / r[small]["tpot_s"]["p50"] for r in runs]
        )
    result = {
        "bench": "serve",
        "model": args.shape or Path(args.model_dir).name,
        "menu": menu,
        "single_budget": budget,
        "prompt_tokens": len(prompt),
        "prefix_tokens": args.prefix,
        "question_tokens": args.question,
        "new_tokens": args.new,
        "concurrency": args.concurrency,
        "capacity": args.capacity or "the server's default",
        "runtime": "onnxruntime" if args.engine else "pytorch",
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]},
        "targets": {
            "mixed_over_single_tok_s": ">= 5" if args.engine else ">= 3",
            "tpot_capacity_4096_over_256": "<= 1.1",
            "http_over_inproc_tok_s": ">= 0.9",
            "prefix_ttft_second_over_first": "<= 0.25",
        },
        "ratios": ratios,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"bench": "serve", "ratios": ratios}))


if __name__ == "__main__":
    main()
