"""Does depth pay? Pointer chasing over single-token assignments, a base model trained
normally, then retrofit arms run through looptool's own ``convert`` and ``train``.

**Task.** Vocabulary: ``<pad> <bos> <eos> ? @``, 8 digits ``d0..d7``, 16 variables
``v0..v15`` and one token per assignment ``vI=X`` (X another variable or a digit: 368
tokens). An example is ``<bos>``, 16 shuffled assignments (every variable defined once,
chains ending in a digit), then one question:
``? vI`` → the digit at the end of vI's chain (tier t = chain hops from vI, 1–6), or
``@ vI`` → vI's own right-hand side (a direct lookup, tier 0). 19 prompt tokens, the answer
is the completion (``looptool train --format completion``: loss on the answer only).
Following a chain of t hops needs about t sequential lookups, so more depth should help.

**Base.** A 3-layer d=64 Llama trained normally (plain torch, AdamW, 10k steps) with a curriculum that
unlocks tier t+1 once tier t reaches 90% on a held-out sample; saved in the looptool cache
and reused.

**Arms** (same steps, batch, LRs, data order; tiers 1–6 and lookups mixed uniformly):
``plain`` continued training (budget 0 only); ``prefix`` retrofit (window 1:3, trained on
budgets 0,1, evaluated also at 2); ``elr-exact`` and ``elr-paper`` (recurrent block 1:2,
re-injection, adaptive delta, trained on k ∈ 1..3, evaluated also at k=4); ``untied``
(iso-depth control: layer 1 duplicated with its own weights, 4 layers, plain training);
``scratch`` (an ELR model from random weights, paper init, base + retrofit steps).

Reports accuracy per tier per budget (≥ 500 test questions per tier, standard errors),
``depth_pays`` by the benchmark's criterion (on tiers 3–6, some arm's best budget beats its
shallowest by ≥ 10 points, accuracy non-decreasing in the budget within 2 SE, and the
shallowest within 2 points of ``plain``), a JSON line, ``--out`` JSON and a PNG.

Run: python tests/bench/bench_depth.py [--steps 2500] [--arms plain,prefix,...]
[--out tests/bench/results/bench_depth.json] [--png tests/bench/results/bench_depth.png]
Recipes (``looptool train`` options): ``--arms prefix-floor,prefix-curriculum,elr-floor,elr-curriculum --merge``
(gate floor 0.5 for the first half of the steps; depth curriculum over the first half);
``--arms elr-exit,elr-exact-exit,elr-lr,elr-long,elr-all-long --merge`` (``--exit-loss 1``:
every loop exit's loss weighted like the last; loop LR 5e-2 instead of 5e-3; 4x the steps;
exit loss + depth curriculum over the first quarter + 4x the steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

DIGITS = [f"d{i}" for i in range(8)]
VARS = [f"v{i}" for i in range(16)]
SPECIAL = ["<pad>", "<bos>", "<eos>", "?", "@"]
ASSIGN = [f"{v}={x}" for v in VARS for x in VARS + DIGITS if x != v]
VOCAB = SPECIAL + DIGITS + VARS + ASSIGN
TIERS = (1, 2, 3, 4, 5, 6)
HARD = (3, 4, 5, 6)
ARMS = ("plain", "prefix", "elr-exact", "elr-paper", "untied", "scratch")
# recipes: the same arms with looptool train's depth options
RECIPES = {
    "prefix-floor": ("prefix", {"gate_floor": 0.5, "gate_floor_until": 0.5}),
    "prefix-curriculum": ("prefix", {"depth_curriculum": 0.5}),
    "elr-floor": ("elr-exact", {"gate_floor": 0.5, "gate_floor_until": 0.5}),
    "elr-curriculum": ("elr-exact", {"depth_curriculum": 0.5}),
    # intermediate-exit loss (every loop exit weighted like the last), a 10x larger loop LR,
    # 4x longer runs, and all of them together
    "elr-exit": ("elr-paper", {"exit_loss": 1.0}),
    "elr-exact-exit": ("elr-exact", {"exit_loss": 1.0}),
    "elr-lr": ("elr-paper", {"new_lr": 5e-2}),
    "elr-long": ("elr-paper", {"steps_factor": 4}),
    "elr-all-long": ("elr-paper", {"exit_loss": 1.0, "depth_curriculum": 0.25, "steps_factor": 4}),
    "plain-long": ("plain", {"steps_factor": 4}),  # the baseline of the 4x arms
    # learned exits (looptool train --exit-gate, 4x the steps) then a gate-only stage (--exit-gate-only)
    "elr-gate": ("elr-paper", {"exit_gate": True, "steps_factor": 4, "fit_steps": 2000}),
}
PLAIN = ("plain", "plain-long")
LOOPED = ("prefix", "elr-exact", "elr-paper", *(r for r in RECIPES if r not in PLAIN))


# ---------------------------------------------------------------------------- task
def example(rng: random.Random, tier: int) -> tuple[str, str]:
    """One (prompt, answer) pair; tier 0 is a direct lookup ``@ v``, tier t ≥ 1 a t-hop chase."""
    names = VARS[:]
    rng.shuffle(names)
    chains, rest = [], names
    first = rng.randint(max(tier, 1), 6)  # the first chain is long enough for the question's tier
    while rest:
        n = first if not chains else rng.randint(1, 6)
        chains.append(rest[:n])
        rest = rest[n:]
    assignments, value = [], {}
    for chain in chains:
        digit = rng.choice(DIGITS)
        for i, v in enumerate(chain):
            rhs = chain[i + 1] if i + 1 < len(chain) else digit
            assignments.append(f"{v}={rhs}")
            value[v] = rhs
    rng.shuffle(assignments)
    head = chains[0]
    if tier == 0:
        v = rng.choice(VARS)
        return " ".join(["<bos>", *assignments, "@", v]), value[v]
    v = head[len(head) - tier]  # tier hops from the chain's end digit
    answer = v
    for _ in range(tier):
        answer = value[answer]
    assert answer in DIGITS
    return " ".join(["<bos>", *assignments, "?", v]), answer


def dataset(n: int, seed: int, tiers=TIERS, lookups: float = 0.2) -> list[tuple[int, str, str]]:
    """``n`` (tier, prompt, answer) triples: tiers uniform, ``lookups`` of them tier 0."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tier = 0 if rng.random() < lookups else rng.choice(tiers)
        out.append((tier, *example(rng, tier)))
    return out


