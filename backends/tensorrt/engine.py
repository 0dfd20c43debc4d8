"""The TensorRT step engine (:class:`looptool.engine.StepEngine`) and the ``tensorrt`` runtime
of :func:`looptool.engine.open_engine`: an engine directory whose TensorRT engines were built
(``build.py`` on the target GPU), served on a CUDA GPU.

:class:`TrtStepEngine` drives the built engines of a :class:`looptool.backends.tensorrt.runtime.Runtime`
(one upload of the weights, bound by address into every context) over one persistent
:class:`~looptool.engine.TensorSlotCache` on the GPU, laid out like the row-wise engine's caches
(the deepest budget's pairs). Rows of different budgets run the row-wise engine (input
``budgets [R]``: every row exactly its own budget, Accordion Eq. 1 / ELR Eq. 2); rows that all
share a budget with an engine of its own run that cheaper engine on the matching pairs. A step
binds contiguous row views of the cache as ``past``; TensorRT gives no guarantee for an input
and an output bound to the same memory, so ``present`` goes to a scratch buffer that is copied
back into those rows after the step (one copy of the served rows' cache per step).
"""

from __future__ import annotations

import torch

from looptool.backends.errors import EngineError, ReexportError
from looptool.backends.interface import (
    BUDGETS,
    INPUTS,
    LOGITS,
    CacheLayout,
    ExportedSteps,
    own_pairs,
    past_name,
    present_name,
)
from looptool.core.graph import ROWWISE
from looptool.engine.interface import (
    Capabilities,
    StepBatch,
    StepResult,
    TensorSlotCache,
    full_width,
    row_span,
)

_SCRATCH_KEPT = 16  # scratch present buffers kept (one per graph, row count and cache length)


