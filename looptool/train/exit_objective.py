"""The training objectives of the learned exits (:mod:`looptool.passes.exit_gate`).

Both read, for every target token, the next-token loss ``L_d`` at each depth ``d`` of the
training menu ``d_1 < ... < d_{n+1}`` and the gate logits ``z_d`` of the first ``n`` (the
deepest depth has no gate: a token that reaches it stops there).

- :func:`expected_exit_loss` (``looptool train --exit-gate``, trained with the loops): the
  expected loss under the exit distribution minus ``beta`` times its entropy (the entropy term
  is the KL to a uniform prior up to a constant; a geometric prior would starve the late
  depths of gradient)::

      p(d_i) = lambda_i prod_{j<i} (1 - lambda_j),  p(d_{n+1}) = prod_{j<=n} (1 - lambda_j)
      loss   = mean_tokens [ sum_i p(d_i) L_{d_i} - beta * H(p) ],  H(p) = -sum_i p(d_i) log p(d_i)

- :func:`gate_fit_loss` (``looptool train --exit-gate-only``, the backbone frozen): each gate
  learns whether the next depth still pays. A token's label at ``d_i`` is "stop" when the next
  depth improves its loss by at most ``gamma`` nats (``L_{d_i} - L_{d_{i+1}} <= gamma``),
  "continue" otherwise, and the loss is the binary cross-entropy of ``lambda_i`` against it,
  averaged over tokens and gates.

Everything is computed in log space (``log lambda = logsigmoid(z)``, ``log(1 - lambda) =
logsigmoid(-z)``), in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of a position without a target (Hugging Face's convention)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-token loss ``[batch, seq - 1]`` (float32; 0 where the shifted label is
    :data:`IGNORE`): position ``t`` predicts ``labels[:, t + 1]``, as Hugging Face's loss shifts."""
    targets = labels[:, 1:]
    flat = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    return flat.view(targets.shape)


def exit_log_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    """``log p(d_i)`` ``[n + 1, ...]`` from gate logits ``z`` ``[n, ...]`` (the exit distribution)."""
    z = gate_logits.float()
    log_stop, log_go = F.logsigmoid(z), F.logsigmoid(-z)
    survived = torch.cumsum(log_go, 0)  # log prod_{j<=i} (1 - lambda_j)
    before = torch.cat([torch.zeros_like(survived[:1]), survived[:-1]], 0)
    return torch.cat([log_stop + before, survived[-1:]], 0)


def expected_exit_loss(
    losses: torch.Tensor, gate_logits: torch.Tensor, mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict]:
    """The mean over ``mask``'s tokens of ``E_p[L] - beta * H(p)``; ``losses`` ``[n + 1, ...]``,
    ``gate_logits`` ``[n, ...]``, ``mask`` bool over the trailing dimensions. Also returns the
    token means of the expected loss, the entropy and the expected depth index (0-based), as floats."""
    log_p = exit_log_probs(gate_logits)
    p = log_p.exp()
    expected = (p * losses.float()).sum(0)
    entropy = -(p * log_p).sum(0)
    per_token = expected - beta * entropy
    count = mask.sum().clamp_min(1)
    index = torch.arange(p.shape[0], dtype=p.dtype, device=p.device).view(-1, *([1] * (p.dim() - 1)))
    stats = {
        "expected_loss": float(expected.detach()[mask].sum() / count),
        "entropy": float(entropy.detach()[mask].sum() / count),
        "mean_exit": float((p.detach() * index).sum(0)[mask].sum() / count),
    }
    return per_token[mask].sum() / count, stats


def gate_fit_loss(
    losses: torch.Tensor, gate_logits: torch.Tensor, mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, dict]:
    """The mean over ``mask``'s tokens and the ``n`` gates of the binary cross-entropy of
    ``lambda_i`` against "stop" = ``L_{d_i} - L_{d_{i+1}} <= gamma``; also the share of stop labels."""
    losses = losses.detach().float()
    stop = (losses[:-1] - losses[1:] <= gamma).float()
    bce = F.binary_cross_entropy_with_logits(gate_logits.float(), stop, reduction="none")
    count = (mask.sum() * bce.shape[0]).clamp_min(1)
    return bce[:, mask].sum() / count, {"stop_share": float(stop[:, mask].sum() / count)}
