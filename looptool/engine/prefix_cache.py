"""The prefix cache: keys and values of prompt prefixes, kept so a request that starts the way an
earlier one did (a system prompt, few-shot examples, a chat history) copies them into its row
instead of computing them again.

A prompt is cut into blocks of :data:`BLOCK` tokens. Block ``i`` is named by a digest chained
over every token up to its end (``d_i = blake2b(d_{i-1} || tokens of block i)``), because its
keys and values depend on all of them. What a block holds is split by :class:`CacheGroup`: the
slot-cache buffers whose contents do not depend on the depth, kept once for every budget, and
the rest, kept per budget. Under fixed-prefix looping the layers before the window compute the
same keys and values at every budget (Accordion Eq. 1: the loop starts at the window), and
under elastic latent recurrence so does the input block (ELR Eq. 2: the recurrence starts at the
recurrent block); the looped layers and every layer after them depend on the budget, and under
per-loop KV each loop's buffer is its own.

A hit needs every group of the request's budget: a block's per-budget part is only reused at
that budget. Entries are evicted least recently used first within ``max_bytes``
(:class:`cachetools.LRUCache` sized by bytes); a chain whose middle block was evicted is
reused up to the gap. A hit leaves at least the prompt's last token to compute, since its
logits give the first new token.

Reused keys and values are those an earlier prefill of the same tokens wrote at the same
positions (position ids restart at 0 for every request, so a block holds the same values in
any row and at any cache slot). They are computed in a step of another length than a full
prefill would be, so logits may differ from a prefill without the cache in the last bits of
float32 (as any change of batch shape does); the tokens chosen are the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import cachetools
import numpy as np

from looptool.core.errors import LooptoolError

BLOCK = 16  # tokens per block
SHARED = "shared"  # the group key of buffers whose keys and values do not depend on the budget
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB


def block_digests(tokens: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The chained digest of every whole ``block``-token block of ``tokens``: the names a prefix
    cache stores them under (and a router matches prompts by)."""
    out, parent = [], b""
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.blake2b(parent + ids[start : start + block].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class CacheGroup:
    """Slot-cache buffers a block keeps together, and what their contents depend on: ``key`` is
    :data:`SHARED` (the same at every budget) or the budget."""

    key: int | str
    buffers: tuple[int, ...]


def cache_groups(
    buffers: Sequence[tuple[int, int]], used: Iterable[int], shared_before: int, budget: int
) -> tuple[CacheGroup, ...]:
    """The groups of a step engine's slot cache that budget ``budget`` reads: ``buffers[i]`` is
    buffer ``i``'s ``(layer, execution)``, ``used`` the buffers that budget's rows read, and
    layers before ``shared_before`` (the first looped layer) compute the same keys and values
    at every budget in their first execution."""
    used = tuple(used)
    shared = tuple(i for i in used if buffers[i][0] < shared_before and buffers[i][1] == 1)
    own = tuple(i for i in used if i not in shared)
    return tuple(g for g in (CacheGroup(SHARED, shared), CacheGroup(budget, own)) if g.buffers)


def budget_pairs(pairs: Sequence, plan: dict | None, budget: int) -> tuple[int, ...]:
    """The cache pairs (each with ``layer`` and ``execution``) budget ``budget`` reads under the
    loop ``plan`` (a manifest's): a layer's ``e``-th execution where the plan runs that layer at
    least ``e`` times at that budget (Accordion Eq. 1, ELR Eq. 2); every pair without a plan."""
    if not plan:
        return tuple(range(len(pairs)))
    from looptool.core.plan import plan_from_dict

    runs = plan_from_dict(plan).executed_layers(budget, 1 + max(p.layer for p in pairs))
    return tuple(j for j, p in enumerate(pairs) if p.execution <= runs.count(p.layer))


def pair_groups(pairs: Sequence, used: Iterable[int], plan: dict | None, budget: int) -> tuple[CacheGroup, ...]:
    """:func:`cache_groups` for an exported engine's slot cache: ``pairs`` its cache pairs (each
    with ``layer`` and ``execution``; buffers ``2j`` and ``2j + 1`` hold pair ``j``'s keys and
    values), ``used`` the buffers budget ``budget`` reads, ``plan`` the manifest's loop plan
    (None: no layer is taken as shared)."""
    from looptool.core.plan import plan_from_dict

    first = plan_from_dict(plan).looped_layers().start if plan else 0
    buffers = [(p.layer, p.execution) for p in pairs for _ in "kv"]
    return cache_groups(buffers, used, first, budget)


def _nbytes(value: tuple) -> int:
    """Bytes a block's arrays hold (numpy arrays or torch tensors)."""
    return sum(int(a.nbytes) for a in value) or 1


@dataclass
class PrefixStats:
    """Prompt tokens looked up (``queried``) and found (``hit``), blocks stored and evicted."""

    queried: int = 0
    hit: int = 0
    stored: int = 0
    evicted: int = 0


class _Blocks(cachetools.LRUCache):
    """An LRU of blocks sized in bytes that counts what it evicts."""

    def __init__(self, max_bytes: int, stats: PrefixStats):
        super().__init__(maxsize=max_bytes, getsizeof=_nbytes)
        self._stats = stats

    def popitem(self):
        item = super().popitem()
        self._stats.evicted += 1
        return item


@dataclass
class PrefixCache:
    """Blocks of prompt keys and values within ``max_bytes``, ``block`` tokens each."""

    max_bytes: int = DEFAULT_MAX_BYTES
    block: int = BLOCK
    stats: PrefixStats = field(default_factory=PrefixStats)

    def __post_init__(self):
        if self.max_bytes < 1 or self.block < 1:
            raise LooptoolError(
                f"a prefix cache needs a positive size and block, got {self.max_bytes} bytes of {self.block}-token "
                "blocks.",
                parameter="prefix_cache_bytes",
            )
        self._blocks = _Blocks(self.max_bytes, self.stats)

    @property
    def nbytes(self) -> int:
        """Bytes the stored blocks hold."""
        return int(self._blocks.currsize)

    def __len__(self) -> int:
        return len(self._blocks)

    def digests(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained digest of every whole block of ``tokens``."""
        return block_digests(tokens, self.block)

    def lookup(self, tokens: Sequence[int], groups: Sequence[CacheGroup]) -> list[dict[int, object]]:
        """The stored blocks that begin ``tokens``, for every group (at most ``len(tokens) - 1``
        tokens' worth: the last token is always computed); each block is ``buffer index -> its
        keys or values`` for the positions of that block. Counts the lookup."""
        found: list[dict[int, object]] = []
        for digest in self.digests(tokens[: len(tokens) - 1]):
            arrays: dict[int, object] = {}
            for group in groups:
                value = self._blocks.get((group.key, digest))
                if value is None:
                    break
                arrays.update(zip(group.buffers, value, strict=True))
            else:
                found.append(arrays)
                continue
            break
        self.stats.queried += len(tokens)
        self.stats.hit += len(found) * self.block
        return found

    def store(
        self,
        tokens: Sequence[int],
        groups: Sequence[CacheGroup],
        read: Callable[[int, int, int], object],
        skip: int = 0,
    ) -> None:
        """Keep every whole block of ``tokens`` from the ``skip``-th on (the ones before it were
        just read from here): ``read(buffer, start, stop)`` copies a buffer's keys or values at the
        tokens ``[start, stop)``. A block already held only counts as used."""
        for i, digest in enumerate(self.digests(tokens)):
            for group in groups:
                key = (group.key, digest)
                if key in self._blocks:
                    self._blocks[key] = self._blocks[key]  # most recently used
                elif i >= skip:
                    start = i * self.block
                    value = tuple(read(b, start, start + self.block) for b in group.buffers)
                    if _nbytes(value) <= self.max_bytes:
                        self._blocks[key] = value
                        self.stats.stored += 1

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
