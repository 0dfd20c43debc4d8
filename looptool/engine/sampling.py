"""How the next token is chosen, as one value from the command line or the HTTP request down
to every decode loop (PyTorch, onnxruntime, TensorRT, the server's scheduler).

:class:`SamplingParams` is greedy at ``temperature == 0``; otherwise tokens are sampled after
transformers' temperature, top-k and top-p warpers from a generator seeded with ``seed`` (the
warpers transformers' own ``generate`` uses, so a seeded sample is reproducible).
:class:`TokenPicker` applies it to one request's rows of logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from looptool.core.errors import LooptoolError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, checked when made (one sentence naming the setting out of range)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise LooptoolError(
                f"temperature must be a number >= 0, got {self.temperature!r}.", parameter="temperature"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise LooptoolError(f"top_k must be an integer >= 1 (or None), got {self.top_k!r}.", parameter="top_k")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise LooptoolError(f"top_p must lie in (0, 1] (or be None), got {self.top_p!r}.", parameter="top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise LooptoolError(f"seed must be an integer (or None), got {self.seed!r}.", parameter="seed")

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is taken (``temperature == 0``)."""
        return self.temperature <= 0

    def warpers(self) -> LogitsProcessorList | None:
        """transformers' temperature / top-k / top-p warpers, or None when greedy."""
        if self.greedy:
            return None
        warpers = LogitsProcessorList([TemperatureLogitsWarper(self.temperature)])
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (None without a seed: torch's global one)."""
        return torch.Generator(device=device).manual_seed(self.seed) if self.seed is not None else None


GREEDY = SamplingParams()


class TokenPicker:
    """Picks the next token of each row from its logits under one :class:`SamplingParams` (its
    warpers built and its generator seeded once, for all the steps of one generation)."""

    def __init__(self, sampling: SamplingParams, device: torch.device | str = "cpu"):
        self.sampling = sampling
        self.warpers = sampling.warpers()
        self.generator = sampling.generator(device) if self.warpers is not None else None

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """``logits [batch, vocab]`` and ``ids [batch, seq]`` the tokens so far (unused when
        greedy) → the next tokens ``[batch]``."""
        if self.warpers is None:
            return logits.argmax(-1)
        probs = torch.softmax(self.warpers(ids, logits.float()), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def by_picker(rows: list, indices: list[int], key=lambda row: None) -> list[list[int]]:
    """``indices`` of ``rows`` grouped by the token picker they share (and by ``key``), in order:
    the rows of one group draw together, as a static batch does."""
    groups: dict[tuple, list[int]] = {}
    for r in indices:
        groups.setdefault((id(rows[r].picker), key(rows[r])), []).append(r)
    return list(groups.values())
