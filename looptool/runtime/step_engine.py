"""The PyTorch step engine (:class:`looptool.engine.StepEngine`) over a looped model, and the
``pytorch`` runtime of :func:`looptool.engine.open_engine`: a looped model directory.

The slot cache holds one buffer per cache input of the row-wise-budget path (the deepest
budget's slots). Mixed budgets run the row-wise path
(:func:`looptool.runtime.decode_graphs.rowwise_path`: every row exactly at its own budget,
Accordion Eq. 1 / ELR Eq. 2); rows that all share one budget run that budget's own cached
path on the matching cache buffers, so a uniform batch costs what that budget costs.

Under last-loop KV, a step with a row of adaptive depth (:attr:`RowBudgets.auto`) runs the
adaptive-depth path (:func:`looptool.runtime.decode_graphs.adaptive_path`, exit rule fixed per
engine) for the whole slice, every fixed row ``k`` as ``min_budget = max_budget = k`` (exactly
budget ``k``), on the slot-cache buffers its cache inputs name (the deepest budget's slots, like
the row-wise path's).

Under per-loop KV it also runs self-speculative decoding's verify step
(:class:`~looptool.engine.StepBatch` ``every_position``): each budget's verify path, logits at every position, on the
buffers of that budget's own path (the same cache inputs, in the same order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.core.graph import ADAPTIVE, ROWWISE
from looptool.engine.budgets import PER_LOOP_AUTO
from looptool.engine.interface import (
    Capabilities,
    StepBatch,
    StepEngine,
    StepResult,
    TensorSlotCache,
)
from looptool.engine.prefix_cache import CacheGroup, cache_groups
from looptool.engine.speculation import LAST_LOOP_VERIFY
from looptool.passes.adaptive_depth import check_exit_rule
from looptool.runtime.decode_graphs import (
    CachedPath,
    adaptive_path,
    cached_paths,
    check_policy,
    rowwise_path,
    verify_paths,
)

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork


class TorchStepEngine(StepEngine):
    """Cached steps of a :class:`~looptool.runtime.network.LoopedNetwork` over slot-cache rows,
    each row at its own budget; rows of adaptive depth (under last-loop KV) decide theirs per
    token by ``exit_rule`` (``state`` or ``kl``)."""

    def __init__(self, model: LoopedNetwork, kv: str = "per-loop", exit_rule: str = "state"):
        self.model = model
        self.kv = check_policy(model, kv)
        self.exit_rule = check_exit_rule(exit_rule)
        self.budgets: tuple[int, ...] = tuple(model.budgets)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(text.vocab_size)
        self.mask_dtype: torch.dtype = model.mask_dtype
        deepest = max(self.budgets)
        # the slot cache's buffers: the deepest budget's cache inputs (a superset of every budget's)
        self.slots = cached_paths(model, self.kv, [deepest])[deepest].slots
        self._paths: dict[int | str, tuple[CachedPath, list[int]]] = {}  # built on first use
        per_loop = self.kv == "per-loop"
        self.capabilities = Capabilities(
            self.kv,
            str(next(model.parameters()).dtype).removeprefix("torch."),
            None
            if not per_loop
            else LooptoolError(f"adaptive depth needs the last-loop KV policy: {PER_LOOP_AUTO}", parameter="kv"),
            None
            if per_loop
            else LooptoolError(f"a verify step needs the per-loop KV policy: {LAST_LOOP_VERIFY}", parameter="kv"),
        )

    def allocate(self, slots: int, length: int) -> TensorSlotCache:
        """Zeroed persistent caches, every buffer ``[slots, kv_heads, length, head_dim]``."""
        param = next(self.model.parameters())
        buffers = [
            torch.zeros(slots, s.kv_heads, length, s.head_dim, dtype=param.dtype, device=param.device)
            for s in self.slots
        ]
        return TensorSlotCache(buffers, tuple(s.name for s in self.slots))

    def path(self, key: int | str) -> tuple[CachedPath, list[int]]:
        """The path ``key`` runs (a budget's own, :data:`ROWWISE` or :data:`ADAPTIVE`) and, per
        cache input of it, the slot-cache buffer it reads (matched by name, and checked to be
        the same layer, kind and execution); built on first use."""
        if key not in self._paths:
            if key == ROWWISE:
                path = rowwise_path(self.model, self.kv)
            elif key == ADAPTIVE:
                path = adaptive_path(self.model, self.kv, self.exit_rule)
            else:
                path = cached_paths(self.model, self.kv, [key])[key]
            self._paths[key] = (path, self._buffers_of(path, key))
        return self._paths[key]

    def _buffers_of(self, path: CachedPath, key: int | str) -> list[int]:
        """The buffer index of each of ``path``'s cache inputs."""
        by_name = {s.name: i for i, s in enumerate(self.slots)}
        index = []
        for slot in path.slots:
            i = by_name.get(slot.name)
            if i is None or self.slots[i] != slot:
                raise LooptoolError(
                    f"the {key} path's cache input {slot.name!r} (layer {slot.layer}, {slot.kind}) is not a buffer "
                    "of the slot cache."
                )
            index.append(i)
        return index

    @torch.no_grad()
    def run(self, cache: TensorSlotCache, batch: StepBatch) -> StepResult:
        """Run ``batch`` on views of its rows that end at the mask's width (written in place,
        attention reads only those positions): rows of mixed budgets on the row-wise path, rows
        of one budget on that budget's own path, a batch with an adaptive row on the
        adaptive-depth path (every fixed row ``k`` as ``min_budget = max_budget = k``), and a
        verify batch (logits at every position) on each budget's verify path
        (:func:`~looptool.runtime.decode_graphs.verify_paths`, built on first use), one run of
        rows sharing a budget at a time."""
        self.capabilities.check(batch)
        budgets, width = batch.budgets, batch.attention_mask.shape[1]
        start, stop = batch.rows.indices(cache.slots)[:2]
        if batch.every_position:
            paths = verify_paths(self.model, self.kv, sorted(set(budgets.rows)))
            out = []
            for k, part in budgets.runs():
                views = [b[start + part.start : start + part.stop, :, :width] for b in cache.buffers]
                step = (t[part] for t in batch.inputs[:3])
                own = self.path(k)[1]  # a verify path reads its budget's own path's cache inputs
                out.append(paths[k].module(*step, batch.cache_position, *(views[i] for i in own)).float())
            return StepResult(torch.cat(out), budgets.tensor())
        views = [b[start:stop, :, :width] for b in cache.buffers]
        if budgets.adaptive:
            path, index = self.path(ADAPTIVE)
            depth_inputs = budgets.depth_inputs(batch.input_ids.device)
            logits, depths = path.module(*batch.inputs, *depth_inputs, *(views[i] for i in index))
            return StepResult(logits[:, -1].float(), depths.cpu())
        key = budgets.graph(self.budgets)  # one budget: its own path on its own buffers
        path, index = self.path(key)
        extra = (budgets.tensor(batch.input_ids.device),) if key == ROWWISE else ()
        logits = path.module(*batch.inputs, *extra, *(views[i] for i in index))
        return StepResult(logits[:, -1].float(), budgets.tensor())

    def budget_buffers(self, budget: int) -> tuple[int, ...]:
        """The buffers ``budget``'s own path reads."""
        return tuple(self.path(budget)[1])

    def prefix_groups(self, budget: int) -> tuple[CacheGroup, ...]:
        """The buffers of ``budget``'s own path, those of the layers before the loop shared by
        every budget."""
        buffers = [(s.layer, s.execution) for s in self.slots]
        return cache_groups(buffers, self.budget_buffers(budget), self.model.plan.looped_layers().start, budget)

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """float32 log-softmax over the vocabulary at every position, ``[T, vocab]`` (full forward)."""
        logits = self.model(input_ids, budget=self.model.check_budget(budget)).logits
        return torch.log_softmax(logits[0].float(), dim=-1)
