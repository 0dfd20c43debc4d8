"""Per-request token choice: greedy, or transformers' temperature / top-k / top-p warpers
(the ones :func:`looptool.runtime.generation.generate` uses) and a generator seeded per
request, so a seeded request samples what ``generate`` samples for that prompt alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptool.runtime.generation import logits_warpers


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings (``temperature == 0``: greedy)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


class TokenPicker:
    """Picks one request's next token from its row of logits."""

    def __init__(self, sampling: Sampling, device: torch.device | str = "cpu"):
        self.warpers = logits_warpers(sampling.temperature, sampling.top_k, sampling.top_p)
        self.generator = None
        if self.warpers is not None and sampling.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor) -> int:
        """``logits [1, vocab]`` float32, ``ids [1, seq]`` the tokens so far → the next token."""
        if self.warpers is None:
            return int(logits.argmax(-1))
        probs = torch.softmax(self.warpers(ids, logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_logprobs(logp: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the log-probabilities ``logp [vocab]`` and the
    ``n`` most likely tokens with theirs."""
    top = torch.topk(logp, n) if n > 0 else None
    pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top is not None else []
    return float(logp[token]), pairs
