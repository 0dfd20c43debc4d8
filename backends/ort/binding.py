"""Running one onnxruntime serving graph with bound caches: :class:`CacheBinding` binds one
graph's caches once, as both ``past`` input and ``present`` output, so every step writes its
keys and values in place; a row-wise graph (:data:`~looptool.core.graph.ROWWISE`) also gets
each row's budget.
"""

from __future__ import annotations

import numpy as np

from looptool.backends.errors import EngineError
from looptool.backends.serving import BUDGETS, INPUTS, LOGITS, CacheLayout
from looptool.core.dtypes import named
from looptool.engine.budgets import RowBudgets


class CacheBinding:
    """One generate call's IOBinding: caches allocated once and bound as both past and
    present, the mask and the logits bound once; each step rebinds only the step inputs.
    ``budgets`` (each row's budget) is bound once for a row-wise graph."""

    def __init__(
        self,
        session,
        layout: CacheLayout,
        batch: int,
        capacity: int,
        vocab_size: int | None = None,
        budgets: RowBudgets | None = None,
    ):
        import onnxruntime as ort

        self.session = session
        dtype = named(layout.dtype).numpy  # a layout's dtype is float32, float16 or bfloat16
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
            self.budgets = np.asarray(budgets.rows, dtype=np.int64)
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
