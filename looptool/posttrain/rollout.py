"""On-policy rollouts at one budget, shared by ``looptool rl`` and ``looptool distill``.

Prompts come from JSONL: each line has a string ``prompt`` (plain text, or with
``chat=True`` the content of one user turn rendered with the tokenizer's chat template and
its generation prompt) or a ``messages`` list (rendered with the chat template), plus any
fields a reward or a teacher map reads (``answer``, ``domain``, ...).

Sampling runs the budget's cached path (:func:`looptool.runtime.generation.generate`) on the
prompts left-padded; each rollout is then re-laid out right-padded (prompt tokens, then
the completion up to and including its EOS) so the training forward sees the same
positions as the sampler did, and :func:`token_logprobs` scores it with the plain
(uncached) budget path.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.sampling import SamplingParams
from looptool.runtime.convert import load
from looptool.runtime.devices import resolve_device
from looptool.runtime.generation import generate
from looptool.runtime.model import LoopedModel
from looptool.storage.resume import open_output, resumable_state, rng_states, set_rng_states, write_checkpoint
from looptool.train.data import DataError, _jsonl_records, _read_text, find_files
from looptool.train.trainer import adamw

# may differ between a run and its resume (checkpointing is exact; the device is where it runs)
RESUME_FREE = {"resume", "save_every", "output", "device", "overwrite"}


def read_prompts(specs) -> list[dict]:
    """Every record of the JSONL prompt files (each needs ``prompt`` or ``messages``)."""
    records = []
    for path in find_files(specs):
        if path.suffix.lower() not in (".jsonl", ".json"):
            raise DataError(
                f"'{path}' is not a .jsonl file; prompts are JSONL lines with a 'prompt' or 'messages' field."
            )
        for number, record in _jsonl_records(path, _read_text(path)):
            ok = isinstance(record, dict) and (
                isinstance(record.get("prompt"), str) or isinstance(record.get("messages"), list)
            )
            if not ok:
                raise DataError(f"'{path}' line {number} needs a string 'prompt' or a 'messages' list.")
            records.append(record)
    if not records:
        raise DataError(f"{specs} holds no prompts.")
    return records


def prompt_batch(n_records: int, per_step: int, step: int, seed: int) -> list[int]:
    """The prompt indices of one step: consecutive slices of a seeded permutation per epoch."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, n_records)
        order = list(range(n_records))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        out.append(order[i])
    return out


