"""``looptool distill``: budget-matched multi-teacher on-policy distillation (MOPD).

Accordion's last post-training stage (section "Training Pipeline"): the student samples
completions of each prompt at a budget drawn as in training (the mixed-depth sampler, with
the shallowest-budget override), each prompt's teacher is chosen by the prompt's ``domain``
field and run *at the same budget* on the student's own samples, and the student minimises
the per-token reverse KL ``KL(p_student || p_teacher)`` over the completion tokens, summed
over the whole vocabulary (exact, no sampled estimate):
``L = (1 / N) sum_t sum_v p_s(v | x_<t) (log p_s(v | x_<t) - log p_t(v | x_<t))``.
A teacher equal to the student gives zero loss and zero gradient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from looptool.core.errors import LooptoolError
from looptool.posttrain.rollout import PostTrainingRun, RunSettings, encode_prompt, prompt_batch, read_prompts, sample
from looptool.runtime.convert import load
from looptool.runtime.model import LoopedModel
from looptool.train.sampling import BudgetSampler

LOG_FILE = "distill_log.jsonl"
ARGS_FILE = "distill_args.json"


class DistillError(LooptoolError):
    """Distillation cannot run with these teachers, data or settings."""


@dataclass(kw_only=True)
class DistillConfig(RunSettings):
    """Settings of one ``looptool distill`` run (the CLI's options)."""

    teachers: dict[str, str]  # domain -> looped model directory
    override: float = 0.0  # shallowest-budget override fraction, as in training

    def check(self) -> None:
        """Refuse settings that cannot work, one sentence each."""
        for name in ("steps", "prompts", "rollouts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise DistillError(f"{name} must be at least 1.", parameter=name)
        if not self.teachers:
            raise DistillError(
                "distillation needs at least one teacher: teachers={DOMAIN: PATH}.", parameter="teachers"
            )
        if self.temperature <= 0:
            raise DistillError(
                "temperature must be positive: the student samples its rollouts.", parameter="temperature"
            )


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over completion tokens of ``KL(p_s || p_t)`` at the positions predicting them.

    Logits are ``[rows, T, vocab]`` over the whole sequence; ``mask [rows, T]`` is 1 on the
    completion tokens (position ``t`` is predicted by logits ``t - 1``)."""
    ls = torch.log_softmax(student_logits[:, :-1].float(), -1)
    lt = torch.log_softmax(teacher_logits[:, :-1].float(), -1)
    # grad KL = sum_v (ls_v - lt_v) grad p_v (the term sum_v p_v grad ls_v = grad sum_v p_v is 0):
    # detaching the log-ratio gives exactly that gradient, and an exact 0 when the teacher
    # equals the student (the undetached form leaves p (1 - sum p) rounding residue)
    kl = (ls.exp() * (ls - lt).detach()).sum(-1)
    m = mask[:, 1:].to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp(min=1)


def parse_teachers(specs: list[str]) -> dict[str, str]:
    """``DOMAIN=PATH`` strings into a mapping (each domain once)."""
    out: dict[str, str] = {}
    for spec in specs:
        domain, sep, path = spec.partition("=")
        if not sep or not domain or not path:
            raise DistillError(f"teacher spec {spec!r} is not DOMAIN=PATH.", parameter="teachers")
        if domain in out:
            raise DistillError(f"the teacher specs give domain {domain!r} twice.", parameter="teachers")
        out[domain] = path
    return out


class Distiller(PostTrainingRun):
    """Runs a :class:`DistillConfig` on a looped student model directory (:meth:`run`: the
    steps, with checkpoints of the student, its args, log and the run's state; the budget
    sampler and the prompt order are functions of the seed and the step, so they need no
    state of their own)."""

    args_file, log_file = ARGS_FILE, LOG_FILE

    def __init__(
        self,
        student_dir: str | Path,
        config: DistillConfig,
        *,
        tokenizer=None,
        on_step: Callable[[dict], None] | None = None,
    ):
        self._start(student_dir, config, tokenizer, on_step)
        menu = tuple(config.budgets or self.model.budgets)
        for k in menu:
            self.model.check_budget(k)
        self.sampler = BudgetSampler(menu, config.override, 1, 1, config.seed)
        loaded: dict[str, LoopedModel] = {}  # one copy of a teacher that serves several domains
        for domain, path in config.teachers.items():
            if path not in loaded:
                loaded[path] = self._teacher(domain, path, menu)
        self.teachers = {domain: loaded[path] for domain, path in config.teachers.items()}
        self.records = read_prompts(config.data)
        for number, record in enumerate(self.records, 1):
            if record.get("domain") not in self.teachers:
                raise DistillError(
                    f"prompt {number} has domain {record.get('domain')!r}, which no teacher covers "
                    f"(teachers: {', '.join(sorted(self.teachers))}).",
                    parameter="teachers",
                )
        self.prompts = [encode_prompt(self.tokenizer, r, config.chat) for r in self.records]
        self._begin()

    def _teacher(self, domain: str, path: str, menu) -> LoopedModel:
        teacher = load(path, device=str(next(self.model.parameters()).device)).eval()
        missing = [k for k in menu if k not in teacher.budgets]
        if missing:
            raise DistillError(
                f"teacher {domain!r} ('{path}') has no budget {missing[0]}; a teacher runs at the "
                f"student's budget, so its menu must include {list(menu)}."
            )
        if teacher.config.get_text_config().vocab_size != self.model.config.get_text_config().vocab_size:
            raise DistillError(
                f"teacher {domain!r} has another vocabulary than the student; distillation compares "
                "next-token distributions token by token."
            )
        for p in teacher.parameters():
            p.requires_grad_(False)
        return teacher

    def loss(self, rows: torch.Tensor, mask: torch.Tensor, domains: list[str], budget: int) -> torch.Tensor:
        """The MOPD loss of some student rollouts (each row's teacher by its domain)."""
        device = next(self.model.parameters()).device
        rows, mask = rows.to(device), mask.to(device)
        student = self.model(rows, budget=budget).logits
        teacher = torch.empty_like(student)
        with torch.no_grad():
            for domain in dict.fromkeys(domains):
                sel = torch.tensor([d == domain for d in domains], device=device)
                teacher[sel] = self.teachers[domain](rows[sel], budget=budget).logits
        return reverse_kl(student, teacher, mask)

    def step(self, step: int) -> dict:
        """One step: a budget as in training, student rollouts, one update. Returns the log record."""
        cfg = self.config
        t0 = time.perf_counter()
        budget = self.sampler.budget(step, 0)
        batch = prompt_batch(len(self.records), cfg.prompts, step, cfg.seed)
        self.model.eval()
        ro = sample(
            self.model,
            self.tokenizer,
            [self.prompts[i] for i in batch],
            budget=budget,
            n=cfg.rollouts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed * 1_000_003 + step,
            kv=cfg.kv,
        )
        self.model.train()
        domains = [self.records[batch[j]]["domain"] for j in ro.prompt_index]
        loss = self.loss(ro.ids, ro.mask, domains, budget)
        loss.backward()
        self._update()
        record = {
            "step": step,
            "budget": budget,
            "loss": loss.item(),
            "tokens": ro.tokens,
            "domains": sorted(set(domains)),
            "seconds": time.perf_counter() - t0,
        }
        return record

    def summary(self) -> dict:
        """Steps run and the mean reverse KL per budget."""
        by_budget: dict[str, list[float]] = {}
        for r in self.history:
            by_budget.setdefault(str(r["budget"]), []).append(r["loss"])
        return {"steps": len(self.history), "loss_by_budget": {k: sum(v) / len(v) for k, v in by_budget.items()}}
