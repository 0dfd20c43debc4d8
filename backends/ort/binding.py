"""Running one onnxruntime serving graph with bound caches: request checks and the IOBinding.

:func:`check_request` checks a generate request against an engine's manifest (shared by
every runtime); :class:`CacheBinding` binds one graph's caches once, as both ``past`` input
and ``present`` output, so every step writes its keys and values in place; a row-wise graph
(:data:`~looptool.backends.onnx_format.ROWWISE`) also gets each row's budget.
"""

from __future__ import annotations

import numpy as np

from looptool.backends.onnx_format import EngineError
from looptool.backends.serving import BUDGETS, INPUTS, LOGITS, CacheLayout
from looptool.engine.budgets import RowBudgets


def check_request(
    manifest: dict,
    input_ids,
    attention_mask,
    max_new_tokens: int,
    capacity: int | None,
):
    """A generate request checked against an engine's manifest (any runtime): ``(input_ids
    as a LongTensor [batch, prompt], attention_mask or None, cache capacity)``; one
    sentence for each thing that is wrong."""
    import torch

    from looptool.runtime.generation import check_generation_args

    vocab_size = manifest.get("source_config", {}).get("vocab_size")
    ids = input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else torch.from_numpy(np.asarray(input_ids))
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise EngineError(f"input_ids must be [batch, sequence] with at least one token, got shape {tuple(ids.shape)}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise EngineError(f"input_ids must be integer token ids, got {ids.dtype}.")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise EngineError(
            f"input_ids must lie in [0, {vocab_size}), got values from {int(ids.min())} to {int(ids.max())}."
        )
    ids = ids.long()
    mask = None
    if attention_mask is not None:
        mask = (
            attention_mask.detach().cpu()
            if isinstance(attention_mask, torch.Tensor)
            else torch.from_numpy(np.asarray(attention_mask))
        )
        if tuple(mask.shape) != tuple(ids.shape):
            raise EngineError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}; they must match."
            )
    check_generation_args(ids, max_new_tokens)
    prompt = ids.shape[1]
    capacity = prompt + max_new_tokens if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < prompt:
        raise EngineError(
            f"the prompt has {prompt} tokens, more than the cache capacity {capacity}; raise the capacity."
        )
    limit = manifest.get("source_config", {}).get("max_position_embeddings")
    if limit is not None and capacity > limit:
        raise EngineError(
            f"a cache of {capacity} tokens exceeds the model's {limit} positions; use a shorter prompt or fewer new tokens."
        )
    return ids, mask, int(capacity)


def check_row_budgets(budget, menu: tuple[int, ...] | None, batch: int) -> np.ndarray | None:
    """Per-row budgets as int64 ``[batch]``, or None where ``budget`` is one budget for all
    rows (an int or None; checked by the caller). With ``menu`` None only that distinction
    is made; otherwise one sentence for a non-integer, a list whose length is not the batch,
    or a budget not in ``menu``."""
    if isinstance(budget, RowBudgets):
        budget = list(budget.rows)
    if not isinstance(budget, (list, tuple)) and getattr(budget, "ndim", 0) == 0:
        return None  # one budget (or something the single-budget check refuses)
    if menu is None:
        return np.zeros(0, np.int64)
    return np.asarray(RowBudgets.resolve(budget, menu, batch, error=EngineError).rows, dtype=np.int64)


def row_costs(manifest: dict, budgets: tuple[int, ...]) -> tuple:
    """Each row's per-token cost (:class:`~looptool.core.plan.BudgetCost`) from the manifest's
    cost table; empty for an engine exported before it was recorded."""
    from looptool.core.plan import BudgetCost

    table = {int(c["budget"]): BudgetCost(**c) for c in manifest.get("costs") or []}
    return tuple(table[k] for k in budgets) if all(k in table for k in budgets) else ()


class CacheBinding:
    """One generate call's IOBinding: caches allocated once and bound as both past and
    present, the mask and the logits bound once; each step rebinds only the step inputs.
    ``budgets`` (int64 ``[batch]``, each row's budget) is bound once for a row-wise graph."""

    def __init__(
        self,
        session,
        layout: CacheLayout,
        batch: int,
        capacity: int,
        vocab_size: int | None = None,
        budgets: np.ndarray | None = None,
    ):
        import onnxruntime as ort

        self.session = session
        dtype = {"float32": np.float32, "float16": np.float16}.get(layout.dtype)
        if dtype is None:
            raise EngineError(
                f"the engine's cache dtype {layout.dtype} cannot be allocated by this runtime; export in float32 or float16."
            )
        self.caches = [
            np.zeros((batch, p.kv_heads, capacity, p.head_dim), dtype=dtype) for p in layout.pairs for _ in "kv"
        ]
        self.kv_bytes = sum(c.nbytes for c in self.caches)
        past, present = layout.names()
        graph_inputs = {i.name for i in session.get_inputs()}
        graph_outputs = [o.name for o in session.get_outputs()]
        step_inputs = {*INPUTS, BUDGETS} if budgets is not None else set(INPUTS)
        if graph_inputs != {*step_inputs, *past} or graph_outputs != [LOGITS, *present]:
            raise EngineError(
                "the graph's inputs and outputs do not match the cache layout in the manifest; export the engine again."
            )
        vocab = session.get_outputs()[0].shape[-1]
        vocab = vocab if isinstance(vocab, int) else vocab_size  # flat exports name the axis
        self.logits = np.zeros((batch, 1, vocab or 0), dtype=dtype)
        self.io = session.io_binding()
        self._values = [ort.OrtValue.ortvalue_from_numpy(c) for c in self.caches]
        for name_in, name_out, value in zip(past, present, self._values):
            self.io.bind_ortvalue_input(name_in, value)
            self.io.bind_ortvalue_output(name_out, value)  # the same buffer: written in place
        if self.logits.shape[-1]:
            self._logits_value = ort.OrtValue.ortvalue_from_numpy(self.logits)
            self.io.bind_ortvalue_output(LOGITS, self._logits_value)
        else:
            self.io.bind_output(LOGITS)
        if budgets is not None:  # fixed for the whole call: bound once (the array stays referenced)
            self.budgets = np.ascontiguousarray(budgets, dtype=np.int64)
            self._budgets_value = ort.OrtValue.ortvalue_from_numpy(self.budgets)
            self.io.bind_ortvalue_input(BUDGETS, self._budgets_value)
        self._mask = None

    def step(self, ids, mask, position, cache_position):
        """One cached step; returns the next-token logits ``[batch, vocab]`` as a torch tensor."""
        import torch

        if self._mask is not mask:  # bound once over the tensor's memory: the loop updates it in place
            import onnxruntime as ort

            self._mask_value = ort.OrtValue.ortvalue_from_numpy(mask.numpy())
            self.io.bind_ortvalue_input("attention_mask", self._mask_value)
            self._mask = mask
        self.io.bind_cpu_input("input_ids", ids.numpy())
        self.io.bind_cpu_input("position_ids", position.numpy())
        self.io.bind_cpu_input("cache_position", cache_position.numpy())
        self.session.run_with_iobinding(self.io)
        if self.logits.shape[-1]:
            return torch.from_numpy(self.logits[:, -1])
        return torch.from_numpy(self.io.copy_outputs_to_cpu()[0][:, -1])
