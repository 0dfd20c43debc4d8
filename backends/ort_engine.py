"""The onnxruntime step engine: what a server drives to decode rows of different budgets.

:class:`OrtStepEngine` has the surface of :class:`looptool.runtime.step_engine.TorchStepEngine`
(see :mod:`looptool.backends.serving`) over an exported engine's graphs: one persistent
:class:`~looptool.runtime.step_engine.SlotCache` of numpy buffers, laid out like the row-wise
graph's caches (the deepest budget's pairs; :class:`ArraySlotCache`); each :meth:`OrtStepEngine.step` binds views of
the rows it serves (``buffer[a:b]``, contiguous, no copy) as both ``past`` input and
``present`` output, so the graph writes this step's keys and values in place. Rows of
different budgets run the row-wise graph; rows that all share a budget run that budget's own,
cheaper graph on the matching cache pairs (same ``(layer, execution)``), which hold exactly
what the row-wise graph would have written for those rows.
"""

from __future__ import annotations

import numpy as np
import torch

from looptool.backends.onnx_format import ROWWISE, EngineError
from looptool.backends.serving import BUDGETS, INPUTS, LOGITS, CacheLayout, past_name, present_name
from looptool.runtime.step_engine import SlotCache

_BINDINGS_KEPT = 64  # cached IOBindings (one per graph, row slice and cache)


