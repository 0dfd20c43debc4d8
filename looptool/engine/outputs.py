"""What a generation returns (:class:`GenerationOutput`): every runtime's ``generate``
(:mod:`looptool.engine.offline`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptool.core.plan import BudgetCost
from looptool.engine.speculation import SpeculationStats


@dataclass
class GenerationOutput:
    """What ``generate`` returns: the sequences plus what the run cost."""

    sequences: torch.Tensor  # [batch, prompt + new], prompt left-padded as given
    new_tokens: int  # decoding steps run (tokens per row, including any after EOS)
    prefill_seconds: float
    decode_seconds: float
    kv_bytes: int  # keys and values the rows' budgets keep for prompt + new tokens (Accordion Eq. 6)
    kv_bytes_per_token: float  # kv_bytes / (batch x (prompt + new tokens)): one row's bytes per position
    logits: tuple[torch.Tensor, ...] = ()  # per step [batch, vocab], with output_logits=True
    budgets: tuple[int, ...] = ()  # each row's budget
    row_costs: tuple[BudgetCost, ...] = ()  # each row's per-token cost (its budget's cost-table row)
    speculation: SpeculationStats | None = None  # drafts proposed and kept, with draft_budget
    depths: torch.Tensor | None = None  # budget="auto": [batch, new_tokens], the depth that produced each token

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over prefill and decode (all rows)."""
        total = self.prefill_seconds + self.decode_seconds
        return self.sequences.shape[0] * self.new_tokens / total if total > 0 else float("inf")
