"""Structured outputs: the cost per generated token of a JSON schema (xgrammar) against
unconstrained decoding, in process, through the engine core the server runs
(:class:`looptool.engine.core.EngineCore`, the grammar rows of :mod:`looptool.serve.structured`).

An exported looptool engine (``ENGINE_DIR``: SmolLM2-135M looped with budgets 0, 3, 6, 9, 12,
on onnxruntime with ``--threads`` intra-op threads) answers ``--batch`` rows at one ``--budget``,
greedy. The prompt asks for a support ticket extracted from a customer message; the schema
(:data:`SCHEMA`) is schema-heavy: 11 required keys, a nested object, an array of objects,
enums, booleans, bounded integers and short strings with ``maxLength``, no additional
properties, so the keys, quotes, colons and braces of the answer are forced by the grammar.
With ``--batch`` above 1 each row gets its own message (``--same-prompt``: the first one in
every row). Arms:

``free``    no grammar, ``ignore_eos``, ``max_tokens`` per row = the tokens the ``masked`` arm's
            row produced (measured once before the rounds), so it generates as many tokens;
``masked``  the schema, ``jump_forward=False``: every token is chosen by a model step under the
            grammar's mask (the cost before the forced-token saving);
``jump``    the schema, ``jump_forward=True``: the tokens the grammar forces are taken without a
            step and fed with the row's next decode step.

Each arm has its own core (``max_batch`` = ``--batch``) kept across rounds. A run is one
``core.prefill(jobs)`` and then ``core.iterate(); core.retire()`` while rows run. Timed: the
decode phase, from the return of ``prefill`` to the last row's end; ``s_per_token`` is that
time over the tokens generated after each row's first (the first is picked from the prefill's
logits; the tokens a grammar forces right after it are fed by the first decode step, so they
count). Kept beside it: the decode time per answer and per decode step, the prefill time, the time over all tokens (``e2e_s_per_token``), decode
steps (``core.steps``), forced tokens (``Event.forced``) and tokens. Rounds are interleaved
(:func:`looptool.eval.timing.interleaved`): one untimed warm-up round, then ``--rounds``
rounds, each running every arm once in a rotated order; min / median / max per arm, and the
ratios ``masked ÷ free`` and ``jump ÷ free`` of ``s_per_token`` round by round. Targets:
``masked ÷ free`` ≤ 1.10 (the mask costs at most 10% per token), ``jump ÷ free`` < 1.0 (forced
tokens make a constrained answer cheaper per token than free text).

Also measured: compiling the schema (a fresh :class:`Grammars`: its construction, the first
compile, and a cache hit), and the grammar's own work per token without the model: over the
tokens of the first ``masked`` answer, a fresh row's ``mask`` (fill and apply the bitmask to a
``[vocab]`` float row), ``accept`` and ``forced`` (the jump-forward query), in microseconds.

Checks: every constrained answer parses as JSON and validates against the schema
(``jsonschema``); whether ``masked`` and ``jump`` wrote the same text (they may not: jump-forward
tokenizes the forced text its own way, so the model sees other tokens).

Run: python tests/bench/bench_structured.py ENGINE_DIR [--rounds 5] [--batch 1]
[--same-prompt] [--budget 0] [--threads 2] [--max-tokens 256] [--out FILE]. Prints one JSON line
(the summary) and writes the full JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from looptool.engine import open_engine
from looptool.engine.core import EngineCore, Event, Job
from looptool.engine.sampling import SamplingParams
from looptool.eval.timing import Ratio, Timing, interleaved, ratio
from looptool.serve.structured import Grammars, GrammarSpec

RESULTS = Path(__file__).resolve().parent / "results" / "bench_structured.json"
ARMS = ("free", "masked", "jump")
TARGETS = {"masked_over_free": {"max": 1.10}, "jump_over_free": {"below": 1.0}}
CAPACITY = 2048
HITS = 100  # cache hits timed
MASK_PASSES = 5  # passes over one answer's tokens for the grammar's own cost

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "plan": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "plan"],
            "additionalProperties": False,
        },
        "order_id": {"type": "integer", "minimum": 1000, "maximum": 99999},
        "category": {"enum": ["billing", "shipping", "damaged", "account", "other"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "sentiment": {"enum": ["negative", "neutral", "positive"]},
        "refund_requested": {"type": "boolean"},
        "escalate": {"type": "boolean"},
        "language": {"enum": ["en", "fr", "de", "es"]},
        "follow_up_days": {"type": "integer", "minimum": 0, "maximum": 30},
        "summary": {"type": "string", "maxLength": 60},
    },
    "required": [
        "customer",
        "order_id",
        "category",
        "items",
        "priority",
        "sentiment",
        "refund_requested",
        "escalate",
        "language",
        "follow_up_days",
        "summary",
    ],
    "additionalProperties": False,
}

MESSAGES = (
    "Hi, I'm Maria Lopez (Pro plan). Order #48213 arrived with two blue mugs (SKU MUG-BLU) broken "
    "and the teapot (SKU TEA-01) missing. I'd like a refund for the mugs please.",
    "Hello, this is Tom Becker, free account. I was charged twice for order 10457 (one lamp, SKU "
    "LMP-7). Please fix this today, it is the third time!",
    "Good morning. Aiko Tanaka here, enterprise customer. Order 77120 with 5 keyboards (SKU KB-200) "
    "has not shipped after two weeks. Can you tell me when it will arrive?",
    "Hey, Sam Okafor (Pro). I love the headphones from order 3391 (SKU HP-9, qty 1), but the "
    "case is missing. Could you send one? No rush.",
)


def prompt_text(message: str) -> str:
    """The instruction for one customer message."""
    return (
        "Read the customer's message and fill in the support ticket as JSON with the fields customer "
        "(name, plan), order_id, category, items (sku, quantity), priority, sentiment, refund_requested, "
        f"escalate, language, follow_up_days and summary.\n\nMessage: {message}\n\nTicket JSON: "
    )


def _range(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ratio_dict(r: Ratio) -> dict:
    return {"min": r.min, "median": r.median, "max": r.max, "spread": r.spread, "noisy": r.noisy, "cell": r.cell()}


class Runner:
    """One arm: its core and the record of each of its runs."""

    def __init__(self, name: str, opened, args, prompts: list[list[int]], grammars: Grammars, spec, compiled):
        self.name = name
        self.prompts = prompts
        self.args = args
        self.grammars, self.spec, self.compiled = grammars, spec, compiled
        self.core = EngineCore(
            opened.engine,
            max_batch=len(prompts),
            capacity=CAPACITY,
            eos=opened.eos,
            jump_forward=name == "jump",
        )
        self.limits = [args.max_tokens] * len(prompts)  # free: set to the masked arm's counts
        self.records: list[dict] = []

    def run(self) -> float:
        """One run of every row; records it and returns its decode seconds per token."""
        rows = len(self.prompts)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        forced = [0] * rows
        late = [0] * rows  # tokens emitted after the prefill returned
        reasons = [""] * rows
        decoding = False

        def emitter(i: int):
            def emit(event: Event) -> None:
                if event.kind == "token":
                    tokens[i].append(event.token)
                    forced[i] += event.forced
                    late[i] += decoding
                elif event.kind == "finished":
                    reasons[i] = event.reason

            return emit

        constrained = self.name != "free"
        jobs = [
            Job(
                prompt,
                self.args.budget,
                self.limits[i],
                sampling=SamplingParams(),
                constraint=self.grammars.row(self.compiled, self.spec) if constrained else None,
                ignore_eos=not constrained,
                emit=emitter(i),
            )
            for i, prompt in enumerate(self.prompts)
        ]
        core = self.core
        steps0 = core.steps
        t0 = time.perf_counter()
        core.prefill(jobs)
        t1 = time.perf_counter()
        decoding = True
        while core.rows:
            core.iterate()
            core.retire()
        t2 = time.perf_counter()
        total = sum(len(t) for t in tokens)
        counted = total - rows  # each row's first token came from the prefill's logits
        self.records.append(
            {
                "s_per_token": (t2 - t1) / counted,
                "e2e_s_per_token": (t2 - t0) / total,
                "decode_s": t2 - t1,
                "s_per_step": (t2 - t1) / max(core.steps - steps0, 1),
                "prefill_s": t1 - t0,
                "tokens": total,
                "tokens_per_row": [len(t) for t in tokens],
                "tokens_after_prefill": sum(late),
                "steps": core.steps - steps0,
                "forced": sum(forced),
                "finish": reasons,
                "ids": tokens,
            }
        )
        return (t2 - t1) / counted


def check_answers(tokenizer, ids: list[list[int]], eos: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """Each row's answer text (before its stop token) and the errors of those that do not parse
    or validate against :data:`SCHEMA`."""
    texts, errors = [], []
    for i, row in enumerate(ids):
        text = tokenizer.decode([t for t in row if t not in eos])
        texts.append(text)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as exc:
            errors.append(f"row {i}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return texts, errors


def grammar_cost(grammars: Grammars, compiled, spec, answer: list[int], vocab: int) -> dict:
    """Microseconds per token of a fresh grammar row's ``mask``, ``accept`` and ``forced`` over
    ``answer``'s tokens (``MASK_PASSES`` passes; per-token medians and per-answer sums)."""
    base = torch.randn(vocab)
    logits = torch.empty(vocab)
    mask, accept, force = [], [], []
    for _ in range(MASK_PASSES):
        row = grammars.row(compiled, spec)
        for token in answer:
            logits.copy_(base)
            t0 = time.perf_counter()
            row.mask(logits)
            t1 = time.perf_counter()
            ended = row.accept(token)
            t2 = time.perf_counter()
            if not ended:
                row.forced()
            t3 = time.perf_counter()
            mask.append(t1 - t0)
            accept.append(t2 - t1)
            if not ended:
                force.append(t3 - t2)
    n = len(answer)
    per_token = {
        "mask_us": statistics.median(mask) * 1e6,
        "accept_us": statistics.median(accept) * 1e6,
        "forced_us": statistics.median(force) * 1e6,
    }
    per_token["mask_plus_accept_us"] = per_token["mask_us"] + per_token["accept_us"]
    return {
        "tokens": n,
        "passes": MASK_PASSES,
        "median_per_token": per_token,
        "mean_per_answer_ms": {
            "mask": sum(mask) / MASK_PASSES * 1e3,
            "accept": sum(accept) / MASK_PASSES * 1e3,
            "forced": sum(force) / MASK_PASSES * 1e3,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", help="an exported looptool engine directory (SmolLM2: see tests/bench/README.md)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--same-prompt", action="store_true", help="the first message in every row")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    ap.add_argument("--max-tokens", type=int, default=256, help="limit of a constrained answer")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    opened = open_engine(args.engine, runtime="onnxruntime", threads=args.threads)
    tokenizer, vocab = opened.tokenizer, opened.engine.vocab_size
    messages = [MESSAGES[0 if args.same_prompt else i % len(MESSAGES)] for i in range(args.batch)]
    prompts = [tokenizer(prompt_text(m))["input_ids"] for m in messages]

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA, sort_keys=True), "response_format")
    t0 = time.perf_counter()
    grammars = Grammars(tokenizer, vocab, opened.eos)
    t1 = time.perf_counter()
    compiled = grammars.compile(spec)
    t2 = time.perf_counter()
    hits = []
    for _ in range(HITS):
        h0 = time.perf_counter()
        grammars.compile(spec)
        hits.append(time.perf_counter() - h0)
    compile_cost = {
        "grammars_init_s": t1 - t0,
        "compile_cold_s": t2 - t1,
        "cache_hit_us": statistics.median(hits) * 1e6,
    }
    r0 = time.perf_counter()
    for _ in range(HITS):
        grammars.row(compiled, spec)
    compile_cost["fresh_row_us"] = (time.perf_counter() - r0) / HITS * 1e6

    runners = {name: Runner(name, opened, args, prompts, grammars, spec, compiled) for name in ARMS}
    with torch.inference_mode():
        runners["masked"].run()  # the token counts the free arm generates
    probe = runners["masked"].records.pop()
    runners["free"].limits = probe["tokens_per_row"]

    timings: dict[str, Timing] = interleaved(
        {name: runner.run for name, runner in runners.items()}, repeats=args.rounds, warmup=1, measured=True
    )
    for runner in runners.values():
        runner.records = runner.records[1:]  # the warm-up round

    errors: list[str] = []
    texts: dict[str, list[list[str]]] = {"masked": [], "jump": []}
    for name in texts:
        for r, record in enumerate(runners[name].records):
            t, errs = check_answers(tokenizer, record["ids"], opened.eos)
            texts[name].append(t)
            errors += [f"{name} round {r} {e}" for e in errs]
    masked_text, jump_text = texts["masked"][0], texts["jump"][0]
    stable = {name: all(t == texts[name][0] for t in texts[name]) for name in texts}
    free_tokens = [rec["tokens_per_row"] for rec in runners["free"].records]

    cost = grammar_cost(grammars, compiled, spec, runners["masked"].records[0]["ids"][0], vocab)
    ratios = {
        "masked_over_free": ratio(timings["masked"], timings["free"]),
        "jump_over_free": ratio(timings["jump"], timings["free"]),
    }
    met = {
        "masked_over_free": ratios["masked_over_free"].median <= TARGETS["masked_over_free"]["max"],
        "jump_over_free": ratios["jump_over_free"].median < TARGETS["jump_over_free"]["below"],
    }
    arms = {}
    for name, runner in runners.items():
        recs = runner.records
        arms[name] = {
            "s_per_token": _range([r["s_per_token"] for r in recs]),
            "e2e_s_per_token": _range([r["e2e_s_per_token"] for r in recs]),
            "prefill_s": _range([r["prefill_s"] for r in recs]),
            "decode_s": _range([r["decode_s"] for r in recs]),
            "s_per_step": _range([r["s_per_step"] for r in recs]),
            "tokens": recs[0]["tokens"],
            "tokens_per_row": recs[0]["tokens_per_row"],
            "steps": recs[0]["steps"],
            "forced": recs[0]["forced"],
            "tokens_per_step": recs[0]["tokens_after_prefill"] / max(recs[0]["steps"], 1),
            "finish": recs[0]["finish"],
        }
    summary = {
        "s_per_token": {name: arms[name]["s_per_token"] for name in ARMS},
        "ratios": {k: _ratio_dict(v) for k, v in ratios.items()},
        "targets": {"masked_over_free": "<= 1.10", "jump_over_free": "< 1.0"},
        "met": met,
        "decode_s": {name: arms[name]["decode_s"] for name in ARMS},
        "s_per_step": {name: arms[name]["s_per_step"] for name in ARMS},
        "tokens": {name: arms[name]["tokens"] for name in ARMS},
        "steps": {name: arms[name]["steps"] for name in ARMS},
        "forced": {name: arms[name]["forced"] for name in ARMS},
        "compile": compile_cost,
        "grammar_per_token_us": cost["median_per_token"],
        "valid": not errors,
        "masked_equals_jump_text": masked_text == jump_text,
        "free_tokens_match": all(t == free_tokens[0] for t in free_tokens)
        and free_tokens[0] == probe["tokens_per_row"],
    }
    out = {
        "engine": str(args.engine),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "prompt_tokens": [len(p) for p in prompts],
        "schema": SCHEMA,
        "summary": summary,
        "arms": arms,
        "grammar_cost": cost,
        "answers": {"masked": masked_text, "jump": jump_text},
        "answers_stable_over_rounds": stable,
        "errors": errors,
        "rounds": [
            {name: {k: v for k, v in runners[name].records[r].items() if k != "ids"} for name in ARMS}
            | {k: ratios[k].samples[r] for k in ratios}
            for r in range(args.rounds)
        ],
        "when": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary), flush=True)
    for e in errors:
        print(f"invalid answer: {e}", flush=True)


if __name__ == "__main__":
    main()
