"""An opened engine: a step engine with what a caller needs beside it (tokenizer, costs, EOS
ids), and its :meth:`OpenedEngine.generate`, the one-call generation every runtime shares
(:func:`looptool.open_engine` returns it, as onnxruntime-genai's ``og.Model(path)`` does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow, RowBudgets, wants_auto
from looptool.engine.interface import StepEngine
from looptool.engine.offline import generate_batch
from looptool.engine.outputs import GenerationOutput
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.engine.speculation import Speculation


@dataclass
class OpenedEngine:
    """A step engine and what a server needs beside it: the tokenizer, each budget's cost
    (Accordion Eq. 6: ``budget``, ``layer_executions``, ``kv_bytes_per_token``), the EOS ids,
    the device it runs on and the runtime's name (``pytorch``, ``onnxruntime``, ``tensorrt``)."""

    engine: StepEngine
    tokenizer: Any
    costs: dict[int, dict]
    eos: tuple[int, ...]
    device: str
    runtime: str

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        *,
        attention_mask: torch.Tensor | None = None,
        budget: int | Sequence[int] | str | None = None,
        max_new_tokens: int = 32,
        sampling: SamplingParams = GREEDY,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        on_step: Callable[[torch.Tensor], bool | None] | None = None,
        output_logits: bool = False,
        draft_budget: int | None = None,
        draft_tokens: int = 4,
        auto: AutoRow | None = None,
    ) -> GenerationOutput:
        """Generate through the engine core (:func:`~looptool.engine.offline.generate_batch`):
        ``budget`` one for every row, one per row, or ``"auto"`` (adaptive depth, ``auto``'s
        settings; default the menu's ends at the default threshold) where the engine runs it;
        None: the deepest. ``draft_budget`` drafts there (one budget for every row) where the
        engine has verify steps. EOS defaults to the engine's ids."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim != 2 or 0 in ids.shape:
            raise LooptoolError(f"input_ids must be [batch, sequence] with at least one token, got {tuple(ids.shape)}.")
        menu, caps = self.engine.budgets, self.engine.capabilities
        if wants_auto(budget):
            if caps.adaptive_refusal is not None:
                raise caps.adaptive_refusal
            row = (auto or AutoRow(min(menu), max(menu))).check(menu)
            budgets: list = [row] * ids.shape[0]
        else:
            budgets = list(RowBudgets.resolve(budget, menu, ids.shape[0], default=max(menu)).rows)
        spec = None
        if draft_budget is not None:
            if isinstance(budget, str) or len(set(budgets)) > 1:
                raise LooptoolError(
                    "speculative decoding takes one fixed budget for every row.", parameter="draft_budget"
                )
            if caps.verify_refusal is not None:
                raise caps.verify_refusal
            spec = Speculation(draft_budget, draft_tokens).check(budgets[0], menu, caps.kv)
        return generate_batch(
            self.engine,
            ids,
            attention_mask,
            budgets,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=list(self.eos) if eos_token_id is None else eos_token_id,
            pad_token_id=pad_token_id,
            on_step=on_step,
            output_logits=output_logits,
            speculation=spec,
            device=self.device,
        )


def costs_by_budget(table: list[dict], budgets, kv: str) -> dict[int, dict]:
    """``budget -> {"budget", "layer_executions", "kv_bytes_per_token"}`` from cost-table rows
    (Accordion Eq. 6; last-loop KV, ELR Sec. 3.4, where ``kv`` is ``last-loop``); one sentence
    when a budget of ``budgets`` has no row."""
    key = "kv_bytes_per_token_last_loop" if kv == "last-loop" else "kv_bytes_per_token"
    costs = {
        int(c["budget"]): {
            "budget": int(c["budget"]),
            "layer_executions": int(c["layer_executions"]),
            "kv_bytes_per_token": int(c[key]),
        }
        for c in table
        if int(c["budget"]) in budgets
    }
    missing = sorted(set(budgets) - set(costs))
    if missing:
        raise LooptoolError(f"no cost-table entry for budget {missing[0]}; export the engine again.")
    return costs


def eos_ids(tokenizer, config_eos) -> tuple[int, ...]:
    """The tokenizer's EOS id and the config's (one id or a list), sorted."""
    ids = {int(i) for i in ([config_eos] if isinstance(config_eos, int) else (config_eos or []))}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
