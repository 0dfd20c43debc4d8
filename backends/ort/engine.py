"""The onnxruntime step engine (:class:`looptool.engine.StepEngine`) and the ``onnxruntime``
runtime of :func:`looptool.engine.open_engine`: an engine directory written by looptool export.

:class:`OrtStepEngine` runs an exported engine's graphs over one persistent
:class:`~looptool.engine.ArraySlotCache` of numpy buffers, laid out like the row-wise
graph's caches (the deepest budget's pairs); each :meth:`OrtStepEngine.step` binds views of
the rows it serves (``buffer[a:b]``, contiguous, no copy) as both ``past`` input and
``present`` output, so the graph writes this step's keys and values in place. Rows of
different budgets run the row-wise graph; rows that all share a budget run that budget's own,
cheaper graph on the matching cache pairs (same ``(layer, execution)``), which hold exactly
what the row-wise graph would have written for those rows. An engine exported with
``speculative=True`` also runs self-speculative decoding's verify step
(:meth:`OrtStepEngine.verify`): budget ``k``'s verify graph on budget ``k``'s cache pairs. One
exported with ``adaptive=True`` (under last-loop KV) runs rows of adaptive depth
(:meth:`OrtStepEngine.step_with_depth`, ``budget="auto"``): the adaptive-depth graph on the slot
cache's pairs for the whole slice, a fixed row ``k`` as ``min_budget = max_budget = k``. That
graph runs every loop up to the slice's deepest ``max_budget``, rows that stopped masked: it saves
depth, not time.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from looptool.backends.errors import EngineError, ReexportError
from looptool.backends.interface import (
    BUDGETS,
    DEPTH,
    INPUTS,
    LOGITS,
    CacheLayout,
    ExportedSteps,
    own_pairs,
    past_name,
    present_name,
    row_inputs,
)
from looptool.core.dtypes import named
from looptool.core.graph import ADAPTIVE, ROWWISE
from looptool.engine.budgets import PER_LOOP_AUTO
from looptool.engine.interface import (
    ArraySlotCache,
    Capabilities,
    StepBatch,
    StepResult,
    as_numpy,
    full_width,
    row_span,
)
from looptool.engine.speculation import LAST_LOOP_VERIFY

log = logging.getLogger(__name__)


_BINDINGS_KEPT = 64  # cached IOBindings (one per graph, row slice and cache)


class OrtStepEngine(ExportedSteps):
    """Cached decode steps over slices of one slot cache, every row at its own budget, with
    an onnxruntime :class:`~looptool.backends.ort.runtime.Runtime` for ``kv`` (rows of adaptive
    depth stopping by ``exit_rule`` where it holds that adaptive-depth graph). An engine
    exported without the row-wise graph is refused, unless ``mixed`` is False (one generate
    call's engine: rows that share a budget only, a mixed batch refused in one sentence; its
    cache laid out like its deepest budget's graph)."""

    def __init__(self, runtime, kv: str = "per-loop", exit_rule: str = "state", *, mixed: bool = True):
        self.runtime = runtime
        self.kv = runtime._check_policy(kv)
        self.exit_rule = exit_rule
        if mixed:
            runtime.rowwise_menu(self.kv)  # one sentence where the engine has no row-wise graph
        if runtime.has_rowwise(self.kv):
            self.budgets: tuple[int, ...] = tuple(sorted(runtime.rowwise_menu(self.kv)))
            self.layout: CacheLayout = runtime.layout(ROWWISE, self.kv)
        else:
            self.budgets = tuple(sorted(runtime.budgets))
            self.layout = runtime.layout(self.budgets[-1], self.kv)
        if runtime.vocab_size is None:
            raise EngineError("the engine's manifest does not record the vocabulary size; export it again.")
        self.vocab_size = int(runtime.vocab_size)
        self.mask_dtype: torch.dtype = getattr(torch, str(runtime.mask_dtype))
        self._dtype = named(self.layout.dtype).numpy
        if self._dtype is None:
            raise EngineError(f"cache dtype {self.layout.dtype} cannot be held in numpy; export in float32 or float16.")
        graphs = {budget: runtime.layout(budget, kv) for budget in set(runtime.budgets) & set(self.budgets)}
        if runtime.has_rowwise(self.kv):
            graphs[ROWWISE] = self.layout
        auto = runtime.manifest.adaptive_graph(exit_rule, kv)
        if auto is not None:
            graphs[ADAPTIVE] = auto.cache
        self._pairs = own_pairs(self.layout, graphs)
        self.plan = runtime.manifest.plan
        self._bindings: dict[tuple, tuple] = {}
        self.capabilities = Capabilities(
            kv,
            (runtime.manifest.quantization or {}).get("precision", self.layout.dtype),
            self._adaptive_refusal(),
            self._verify_refusal(),
        )

    def _adaptive_refusal(self) -> EngineError | None:
        """None when the engine holds the adaptive-depth graph of its exit rule under last-loop
        KV; else why not (``parameter`` ``kv`` or ``runtime``)."""
        if self.kv != "last-loop":
            return EngineError(f"adaptive depth needs the last-loop KV policy: {PER_LOOP_AUTO}", parameter="kv")
        if ADAPTIVE not in self._pairs:
            return ReexportError(
                f"the engine directory has no adaptive-depth graph ({self.exit_rule} rule, last-loop KV) over its "
                "row-wise graph's caches, which budget 'auto' runs; export it again with adaptive=True and "
                "kv='last-loop'.",
                parameter="runtime",
            )
        return None

    def _verify_refusal(self) -> EngineError | None:
        """None when the engine holds a verify graph for every budget but the shallowest under
        per-loop KV (exported with ``speculative=True``); else why not."""
        if self.kv != "per-loop":
            return EngineError(f"a verify step needs the per-loop KV policy: {LAST_LOOP_VERIFY}", parameter="kv")
        missing = [k for k in self.budgets[1:] if not self.runtime.has_verify(k, self.kv) or k not in self._pairs]
        if missing:
            return ReexportError(
                f"the engine directory has no verify graph for budget {missing[0]} (logits at every position, which "
                "speculative decoding scores drafts with); export it again with speculative=True.",
                parameter="runtime",
            )
        return None

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

    def run(self, cache: ArraySlotCache, batch: StepBatch) -> StepResult:
        """Run ``batch``: rows of one budget on that budget's own graph where the engine has one,
        mixed budgets on the row-wise graph, a batch with an adaptive row on the adaptive-depth
        graph (a fixed row ``k`` as ``min_budget = max_budget = k``, exactly budget ``k`` under
        last-loop KV), and a verify batch one run of rows sharing a budget at a time on that
        budget's verify graph (over the cache pairs of its own graph: the same layout, checked
        when it is bound)."""
        budgets = batch.budgets
        start, stop = row_span(batch.rows, len(cache.buffers[0]), budgets)
        if batch.every_position:  # the verify graphs of the batch's budgets, whatever others lack
            if self.kv != "per-loop" or budgets.adaptive:
                self.capabilities.check(batch)
            for k in sorted(set(budgets.rows)):
                self.runtime.verify_session(k, self.kv)  # one sentence where the engine has none
                if k not in self._pairs:
                    raise ReexportError(
                        f"the engine directory has no graph of budget {k}'s own, which its verify graph reads."
                    )
            steps, out = int(batch.input_ids.shape[1]), []
            for k, part in budgets.runs():
                step = (*(t[part] for t in batch.inputs[:3]), batch.cache_position)
                logits, _ = self._run(cache, k, start + part.start, start + part.stop, step, budgets, steps=steps)
                out.append(torch.from_numpy(logits.astype(np.float32)))
            return StepResult(torch.cat(out), budgets.tensor())
        self.capabilities.check(batch)
        key = ADAPTIVE if budgets.adaptive else budgets.graph(self._pairs)
        if key not in self._pairs:
            self.runtime._entry(key, self.kv)  # one sentence: the engine has no such graph
        logits, depth = self._run(cache, key, start, stop, batch.inputs, budgets, steps=0)
        depths = torch.from_numpy(depth.copy()) if budgets.adaptive else budgets.tensor()
        return StepResult(torch.from_numpy(logits[:, -1].astype(np.float32)), depths)

    def _run(self, cache: ArraySlotCache, key: int | str, start: int, stop: int, step, budgets, steps: int):
        """Run graph ``key`` (with ``steps``: budget ``key``'s verify graph over that many
        positions) on rows ``[start, stop)`` with ``step`` (``input_ids``, ``attention_mask``,
        ``position_ids``, ``cache_position``); its logits and depth buffers (reused by the next run;
        the depths are the adaptive-depth graph's, else unused)."""
        input_ids, attention_mask, position_ids, cache_position = step
        io, logits, session, depth = self._binding(cache, key, start, stop, steps)
        io.bind_cpu_input(INPUTS[0], as_numpy(input_ids).astype(np.int64, copy=False))
        mask = full_width(as_numpy(attention_mask), cache.length)  # the graph attends over whole bound buffers
        io.bind_cpu_input(INPUTS[1], mask.astype(self.runtime.mask_dtype, copy=False))
        io.bind_cpu_input(INPUTS[2], as_numpy(position_ids).astype(np.int64, copy=False))
        io.bind_cpu_input(INPUTS[3], as_numpy(cache_position).astype(np.int64, copy=False))
        if key in (ROWWISE, ADAPTIVE):
            for name, value in row_inputs(budgets, key == ADAPTIVE).items():
                io.bind_cpu_input(name, value)
        session.run_with_iobinding(io)
        return logits, depth

    def _binding(self, cache: ArraySlotCache, key: int | str, start: int, stop: int, steps: int = 0):
        """The IOBinding of graph ``key`` (``steps`` > 0: budget ``key``'s verify graph, logits at
        that many positions) over rows ``[start, stop)`` of ``cache``: views of the buffers bound
        as past and present, a logits buffer and the session; made once per combination."""
        import onnxruntime as ort

        ident = (key, start, stop, steps, *map(id, cache.buffers))
        found = self._bindings.get(ident)
        if found is not None:
            return found[0], found[1], found[4], found[5]
        if len(self._bindings) >= _BINDINGS_KEPT or any(b[2] is not cache.buffers for b in self._bindings.values()):
            self._bindings.clear()  # also when the cache was resized: the old buffers are freed
        if steps:
            if self.runtime.verify_layout(key, self.kv) != self.runtime.layout(key, self.kv):
                raise EngineError(
                    f"the verify graph of budget {key} ({self.kv}) has another cache layout than budget {key}'s graph; "
                    "export the engine again."
                )
            session = self.runtime.verify_session(key, self.kv)
        elif key == ADAPTIVE:
            session = self.runtime.adaptive_session(self.exit_rule, self.kv)
        else:
            session = self.runtime.session(key, self.kv)
        self._check_interface(session, key)
        io = session.io_binding()
        values = []
        for local, j in enumerate(self._pairs[key]):
            for kind, buffer in zip("kv", cache.buffers[2 * j : 2 * j + 2]):
                view = buffer[start:stop]  # a contiguous view: the graph reads and writes it in place
                value = ort.OrtValue.ortvalue_from_numpy(view)
                io.bind_ortvalue_input(past_name(local, kind), value)
                io.bind_ortvalue_output(present_name(local, kind), value)
                values.append(value)
        logits = np.zeros((stop - start, max(steps, 1), self.vocab_size), dtype=self._dtype)
        values.append(ort.OrtValue.ortvalue_from_numpy(logits))
        io.bind_ortvalue_output(LOGITS, values[-1])
        depth = np.zeros(stop - start, dtype=np.int64)
        if key == ADAPTIVE:
            values.append(ort.OrtValue.ortvalue_from_numpy(depth))
            io.bind_ortvalue_output(DEPTH, values[-1])
        self._bindings[ident] = (
            io,
            logits,
            cache.buffers,
            values,
            session,
            depth,
        )  # keeps buffers, views, values alive
        return io, logits, session, depth

    def _check_interface(self, session, key: int | str) -> None:
        """One sentence unless the session's inputs and outputs are those the manifest's layout
        for graph ``key`` gives (step inputs, per-row inputs, one past and present pair each)."""
        from looptool.passes.adaptive_depth import AUTO_INPUTS

        past = [past_name(j, kind) for j in range(len(self._pairs[key])) for kind in "kv"]
        present = [present_name(j, kind) for j in range(len(self._pairs[key])) for kind in "kv"]
        step = set(AUTO_INPUTS) if key == ADAPTIVE else {*INPUTS, BUDGETS} if key == ROWWISE else set(INPUTS)
        heads = [LOGITS, DEPTH] if key == ADAPTIVE else [LOGITS]
        inputs, outputs = {i.name for i in session.get_inputs()}, [o.name for o in session.get_outputs()]
        if inputs != {*step, *past} or outputs != [*heads, *present]:
            raise EngineError(
                "the graph's inputs and outputs do not match the cache layout in the manifest; export the engine again."
            )
