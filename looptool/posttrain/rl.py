"""``looptool rl``: reinforcement learning from verifiable rewards with GRPO at every budget.

The recipe of ELR's post-training (appendix "Post-training"), each setting an
option of :class:`RLConfig`:

* every step draws ``prompts`` prompts and samples ``rollouts`` (16) completions of each,
  all rollouts of a prompt at the *same* loop count;
* prompts are split across the budget menu by ``ratio`` (4:1:1:1 over k = 1..4); with the
  pass-rate ``curriculum`` the prompts the model solves least often go to the deepest
  budgets (:func:`looptool.train.sampling.assign_budgets`);
* the advantage of rollout ``i`` of a prompt is its reward minus the leave-one-out mean of
  the prompt's other rewards, divided by the standard deviation of the prompt's rewards
  (reward normalisation; :func:`leave_one_out_advantages`);
* the loss is token-level (summed over every completion token of the step, divided by their
  number), with no KL term;
* sampler/trainer mismatch: each token's policy-gradient term is weighted by the truncated
  importance weight ``clip(p_train / p_sample, 0.2, 5)`` (detached), and a rollout whose
  sampling and training probabilities differ by more than 2x on average (geometric mean of
  the per-token ratio outside [1/2, 2]) is masked out (:func:`grpo_loss`).

One optimizer step per batch of rollouts (on-policy). Why not TRL's ``GRPOTrainer``: it
samples through ``model.generate`` with one model configuration per batch, so it cannot give
each prompt its own loop count, and it computes advantages over its own group layout; the
per-prompt budget assignment, the pass-rate curriculum and the cached looped decode are the
point here, so the loop is written out (about 150 lines) on top of looptool's own generation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.posttrain.rewards import load_reward, score
from looptool.posttrain.rollout import (
    PostTrainingRun,
    RunSettings,
    encode_prompt,
    prompt_batch,
    prompt_text,
    read_prompts,
    sample,
    token_logprobs,
)
from looptool.train.sampling import assign_budgets

LOG_FILE = "rl_log.jsonl"
ARGS_FILE = "rl_args.json"


class RLError(LooptoolError):
    """RL cannot run with these settings."""


@dataclass(kw_only=True)
class RLConfig(RunSettings):
    """Settings of one ``looptool rl`` run (the CLI's options)."""

    reward: str = "exact_match"  # built-in name, module:function or file.py:function
    rollouts: int = 16  # rollouts per prompt, all at the prompt's budget
    ratio: list[float] | None = None  # prompt split over the menu (default 4:1:...:1)
    curriculum: bool = True  # route the prompts with the lowest pass rate to the deepest budgets
    pass_threshold: float = 1.0  # a rollout passes when its reward is at least this
    normalize: bool = True  # divide advantages by the prompt's reward standard deviation
    is_clip: tuple[float, float] = (0.2, 5.0)  # truncated importance weight range
    max_mismatch: float = 2.0  # mask rollouts whose average sampling/training ratio leaves [1/x, x]
    lr: float = 1e-6

    def check(self) -> None:
        """Refuse settings that cannot work, one sentence each."""
        for name in ("steps", "prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise RLError(f"{name} must be at least 1.", parameter=name)
        if self.rollouts < 2:
            raise RLError(
                "rollouts must be at least 2: the leave-one-out baseline needs another rollout of the prompt.",
                parameter="rollouts",
            )
        lo, hi = self.is_clip
        if not 0 < lo <= 1 <= hi:
            raise RLError(f"is_clip ({lo}, {hi}) must satisfy 0 < low ≤ 1 ≤ high.", parameter="is_clip")
        if self.max_mismatch < 1:
            raise RLError(
                "max_mismatch is a ratio ≥ 1 (2: mask rollouts off by more than 2x on average).",
                parameter="max_mismatch",
            )
        if self.temperature <= 0:
            raise RLError("temperature must be positive: GRPO samples its rollouts.", parameter="temperature")
        if self.lr <= 0 or (self.new_lr is not None and self.new_lr <= 0):
            raise RLError("learning rates must be positive.")


def leave_one_out_advantages(rewards: torch.Tensor, normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = r_i - mean_{j != i} r_j`` over the rollouts of one prompt (the last dim), divided
    by the rewards' standard deviation (population) plus ``eps`` when ``normalize``."""
    g = rewards.shape[-1]
    baseline = (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)
    adv = rewards - baseline
    if normalize:
        adv = adv / (rewards.std(-1, unbiased=False, keepdim=True) + eps)
    return adv


def grpo_loss(
    logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    is_clip: tuple[float, float] = (0.2, 5.0),
    max_mismatch: float = 2.0,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """The token-level GRPO loss of some rollouts (no KL term).

    ``logprobs`` (differentiable), ``sample_logprobs`` and ``mask`` are ``[rows, T]``;
    ``advantages`` is ``[rows]``. Per token the term is ``-w_t A log p_t`` with
    ``w_t = clip(exp(log p_t - log q_t), *is_clip)`` detached; rows whose mean log-ratio
    over their tokens exceeds ``log(max_mismatch)`` in magnitude are dropped. The sum is
    divided by ``normalizer`` (default: the number of completion tokens in ``mask``).
    Returns the loss and ``{"masked": rows dropped, "mean_weight": mean w over kept tokens}``.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs.detach() - sample_logprobs) * mask
    weights = torch.exp(log_ratio).clamp(*is_clip)
    tokens = mask.sum(-1)
    mean_log_ratio = log_ratio.sum(-1) / tokens.clamp(min=1)
    keep = (mean_log_ratio.abs() <= math.log(max_mismatch)) & (tokens > 0)
    kept = mask * keep[:, None].to(mask.dtype)
    total = float(mask.sum()) if normalizer is None else normalizer
    loss = -(weights * advantages[:, None] * logprobs * kept).sum() / max(total, 1.0)
    stats = {
        "masked": int((~keep & (tokens > 0)).sum()),
        "mean_weight": float((weights * kept).sum() / kept.sum().clamp(min=1)),
    }
    return loss, stats


class GRPO(PostTrainingRun):
    """Runs an :class:`RLConfig` on a looped model directory (:meth:`run`: the steps, with
    checkpoints of the model, ``rl_args.json``, ``rl_log.jsonl`` and the run's state; the
    pass rates of the curriculum are part of that state)."""

    args_file, log_file = ARGS_FILE, LOG_FILE

    def __init__(
        self, model_dir: str | Path, config: RLConfig, *, tokenizer=None, on_step: Callable[[dict], None] | None = None
    ):
        self._start(model_dir, config, tokenizer, on_step)
        self.menu = tuple(sorted(config.budgets or self.model.budgets))
        for k in self.menu:
            self.model.check_budget(k)
        self.ratio = list(config.ratio) if config.ratio else [4.0] + [1.0] * (len(self.menu) - 1)
        if len(self.ratio) != len(self.menu):
            raise RLError(
                f"ratio has {counted(len(self.ratio), 'weight')} for the {counted(len(self.menu), 'budget')} {list(self.menu)}.",
                parameter="ratio",
            )
        self.reward_fn = load_reward(config.reward)
        self.records = read_prompts(config.data)
        self.prompts = [encode_prompt(self.tokenizer, r, config.chat) for r in self.records]
        self.pass_rates: list[float | None] = [None] * len(self.records)
        self._begin()

    def extra_state(self) -> dict:
        """The curriculum's pass rate of every prompt (None: not sampled yet)."""
        return {"pass_rates": list(self.pass_rates)}

    def load_extra_state(self, state: dict) -> None:
        """Restore the curriculum's pass rates."""
        self.pass_rates = list(state["pass_rates"])

    def step(self, step: int) -> dict:
        """One GRPO step: sample, score, one optimizer update. Returns the log record."""
        cfg = self.config
        t0 = time.perf_counter()
        batch = prompt_batch(len(self.records), cfg.prompts, step, cfg.seed)
        rates = [self.pass_rates[i] for i in batch] if cfg.curriculum else None
        budgets = assign_budgets(self.menu, self.ratio, len(batch), pass_rates=rates, key=f"{cfg.seed}:{step}")
        self.model.eval()
        groups = []
        for k in self.menu:
            chosen = [i for i, b in zip(batch, budgets) if b == k]
            if not chosen:
                continue
            ro = sample(
                self.model,
                self.tokenizer,
                [self.prompts[i] for i in chosen],
                budget=k,
                n=cfg.rollouts,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                seed=cfg.seed * 1_000_003 + step * 101 + k,
                kv=cfg.kv,
            )
            rewards = torch.tensor(
                [
                    score(self.reward_fn, prompt_text(self.records[chosen[j]]), c, self.records[chosen[j]])
                    for j, c in zip(ro.prompt_index, ro.completions)
                ]
            ).view(len(chosen), cfg.rollouts)
            for j, i in enumerate(chosen):
                self.pass_rates[i] = float((rewards[j] >= cfg.pass_threshold).float().mean())
            groups.append((k, chosen, ro, rewards))
        self.model.train()
        total_tokens = sum(ro.tokens for _, _, ro, _ in groups)
        loss_sum, masked, by_budget = 0.0, 0, {}
        for k, chosen, ro, rewards in groups:
            adv = leave_one_out_advantages(rewards, cfg.normalize).flatten().to(self.device)
            logp = token_logprobs(self.model, ro.ids, k, cfg.temperature)
            loss, stats = grpo_loss(
                logp,
                ro.sample_logprobs.to(self.device),
                ro.mask.to(self.device),
                adv,
                is_clip=cfg.is_clip,
                max_mismatch=cfg.max_mismatch,
                normalizer=total_tokens,
            )
            loss.backward()
            loss_sum += loss.item()
            masked += stats["masked"]
            by_budget[str(k)] = {
                "prompts": len(chosen),
                "reward": float(rewards.mean()),
                "pass_rate": float((rewards >= cfg.pass_threshold).float().mean()),
                "mean_tokens": ro.tokens / len(ro.completions),
            }
        self._update()
        record = {
            "step": step,
            "loss": loss_sum,
            "budgets": by_budget,
            "masked_rollouts": masked,
            "tokens": total_tokens,
            "seconds": time.perf_counter() - t0,
        }
        return record

    def summary(self) -> dict:
        """Reward and pass rate per budget, first vs last quarter of the steps."""
        return summarize(self.history, self.menu)


def summarize(history: list[dict], menu) -> dict:
    """Reward and pass rate per budget over the first and the last quarter of the steps."""
    quarter = max(1, len(history) // 4)

    def mean(records, k, key):
        xs = [r["budgets"][str(k)][key] for r in records if str(k) in r["budgets"]]
        return sum(xs) / len(xs) if xs else None

    return {
        str(k): {
            "reward_first": mean(history[:quarter], k, "reward"),
            "reward_last": mean(history[-quarter:], k, "reward"),
            "pass_first": mean(history[:quarter], k, "pass_rate"),
            "pass_last": mean(history[-quarter:], k, "pass_rate"),
        }
        for k in menu
    }