def prompt_text(record: dict) -> str:
    """The text a reward sees as the prompt: ``prompt``, or the last user message."""
    if "prompt" in record:
        return record["prompt"]
    users = [m.get("content", "") for m in record["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users else ""


def encode_prompt(tokenizer, record: dict, chat: bool) -> list[int]:
    """Token ids of one prompt (see the module docstring)."""
    messages = record.get("messages")
    if messages is None and chat:
        messages = [{"role": "user", "content": record["prompt"]}]
    if messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "chat prompts need a tokenizer with a chat template; this one has none (set chat=False).",
                parameter="chat",
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(record["prompt"], add_special_tokens=True).input_ids
    if not ids:
        raise DataError("a prompt encodes to no tokens; every prompt needs at least one.")
    return ids


@dataclass
class Rollouts:
    """Sampled continuations of some prompts at one budget, laid out right-padded."""

    budget: int
    prompt_index: list[int]  # per row: which of the given prompts it continues
    ids: torch.Tensor  # [rows, T] prompt + completion (+ EOS), right-padded
    mask: torch.Tensor  # [rows, T] float: 1 on completion tokens (the sampled ones)
    sample_logprobs: torch.Tensor  # [rows, T] the sampler's log-probability of each completion token, 0 elsewhere
    completions: list[str]  # decoded completions, without special tokens

    @property
    def tokens(self) -> int:
        """Completion tokens in all rows."""
        return int(self.mask.sum())


@torch.no_grad()
def sample(
    model: LoopedModel,
    tokenizer,
    prompts: Sequence[list[int]],
    *,
    budget: int,
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    kv: str = "per-loop",
) -> Rollouts:
    """``n`` rollouts of every prompt at ``budget`` (temperature sampling, cached decode)."""
    if temperature <= 0:
        raise DataError("rollouts are sampled: temperature must be positive.", parameter="temperature")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    rows = [p for p in prompts for _ in range(n)]
    index = [i for i in range(len(prompts)) for _ in range(n)]
    width = max(len(p) for p in rows)
    left = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, p in enumerate(rows):
        left[r, width - len(p) :] = torch.tensor(p)
        attention[r, width - len(p) :] = 1
    out = generate(
        model,
        left,
        attention_mask=attention,
        budget=budget,
        max_new_tokens=max_new_tokens,
        kv=kv,
        sampling=SamplingParams(temperature, seed=seed),
        eos_token_id=eos,
        pad_token_id=pad,
        output_logits=True,
    )
    new = out.sequences[:, width:].cpu()
    logprobs = torch.stack([torch.log_softmax(lg.float().cpu() / temperature, -1) for lg in out.logits], 1)
    picked = logprobs.gather(-1, new[..., None])[..., 0]  # [rows, steps]
    completions, lengths = [], []
    for r in range(len(rows)):
        tokens = new[r].tolist()
        length = tokens.index(eos) + 1 if eos is not None and eos in tokens else len(tokens)
        lengths.append(length)
        completions.append(tokenizer.decode(tokens[:length], skip_special_tokens=True))
    total = max(len(p) + n_ for p, n_ in zip(rows, lengths))
    ids = torch.full((len(rows), total), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), total))
    sample_lp = torch.zeros((len(rows), total))
    for r, (p, length) in enumerate(zip(rows, lengths)):
        ids[r, : len(p)] = torch.tensor(p)
        ids[r, len(p) : len(p) + length] = new[r, :length]
        mask[r, len(p) : len(p) + length] = 1
        sample_lp[r, len(p) : len(p) + length] = picked[r, :length]
    return Rollouts(budget, index, ids, mask, sample_lp, completions)


def token_logprobs(model: LoopedModel, ids: torch.Tensor, budget: int, temperature: float = 1.0) -> torch.Tensor:
    """``[rows, T]``: log p(ids[t] | ids[<t]) under the budget path (softmax of logits /
    ``temperature``), 0 at t = 0. Differentiable."""
    ids = ids.to(next(model.parameters()).device)
    logits = model(ids, budget=budget).logits
    return shifted_logprobs(logits, ids, temperature)


def shifted_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position log-probabilities of ``ids`` under next-token ``logits`` (0 at t = 0)."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


