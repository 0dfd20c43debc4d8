"""The backend-neutral decode interface of exported engines.

Every backend (onnxruntime now, TensorRT later) serves a budget path as one graph with a
dynamic step length, so the same graph runs the prefill (``T`` prompt tokens) and each
decode step (``T = 1``). Its interface follows onnxruntime-genai's names:

inputs
    ``input_ids [batch, step]`` int64, ``attention_mask [batch, capacity]`` (1 on the
    cache slots that hold real tokens, including this step's), ``position_ids [batch,
    step]`` int64, ``cache_position [step]`` int64 (the slots this step writes; genai has no
    such input, transformers' static-cache exports do), and per cache pair ``j``
    ``past_key_values.{j}.key`` / ``.value`` ``[batch, kv_heads, capacity, head_dim]``;
outputs
    ``logits [batch, 1, vocab]`` (the last position only, like ``logits_to_keep=1``), then
    ``present.{j}.key`` / ``.value``: the caches with this step's keys and values written at
    ``cache_position``, same shape as the past ones.

The cache has a fixed capacity chosen by the caller; ``present`` may be bound to the very
buffer ``past`` was read from (onnxruntime IOBinding), so nothing is copied per token. Pair
``j`` is the ``j``-th attention execution to write a cache slot, in graph order; the
:class:`CacheLayout` says which layer and which execution (a repeated layer's second pass,
loop ``i`` of a recurrent block) it serves.

:func:`serving_graph` builds that graph from the cached budget path
(:func:`looptool.runtime.generation.cached_paths`, whose head already reads only the last
position): the in-place cache writes become functional writes whose results are returned,
and the fused ops replace their subgraphs. The arithmetic is the cached path's, op for op.

**One batch, many depths.** :func:`rowwise_serving_graph` builds the same interface from the
row-wise-budget path (the ``rowwise_budget`` pass): one more input, ``budgets [batch]``
int64 after ``cache_position``, each row's budget; its caches are the deepest budget's
pairs, a superset of every budget's. Every row gets exactly its own budget's computation
(Accordion Eq. 1, ELR Eq. 2). Engines keep it *beside* the per-budget graphs: the pass
masks rows, so the row-wise graph costs the deepest budget whatever its rows ask for, while
a batch whose rows share a budget runs that budget's own graph on the matching pairs.

A server drives any runtime through :class:`StepEngine` (PyTorch:
:class:`looptool.runtime.step_engine.TorchStepEngine`; onnxruntime:
:class:`looptool.backends.ort_engine.OrtStepEngine`) over one
:class:`~looptool.runtime.step_engine.SlotCache` (buffers ``[slots, kv_heads, length,
head_dim]``: torch tensors or numpy arrays; ``copy_row(src, dst)``, ``shift_left(n)``,
``nbytes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import fx

from looptool.core.errors import LooptoolError
from looptool.core.graph import BUDGETS, annotation, copy_graph

INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position")
ROWWISE_INPUTS = (*INPUTS, BUDGETS)
LOGITS = "logits"
_aten = torch.ops.aten


class StepEngine(Protocol):
    """What a server drives (structural): cached steps over a contiguous slice of slot-cache
    rows, each row at its own budget."""

    budgets: tuple[int, ...]  # the menu, sorted
    vocab_size: int
    mask_dtype: torch.dtype  # dtype of the attention_mask the graphs take

    def allocate(self, slots: int, length: int) -> Any:
        """Zeroed persistent caches (a SlotCache), every buffer ``[slots, kv_heads, length, head_dim]``."""

    def step(
        self, cache: Any, rows: slice, input_ids, attention_mask, position_ids, cache_position, budgets
    ) -> torch.Tensor:
        """One cached step over cache rows ``rows`` (zero-copy views): ``input_ids [R, T]``,
        ``attention_mask [R, length]``, ``position_ids [R, T]``, ``cache_position [T]``,
        ``budgets [R]``; float32 next-token logits ``[R, vocab]``."""

    def prompt_logprobs(self, input_ids, budget: int) -> torch.Tensor:
        """float32 log-softmax over the vocabulary at every position of ``input_ids [1, T]``: ``[T, vocab]``."""


def past_name(pair: int, kind: str) -> str:
    """Input name of cache pair ``pair``, ``kind`` ``"k"`` or ``"v"``."""
    return f"past_key_values.{pair}.{'key' if kind == 'k' else 'value'}"


def present_name(pair: int, kind: str) -> str:
    """Output name of cache pair ``pair``, ``kind`` ``"k"`` or ``"v"``."""
    return f"present.{pair}.{'key' if kind == 'k' else 'value'}"


def example_budgets(menu: tuple[int, ...], batch: int) -> torch.Tensor:
    """Row budgets ``[batch]`` (int64) cycling through ``menu`` from its deepest budget, for
    tracing and recording a row-wise graph (so a batch of two holds the deepest and the shallowest)."""
    order = [menu[-1], *menu[:-1]] if menu else [0]
    return torch.tensor([order[i % len(order)] for i in range(batch)], dtype=torch.long)


@dataclass(frozen=True)
class CachePair:
    """One key/value cache pair: the cache of one attention execution."""

    layer: int
    execution: int  # 1: the layer's own pass; 2: a repeated layer's second pass / loop 2; ...
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class CacheLayout:
    """The cache pairs of one serving graph, in interface order, and their dtype."""

    pairs: tuple[CachePair, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        """Bytes per cache element."""
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    def bytes_per_token(self) -> int:
        """Key and value bytes one token occupies in all pairs, per batch row."""
        return sum(2 * p.kv_heads * p.head_dim for p in self.pairs) * self.itemsize

    def names(self) -> tuple[list[str], list[str]]:
        """``(past input names, present output names)`` in interface order (key, value per pair)."""
        past = [past_name(j, kind) for j in range(len(self.pairs)) for kind in "kv"]
        present = [present_name(j, kind) for j in range(len(self.pairs)) for kind in "kv"]
        return past, present

    def to_dict(self) -> dict:
        """JSON-ready form (stored in engine manifests)."""
        return {
            "dtype": self.dtype,
            "pairs": [asdict(p) for p in self.pairs],
            "shape": "[batch, kv_heads, capacity, head_dim]",
        }

    @classmethod
    def from_dict(cls, data: dict) -> CacheLayout:
        """Inverse of :meth:`to_dict`; raises ``ValueError``/``KeyError``/``TypeError`` on a malformed entry."""
        pairs = tuple(
            CachePair(int(p["layer"]), int(p["execution"]), int(p["kv_heads"]), int(p["head_dim"]))
            for p in data["pairs"]
        )
        if data["dtype"] not in ("float32", "float16", "bfloat16") or any(
            min(p.kv_heads, p.head_dim) < 1 or p.execution < 1 for p in pairs
        ):
            raise ValueError("cache layout out of range")
        return cls(pairs, str(data["dtype"]))


@dataclass
class ServingGraph:
    """A budget path in the decode interface: ``module(*inputs)`` → ``(logits, *presents)``."""

    module: fx.GraphModule
    layout: CacheLayout
    input_names: list[str]
    output_names: list[str]
    fused: dict[str, int]
    vocab_size: int
    menu: tuple[int, ...] = ()  # row-wise graphs: the budgets a row may take (else empty)

    @property
    def rowwise(self) -> bool:
        """Whether this is the row-wise graph (input ``budgets`` after ``cache_position``)."""
        return BUDGETS in self.input_names


def serving_graph(model, budget: int, kv: str = "per-loop", *, fuse: bool = True) -> ServingGraph:
    """The decode-interface graph of ``model`` at ``budget`` under KV policy ``kv``, reading
    the model's own tensors (nothing is copied). With ``fuse`` the ``fuse`` pass runs (through
    the PassManager) on the cached path of ``budget``."""
    from looptool.passes import PassManager
    from looptool.passes.fuse import fused_counts
    from looptool.runtime.generation import cached_layer_graph, cached_paths

    budget = model.check_budget(budget)
    path = cached_paths(model, kv, (budget,))[budget]
    counts: dict[str, int] = {}
    if fuse:
        fused = PassManager([("fuse", {})])(cached_layer_graph(model, kv, (budget,)))  # that path alone
        graph = fused.paths[budget]  # a new graph, this function's own to rewrite
        counts = fused_counts(graph)
    else:
        graph = copy_graph(path.module.graph)
    return interface_graph(model, path, graph, counts, INPUTS, f"budget {budget}")


def rowwise_serving_graph(model, kv: str = "per-loop", *, fuse: bool = True) -> ServingGraph:
    """The row-wise-budget graph of ``model`` under KV policy ``kv`` in the decode interface:
    the step inputs, then ``budgets`` (int64 ``[batch]``, each row's budget), then the deepest
    budget's cache pairs (:func:`looptool.runtime.generation.rowwise_path`). With ``fuse`` the
    ``fuse`` pass runs (through the PassManager) on the row-wise LayerGraph."""
    from looptool.passes import PassManager
    from looptool.passes.fuse import fused_counts
    from looptool.runtime.generation import rowwise_layer_graph, rowwise_path

    path = rowwise_path(model, kv)
    counts: dict[str, int] = {}
    if fuse:
        fused = PassManager([("fuse", {})])(rowwise_layer_graph(model, kv))
        (graph,) = fused.paths.values()  # a new graph, this function's own to rewrite
        counts = fused_counts(graph)
    else:
        graph = copy_graph(path.module.graph)
    return interface_graph(model, path, graph, counts, ROWWISE_INPUTS, "the row-wise graph", model.budgets)


def interface_graph(
    model, path, graph: fx.Graph, counts: dict[str, int], inputs: tuple[str, ...], what: str, menu: tuple = ()
) -> ServingGraph:
    """``graph`` (this caller's own copy of cached path ``path``'s graph, maybe fused) in the
    decode interface with step inputs ``inputs``: functional cache writes, placeholders in
    interface order, outputs ``(logits, present...)``."""
    from looptool.core.graph import shared_graph_module

    order = functional_cache_writes(graph)
    by_name = {s.name: s for s in path.slots}
    pairs: list[CachePair] = []
    names: dict[str, str] = {}
    index: dict[tuple[int, int], int] = {}
    for slot_name in order:
        slot = by_name[slot_name]
        key = (slot.layer, slot.execution)
        if key not in index:
            index[key] = len(pairs)
            pairs.append(CachePair(slot.layer, slot.execution, slot.kv_heads, slot.head_dim))
        names[slot_name] = past_name(index[key], slot.kind)
    if len(names) != 2 * len(pairs):
        raise LooptoolError(
            f"{what}: the cached path's cache inputs do not form key/value pairs; please report this as a bug."
        )
    _order_inputs(graph, names, inputs)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    layout = CacheLayout(tuple(pairs), dtype)
    past, present = layout.names()
    _order_outputs(graph, names, past)
    graph.lint()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ServingGraph(
        shared_graph_module(model, graph),
        layout,
        [*inputs, *past],
        [LOGITS, *present],
        dict(counts),
        int(text.vocab_size),
        tuple(menu),
    )


def functional_cache_writes(graph: fx.Graph) -> list[str]:
    """Turn every in-place cache write (``index_copy_`` on a cache input) into the functional
    ``index_copy``; later readers of the cache read the write's result, and the graph returns
    ``(logits, last write of each cache...)``. Returns the cache input names in the order
    of their first write."""
    caches = {n for n in graph.nodes if n.op == "placeholder" and "kv" in annotation(n)}
    current: dict[fx.Node, fx.Node] = {}
    order: list[str] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.index_copy_.default and node.args[0] in caches:
            base = node.args[0]
            source = current.get(base, base)
            with graph.inserting_before(node):
                new = graph.call_function(_aten.index_copy.default, (source, *node.args[1:]), dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if base not in current:
                order.append(str(base.target))
            current[base] = new
            continue
        if node.op == "output":
            continue
        for base, latest in current.items():  # a later read of a written cache reads the write
            if base in node.all_input_nodes and node is not latest:
                node.replace_input_with(base, latest)
    unwritten = sorted(str(c.target) for c in caches if c not in current)
    if unwritten:
        raise LooptoolError(f"cache input(s) {unwritten} are never written; this graph is not a cached decode step.")
    output = graph.output_node()
    (logits,) = _flatten(output.args[0])
    output.args = ((logits, *(current[c] for c in sorted(current, key=lambda c: order.index(str(c.target))))),)
    return order


def _order_inputs(graph: fx.Graph, names: dict[str, str], inputs: tuple[str, ...] = INPUTS) -> None:
    """Put the placeholders in interface order: the step ``inputs``, then the cache pairs
    by index, key before value (FX placeholder names stay Python identifiers; the interface
    names are given to the exporter)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    unknown = [n.target for n in placeholders if n.target not in inputs and n.target not in names]
    if unknown:
        raise LooptoolError(f"the cached path has input(s) {unknown} outside the decode interface {list(inputs)}.")
    interface = {
        n: (inputs.index(n.target), 0, 0) if n.target in inputs else (len(inputs), *_pair_order(names[n.target]))
        for n in placeholders
    }
    first = placeholders[0]
    for node in sorted(placeholders, key=interface.__getitem__, reverse=True):
        if node is not first:
            first.prepend(node)
        first = node


def _pair_order(name: str) -> tuple[int, int]:
    _, pair, kind = name.split(".")
    return int(pair), 0 if kind == "key" else 1


def _order_outputs(graph: fx.Graph, names: dict[str, str], past: list[str]) -> None:
    """Return ``(logits, present...)`` with present ``j`` the last write of past ``j``."""
    output = graph.output_node()
    logits, *writes = output.args[0]
    by_past = {}
    for write in writes:
        base = write
        while base.op != "placeholder":
            base = base.args[0]
        by_past[names[base.target]] = write
    output.args = ((logits, *(by_past[name] for name in past)),)


def _flatten(value) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]
