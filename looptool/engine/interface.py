"""What a step engine is and what it works on.

:class:`StepEngine` runs one cached step (a prefill of ``T`` prompt tokens or one decode
token) over a contiguous slice of a :class:`SlotCache`'s rows, every row at its own budget:
rows of different budgets run the row-wise-budget path (every row exactly its own budget's
computation, Accordion Eq. 1 / ELR Eq. 2), rows that share a budget may run that budget's own,
cheaper path. The cache is ``[slots, kv_heads, length, head_dim]`` per buffer, row ``r`` being
slot ``r`` (a request) and dimension 2 its token positions; torch tensors
(:class:`TensorSlotCache`) or numpy arrays (:class:`ArraySlotCache`, bound in place by
onnxruntime). :class:`OpenedEngine` is a step engine with what a server needs beside it.

Rows of adaptive depth (:attr:`RowBudgets.auto`, ``budget="auto"``) run through
:meth:`StepEngine.step_with_depth`, which also reports the depth every row realised
(:class:`StepResult`); an engine that cannot run them says so in :meth:`StepEngine.check_adaptive`.
Self-speculative decoding's verify step (logits at every position of a multi-token step) is
:meth:`StepEngine.verify`, refused likewise by :meth:`StepEngine.check_verify`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine.budgets import RowBudgets
from looptool.engine.prefix_cache import CacheGroup


class SlotCache(ABC):
    """Persistent cache buffers, each ``[slots, kv_heads, length, head_dim]``; ``names`` are the
    cache inputs they feed (the row-wise path's, where the engine records them)."""

    def __init__(self, buffers: list, names: tuple[str, ...] = ()):
        self.buffers = buffers
        self.names = names

    @property
    def slots(self) -> int:
        """Rows (request slots) of every buffer."""
        return int(self.buffers[0].shape[0])

    @property
    def length(self) -> int:
        """Token positions of every buffer."""
        return int(self.buffers[0].shape[2])

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of all buffers together."""

    @abstractmethod
    def _copy_row(self, src: int, dst: int) -> None: ...

    @abstractmethod
    def _copy(self, view): ...

    def read(self, index: int, row: int, start: int, stop: int):
        """A copy of buffer ``index``'s row ``row`` at positions ``[start, stop)``:
        ``[kv_heads, stop - start, head_dim]`` (a prefix-cache block)."""
        return self._copy(self.buffers[index][row, :, start:stop])

    def write(self, index: int, row: int, start: int, value) -> None:
        """Buffer ``index``'s row ``row`` from position ``start`` on takes ``value``
        (``[kv_heads, n, head_dim]``, as :meth:`read` gave it)."""
        self.buffers[index][row, :, start : start + value.shape[1]] = value

    @abstractmethod
    def _shift(self, n: int) -> None: ...

    @abstractmethod
    def _shift_right(self, n: int) -> None: ...

    def copy_row(self, src: int, dst: int) -> None:
        """Every buffer: ``buf[dst] = buf[src]`` (moves a request to another slot)."""
        if src != dst:
            self._copy_row(src, dst)

    def shift_left(self, n: int) -> None:
        """Every buffer: positions ``[n:]`` move to ``[:length - n]`` (the rest keeps its values)."""
        if not 0 <= n <= self.length:
            raise LooptoolError(f"cannot shift a cache of {counted(self.length, 'position')} by {n}.", parameter="n")
        if n:
            self._shift(n)

    def shift_right(self, n: int) -> None:
        """Every buffer: positions ``[:length - n]`` move to ``[n:]`` (the rest keeps its values)."""
        if not 0 <= n <= self.length:
            raise LooptoolError(f"cannot shift a cache of {counted(self.length, 'position')} by {n}.", parameter="n")
        if n:
            self._shift_right(n)

    def position_bytes(self, buffers: Iterable[int] | None = None) -> int:
        """Bytes one row keeps per position in ``buffers`` (default: every buffer)."""
        chosen = (self.buffers[i] for i in buffers) if buffers is not None else self.buffers
        return sum(int(b.shape[1]) * int(b.shape[3]) * int(b.dtype.itemsize) for b in chosen)

    def resize(self, length: int) -> None:
        """Give every buffer ``length`` positions (new ones zeroed, the first ``min(length,
        old)`` kept): a cache grows and shrinks with what its rows hold."""
        if length < 1:
            raise LooptoolError(f"a slot cache needs at least one position, got {length}.", parameter="length")
        if length != self.length:
            self.buffers = [with_length(b, length, dim=2) for b in self.buffers]


class TensorSlotCache(SlotCache):
    """A slot cache of torch tensors (any device)."""

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _copy_row(self, src: int, dst: int) -> None:
        for b in self.buffers:
            b[dst].copy_(b[src])

    def _copy(self, view):
        return view.clone()

    def _shift(self, n: int) -> None:
        for b in self.buffers:
            b[:, :, : self.length - n].copy_(b[:, :, n:].clone())  # the ranges overlap

    def _shift_right(self, n: int) -> None:
        for b in self.buffers:
            b[:, :, n:].copy_(b[:, :, : self.length - n].clone())


class ArraySlotCache(SlotCache):
    """A slot cache of numpy arrays (row slices are contiguous views a runtime binds in place)."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def _copy_row(self, src: int, dst: int) -> None:
        for b in self.buffers:
            b[dst] = b[src]

    def _copy(self, view):
        return view.copy()

    def _shift(self, n: int) -> None:
        for b in self.buffers:
            b[:, :, : self.length - n] = b[:, :, n:]  # numpy copies overlapping ranges safely

    def _shift_right(self, n: int) -> None:
        for b in self.buffers:
            b[:, :, n:] = b[:, :, : self.length - n]


@dataclass(frozen=True)
class StepResult:
    """What one step gives: float32 logits (CPU), ``[R, vocab]`` at each row's last position, or
    ``[R, T, vocab]`` at every position when the batch asked for them
    (:attr:`StepBatch.every_position`), and the depth each row realised, int64 ``[R]`` (CPU): a
    fixed row's budget, an adaptive row's depth this step."""

    logits: torch.Tensor
    depths: torch.Tensor


@dataclass(frozen=True)
class StepBatch:
    """One cached step over cache rows ``rows`` (a contiguous slice, written in place):
    ``input_ids [R, T]``, ``attention_mask [R, W]``, ``position_ids [R, T]``,
    ``cache_position [T]`` (the slots this step writes) and each row's budget, fixed or adaptive
    (resolved by the caller; an engine does not check it again). ``every_position`` asks for
    logits at every position (self-speculative decoding's verify step, fixed budgets only), else
    they come at the last one.

    The mask may be narrower than the cache (``W <= length``): positions from ``W`` on are
    neither read nor written, so an engine that can attends over the first ``W`` positions only
    (a decode step then costs what the rows hold, not what the cache could hold); one that binds
    whole buffers pads the mask with zeros (:func:`full_width`)."""

    rows: slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    cache_position: torch.Tensor
    budgets: RowBudgets
    every_position: bool = False

    @property
    def inputs(self) -> tuple:
        """``(input_ids, attention_mask, position_ids, cache_position)``, the graphs' first inputs."""
        return (self.input_ids, self.attention_mask, self.position_ids, self.cache_position)


@dataclass(frozen=True)
class Capabilities:
    """What a step engine runs beside fixed-budget steps, read by whoever drives it: ``kv`` (its
    KV policy), ``precision`` (its cache's dtype, or the weights' quantization), and why it does
    not run rows of adaptive depth (``adaptive_refusal``: budget ``auto``) or logits at every
    position (``verify_refusal``: self-speculative decoding's verify step), None where it
    does: a :class:`LooptoolError` whose ``parameter`` names what stands in the way (``runtime``
    or ``kv``)."""

    kv: str
    precision: str
    adaptive_refusal: LooptoolError | None = None
    verify_refusal: LooptoolError | None = None

    @property
    def adaptive(self) -> bool:
        """Whether rows of adaptive depth run."""
        return self.adaptive_refusal is None

    @property
    def verify(self) -> bool:
        """Whether steps with logits at every position run."""
        return self.verify_refusal is None

    def check(self, batch: StepBatch) -> None:
        """Nothing when ``batch`` asks for what the engine runs; else its refusal."""
        if batch.budgets.adaptive and self.adaptive_refusal is not None:
            raise self.adaptive_refusal
        if batch.every_position:
            if self.verify_refusal is not None:
                raise self.verify_refusal
            if batch.budgets.adaptive:
                raise LooptoolError("a verify step runs fixed budgets only, not budget 'auto'.", parameter="budgets")


class StepEngine(ABC):
    """Cached steps over slices of one slot cache, every row at its own budget: :meth:`allocate`
    and :meth:`run`, and what the engine can do beside that in :attr:`capabilities`.

    ``budgets`` is the menu (sorted), ``vocab_size`` the logits' width, ``mask_dtype`` the
    dtype of the ``attention_mask`` the graphs take.
    """

    budgets: tuple[int, ...]
    vocab_size: int
    mask_dtype: torch.dtype
    capabilities: Capabilities

    @abstractmethod
    def allocate(self, slots: int, length: int) -> SlotCache:
        """Zeroed persistent caches, every buffer ``[slots, kv_heads, length, head_dim]``."""

    @abstractmethod
    def run(self, cache: SlotCache, batch: StepBatch) -> StepResult:
        """Run ``batch`` over its rows of ``cache``; refuses what :attr:`capabilities` says the
        engine does not run (:meth:`Capabilities.check`)."""

    def step(
        self,
        cache: SlotCache,
        rows: slice,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        budgets: RowBudgets,
    ) -> torch.Tensor:
        """:meth:`run` for a batch of fixed budgets, spelled out: its float32 next-token logits
        ``[R, vocab]``."""
        batch = StepBatch(rows, input_ids, attention_mask, position_ids, cache_position, budgets)
        return self.run(cache, batch).logits

    def budget_buffers(self, budget: int) -> tuple[int, ...] | None:
        """The slot-cache buffers rows at ``budget`` read (what a row of that budget keeps per
        position, Accordion Eq. 6); None (this default) when the engine does not know them."""
        return None

    def prefix_groups(self, budget: int) -> tuple[CacheGroup, ...] | None:
        """The slot-cache buffers that rows at ``budget`` read, grouped by what their keys and
        values depend on (:func:`~looptool.engine.prefix_cache.cache_groups`), for the prefix
        cache; None (this default) when the engine does not know them, and its prompts are
        then never cached."""
        return None

    def prompt_logprobs(self, input_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """float32 log-softmax over the vocabulary at every position of ``input_ids [1, T]``:
        ``[T, vocab]`` (for ``echo`` with ``logprobs``). This default runs the prompt as ``T``
        one-token steps on a scratch cache, which every engine can; one with a full forward
        overrides it."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise LooptoolError(f"prompt_logprobs takes input_ids [1, T] with T >= 1, got shape {tuple(ids.shape)}.")
        length = ids.shape[1]
        scratch = self.allocate(1, length)
        mask = torch.zeros(1, length, dtype=self.mask_dtype)
        rows = []
        for t in range(length):
            mask[0, t] = 1
            step = torch.tensor([[t]])
            logits = self.step(scratch, slice(0, 1), ids[:, t : t + 1], mask, step, step[0], RowBudgets((budget,)))
            rows.append(logits[0])
        return torch.log_softmax(torch.stack(rows).float(), dim=-1)


@dataclass(frozen=True)
class EngineFacts:
    """What a directory serves, read from its JSON files alone (no weights, no graphs): the
    budget menu of its plan and the positions its source model was built for (None if unknown)."""

    budgets: tuple[int, ...]
    context: int | None


def row_span(rows: slice, slots: int, budgets: RowBudgets) -> tuple[int, int]:
    """``(start, stop)`` of ``rows`` in a cache of ``slots`` rows; one sentence unless it is a
    contiguous, non-empty slice with one budget per row."""
    start, stop, stride = rows.indices(slots)
    if stride != 1 or stop - start != len(budgets) or stop <= start:
        raise LooptoolError(
            f"rows {rows} must be a contiguous, non-empty slice of the cache with one budget per row "
            f"({len(budgets)} given)."
        )
    return start, stop


def full_width(mask, length: int):
    """``mask [R, W]`` (a torch tensor or numpy array) padded with zeros to ``[R, length]``; the
    mask itself when it is that wide already."""
    if mask.shape[1] == length:
        return mask
    if mask.shape[1] > length:
        raise LooptoolError(
            f"an attention mask of {counted(mask.shape[1], 'position')} is wider than the cache ({length})."
        )
    return with_length(mask if isinstance(mask, torch.Tensor) else np.asarray(mask), length, dim=1)


def with_length(array, length: int, dim: int):
    """A new, zeroed torch tensor or numpy array like ``array`` with ``length`` entries along
    ``dim``, holding ``array``'s first ones (a cache or mask grown or shrunk; never a view, so
    a shrunk buffer frees the old one and stays contiguous)."""
    shape = list(array.shape)
    shape[dim] = length
    new = array.new_zeros(shape) if isinstance(array, torch.Tensor) else np.zeros(shape, dtype=array.dtype)
    kept = (slice(None),) * dim + (slice(0, min(length, array.shape[dim])),)
    new[kept] = array[kept]
    return new


def as_numpy(value) -> np.ndarray:
    """A numpy view of a CPU torch tensor, or ``value`` as an array."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
