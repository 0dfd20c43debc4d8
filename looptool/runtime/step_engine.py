"""The PyTorch step engine a server drives: one cached step over rows of a slot cache.

A server keeps its running requests in the rows of one persistent :class:`SlotCache`
(``[slots, kv_heads, length, head_dim]`` per cache input of the row-wise-budget path, the
deepest budget's slots) and calls :meth:`TorchStepEngine.step` on a contiguous slice of
rows, each with its own budget. Mixed budgets run the row-wise path
(:func:`looptool.runtime.generation.rowwise_path`: every row exactly at its own budget,
Accordion Eq. 1 / ELR Eq. 2); rows that all share one budget run that budget's own cached
path on the matching cache buffers, so a uniform batch costs what that budget costs.
The backend-neutral protocol these classes follow is described in ``backends/serving.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from looptool.core.errors import LooptoolError
from looptool.runtime.generation import allocate_cache, cached_paths, check_policy, rowwise_path

if TYPE_CHECKING:
    from looptool.runtime.model import LoopedModel


class SlotCache:
    """Persistent cache buffers, each ``[slots, kv_heads, length, head_dim]``; row ``r`` of
    every buffer is the cache of slot ``r`` (a request), dimension 2 its token positions."""

    def __init__(self, buffers: list[torch.Tensor], names: tuple[str, ...] = ()):
        self.buffers = buffers
        self.names = names  # the cache input each buffer feeds (the row-wise path's slot names)

    @property
    def slots(self) -> int:
        """Rows (request slots) of every buffer."""
        return int(self.buffers[0].shape[0])

    @property
    def length(self) -> int:
        """Token positions of every buffer."""
        return int(self.buffers[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers together."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def copy_row(self, src: int, dst: int) -> None:
        """Every buffer: ``buf[dst] = buf[src]`` (moves a request to another slot)."""
        if src != dst:
            for b in self.buffers:
                b[dst].copy_(b[src])

    def shift_left(self, n: int) -> None:
        """Every buffer: positions ``[n:]`` move to ``[:length - n]`` (the rest keeps its values)."""
        if not 0 <= n <= self.length:
            raise LooptoolError(f"cannot shift a cache of {self.length} positions by {n}.", parameter="n")
        if n:
            for b in self.buffers:
                b[:, :, : self.length - n].copy_(b[:, :, n:].clone())  # the ranges overlap


class TorchStepEngine:
    """Cached steps of a :class:`~looptool.runtime.model.LoopedModel` over slot-cache rows,
    each row at its own budget (the serving interface, ``backends/serving.py``)."""

    def __init__(self, model: LoopedModel, kv: str = "per-loop"):
        self.model = model
        self.kv = check_policy(model, kv)
        self.budgets: tuple[int, ...] = tuple(model.budgets)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(text.vocab_size)
        self.mask_dtype: torch.dtype = model.mask_dtype
        self.rowwise = rowwise_path(model, self.kv)
        self.paths = cached_paths(model, self.kv)
        names = [s.name for s in self.rowwise.slots]
        # buffer index of each cache input of each budget's own path (a subset of the row-wise slots)
        self.pairs = {k: [names.index(s.name) for s in p.slots] for k, p in self.paths.items()}

    def allocate(self, slots: int, length: int) -> SlotCache:
        """Zeroed persistent caches, every buffer ``[slots, kv_heads, length, head_dim]``."""
        param = next(self.model.parameters())
        buffers = allocate_cache(self.rowwise, slots, length, dtype=param.dtype, device=param.device)
        return SlotCache(buffers, tuple(s.name for s in self.rowwise.slots))

    @torch.no_grad()
    def step(
        self,
        cache: SlotCache,
        rows: slice,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        budgets: torch.Tensor,
    ) -> torch.Tensor:
        """One cached step over cache rows ``rows`` (views, written in place); returns float32
        next-token logits ``[R, vocab]`` at the last position, each row at its own budget."""
        views = [b[rows] for b in cache.buffers]
        ks = [int(k) for k in budgets.tolist()]
        if len(ks) != input_ids.shape[0] or len(ks) != views[0].shape[0]:
            raise LooptoolError(
                f"{len(ks)} budgets for {input_ids.shape[0]} input rows and {views[0].shape[0]} cache rows; "
                "give one budget per row of the slice.",
                parameter="budgets",
            )
        unknown = sorted(set(ks) - set(self.budgets))
        if unknown:
            raise LooptoolError(
                f"budget {unknown[0]} is not in this model's budget menu {list(self.budgets)}; pick one of those.",
                parameter="budgets",
            )
        if len(set(ks)) == 1:  # one budget: its own path on its own cache pairs
            caches = [views[i] for i in self.pairs[ks[0]]]
            logits = self.paths[ks[0]].module(input_ids, attention_mask, position_ids, cache_position, *caches)
        else:
            logits = self.rowwise.module(input_ids, attention_mask, position_ids, cache_position, budgets, *views)
        return logits[:, -1].float()

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """float32 log-softmax over the vocabulary at every position, ``[T, vocab]`` (full forward)."""
        logits = self.model(input_ids, budget=self.model.check_budget(budget)).logits
        return torch.log_softmax(logits[0].float(), dim=-1)
