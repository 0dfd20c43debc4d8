"""Self-speculative decoding's acceptance rule, shared by every runtime's decode loop.

A shallow budget ``j`` drafts ``n`` tokens one at a time; the requested budget ``k`` scores
the last accepted token and the ``n`` drafts in one step, which gives its next-token
distribution ``p_0 … p_n`` at every drafted position. :func:`accept_drafts` then keeps the
longest prefix of drafts budget ``k`` agrees with and adds one token of budget ``k``'s own:

* greedy: draft ``i`` is kept while it is budget ``k``'s most likely token at its position;
  the token after the kept prefix is budget ``k``'s most likely one there (so the output is
  token for token what decoding at budget ``k`` alone gives);
* sampling: draft ``d_i``, drawn from the draft's distribution ``q_i``, is kept with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; the first rejected position is resampled from
  the normalised residual ``max(0, p_i − q_i)``, and when every draft is kept one more token is
  drawn from ``p_n``. Each emitted token is then distributed exactly as budget ``k``'s own
  sample (the standard speculative-sampling rule, Leviathan et al. 2023; Chen et al. 2023).

``p`` and ``q`` are the distributions after the request's temperature, top-k and top-p
(:class:`~looptool.engine.sampling.TokenPicker`), the ones plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.sampling import TokenPicker

DEFAULT_DRAFT_TOKENS = 4  # tokens drafted per verify step unless the request or the server says otherwise
MAX_DRAFT_TOKENS = 32  # a round holds the clock's slots for this many drafts of every row

# Why speculation refuses last-loop KV, said by every runtime that refuses it.
LAST_LOOP_VERIFY = "under last-loop caching a step over several tokens does not compute what one-token steps compute."


@dataclass(frozen=True)
class Speculation:
    """Draft ``tokens`` tokens at budget ``budget`` per verify step (checked by :meth:`check`)."""

    budget: int
    tokens: int = 4

    def check(self, target: int, menu, kv: str = "per-loop") -> Speculation:
        """This setting checked against the target budget, the menu and the KV policy (one
        sentence otherwise). Last-loop KV is refused: there a step of several tokens lets a
        repeated layer's first pass read the first-pass keys of the step's earlier tokens, where
        one-token decoding reads their last pass's, so one verify step over the drafts would not
        compute what budget ``k`` decodes one token at a time."""
        if kv == "last-loop":
            raise LooptoolError(
                f"speculative decoding needs kv='per-loop': {LAST_LOOP_VERIFY}",
                parameter="kv",
            )
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise LooptoolError(f"draft_tokens must be an integer >= 1, got {self.tokens!r}.", parameter="draft_tokens")
        if self.budget not in menu:
            raise LooptoolError(
                f"draft budget {self.budget} is not in the budget menu {list(menu)}; pick one of those.",
                parameter="draft_budget",
            )
        if self.budget >= target:
            raise LooptoolError(
                f"the draft budget ({self.budget}) must be shallower than the budget it drafts for ({target}).",
                parameter="draft_budget",
            )
        return self


@dataclass
class SpeculationStats:
    """What speculation did over one generation: verify steps, drafts proposed and kept, and
    the seconds spent in draft steps and in verify steps."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens budget ``k`` kept (0 when nothing was drafted)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict:
        """JSON-ready counts and the acceptance rate."""
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
        }


def draft_probs(picker: TokenPicker, logits: torch.Tensor) -> torch.Tensor | None:
    """The distribution ``picker`` samples from for ``logits [..., vocab]`` (float32; None when greedy)."""
    if picker.warpers is None:
        return None
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return torch.softmax(picker.warpers(None, flat), dim=-1).reshape(logits.shape)


def accept_drafts(
    picker: TokenPicker,
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_dist: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the acceptance rule (module docstring) to a batch.

    ``target_logits [B, n+1, vocab]``: budget ``k``'s logits at the last accepted token and at
    each draft; ``drafts [B, n]`` the drafted tokens; ``draft_dist [B, n, vocab]`` the
    distributions they were drawn from (None when greedy). Returns ``(kept [B], next [B])``:
    how many drafts each row keeps and the token that follows them.
    """
    batch, n = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    if picker.warpers is None:
        best = target_logits.argmax(-1)  # [B, n+1]
        kept = (best[:, :n] == drafts).long().cumprod(dim=1).sum(dim=1)
        return kept, best[rows, kept]
    if draft_dist is None:
        raise LooptoolError("sampled speculation needs the drafts' distributions.")
    p = draft_probs(picker, target_logits)  # [B, n+1, V]
    p_draft = p[:, :n].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = draft_dist.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(batch, n, generator=picker.generator, device=drafts.device)
    ok = u * q_draft < p_draft  # u < p/q without dividing (q > 0: the draft was drawn from q)
    kept = ok.long().cumprod(dim=1).sum(dim=1)
    # where a draft was rejected: the residual max(0, p - q) at that position; else p_n
    target = p[rows, kept]
    rejected = kept < n
    if bool(rejected.any()):
        q_at = torch.zeros_like(target)
        q_at[rejected] = draft_dist[rows[rejected], kept[rejected]]
        residual = (target - q_at).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        target = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target)
    return kept, torch.multinomial(target, 1, generator=picker.generator).squeeze(-1)
