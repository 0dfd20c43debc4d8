"""Log-probabilities a response reports: the chosen token's and the ``n`` most likely ones."""

from __future__ import annotations

import torch


def top_logprobs(logp: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the log-probabilities ``logp [vocab]`` and the
    ``n`` most likely tokens with theirs."""
    top = torch.topk(logp, n) if n > 0 else None
    pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top is not None else []
    return float(logp[token]), pairs
