"""A training run's settings (:class:`TrainConfig`), its file names and its error type."""

from __future__ import annotations

from dataclasses import dataclass

from looptool.core.errors import LooptoolError
from looptool.train.data import FORMATS, find_files

ARGS_FILE = "train_args.json"


LOG_FILE = "train_log.jsonl"


SCHEDULES = ("constant", "cosine", "sqrt")


DEFAULT_TOKENS = 2_000_000  # the run's length when neither tokens nor steps is given


STRATEGIES = ("ddp", "fsdp")


# may differ between a run and its resume (checkpointing is exact; the device is where it runs)
_RESUME_FREE = {"resume", "save_every", "output", "device", "checkpoint", "save_optimizer"}


class TrainingError(LooptoolError):
    """Training cannot go on (bad settings, diverged loss, mismatched resume)."""


@dataclass
class TrainConfig:
    """Settings of one training run (the CLI's options)."""

    data: list[str]
    output: str
    tokens: int | None = None  # training tokens (default DEFAULT_TOKENS); or give steps instead
    steps: int | None = None  # optimizer steps, instead of tokens
    seq_len: int = 512
    batch: int = 8
    grad_accum: int = 1
    lr: float = 3e-5
    new_lr: float | None = None  # LR of the loop.* parameters (default: lr)
    weight_decay: float = 0.1
    override: float = 0.0
    delay: float = 0.0
    warmup: float = 0.05
    schedule: str = "constant"
    clip: float = 1.0
    aux_coef: float = 1e-4
    bf16: bool = False
    freeze_below_window: bool = False
    save_every: int = 0
    save_optimizer: bool = True  # write trainer_state.pt (optimizer state, step, RNG) beside the model: resume needs it
    seed: int = 0
    resume: bool = False
    budgets: list[int] | None = None  # sample only these budgets (e.g. [0]: plain fine-tuning)
    device: str | None = None  # cpu, cuda, cuda:N; None: cuda when available
    checkpoint: bool = False  # activation checkpointing per layer application (exact)
    compile: bool = False  # torch.compile each budget path on first use
    strategy: str = "ddp"  # ddp | fsdp (FSDP2 under torchrun: one shard unit per source layer)
    format: str = (
        "text"  # text (packed, every token a target) | completion (JSONL prompt/completion) | chat (JSONL messages)
    )
    depth_curriculum: float = 0.0  # fraction of steps over which the budget menu grows from the shallowest
    gate_floor: float = 0.0  # lower bound on the new gates (loop.*_gate) while training ...
    gate_floor_until: float = 0.5  # ... for this fraction of the steps, then released
    exit_loss: float = 0.0  # ELR: weight of each earlier loop exit's loss relative to the last one (0: off)
    exit_gate: bool = False  # train learned exits with the loops: expected loss under the exit distribution
    exit_gate_only: bool = False  # fit the learned exits alone (backbone frozen) to the next depth's gain
    exit_beta: float = 0.1  # weight of the exit distribution's entropy (exit_gate)
    exit_gamma: float = 0.005  # nats the next depth must gain for a token to be labelled "continue" (exit_gate_only)

    def check(self) -> None:
        """Refuse settings that cannot work, one sentence each."""
        if self.tokens is not None and self.steps is not None:
            raise TrainingError("tokens and steps both set the length of the run; give one of them.")
        for name in ("tokens", "steps", "seq_len", "batch", "grad_accum"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise TrainingError(f"{name} must be at least 1.", parameter=name)
        if self.save_every < 0:
            raise TrainingError(
                "save_every must be at least 0 (0: checkpoint only at the end).", parameter="save_every"
            )
        if self.lr <= 0 or (self.new_lr is not None and self.new_lr <= 0):
            raise TrainingError("learning rates must be positive.")
        if not 0 <= self.override <= 1:
            raise TrainingError(f"override {self.override} must be in [0, 1].", parameter="override")
        for name in ("delay", "warmup"):
            if not 0 <= getattr(self, name) < 1:
                raise TrainingError(f"{name} {getattr(self, name)} must be in [0, 1).", parameter=name)
        if self.strategy not in STRATEGIES:
            raise TrainingError(
                f"strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}.", parameter="strategy"
            )
        for name in ("depth_curriculum", "gate_floor_until"):
            if not 0 <= getattr(self, name) <= 1:
                raise TrainingError(
                    f"{name} {getattr(self, name)} is a fraction of the run, in [0, 1].", parameter=name
                )
        if self.exit_loss < 0:
            raise TrainingError("exit_loss is a non-negative weight (0: off).", parameter="exit_loss")
        if self.exit_gate and self.exit_gate_only:
            raise TrainingError(
                "exit_gate trains the exits with the loops and exit_gate_only with the loops frozen; give one of them.",
                parameter="exit_gate_only",
            )
        for name in ("exit_beta", "exit_gamma"):
            if getattr(self, name) < 0:
                raise TrainingError(f"{name} must be >= 0.", parameter=name)
        if self.exit_gate or self.exit_gate_only:
            sampled = [n for n in ("override", "delay", "depth_curriculum", "exit_loss") if getattr(self, n)]
            if sampled:
                raise TrainingError(
                    f"{sampled[0]} shapes the one budget drawn per micro-batch, but exit_gate and exit_gate_only "
                    f"train every depth of the menu at each step; drop {sampled[0]}.",
                    parameter=sampled[0],
                )
        if self.gate_floor < 0:
            raise TrainingError(
                "gate_floor must be non-negative (0: off); gates start at 0 (exact conversion).", parameter="gate_floor"
            )
        if self.format not in FORMATS:
            raise TrainingError(f"format {self.format!r} is unknown; use {', '.join(FORMATS)}.", parameter="format")
        if self.schedule not in SCHEDULES:
            raise TrainingError(
                f"schedule {self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}.", parameter="schedule"
            )
        find_files(self.data)  # a missing data path fails here, before the model loads