def tokenizer():
    """A word-level Hugging Face tokenizer over the task's vocabulary (saved with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def encode(tok, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiers, prompt ids [n, 19], answer ids [n])."""
    tiers = torch.tensor([t for t, _, _ in rows])
    ids = torch.tensor([tok(p, add_special_tokens=False).input_ids for _, p, _ in rows])
    answers = torch.tensor([tok.convert_tokens_to_ids(a) for _, _, a in rows])
    return tiers, ids, answers


@torch.no_grad()
def accuracy(forward, ids: torch.Tensor, answers: torch.Tensor, tiers: torch.Tensor, batch: int = 500) -> dict:
    """Per tier: accuracy and its standard error (greedy answer at the last prompt position)."""
    hits = torch.cat(
        [forward(ids[i : i + batch])[:, -1].argmax(-1) == answers[i : i + batch] for i in range(0, len(ids), batch)]
    )
    out = {}
    for t in sorted(set(tiers.tolist())):
        h = hits[tiers == t].float()
        p = h.mean().item()
        out[str(t)] = {"acc": p, "se": math.sqrt(max(p * (1 - p), 1e-12) / len(h)), "n": len(h)}
    return out


# ---------------------------------------------------------------------------- base model
def base_config(layers: int = 3):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def train_base(steps: int, batch: int, lr: float, seed: int, log=print):
    """A 3-layer Llama trained normally on the task with a tier curriculum (≥ 90% unlocks
    the next tier, checked every 250 steps on 200 held-out questions per tier)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tok = tokenizer()
    model = LlamaForCausalLM(base_config())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    unlocked = 1
    val = encode(tok, dataset(200 * len(TIERS), seed + 999, lookups=0.0))
    rng = random.Random(seed)
    history = []
    for step in range(steps):
        rows = [
            (t, *example(rng, t)) for t in (0 if rng.random() < 0.2 else rng.randint(1, unlocked) for _ in range(batch))
        ]
        _, ids, answers = encode(tok, rows)
        logits = model(ids).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 250 == 0:
            model.eval()
            acc = accuracy(lambda x: model(x).logits, val[1], val[2], val[0])
            model.train()
            history.append({"step": step + 1, "unlocked": unlocked, "acc": {t: a["acc"] for t, a in acc.items()}})
            log(f"base step {step + 1}: loss {loss.item():.3f}, tiers ≤ {unlocked}, acc {history[-1]['acc']}")
            while unlocked < len(TIERS) and acc[str(unlocked)]["acc"] >= 0.9:
                unlocked += 1
    model.eval()
    return model, tok, history


# ---------------------------------------------------------------------------- arms
def untie(model):
    """The iso-depth control: layer 1 duplicated with its own (copied) weights."""
    import copy

    from transformers import LlamaForCausalLM

    cfg = base_config(len(model.model.layers) + 1)
    out = LlamaForCausalLM(cfg)
    layers = list(model.model.layers)
    order = layers[:2] + [copy.deepcopy(layers[1])] + layers[2:]
    state = {k: v for k, v in model.state_dict().items() if ".layers." not in k}
    for i, layer in enumerate(order):
        state.update({f"model.layers.{i}.{k}": v for k, v in layer.state_dict().items()})
    out.load_state_dict(state)
    for i, layer in enumerate(out.model.layers):
        layer.self_attn.layer_idx = i
    return out.eval()


def arm_setup(arm: str, base):
    """(source model, plan, trained budget menu, extra TrainConfig settings) of an arm."""
    if arm in RECIPES:
        parent, extra = RECIPES[arm]
        return (*arm_setup(parent, base)[:3], extra)
    return (*_arm_setup(arm, base), {})


def _arm_setup(arm: str, base):
    import looptool

    if arm == "plain":
        return base, looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), [0]
    if arm == "prefix":
        return base, looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), [0, 1]
    if arm in ("elr-exact", "elr-paper"):
        init = arm.split("-")[1]
        return base, looptool.RecurrentLoop(recurrent=(1, 2), max_loops=4, init=init, reinject=True), [1, 2, 3]
    if arm == "untied":
        return untie(base), looptool.PrefixLoop(window=(1, 2), budgets=(0,)), [0]
    if arm == "scratch":
        from transformers import LlamaForCausalLM

        torch.manual_seed(1)
        return (
            LlamaForCausalLM(base_config()).eval(),
            looptool.RecurrentLoop(recurrent=(1, 2), max_loops=4, init="paper"),
            [1, 2, 3],
        )
    raise ValueError(arm)


def run_arm(
    arm: str, base_dir: str, data: str, test: tuple, steps: int, batch: int, lr: float, new_lr: float, seed: int
) -> dict:
    """Convert, train with ``looptool.train.trainer.Trainer`` (completion format), evaluate every budget."""
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    import looptool
    from looptool.train.trainer import TrainConfig, Trainer

    base = LlamaForCausalLM.from_pretrained(base_dir).eval()
    tok = tokenizer()
    source, plan, menu, extra = arm_setup(arm, base)
    model = looptool.convert(source, plan, tokenizer=tok)
    work = Path(tempfile.mkdtemp(prefix=f"depth-{arm}-"))
    model.save_pretrained(work / "converted")
    options = dict(extra)
    # from scratch gets the base's steps too (roughly); a recipe may scale the steps or set the loop LR
    arm_steps = steps * (2 if arm == "scratch" else 1) * options.pop("steps_factor", 1)
    new_lr = options.pop("new_lr", new_lr)
    fit_steps = options.pop("fit_steps", 0)
    cfg = TrainConfig(
        data=[data],
        output=str(work / "trained"),
        tokens=arm_steps * batch * 21,
        seq_len=21,
        batch=batch,
        lr=lr,
        new_lr=new_lr,
        warmup=0.05,
        weight_decay=0.1,
        seed=seed,
        budgets=menu,
        format="completion",
        device="cpu",
        **options,
    )
    t0 = time.perf_counter()
    Trainer(work / "converted", cfg).run()
    if fit_steps:  # the gate-only stage: the loops frozen, each exit fitted to the next loop's gain
        fit = dataclasses.replace(
            cfg, output=str(work / "fitted"), tokens=fit_steps * batch * 21, exit_gate=False, exit_gate_only=True
        )
        Trainer(work / "trained", fit).run()
        (work / "trained").rename(work / "joint")
        (work / "fitted").rename(work / "trained")
    seconds = time.perf_counter() - t0
    trained = looptool.load(work / "trained")
    tiers, ids, answers = test
    per_budget = {}
    for k in trained.budgets:
        per_budget[str(k)] = accuracy(lambda x, k=k: trained(x, budget=k).logits, ids, answers, tiers)
    gates = {n: float(p.abs().max()) for n, p in trained.new_parameters()}
    return {
        "arm": arm,
        "plan": plan.to_dict() if hasattr(plan, "to_dict") else str(plan),
        "menu": menu,
        "recipe": extra,
        "steps": arm_steps,
        "fit_steps": fit_steps,
        "train_seconds": seconds,
        "accuracy": per_budget,
        "max_abs_new_param": max(gates.values()) if gates else None,
    }


def hard_mean(acc: dict) -> tuple[float, float]:
    """Mean accuracy over the hard tiers and its standard error."""
    xs = [acc[str(t)] for t in HARD]
    return sum(a["acc"] for a in xs) / len(xs), math.sqrt(sum(a["se"] ** 2 for a in xs)) / len(xs)


def depth_pays(results: dict) -> dict:
    """The depth-pays criterion, per looped arm, and overall."""
    # the shallowest budget is compared with plain continued training of the same length
    plain = {results[a]["steps"]: hard_mean(results[a]["accuracy"]["0"])[0] for a in PLAIN if a in results}
    verdict = {}
    for arm in LOOPED:
        if arm not in results:
            continue
        acc = results[arm]["accuracy"]
        budgets = sorted(acc, key=int)
        means = [hard_mean(acc[b]) for b in budgets]
        shallow = means[0][0]
        best = max(m for m, _ in means)
        monotone = all(
            means[i + 1][0] >= means[i][0] - 2 * math.hypot(means[i][1], means[i + 1][1]) for i in range(len(means) - 1)
        )
        reference = plain.get(results[arm]["steps"])
        near_plain = reference is not None and abs(shallow - reference) <= 0.02
        verdict[arm] = {
            "hard_by_budget": dict(zip(budgets, [round(m, 4) for m, _ in means])),
            "gain_points": round(100 * (best - shallow), 2),
            "monotone": monotone,
            "plain_hard": None if reference is None else round(reference, 4),
            "near_plain": near_plain,
            "pays": best - shallow >= 0.10 and monotone and near_plain,
        }
    verdict["depth_pays"] = any(v["pays"] for v in verdict.values() if isinstance(v, dict))
    return verdict


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in (*ARMS, *RECIPES) if a in results]
    cols = min(5, len(arms))
    rows = -(-len(arms) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(arms) :]:
        ax.axis("off")
    for ax, arm in zip(axes.flat, arms):
        menu = results[arm]["menu"]
        for b, acc in sorted(results[arm]["accuracy"].items(), key=lambda kv: int(kv[0])):
            ys = [acc[str(t)]["acc"] for t in TIERS]
            errs = [2 * acc[str(t)]["se"] for t in TIERS]
            style = "-" if int(b) in menu else "--"
            ax.errorbar(TIERS, ys, yerr=errs, linestyle=style, marker="o", ms=3, label=f"budget {b}")
        ax.set_title(arm)
        ax.set_xlabel("hops (tier)")
        ax.axhline(1 / 8, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("accuracy (±2 SE)")
    fig.suptitle(
        "pointer chasing: accuracy per hop count and budget (dashed: budget outside the trained menu)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2500, help="retrofit steps per arm")
    parser.add_argument("--base-steps", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--new-lr", type=float, default=5e-3)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--train-examples", type=int, default=60_000)
    parser.add_argument("--test-per-tier", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--merge", action="store_true", help="keep the arms already in --out (same settings)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, args.workers)))
    from looptool.cache import root as cache_root

    base_dir = cache_root() / f"depth-base-{args.base_steps}-{args.batch}-{args.seed}"
    tok = tokenizer()
    if not (base_dir / "config.json").exists():
        t0 = time.perf_counter()
        model, tok, history = train_base(args.base_steps, args.batch, 1e-3, args.seed)
        model.save_pretrained(base_dir)
        (base_dir / "history.json").write_text(json.dumps({"seconds": time.perf_counter() - t0, "history": history}))
    base_info = json.loads((base_dir / "history.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="depth-data-"))
    data = work / "train.jsonl"
    with data.open("w") as f:
        for _, prompt, answer in dataset(args.train_examples, args.seed + 1):
            f.write(json.dumps({"prompt": prompt, "completion": answer}) + "\n")
    test_rows = [
        row
        for t in TIERS
        for row in [(t, *example(random.Random(f"test:{args.seed}:{t}:{i}"), t)) for i in range(args.test_per_tier)]
    ]
    test = encode(tok, test_rows)
    arms = [a for a in args.arms.split(",") if a]
    jobs = [(a, str(base_dir), str(data), test, args.steps, args.batch, args.lr, args.new_lr, args.seed) for a in arms]
    if args.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.workers) as pool:
            done = pool.starmap(run_arm, jobs)
    else:
        done = [run_arm(*job) for job in jobs]
    results = {r["arm"]: r for r in done}
    if args.merge and args.out and Path(args.out).exists():
        results = {**json.loads(Path(args.out).read_text())["arms"], **results}
        args.arms = ",".join(results)
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir).eval()
    summary = {
        "task": "pointer chasing, 16 single-token assignments, tiers 1-6 hops",
        "base": {
            "steps": args.base_steps,
            "seconds": base_info["seconds"],
            "accuracy": accuracy(lambda x: base(x).logits, test[1], test[2], test[0]),
        },
        "settings": vars(args),
        "arms": results,
        "verdict": depth_pays(results),
    }
    summary["depth_pays"] = summary["verdict"]["depth_pays"]
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    if args.png:
        plot(results, Path(args.png))


if __name__ == "__main__":
    main()