class TrtStepEngine(ExportedSteps):
    """Cached steps over slices of one GPU slot cache with the built TensorRT engines of
    ``runtime`` for KV policy ``kv``; needs the row-wise engine of that policy."""

    def __init__(self, runtime, kv: str = "per-loop"):
        self.runtime, self.kv = runtime, kv
        manifest = runtime.manifest
        if (ROWWISE, kv) in runtime.contexts:
            entry = manifest.graphs[ROWWISE][kv]
            self.budgets: tuple[int, ...] = tuple(sorted(runtime.budgets if entry.menu is None else entry.menu))
        else:  # rows that share a budget only, on a cache laid out like the deepest budget's engine
            self.budgets = tuple(sorted(b for b in runtime.budgets if (b, kv) in runtime.contexts))
            if not self.budgets:
                raise EngineError(f"no engine for kv {kv}; this directory has {sorted(runtime.contexts)}.")
            entry = manifest.graphs[self.budgets[-1]][kv]
        self.layout: CacheLayout = entry.cache
        self.vocab_size = int(runtime.vocab_size)
        self.mask_dtype: torch.dtype = runtime.mask_dtype
        graphs = {b: manifest.graphs[b][kv].cache for b in runtime.budgets if (b, kv) in runtime.contexts}
        if (ROWWISE, kv) in runtime.contexts:
            graphs[ROWWISE] = self.layout
        self._pairs = own_pairs(self.layout, graphs)
        self.plan = manifest.plan
        self.capabilities = Capabilities(
            kv,
            self.layout.dtype,
            EngineError(
                "TensorRT engines run fixed budgets only; budget 'auto' runs on PyTorch or onnxruntime.",
                parameter="runtime",
            ),
            EngineError(
                "TensorRT engines have no verify step (logits at every position); self-speculative decoding runs on "
                "PyTorch, or on an onnxruntime engine exported with verify graphs, under per-loop KV.",
                parameter="runtime",
            ),
        )
        self._profiles: dict[int | str, int] = {}  # the optimisation profile each context has set
        self._scratch: dict[tuple, list[torch.Tensor]] = {}

    def allocate(self, slots: int, length: int) -> TensorSlotCache:
        """Zeroed persistent caches on the GPU, every buffer ``[slots, kv_heads, length, head_dim]``."""
        if slots < 1 or length < 1:
            raise EngineError(f"a slot cache needs at least one slot and one position, got {slots} x {length}.")
        dtype, device = getattr(torch, self.layout.dtype), self.runtime.device
        return TensorSlotCache(
            [
                torch.zeros((slots, p.kv_heads, length, p.head_dim), dtype=dtype, device=device)
                for p in self.layout.pairs
                for _ in "kv"
            ]
        )

    @torch.no_grad()
    def run(self, cache: TensorSlotCache, batch: StepBatch) -> StepResult:
        """Run ``batch`` (fixed budgets; :attr:`capabilities` refuses the rest): rows of one
        budget on that budget's engine where one was built, else the row-wise engine; float32
        next-token logits ``[R, vocab]`` on the CPU."""
        self.capabilities.check(batch)
        budgets = batch.budgets
        input_ids, attention_mask, position_ids, cache_position = batch.inputs
        start, stop = row_span(batch.rows, cache.slots, budgets)
        key = budgets.graph(self._pairs)
        if key not in self._pairs:
            raise ReexportError(
                f"'{self.runtime.directory}' has no row-wise TensorRT engine for kv {self.kv}, so its rows cannot take "
                "different budgets; export it again with rowwise=True and rebuild the engines.",
                parameter="budget",
            )
        rt, ctx = self.runtime, self.runtime.contexts[key, self.kv]
        steps = int(input_ids.shape[1])
        profile = 0 if steps > 1 else 1  # the prefill profile, then the decode one
        if self._profiles.get(key) != profile:
            ctx.set_optimization_profile_async(profile, rt.stream.cuda_stream)
            self._profiles[key] = profile
        mask = full_width(torch.as_tensor(attention_mask), cache.length)  # the engine reads whole row buffers
        feeds = dict(zip(INPUTS, (input_ids, mask, position_ids, cache_position)))
        dtypes = dict(zip(INPUTS, (torch.long, self.mask_dtype, torch.long, torch.long)))
        if key == ROWWISE:
            feeds[BUDGETS], dtypes[BUDGETS] = budgets.tensor(), torch.long
        on_device = {
            name: torch.as_tensor(t).to(rt.device, dtypes[name], non_blocking=True).contiguous()
            for name, t in feeds.items()
        }
        past = [cache.buffers[2 * j + i][start:stop] for j in self._pairs[key] for i in range(2)]
        present = self._present(key, past)
        pairs = range(len(self._pairs[key]))
        for name, t in [*on_device.items(), *zip((past_name(j, k) for j in pairs for k in "kv"), past)]:
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for name, t in zip((present_name(j, k) for j in pairs for k in "kv"), present):
            ctx.set_tensor_address(name, t.data_ptr())
        logits = torch.empty(
            stop - start, 1, self.vocab_size, dtype=getattr(torch, self.layout.dtype), device=rt.device
        )
        ctx.set_tensor_address(LOGITS, logits.data_ptr())
        if not ctx.execute_async_v3(rt.stream.cuda_stream):
            raise EngineError("TensorRT failed to execute the step; rerun with TensorRT's verbose log.")
        rt.stream.synchronize()
        for view, written in zip(past, present):
            view.copy_(written)
        return StepResult(logits[:, -1].float().cpu(), budgets.tensor())

    def _present(self, key: int | str, past: list[torch.Tensor]) -> list[torch.Tensor]:
        """Scratch ``present`` buffers shaped like ``past`` (reused across steps of that shape)."""
        ident = (key, *tuple(past[0].shape))
        found = self._scratch.get(ident)
        if found is None:
            if len(self._scratch) >= _SCRATCH_KEPT:
                self._scratch.clear()
            found = self._scratch[ident] = [torch.empty_like(p) for p in past]
        return found


# ---------------------------------------------------------------------- the tensorrt runtime
