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
    ``logits [batch, 1, vocab]`` (the last position only, like ``logits_to_keep=1``; a verify
    graph, :func:`verify_serving_graph`, returns every position's), then
    ``present.{j}.key`` / ``.value``: the caches with this step's keys and values written at
    ``cache_position``, same shape as the past ones.

The cache has a fixed capacity chosen by the caller; ``present`` may be bound to the very
buffer ``past`` was read from (onnxruntime IOBinding), so nothing is copied per token. Pair
``j`` is the ``j``-th attention execution to write a cache slot, in graph order; the
:class:`CacheLayout` says which layer and which execution (a repeated layer's second pass,
loop ``i`` of a recurrent block) it serves.

:func:`serving_graph` builds that graph from the cached budget path
(:func:`looptool.runtime.decode_graphs.cached_paths`, whose head already reads only the last
position) with passes run by the PassManager: ``fuse`` replaces subgraphs with the fused ops
and ``decode_interface`` turns the in-place cache writes into functional writes whose results
are returned. The arithmetic is the cached path's, op for op.

**One batch, many depths.** :func:`rowwise_serving_graph` builds the same interface from the
row-wise-budget path (the ``rowwise_budget`` pass): one more input, ``budgets [batch]``
int64 after ``cache_position``, each row's budget; its caches are the deepest budget's
pairs, a superset of every budget's. Every row gets exactly its own budget's computation
(Accordion Eq. 1, ELR Eq. 2). Engines keep it *beside* the per-budget graphs: the pass
masks rows, so the row-wise graph costs the deepest budget whatever its rows ask for, while
a batch whose rows share a budget runs that budget's own graph on the matching pairs.

The step engines of the runtimes (:class:`looptool.engine.StepEngine`) bind these graphs;
every runtime checks a generate request against its engine's manifest with
:func:`looptool.backends.manifest.check_request`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import fx

from looptool.core.graph import BUDGETS, ROWWISE_STEP_INPUTS, STEP_INPUTS, annotation
from looptool.engine.interface import StepEngine
from looptool.engine.prefix_cache import CacheGroup, budget_pairs, pair_groups

if TYPE_CHECKING:
    from looptool.engine.budgets import RowBudgets

INPUTS = STEP_INPUTS
ROWWISE_INPUTS = ROWWISE_STEP_INPUTS
LOGITS = "logits"
DEPTH = "depth"  # the adaptive-depth graph's second output: int64 [batch], each row's realised depth


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


def row_inputs(budgets: RowBudgets, adaptive: bool) -> dict[str, np.ndarray]:
    """The per-row inputs a graph binds between ``cache_position`` and the caches, from each
    row's ``budgets``: the adaptive-depth graph's ``min_budget``, ``max_budget`` and
    ``exit_threshold`` (:meth:`~looptool.engine.budgets.RowBudgets.depth_inputs`), else the
    row-wise graph's ``budgets``."""
    from looptool.passes.adaptive_depth import AUTO_INPUTS

    if adaptive:
        names, values = AUTO_INPUTS[len(INPUTS) :], budgets.depth_inputs()
    else:
        names, values = (BUDGETS,), (budgets.tensor(),)
    return {name: np.ascontiguousarray(value.numpy()) for name, value in zip(names, values)}


def example_extras(sg: ServingGraph, batch: int) -> list[torch.Tensor]:
    """Example values ``[batch]`` of the inputs a graph takes between ``cache_position`` and the
    caches, for tracing and recording it: a row-wise graph's ``budgets``
    (:func:`example_budgets`); an adaptive-depth graph's ``min_budget`` (the menu's smallest),
    ``max_budget`` (cycling like ``budgets``) and ``exit_threshold`` (0 and 0.5 in turn); none
    for a budget's own graph."""
    if sg.rowwise:
        return [example_budgets(sg.menu, batch)]
    if not sg.adaptive:
        return []
    hi = example_budgets(sg.menu, batch)
    lo = torch.full_like(hi, min(sg.menu))
    return [lo, hi, torch.tensor([0.5 * (i % 2) for i in range(batch)], dtype=torch.float32)]


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
    every_position: bool = False  # verify graphs: logits [batch, step, vocab] (else the last position's)

    @property
    def rowwise(self) -> bool:
        """Whether this is the row-wise graph (input ``budgets`` after ``cache_position``)."""
        return BUDGETS in self.input_names

    @property
    def adaptive(self) -> bool:
        """Whether this is the adaptive-depth graph (inputs ``min_budget``, ``max_budget``,
        ``exit_threshold`` after ``cache_position``; output ``depth`` after the logits)."""
        return DEPTH in self.output_names


def serving_graph(
    model, budget: int, kv: str = "per-loop", *, fuse: bool = True, unflatten: bool = False
) -> ServingGraph:
    """The decode-interface graph of ``model`` at ``budget`` under KV policy ``kv``, reading
    the model's own tensors (nothing is copied): the cached path of ``budget`` lowered by
    passes run through the PassManager (:func:`lower`)."""
    from looptool.runtime.decode_graphs import cached_layer_graph

    budget = model.check_budget(budget)
    return lower(model, cached_layer_graph(model, kv, (budget,)), fuse=fuse, unflatten=unflatten)


def verify_serving_graph(
    model, budget: int, kv: str = "per-loop", *, fuse: bool = True, unflatten: bool = False
) -> ServingGraph:
    """The verify graph of ``model`` at ``budget`` (speculative decoding's verify step): the
    decode interface of :func:`serving_graph`, same inputs and cache pairs, but ``logits [batch,
    step, vocab]`` at every position of the step; lowered (:func:`lower`) from the verify path
    (:func:`looptool.runtime.decode_graphs.verify_layer_graph`, no ``last_position`` pass)."""
    from looptool.runtime.decode_graphs import verify_layer_graph

    budget = model.check_budget(budget)
    sg = lower(model, verify_layer_graph(model, kv, (budget,)), fuse=fuse, unflatten=unflatten)
    return replace(sg, every_position=True)


def rowwise_serving_graph(model, kv: str = "per-loop", *, fuse: bool = True, unflatten: bool = False) -> ServingGraph:
    """The row-wise-budget graph of ``model`` under KV policy ``kv`` in the decode interface:
    the step inputs, then ``budgets`` (int64 ``[batch]``, each row's budget), then the deepest
    budget's cache pairs: the row-wise path (:func:`looptool.runtime.decode_graphs.rowwise_path`)
    lowered like every serving graph (:func:`lower`)."""
    from looptool.runtime.decode_graphs import rowwise_layer_graph

    return lower(model, rowwise_layer_graph(model, kv), fuse=fuse, unflatten=unflatten, menu=model.budgets)


def adaptive_serving_graph(
    model, exit_rule: str = "state", kv: str = "last-loop", *, fuse: bool = True, unflatten: bool = False
) -> ServingGraph:
    """The adaptive-depth graph of ``model`` (``budget="auto"``) in the decode interface: the
    step inputs, then ``min_budget``, ``max_budget`` (int64 ``[batch]``) and ``exit_threshold``
    (float32 ``[batch]``), then the deepest budget's cache pairs (last-loop KV); outputs the
    logits, ``depth`` (int64 ``[batch]``, each row's realised depth) and the presents. The
    adaptive path (:func:`looptool.runtime.decode_graphs.adaptive_layer_graph`, every loop run
    and masked per row) lowered like every serving graph (:func:`lower`)."""
    from looptool.runtime.decode_graphs import adaptive_layer_graph

    lg = adaptive_layer_graph(model, kv, exit_rule)
    return lower(model, lg, fuse=fuse, unflatten=unflatten, menu=model.budgets)


def lower(model, lg, *, fuse: bool = True, unflatten: bool = False, menu: tuple[int, ...] = ()) -> ServingGraph:
    """The one path of ``lg`` (a cached decode LayerGraph of ``model``) as a serving graph: with
    ``fuse`` the ``fuse`` pass, then ``decode_interface`` (functional cache writes, inputs and
    outputs in interface order), and with ``unflatten`` ``unflatten_crossings`` (what composing
    the graph from layer functions needs), each run and verified by the PassManager on graphs
    of their own; ``menu``: the row-wise graph's budgets."""
    from looptool.passes import PassManager
    from looptool.passes.fuse import fused_counts

    lowered = PassManager([*([("fuse", {})] if fuse else []), ("decode_interface", {})])(lg)
    (graph,) = lowered.paths.values()
    counts = fused_counts(graph) if fuse else {}  # before unflatten_crossings, whose flattens copy readers' metadata
    if unflatten:
        (graph,) = PassManager([("unflatten_crossings", {})])(lowered).paths.values()
    return interface_graph(model, graph, counts, menu, captured=lg.module)


def interface_graph(
    model, graph: fx.Graph, counts: dict[str, int], menu: tuple = (), *, captured: torch.nn.Module | None = None
) -> ServingGraph:
    """The serving graph of ``graph``, a cached path in the decode interface (the
    ``decode_interface`` pass): its cache layout read from the cache inputs, in order; the
    bodies of its higher-order ops are ``captured``'s (the decode capture's own, see
    :func:`looptool.core.graph.own_bodies`)."""
    from looptool.core.graph import own_bodies, shared_graph_module
    from looptool.passes.adaptive_depth import MIN_BUDGET
    from looptool.passes.decode_interface import interface_inputs

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    caches = [(annotation(n)["kv"], n.meta["val"].shape) for n in placeholders if "kv" in annotation(n)]
    pairs = tuple(
        CachePair(kv["layer"], kv.get("execution", 1), int(shape[1]), int(shape[3])) for kv, shape in caches[::2]
    )
    inputs = interface_inputs({str(n.target) for n in placeholders})
    heads = [LOGITS, DEPTH] if MIN_BUDGET in inputs else [LOGITS]
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    layout = CacheLayout(pairs, dtype)
    past, present = layout.names()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ServingGraph(
        shared_graph_module(model, graph, bodies=own_bodies(captured, graph) if captured is not None else None),
        layout,
        [*inputs, *past],
        [*heads, *present],
        dict(counts),
        int(text.vocab_size),
        tuple(menu),
    )


class ExportedSteps(StepEngine):
    """What the step engines of exported engines share: a slot cache laid out as ``layout``'s cache
    pairs (buffers ``2j`` and ``2j + 1`` hold pair ``j``'s keys and values), the pairs each graph
    reads (``_pairs``: a budget's own graph, :data:`ROWWISE`, the adaptive-depth graph) and the
    manifest's loop ``plan``."""

    layout: CacheLayout
    _pairs: dict[int | str, list[int]]
    plan: dict | None

    def budget_buffers(self, budget: int) -> tuple[int, ...]:
        """The buffers ``budget`` reads: its own graph's pairs, or where it has none (a looped
        or row-wise engine) those the plan runs at that budget."""
        pairs = self._pairs.get(budget) or budget_pairs(self.layout.pairs, self.plan, budget)
        return tuple(2 * j + i for j in pairs for i in (0, 1))

    def prefix_groups(self, budget: int) -> tuple[CacheGroup, ...]:
        """:meth:`budget_buffers`, those of the layers before the loop shared by every budget."""
        return pair_groups(self.layout.pairs, self.budget_buffers(budget), self.plan, budget)


def own_pairs(layout: CacheLayout, graphs: dict[int | str, CacheLayout]) -> dict[int | str, list[int]]:
    """Per graph of ``graphs`` (its key and cache layout), the pairs of ``layout`` it reads, matched
    by layer and execution; a graph with a pair ``layout`` lacks is left out."""
    index = {(p.layer, p.execution): j for j, p in enumerate(layout.pairs)}
    return {
        key: [index[p.layer, p.execution] for p in other.pairs]
        for key, other in graphs.items()
        if all((p.layer, p.execution) in index for p in other.pairs)
    }
