"""Running one onnxruntime serving graph with bound caches: :class:`CacheBinding` binds one
graph's caches once, as both ``past`` input and ``present`` output, so every step writes its
keys and values in place; a row-wise graph (:data:`~looptool.core.graph.ROWWISE`) also gets
each row's budget, an adaptive-depth graph (:mod:`looptool.backends.onnx.adaptive`) each row's
``min_budget``, ``max_budget`` and ``exit_threshold``, and returns each row's depth. Several
bindings may share one set of cache buffers (``caches``: speculative decoding's draft, verify
and prefill graphs over one cache, :mod:`looptool.backends.ort.speculative`).
"""

from __future__ import annotations

import numpy as np

from looptool.backends.errors import EngineError
from looptool.backends.interface import BUDGETS, DEPTH, INPUTS, LOGITS, CacheLayout, row_inputs
from looptool.core.dtypes import named
from looptool.engine.budgets import RowBudgets
from looptool.passes.adaptive_depth import AUTO_INPUTS, MIN_BUDGET


class CacheBinding:
    """One generate call's IOBinding: caches allocated once and bound as both past and
    present, the mask and the logits bound once; each step rebinds only the step inputs.
    ``budgets`` (each row's budget) is bound once for a row-wise graph; for an adaptive-depth
    graph its :meth:`~looptool.engine.budgets.RowBudgets.depth_inputs`, and each step's depths
    are written into :attr:`depth` (int64 ``[batch]``). ``caches`` (default: zeroed ones of
    ``capacity`` positions) are the buffers to bind, in the layout's order, e.g. another
    binding's; ``steps``: the positions the graph returns logits for (1, or a verify graph's
    step length, fixed for the binding)."""

    def __init__(
        self,
        session,
        layout: CacheLayout,
        batch: int,
        capacity: int,
        vocab_size: int | None = None,
        budgets: RowBudgets | None = None,
        caches: list[np.ndarray] | None = None,
        steps: int = 1,
    ):
        import onnxruntime as ort

        self.session = session
        dtype = named(layout.dtype).numpy  # a layout's dtype is float32, float16 or bfloat16
        if dtype is None:
            raise EngineError(
                f"the engine's cache dtype {layout.dtype} cannot be allocated by this runtime; export in float32 or float16."
            )
        shapes = [(batch, p.kv_heads, capacity, p.head_dim) for p in layout.pairs for _ in "kv"]
        if caches is None:
            caches = [np.zeros(shape, dtype=dtype) for shape in shapes]
        if [(c.shape, c.dtype) for c in caches] != [(shape, np.dtype(dtype)) for shape in shapes]:
            raise EngineError("the cache buffers given do not match the graph's cache layout in the manifest.")
        self.caches = list(caches)
        self.kv_bytes = sum(c.nbytes for c in self.caches)
        past, present = layout.names()
        graph_inputs = {i.name for i in session.get_inputs()}
        graph_outputs = [o.name for o in session.get_outputs()]
        adaptive = MIN_BUDGET in graph_inputs
        step_inputs = set(AUTO_INPUTS) if adaptive else {*INPUTS, BUDGETS} if budgets is not None else set(INPUTS)
        heads = [LOGITS, DEPTH] if adaptive else [LOGITS]
        if adaptive and budgets is None:
            raise EngineError("the adaptive-depth graph needs each row's depth range; pass budgets.")
        if graph_inputs != {*step_inputs, *past} or graph_outputs != [*heads, *present]:
            raise EngineError(
                "the graph's inputs and outputs do not match the cache layout in the manifest; export the engine again."
            )
        vocab = session.get_outputs()[0].shape[-1]
        vocab = vocab if isinstance(vocab, int) else vocab_size  # flat exports name the axis
        self.logits = np.zeros((batch, steps, vocab or 0), dtype=dtype)
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
        self.depth = np.zeros(batch, dtype=np.int64)
        if adaptive:
            self._depth_value = ort.OrtValue.ortvalue_from_numpy(self.depth)
            self.io.bind_ortvalue_output(DEPTH, self._depth_value)
        if budgets is not None:  # fixed for the whole call: bound once (the arrays stay referenced)
            self._extras = row_inputs(budgets, adaptive)
            self._extra_values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._extras.values()]
            for name, value in zip(self._extras, self._extra_values):
                self.io.bind_ortvalue_input(name, value)
        self._mask = None

    def step(self, ids, mask, position, cache_position):
        """One cached step; returns the next-token logits ``[batch, vocab]`` as a torch tensor
        (over the bound logits buffer: the next step overwrites it)."""
        import torch

        return torch.from_numpy(self.run(ids, mask, position, cache_position)[:, -1])

    def run(self, ids, mask, position, cache_position) -> np.ndarray:
        """One cached step (torch tensors in); returns the graph's logits ``[batch, steps, vocab]``
        (the bound buffer where the vocabulary is known)."""
        if self._mask is not mask:  # bound once over the tensor's memory: the loop updates it in place
            import onnxruntime as ort

            self._mask_value = ort.OrtValue.ortvalue_from_numpy(mask.numpy())
            self.io.bind_ortvalue_input("attention_mask", self._mask_value)
            self._mask = mask
        self.io.bind_cpu_input("input_ids", ids.numpy())
        self.io.bind_cpu_input("position_ids", position.numpy())
        self.io.bind_cpu_input("cache_position", cache_position.numpy())
        self.session.run_with_iobinding(self.io)
        return self.logits if self.logits.shape[-1] else self.io.copy_outputs_to_cpu()[0]
