"""Depth on a sequential task: 5-digit addition after a short mixed-depth retrofit.

SmolLM2-135M, fixed-prefix looping (window 8:20, budgets 0,3,6,9,12), trained with mixed
depth on ``a+b=c`` lines (two random 5-digit numbers), against (b) the same source
fine-tuned plainly on the same tokens with the same optimizer and (c) the untrained
source. Evaluated on held-out problems by greedy exact match of the sum, generated with
looptool's cached decoding at every budget (per-loop KV). Reports accuracy with its
binomial standard error per budget. It reruns, through looptool's trainer and generator, an earlier
throwaway probe of the same task (README, "Results").

Run: python tests/bench/bench_addition.py [--steps 200] [--test 300] [--out DIR].
Prints one JSON line and writes bench_addition.json into the output directory.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import looptool
from looptool.capture.sources import load_source
from looptool.runtime.generation import generate
from looptool.train.trainer import TrainConfig, Trainer


def problems(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct ``("a+b=", "c")`` pairs of 5-digit operands."""
    rng = random.Random(seed)
    out: dict[str, str] = {}
    while len(out) < n:
        a, b = rng.randrange(10_000, 100_000), rng.randrange(10_000, 100_000)
        out[f"{a}+{b}="] = str(a + b)
    return list(out.items())


def accuracy(run_generate, tokenizer, test: list[tuple[str, str]], batch: int = 50) -> float:
    """Greedy exact-match accuracy of ``run_generate(ids, mask) -> sequences`` on ``test``."""
    tokenizer.padding_side = "left"
    correct = 0
    for i in range(0, len(test), batch):
        chunk = test[i : i + batch]
        enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True)
        seqs = run_generate(enc["input_ids"], enc["attention_mask"])
        texts = tokenizer.batch_decode(seqs[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(t.split("\n")[0].strip() == answer for t, (_, answer) in zip(texts, chunk))
    return correct / len(test)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--new-lr", type=float, default=1e-2)
    ap.add_argument("--override", type=float, default=0.0)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_addition_"))
    work.mkdir(parents=True, exist_ok=True)
    tokens = args.steps * args.seq_len * args.batch
    all_problems = problems(args.test + tokens // 8, seed=0)  # ~18 tokens a line: enough never to repeat
    test, train = all_problems[: args.test], all_problems[args.test :]
    (work / "train.txt").write_text("".join(f"{p}{a}\n" for p, a in train))
    src = load_source("smollm2")
    tok = src.tokenizer
    new = 7  # a 5-digit sum has 5 or 6 digits, then the newline
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def hf_generate(model):
        return lambda ids, mask: model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad
        )

    t0 = time.perf_counter()
    source_acc = accuracy(hf_generate(src.model), tok, test)
    plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
    looped = looptool.convert(src.model, plan, tokenizer=tok)
    if not (work / "converted").exists():
        looped.save_pretrained(work / "converted")
    del looped, src
    common = dict(
        data=[str(work / "train.txt")],
        tokens=tokens,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        new_lr=args.new_lr,
        warmup=0.05,
        freeze_below_window=True,
        seed=0,
    )
    for name, extra in (("mixed", {"override": args.override}), ("plain", {"budgets": [0]})):
        out = work / name
        Trainer(work / "converted", TrainConfig(output=str(out), resume=out.exists(), **common, **extra)).run()

    def looped_generate(model, budget):
        def run(ids, mask):
            return generate(
                model, ids, attention_mask=mask, budget=budget, max_new_tokens=new, pad_token_id=pad
            ).sequences

        return run

    mixed, plain = looptool.load(work / "mixed"), looptool.load(work / "plain")
    n = len(test)
    rows = []
    for k in mixed.budgets:
        acc = accuracy(looped_generate(mixed, k), tok, test)
        rows.append({"budget": k, "accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n)})
    plain_acc = accuracy(looped_generate(plain, 0), tok, test)
    result = {
        "bench": "addition",
        "model": "SmolLM2-135M-Instruct",
        "train_tokens": tokens,
        "test_problems": n,
        "settings": vars(args),
        "source_accuracy": source_acc,
        "plain_finetune_accuracy": plain_acc,
        "plain_stderr": math.sqrt(plain_acc * (1 - plain_acc) / n),
        "mixed": rows,
        "wall_s": time.perf_counter() - t0,
    }
    (work / "bench_addition.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