class ArraySlotCache(SlotCache):
    """A :class:`~looptool.runtime.step_engine.SlotCache` over numpy buffers (bound in place
    by onnxruntime); the same rows, positions and operations."""

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers together."""
        return sum(b.nbytes for b in self.buffers)

    def copy_row(self, src: int, dst: int) -> None:
        """Every buffer: ``buf[dst] = buf[src]``."""
        if src != dst:
            for b in self.buffers:
                b[dst] = b[src]

    def shift_left(self, n: int) -> None:
        """Every buffer: positions ``[n:]`` move to ``[:length - n]`` (the rest keeps its values)."""
        if not 0 <= n <= self.length:
            raise EngineError(f"cannot shift a cache of {self.length} positions by {n}.", parameter="n")
        if n:
            for b in self.buffers:
                b[:, :, : self.length - n] = b[:, :, n:]  # numpy copies overlapping ranges safely


class OrtStepEngine:
    """Cached decode steps over slices of one slot cache, every row at its own budget, with
    an onnxruntime :class:`~looptool.backends.ort.Runtime` whose engine holds the row-wise
    graph for ``kv``."""

    def __init__(self, runtime, kv: str = "per-loop"):
        self.runtime = runtime
        self.kv = kv
        self.budgets: tuple[int, ...] = tuple(sorted(runtime.rowwise_menu(kv)))  # refuses a missing graph
        self.layout: CacheLayout = runtime.layout(ROWWISE, kv)
        if runtime.vocab_size is None:
            raise EngineError("the engine's manifest does not record the vocabulary size; export it again.")
        self.vocab_size = int(runtime.vocab_size)
        self.mask_dtype: torch.dtype = getattr(torch, str(runtime.mask_dtype))
        self._dtype = {"float32": np.float32, "float16": np.float16}.get(self.layout.dtype)
        if self._dtype is None:
            raise EngineError(f"cache dtype {self.layout.dtype} cannot be held in numpy; export in float32 or float16.")
        index = {(p.layer, p.execution): j for j, p in enumerate(self.layout.pairs)}
        self._pairs: dict[int | str, list[int]] = {ROWWISE: list(range(len(self.layout.pairs)))}
        for budget in set(runtime.budgets) & set(self.budgets):  # budgets with a graph of their own
            pairs = runtime.layout(budget, kv).pairs
            if all((p.layer, p.execution) in index for p in pairs):
                self._pairs[budget] = [index[p.layer, p.execution] for p in pairs]
        self._bindings: dict[tuple, tuple] = {}

    def allocate(self, slots: int, length: int) -> ArraySlotCache:
        """Zeroed persistent caches, every buffer ``[slots, kv_heads, length, head_dim]``."""
        if slots < 1 or length < 1:
            raise EngineError(f"a slot cache needs at least one slot and one position, got {slots} x {length}.")
        return ArraySlotCache(
            [
                np.zeros((slots, p.kv_heads, length, p.head_dim), dtype=self._dtype)
                for p in self.layout.pairs
                for _ in "kv"
            ]
        )

    def step(
        self, cache: SlotCache, rows: slice, input_ids, attention_mask, position_ids, cache_position, budgets
    ) -> torch.Tensor:
        """One cached step over cache rows ``rows`` (``input_ids [R, T]``, ``attention_mask
        [R, length]``, ``position_ids [R, T]``, ``cache_position [T]``, ``budgets [R]``);
        returns float32 next-token logits ``[R, vocab]`` (last position)."""
        start, stop, stride = rows.indices(len(cache.buffers[0]))
        row_budgets = _numpy(budgets).astype(np.int64, copy=False).reshape(-1)
        if stride != 1 or stop - start != len(row_budgets) or stop <= start:
            raise EngineError(
                f"rows {rows} must be a contiguous, non-empty slice of the cache with one budget per row "
                f"({len(row_budgets)} given)."
            )
        unknown = sorted(set(row_budgets.tolist()) - set(self.budgets))
        if unknown:
            raise EngineError(f"budget {unknown[0]} is not in this engine's budgets {list(self.budgets)}.")
        first = int(row_budgets[0])
        key = first if (row_budgets == first).all() and first in self._pairs else ROWWISE
        io, logits = self._binding(cache, key, start, stop)
        io.bind_cpu_input(INPUTS[0], _numpy(input_ids).astype(np.int64, copy=False))
        io.bind_cpu_input(INPUTS[1], _numpy(attention_mask).astype(self.runtime.mask_dtype, copy=False))
        io.bind_cpu_input(INPUTS[2], _numpy(position_ids).astype(np.int64, copy=False))
        io.bind_cpu_input(INPUTS[3], _numpy(cache_position).astype(np.int64, copy=False))
        if key == ROWWISE:
            io.bind_cpu_input(BUDGETS, np.ascontiguousarray(row_budgets))
        self.runtime.session(key, self.kv).run_with_iobinding(io)
        return torch.from_numpy(logits[:, -1].astype(np.float32))

    def _binding(self, cache: SlotCache, key: int | str, start: int, stop: int):
        """The IOBinding of graph ``key`` over rows ``[start, stop)`` of ``cache``: views of the
        buffers bound as past and present, and a logits buffer; made once per combination."""
        import onnxruntime as ort

        ident = (key, start, stop, *map(id, cache.buffers))
        found = self._bindings.get(ident)
        if found is not None:
            return found[0], found[1]
        if len(self._bindings) >= _BINDINGS_KEPT:
            self._bindings.clear()
        io = self.runtime.session(key, self.kv).io_binding()
        values = []
        for local, j in enumerate(self._pairs[key]):
            for kind, buffer in zip("kv", cache.buffers[2 * j : 2 * j + 2]):
                view = buffer[start:stop]  # a contiguous view: the graph reads and writes it in place
                value = ort.OrtValue.ortvalue_from_numpy(view)
                io.bind_ortvalue_input(past_name(local, kind), value)
                io.bind_ortvalue_output(present_name(local, kind), value)
                values.append(value)
        logits = np.zeros((stop - start, 1, self.vocab_size), dtype=self._dtype)
        values.append(ort.OrtValue.ortvalue_from_numpy(logits))
        io.bind_ortvalue_output(LOGITS, values[-1])
        self._bindings[ident] = (io, logits, cache.buffers, values)  # keeps the buffers, views and values alive
        return io, logits

    def prompt_logprobs(self, input_ids, budget: int) -> torch.Tensor:
        """float32 log-softmax over the vocabulary at every position of ``input_ids [1, T]``,
        ``[T, vocab]``: the prompt run as ``T`` one-token steps on a scratch cache."""
        ids = _numpy(input_ids).astype(np.int64, copy=False)
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise EngineError(f"prompt_logprobs takes input_ids [1, T] with T >= 1, got shape {tuple(ids.shape)}.")
        length = ids.shape[1]
        scratch = self.allocate(1, length)
        mask = np.zeros((1, length), dtype=self.runtime.mask_dtype)
        rows = []
        for t in range(length):
            mask[0, t] = 1
            logits = self.step(
                scratch, slice(0, 1), ids[:, t : t + 1], mask, np.array([[t]]), np.array([t]), np.array([budget])
            )
            rows.append(logits[0])
        return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def _numpy(value) -> np.ndarray:
    """A numpy view of a torch tensor (CPU) or array-like."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
