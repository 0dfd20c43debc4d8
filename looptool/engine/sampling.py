"""How the next token is chosen, as one value from the command line or the HTTP request down
to every decode loop (PyTorch, onnxruntime, TensorRT, the server's scheduler).

:class:`SamplingParams` is greedy at ``temperature == 0``; otherwise tokens are sampled after
transformers' temperature, min-p, top-k and top-p warpers (in vLLM's order) from a generator
seeded with ``seed`` (the warpers transformers' own ``generate`` uses, so a seeded sample is
reproducible). :class:`TokenPicker` applies them to one request's rows of logits.

Before any of that, a row's logits are shaped by what depends on the row's own tokens
(:func:`shape_logits`, in vLLM's order and with vLLM's formulas, greedy rows included): a
grammar's token mask (:class:`RowConstraint`), ``logit_bias`` (added), then the repetition
penalty (a logit of a token seen in the prompt or the output is divided by it when positive,
multiplied when not), the frequency penalty (subtracted once per time the token occurs in the
output) and the presence penalty (subtracted once if it occurs in the output). Log-probabilities
a request asks for are those of the model's own logits, before any of it (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from looptool.core.errors import LooptoolError


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, checked when made (one sentence naming the setting out of range)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

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
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise LooptoolError(f"min_p must lie in [0, 1], got {self.min_p!r}.", parameter="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise LooptoolError(f"{name} must lie in [-2, 2], got {value!r}.", parameter=name)
        if not _number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise LooptoolError(
                f"repetition_penalty must be a number > 0 (1: none), got {self.repetition_penalty!r}.",
                parameter="repetition_penalty",
            )
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _integer(pair[0]) and _number(pair[1])):
                raise LooptoolError(f"logit_bias must be (token id, bias) pairs, got {pair!r}.", parameter="logit_bias")

    @property
    def shapes(self) -> bool:
        """Whether a row's logits depend on its own tokens or a bias (:func:`shape_logits`)."""
        return bool(self.logit_bias) or self.penalized

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is taken (``temperature == 0``)."""
        return self.temperature <= 0

    def warpers(self) -> LogitsProcessorList | None:
        """transformers' temperature / top-k / top-p warpers, or None when greedy."""
        if self.greedy:
            return None
        warpers = LogitsProcessorList([TemperatureLogitsWarper(self.temperature)])
        if self.min_p > 0:
            warpers.append(MinPLogitsWarper(self.min_p))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (None without a seed: torch's global one)."""
        return torch.Generator(device=device).manual_seed(self.seed) if self.seed is not None else None


GREEDY = SamplingParams()


class RowConstraint(Protocol):
    """What a grammar does for one row (:mod:`looptool.serve.structured` builds them): masks
    the tokens it does not allow, follows the tokens the row takes, and says which tokens it
    forces next (none where the model has a choice)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits ``[vocab]`` of the tokens not allowed next to ``-inf``, in place."""

    def accept(self, token: int) -> bool:
        """Follow ``token``; whether the grammar is now complete (only a stop token may follow)."""

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (empty: none)."""


def shape_logits(
    logits: torch.Tensor, sampling: SamplingParams, ids: list[int], prompt: int, constraint: RowConstraint | None
) -> torch.Tensor:
    """One row's logits ``[1, vocab]`` (float) shaped by ``constraint``'s mask, ``sampling``'s
    ``logit_bias`` and penalties over its tokens ``ids``, the first ``prompt`` of them the
    prompt's (module docstring; vLLM's order and formulas). The input is left as it is."""
    if constraint is None and not sampling.shapes:
        return logits
    out = logits.float().clone()
    row = out[0]
    if constraint is not None:
        constraint.mask(row)
    vocab = row.shape[-1]
    for token, bias in sampling.logit_bias:
        if 0 <= token < vocab:
            row[token] += bias
    if sampling.penalized:
        output = torch.tensor(ids[prompt:], dtype=torch.long)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.device, row.dtype)
        if sampling.repetition_penalty != 1:
            seen = counts > 0
            seen[torch.tensor(ids[:prompt], dtype=torch.long)] = True
            factor = torch.where(seen, torch.tensor(sampling.repetition_penalty, dtype=row.dtype), 1.0)
            row.copy_(torch.where(row > 0, row / factor, row * factor))
        row -= sampling.frequency_penalty * counts
        row -= sampling.presence_penalty * (counts > 0).to(row.dtype)
    return out


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