@dataclass(kw_only=True)
class RunSettings:
    """What every post-training run (``looptool rl``, ``looptool distill``) is set with: its
    data and output, the step loop, the optimizer, the rollouts' sampling and the checkpoints.
    Each method's settings add their own fields (and their own defaults where they differ)."""

    data: list[str]
    output: str
    steps: int = 50
    prompts: int = 8  # prompts per step
    rollouts: int = 1  # samples per prompt
    budgets: list[int] | None = None  # the menu to train (default: the model's)
    lr: float = 1e-5
    new_lr: float | None = None
    weight_decay: float = 0.0
    clip: float = 1.0  # gradient norm clip
    temperature: float = 1.0  # sampling temperature of the rollouts
    max_new_tokens: int = 32
    chat: bool = False  # render "prompt" as a user turn with the chat template
    kv: str = "per-loop"
    seed: int = 0
    device: str | None = None
    overwrite: bool = False
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    resume: bool = False  # continue the run checkpointed in output

    @classmethod
    def from_options(cls, options: dict, **converted):
        """The settings named in ``options`` (a command's arguments, e.g. its ``locals()``;
        other names are ignored), with ``converted`` values in place of the raw ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names} | converted)


class PostTrainingRun:
    """The step loop shared by ``looptool rl`` and ``looptool distill``, with the trainer's
    checkpoints: every ``save_every`` steps and at the end the output directory is rebuilt
    atomically (model, settings, step log and :data:`~looptool.storage.resume.STATE_FILE`), and
    ``resume`` continues a killed run to the same weights as an uninterrupted one.

    A subclass calls :meth:`_start`, sets itself up, calls :meth:`_begin` (the optimizer,
    then the checkpoint's state when resuming), and implements :meth:`step` and
    :meth:`summary`; the state a step carries over beyond the model, the optimizer, the RNGs
    and the history (e.g. RL's pass rates) goes through :meth:`extra_state` and
    :meth:`load_extra_state`. Nothing is written before the first checkpoint, so a run that
    fails earlier leaves no output."""

    args_file = "args.json"
    log_file = "log.jsonl"
    on_step: Callable[[dict], None] | None = None

    def _start(self, model_dir, config, tokenizer, on_step) -> None:
        """Check ``config`` and the output directory, load the model (from the checkpoint
        when resuming) and its tokenizer. Resuming a run that has run all its steps raises
        :class:`~looptool.storage.resume.RunComplete`."""
        config.check()
        if config.save_every < 0:
            raise LooptoolError("save_every must be at least 0 (0: checkpoint only at the end).")
        self.config, self.on_step, self.history = config, on_step, []
        self.output = Path(config.output)
        self.resuming = open_output(self.output, resume=config.resume, overwrite=config.overwrite)
        self.start_step = 0
        self.device = resolve_device(config.device)
        self._state = None
        if self.resuming:  # before the slow load: a changed command or a finished run stops here
            self._state = resumable_state(self.output, config, RESUME_FREE, config.steps, self.device)
        self.model = load(self.output if self.resuming else model_dir, device=str(self.device))
        self.tokenizer = tokenizer or self.model.tokenizer
        if self.tokenizer is None:
            raise LooptoolError(
                f"the model in '{model_dir}' has no tokenizer; pass one as tokenizer (a Hugging Face tokenizer).",
                parameter="tokenizer",
            )

    def _begin(self) -> None:
        """Create the optimizer; when resuming, restore the checkpoint's optimizer state, RNG
        states, history, step and :meth:`extra_state`."""
        cfg = self.config
        self.optimizer = adamw(self.model, cfg.lr, cfg.new_lr, cfg.weight_decay)
        state, self._state = self._state, None
        if state is None:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_states(state["rng"], self.device)
        self.history = list(state["history"])
        self.start_step = state["step"]
        self.load_extra_state(state["extra"])

    def extra_state(self) -> dict:
        """Run state a resume needs beyond model, optimizer, RNGs, history and step."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Restore what :meth:`extra_state` returned."""

    def step(self, step: int) -> dict:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def summary(self) -> dict:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def _update(self) -> None:
        """Clip the gradient norm, take an optimizer step, clear the gradients."""
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.config.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _checkpoint(self, step: int) -> None:
        """Rebuild the output directory atomically with the state after ``step`` steps."""
        config = dataclasses.asdict(self.config)
        state = {
            "step": step,
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_states(self.device),
            "history": self.history,
            "extra": self.extra_state(),
            "config": config,
        }
        write_checkpoint(
            self.output,
            self.model,
            state,
            {
                self.args_file: json.dumps(config, indent=2),
                self.log_file: "".join(json.dumps(r) + "\n" for r in self.history),
            },
        )

    def run(self) -> dict:
        """The steps from the first (or the resumed one) to the last, checkpointing every
        ``save_every`` steps and at the end; returns :meth:`summary`."""
        cfg = self.config
        for step in range(self.start_step, cfg.steps):
            record = self.step(step)
            self.history.append(record)
            if self.on_step is not None:
                self.on_step(record)
            if step == cfg.steps - 1 or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                self._checkpoint(step + 1)
        return self.summary()
