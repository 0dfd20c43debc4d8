"""Post-training at every budget on SmolLM2-135M, on a CPU: chat SFT, two RL experts,
parameter-group merging, budget-matched multi-teacher distillation.

Run: python examples/posttrain.py [OUT_DIR] [--steps-rl 12] [--smoke]
(about 25 minutes on 2 CPU cores; ``--smoke`` checks the pipeline on a tiny random model in about a minute).

Two generated tasks, no downloads at run time:
* ``add``: "What is 23 + 45? Reply with the number only." → "68" (reward: ``numeric``);
* ``caps``: "Write the word 'apple' in capital letters. Reply with the word only." → "APPLE"
  (reward: :func:`caps_reward` below, a user-defined reward — ``--reward examples/posttrain.py:caps_reward``).

Stages, each the Python API of a ``looptool`` command:
1. convert (``looptool convert smollm2 --mode prefix --window 8:20 --budgets 0,6,12``);
2. chat SFT on both tasks (``looptool train --format chat``, mixed depth);
3. one GRPO expert per task from the SFT model (``looptool rl --reward ...``);
4. task arithmetic of the experts onto the SFT model (``looptool merge SFT ADD CAPS --lambda 1``);
5. on-policy distillation of the merged model from both experts at the student's budget
   (``looptool distill MERGED --teacher add=ADD --teacher caps=CAPS``).
Prints (and writes ``results.json``) the greedy accuracy of every stage at every budget on
held-out prompts, and each RL run's reward per budget over its steps.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import torch

import looptool
from looptool.posttrain.distill import DistillConfig, Distiller
from looptool.posttrain.merge import merge, parse_lambdas
from looptool.posttrain.rewards import numeric
from looptool.posttrain.rl import GRPO, RLConfig
from looptool.posttrain.rollout import encode_prompt
from looptool.train.trainer import TrainConfig, Trainer

WORDS = (
    "apple river stone cloud tiger piano garden silver candle forest planet window "
    "orange bridge rocket castle pencil island marble shadow winter summer dragon yellow "
    "basket mirror button jacket ladder pepper"
).split()


def caps_reward(prompt: str, completion: str, example: dict) -> float:
    """1 when the completion, without quotes and final punctuation, is the answer word."""
    return float(re.sub(r"^[\"'\s]+|[\"'.!\s]+$", "", completion) == example["answer"])


def task_records(task: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(f"{task}:{seed}")
    out = []
    for _ in range(n):
        if task == "add":
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            out.append(
                {"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b), "domain": "add"}
            )
        else:
            w = rng.choice(WORDS)
            out.append(
                {
                    "prompt": f"Write the word '{w}' in capital letters. Reply with the word only.",
                    "answer": w.upper(),
                    "domain": "caps",
                }
            )
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@torch.no_grad()
def accuracy(model_dir: Path, tests: dict[str, list[dict]], max_new_tokens: int) -> dict:
    """Greedy accuracy per task per budget (chat-rendered prompts, cached decode)."""
    model = looptool.load(model_dir)
    tok = model.tokenizer
    rewards = {"add": numeric, "caps": caps_reward}
    out = {}
    for k in model.budgets:
        row = {}
        for task, records in tests.items():
            ids = [encode_prompt(tok, r, chat=True) for r in records]
            width = max(map(len, ids))
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            batch = torch.full((len(ids), width), pad)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for i, x in enumerate(ids):
                batch[i, width - len(x) :], mask[i, width - len(x) :] = torch.tensor(x), 1
            seqs = model.generate(
                batch,
                attention_mask=mask,
                budget=k,
                max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=pad,
            )
            texts = tok.batch_decode(seqs[:, width:], skip_special_tokens=True)
            row[task] = sum(rewards[task](r["prompt"], t, r) for r, t in zip(records, texts)) / len(records)
        out[str(k)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--steps-sft", type=int, default=30)
    ap.add_argument("--steps-rl", type=int, default=8)
    ap.add_argument("--steps-distill", type=int, default=6)
    ap.add_argument("--test", type=int, default=24, help="held-out prompts per task")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny random model, 1 step per stage, first and last stage evaluated: checks the pipeline",
    )
    args = ap.parse_args()
    small = 2 if args.smoke else None  # smoke: 1 step per stage, 2 prompts, 2 rollouts
    if args.smoke:
        args.steps_sft = args.steps_rl = args.steps_distill = 1
        args.test = 2
    out = Path(args.out or tempfile.mkdtemp(prefix="posttrain_"))
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if args.smoke:
        from looptool.testing import byte_tokenizer, tiny_model

        tok = byte_tokenizer()
        tok.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        model = looptool.convert(
            tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), tokenizer=tok
        )
    else:
        model = looptool.convert("smollm2", looptool.PrefixLoop(window=(8, 20), budgets=(0, 6, 12)))
    model.save_pretrained(out / "converted", overwrite=True)
    del model

    train = {t: task_records(t, 200, 0) for t in ("add", "caps")}
    tests = {t: task_records(t, args.test, 1) for t in ("add", "caps")}
    sft_data = write_jsonl(
        out / "sft.jsonl",
        [
            {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in train["add"][:100] + train["caps"][:100]
        ],
    )
    Trainer(
        out / "converted",
        TrainConfig(
            data=[str(sft_data)],
            output=str(out / "sft"),
            format="chat",
            seq_len=160 if args.smoke else 96,
            batch=small or 4,
            tokens=args.steps_sft * (small or 4) * (160 if args.smoke else 96),
            lr=2e-5,
            new_lr=1e-3,
            warmup=0.1,
            freeze_below_window=True,
            device="cpu",
        ),
        on_step=lambda rec: print(
            f"sft step {rec['step'] + 1}: budget {rec['budgets'][0]} loss {rec['loss'][0]:.3f}", flush=True
        ),
    ).run()

    rl_logs = {}
    for task, reward in (("add", "numeric"), ("caps", f"{__file__}:caps_reward")):
        data = write_jsonl(out / f"rl_{task}.jsonl", train[task][100:])
        runner = GRPO(
            out / "sft",
            RLConfig(
                data=[str(data)],
                output=str(out / f"expert_{task}"),
                reward=reward,
                steps=args.steps_rl,
                prompts=small or 6,
                rollouts=small or 4,
                ratio=[1, 1, 1],
                lr=1e-5,
                new_lr=1e-3,
                max_new_tokens=8,
                chat=True,
                device="cpu",
                overwrite=True,
            ),
        )
        runner.on_step = lambda rec, task=task: print(
            f"rl {task} step {rec['step'] + 1}: reward per budget",
            {k: round(b["reward"], 2) for k, b in rec["budgets"].items()},
            flush=True,
        )
        rl_logs[task] = runner.run()

    sft = looptool.load(out / "sft")
    experts = [looptool.load(out / "expert_add"), looptool.load(out / "expert_caps")]
    merge(sft, experts, parse_lambdas(["1"], 2)).save_pretrained(out / "merged", overwrite=True)
    mix = write_jsonl(out / "distill.jsonl", train["add"][100:] + train["caps"][100:])
    Distiller(
        out / "merged",
        DistillConfig(
            data=[str(mix)],
            teachers={"add": str(out / "expert_add"), "caps": str(out / "expert_caps")},
            output=str(out / "distilled"),
            steps=args.steps_distill,
            prompts=small or 4,
            lr=1e-5,
            new_lr=1e-3,
            max_new_tokens=8,
            chat=True,
            device="cpu",
            overwrite=True,
        ),
    ).run()

    stages = ["converted", "sft", "expert_add", "expert_caps", "merged", "distilled"]
    if args.smoke:  # the pipeline check: the first and the last model
        stages = ["converted", "distilled"]
    table = {}
    for stage in stages:
        table[stage] = accuracy(out / stage, tests, 8)
        print(stage, table[stage], flush=True)
    result = {"accuracy": table, "rl_reward": rl_logs, "seconds": time.perf_counter() - t_start, "settings": vars(args)}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    budgets = list(table["converted"])
    print(f"{'stage':<12}" + "".join(f"{'k=' + k + ' add':>12}{'k=' + k + ' caps':>12}" for k in budgets))
    for s in stages:
        print(f"{s:<12}" + "".join(f"{table[s][k]['add']:>12.2f}{table[s][k]['caps']:>12.2f}" for k in budgets))
    print(f"({result['seconds']:.0f} s; everything in {out})")


if __name__ == "__main__":
    main()
