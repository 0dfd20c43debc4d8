"""Text generation at any budget with a KV cache (ELR Sec. 3.4, Accordion Eq. 6):
:func:`generate` submits a batch to the engine core (:mod:`looptool.engine.offline`) over the
model's step engine (:class:`~looptool.runtime.step_engine.TorchStepEngine`: its cached budget
paths, built and kept by :mod:`looptool.runtime.decode_graphs`), the core ``looptool serve``
drives too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow, RowBudgets, wants_auto
from looptool.engine.offline import generate_batch
from looptool.engine.outputs import GenerationOutput
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.engine.speculation import Speculation
from looptool.runtime.adaptive import AutoDepth, check_auto_policy
from looptool.runtime.step_engine import TorchStepEngine

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork

log = logging.getLogger(__name__)

DERIVED_KEY = "step_engines"  # the entry of ``LoopedNetwork.derived`` that holds a model's step engines


def row_budgets(model: LoopedNetwork, budget, batch: int) -> RowBudgets:
    """Each row's budget from ``budget`` (see :meth:`looptool.engine.budgets.RowBudgets.resolve`;
    None: the model's default budget), checked against the model's menu once."""
    return RowBudgets.resolve(budget, model.budgets, batch, default=model.default_budget)


def check_generation_args(input_ids, max_new_tokens) -> None:
    """One clear error for an empty prompt or a bad ``max_new_tokens``."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise LooptoolError(f"the prompt is empty (input_ids shape {tuple(input_ids.shape)}); give at least one token.")
    check_max_new_tokens(max_new_tokens)


def check_max_new_tokens(max_new_tokens) -> None:
    """One clear error for a ``max_new_tokens`` that is not a non-negative integer (needs no
    model: callers check it before a slow load)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise LooptoolError(
            f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}.", parameter="max_new_tokens"
        )


@torch.no_grad()
def generate(
    model: LoopedNetwork,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    budget: int | Sequence[int] | torch.Tensor | str | None = None,
    max_new_tokens: int = 32,
    kv: str | None = None,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
    draft_budget: int | None = None,
    draft_tokens: int = 4,
    min_budget: int | None = None,
    max_budget: int | None = None,
    exit_threshold: float | None = None,
    exit_rule: str | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens per row at ``budget`` with a KV cache.

    ``budget`` is one budget for every row, or one per row (a list, a 1-D integer tensor or a
    :class:`~looptool.engine.budgets.RowBudgets` resolved before):
    rows of different budgets then run together through :func:`rowwise_path`, each exactly
    at its own budget; a batch whose rows share one budget runs that budget's own path.

    ``input_ids [batch, prompt]`` may be left-padded (``attention_mask`` 0 on padding).
    ``sampling`` (:class:`~looptool.engine.sampling.SamplingParams`, default greedy) says how
    each token is chosen: ``SamplingParams(temperature=0.8, top_p=0.9, seed=0)`` samples. Rows
    stop at ``eos_token_id`` (then emit ``pad_token_id``); the call stops when all rows
    have stopped. ``on_step(tokens)`` is called with each step's ``[batch]`` new tokens and
    ends the generation early by returning True;
    ``output_logits=True`` keeps each step's next-token logits. ``kv`` is the KV cache policy
    (None: ``"per-loop"``, or ``"last-loop"`` for ``budget="auto"``).

    ``draft_budget=j`` decodes speculatively (:mod:`looptool.engine.rounds`): budget ``j``
    (shallower than ``budget``, one budget for every row) drafts ``draft_tokens`` tokens, the
    budget asked for scores them in one step and keeps what it agrees with, so the output is
    budget ``budget``'s own (token for token when greedy, in distribution when sampling);
    ``speculation`` in the result counts the drafts kept.

    ``budget="auto"`` decides each row's depth per token (:mod:`looptool.runtime.adaptive`):
    between ``min_budget`` and ``max_budget`` (default: the menu's ends) a row goes on while its
    relative state change reaches ``exit_threshold`` (``exit_rule="kl"``: the KL divergence of
    successive next-token distributions instead); ``depths`` reports each token's depth.
    """
    check_generation_args(input_ids, max_new_tokens)
    batch = input_ids.shape[0]
    spec = None
    if wants_auto(budget, min_budget, max_budget, exit_threshold, exit_rule):
        if draft_budget is not None:
            raise LooptoolError(
                "speculative decoding needs a fixed budget, not budget='auto'.", parameter="draft_budget"
            )
        settings = AutoDepth.resolve(model, min_budget, max_budget, exit_threshold, exit_rule)
        engine = step_engine(model, check_auto_policy(model, kv), settings.exit_rule)
        rows: RowBudgets | None = None
        budgets = [AutoRow(settings.min_budget, settings.max_budget, settings.exit_threshold)] * batch
    else:
        kv = "per-loop" if kv is None else kv
        rows = row_budgets(model, budget, batch)
        if draft_budget is not None:
            if not rows.uniform:
                raise LooptoolError("speculative decoding takes one budget for every row.", parameter="draft_budget")
            spec = Speculation(draft_budget, draft_tokens).check(rows.rows[0], model.budgets, kv)
        engine = step_engine(model, kv)
        budgets = list(rows.rows)
    out = generate_batch(
        engine,
        input_ids,
        attention_mask,
        budgets,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        on_step=on_step,
        output_logits=output_logits,
        speculation=spec,
        device=next(model.parameters()).device,
    )
    return out if rows is None else _with_costs(model, out, rows)


def step_engine(model: LoopedNetwork, kv: str, exit_rule: str = "state") -> TorchStepEngine:
    """``model``'s step engine for ``kv`` (rows of adaptive depth stopping by ``exit_rule``),
    kept with the model (dropped when it moves) so its paths are bound once."""
    engines = model.derived.setdefault(DERIVED_KEY, {})
    key = (kv, exit_rule)
    if key not in engines:
        engines[key] = TorchStepEngine(model, kv=kv, exit_rule=exit_rule)
    return engines[key]


def _with_costs(model: LoopedNetwork, out: GenerationOutput, rows: RowBudgets) -> GenerationOutput:
    """``out`` with each row's budget and its cost-table row."""
    costs = {c.budget: c for c in model.cost_table()}
    return dataclasses.replace(out, budgets=rows.rows, row_costs=tuple(costs[k] for k in rows.rows))
