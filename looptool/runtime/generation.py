"""Text generation at any budget with a KV cache (ELR Sec. 3.4, Accordion Eq. 6): the
prefill-then-decode loop every runtime shares (:func:`decode_loop`) and :func:`generate`, which
runs it over a model's cached budget paths (built and kept by
:mod:`looptool.runtime.decode_graphs`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine.budgets import RowBudgets
from looptool.engine.sampling import GREEDY, SamplingParams, TokenPicker
from looptool.engine.speculation import Speculation
from looptool.runtime.adaptive import AutoDepth, AutoStep, wants_auto
from looptool.runtime.decode_graphs import allocate_cache, cached_paths, rowwise_path
from looptool.runtime.outputs import GenerationOutput, position_ids

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork

log = logging.getLogger(__name__)


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


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_loop(
    step: Step,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    capacity: int,
    max_new_tokens: int,
    mask_dtype: torch.dtype,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
    kv_bytes: int = 0,
) -> GenerationOutput:
    """The prefill-then-decode loop shared by every runtime (PyTorch paths, exported engines).

    ``step(ids, attention_mask, position_ids, cache_position)`` runs one cached step and
    returns the next-token logits ``[batch, vocab]``; the loop owns the
    ``[batch, capacity]`` mask (updated in place, so a runtime may bind it once), picks
    tokens under ``sampling``, stops rows at EOS and times both phases.
    """
    device = input_ids.device
    batch, prompt = input_ids.shape
    if prompt + max_new_tokens > capacity:
        raise LooptoolError(
            f"the prompt ({counted(prompt, 'token')}) plus {counted(max_new_tokens, 'new token')} exceed the cache capacity "
            f"of {capacity}; raise the capacity or generate fewer tokens."
        )
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    pick = TokenPicker(sampling, device)
    mask = torch.zeros(batch, capacity, dtype=mask_dtype, device=device)
    mask[:, :prompt] = 1 if attention_mask is None else attention_mask.to(device=device, dtype=mask_dtype)
    ids = input_ids
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    position = position_ids(mask[:, :prompt])
    t0 = time.perf_counter()
    logits = step(ids, mask, position, torch.arange(prompt, device=device))
    prefill = time.perf_counter() - t0
    steps = 0
    kept: list[torch.Tensor] = []
    t1 = time.perf_counter()
    for i in range(max_new_tokens):
        if i > 0:
            slot = prompt + i - 1
            mask[:, slot] = 1
            position = position[:, -1:] + 1
            logits = step(ids[:, -1:], mask, position, torch.tensor([slot], device=device))
        if output_logits:
            kept.append(logits.clone())
        token = pick(logits, ids)
        token = torch.where(done, torch.full_like(token, pad), token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        steps += 1
        if on_step is not None and on_step(token):
            break  # the caller's stop condition (e.g. a stop string) holds for every row
        if len(eos):
            done |= torch.isin(token, eos)
            if bool(done.all()):
                break
    decode = time.perf_counter() - t1
    return GenerationOutput(ids, steps, prefill, decode, kv_bytes, kv_bytes / (batch * capacity), tuple(kept))


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

    ``draft_budget=j`` decodes speculatively (:mod:`looptool.runtime.speculative`): budget ``j``
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
    batch, prompt = input_ids.shape
    capacity = prompt + max_new_tokens
    if wants_auto(budget, min_budget, max_budget, exit_threshold, exit_rule):
        if draft_budget is not None:
            raise LooptoolError(
                "speculative decoding needs a fixed budget, not budget='auto'.", parameter="draft_budget"
            )
        settings = AutoDepth.resolve(model, min_budget, max_budget, exit_threshold, exit_rule)
        auto = AutoStep(model, batch, capacity, settings, kv)
        step, device, kv_bytes = auto, auto.device, auto.kv_bytes

        def finish(out: GenerationOutput) -> GenerationOutput:
            return dataclasses.replace(out, depths=auto.depths(out.new_tokens))

    else:
        kv = "per-loop" if kv is None else kv
        rows = row_budgets(model, budget, batch)
        if draft_budget is not None:
            if not rows.uniform:
                raise LooptoolError("speculative decoding takes one budget for every row.", parameter="draft_budget")
            spec = Speculation(draft_budget, draft_tokens).check(rows.rows[0], model.budgets, kv)
            if max_new_tokens > 1:
                from looptool.runtime.speculative import speculative_generate

                out = speculative_generate(
                    model,
                    input_ids,
                    attention_mask=attention_mask,
                    budget=rows.rows[0],
                    speculation=spec,
                    max_new_tokens=max_new_tokens,
                    kv=kv,
                    sampling=sampling,
                    eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id,
                    on_step=on_step,
                    output_logits=output_logits,
                )
                return _with_costs(model, out, rows)
        path = cached_paths(model, kv, rows.rows[:1])[rows.rows[0]] if rows.uniform else rowwise_path(model, kv)
        param = next(model.parameters())
        caches = allocate_cache(path, batch, capacity, dtype=param.dtype, device=param.device)
        extra = () if rows.uniform else (rows.tensor(param.device),)
        device, kv_bytes = param.device, sum(c.numel() * c.element_size() for c in caches)

        def step(ids, mask, position, cache_position):
            return path.module(ids, mask, position, cache_position, *extra, *caches)[:, -1]

        def finish(out: GenerationOutput) -> GenerationOutput:
            return _with_costs(model, out, rows)

    out = decode_loop(
        step,
        input_ids.to(device),
        attention_mask,
        capacity=capacity,
        max_new_tokens=max_new_tokens,
        mask_dtype=model.mask_dtype,
        sampling=sampling,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        on_step=on_step,
        output_logits=output_logits,
        kv_bytes=kv_bytes,
    )
    return finish(out)


def _with_costs(model: LoopedNetwork, out: GenerationOutput, rows: RowBudgets) -> GenerationOutput:
    """``out`` with each row's budget and its cost-table row."""
    costs = {c.budget: c for c in model.cost_table()}
    return dataclasses.replace(out, budgets=rows.rows, row_costs=tuple(costs[k] for k in rows.rows))
