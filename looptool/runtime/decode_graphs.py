"""The decode graphs of a looped model: its cached budget paths (ELR Sec. 3.4, Accordion Eq. 6).

Cached decoding runs budget paths built from a second capture of the source: one cached
step (:func:`looptool.capture.export_decode_step`, a static KV cache written in place),
captured on ``meta`` from the model's config, looped by replaying the model's own recipe,
routed to cache slots by the ``kv_cache`` pass and bound to the model's parameters (no
copy). Prefill and every decode step go through the same graph; there is no hand-written
attention code. Every rewrite is a pass run by the PassManager.

What is built is kept with the model in one typed cache, :class:`DecodeGraphs`
(``model.derived["decode_graphs"]``, dropped when the model moves to another device), keyed by
:class:`DecodeKey`: the kind of graph and the KV policy; the budgets are the paths inside.
The decode loop itself is :mod:`looptool.runtime.generation`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import fx

from looptool.capture import capture_config
from looptool.core.errors import LooptoolError
from looptool.core.graph import (
    ADAPTIVE,
    ROWWISE,
    LayerGraph,
    annotation,
    dtype_from_str,
    own_bodies,
    shared_graph_module,
)
from looptool.passes import PassManager
from looptool.passes.kv_cache import KV_POLICIES

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork

DERIVED_KEY = "decode_graphs"  # the entry of ``LoopedNetwork.derived`` that holds a model's DecodeGraphs


@dataclass(frozen=True)
class CacheSlot:
    """One cache input of a cached budget path: keys or values of one attention execution."""

    name: str
    layer: int
    kind: str  # "k" or "v"
    execution: int  # 1 = the layer's own pass; 2 = a repeated layer's second pass / loop 2; ...
    kv_heads: int
    head_dim: int


@dataclass
class CachedPath:
    """A cached budget path: ``module(input_ids, attention_mask, position_ids,
    cache_position, *caches) -> logits`` and the cache inputs it expects, in order."""

    module: fx.GraphModule
    slots: tuple[CacheSlot, ...]


@dataclass(frozen=True)
class DecodeKey:
    """Which decode graph: ``kind`` ``"cached"`` (a path per budget, from the ``kv_cache`` and
    ``last_position`` passes), ``"rowwise"`` (those, then ``rowwise_budget``: one path, key
    :data:`~looptool.core.graph.ROWWISE`, every row at its own budget), ``"verify"`` (a path per
    budget from ``kv_cache`` alone: logits at every position, for speculative decoding's verify
    step) or ``"adaptive"`` / ``"adaptive-kl"`` / ``"adaptive-gate"`` (``cached``'s, then
    ``adaptive_depth`` with exit rule ``"state"`` / ``"kl"`` / ``"gate"``: one path, key
    :data:`~looptool.passes.adaptive_depth.ADAPTIVE`, every row's depth decided per token), under
    KV policy ``kv``."""

    kind: Literal["cached", "rowwise", "verify", "adaptive", "adaptive-kl", "adaptive-gate"]
    kv: str

    @classmethod
    def adaptive(cls, exit_rule: str, kv: str) -> DecodeKey:
        """The key of the adaptive-depth graph of ``exit_rule`` under ``kv``."""
        return cls("adaptive" if exit_rule == "state" else f"adaptive-{exit_rule}", kv)


@dataclass
class DecodeGraphs:
    """The decode graphs one model has built so far."""

    step: LayerGraph | None = None  # the captured decode step with the recipe replayed, shared by every key
    graphs: dict[DecodeKey, LayerGraph] = field(default_factory=dict)  # the paths rewritten so far
    paths: dict[DecodeKey, dict[int | str, CachedPath]] = field(default_factory=dict)  # bound to the model


def decode_graphs(model: LoopedNetwork) -> DecodeGraphs:
    """The decode graphs ``model`` keeps (empty at first)."""
    kept = model.derived.get(DERIVED_KEY)
    if not isinstance(kept, DecodeGraphs):
        kept = model.derived[DERIVED_KEY] = DecodeGraphs()
    return kept


def repeats_layers(model: LoopedNetwork) -> bool:
    """Whether some budget of ``model`` executes a layer more than once (last-loop caches need that)."""
    n = len(model.layer_graph.layers)
    return any(len(set(ex)) != len(ex) for ex in (model.plan.executed_layers(b, n) for b in model.budgets))


def check_policy(model: LoopedNetwork, kv: str) -> str:
    """Validate a KV cache policy for ``model``."""
    if kv not in KV_POLICIES:
        raise LooptoolError(f"unknown KV cache policy {kv!r}; use one of {list(KV_POLICIES)}.", parameter="kv")
    if kv == "last-loop":
        if not repeats_layers(model):
            raise LooptoolError(
                f"kv 'last-loop' shares one cache slot between repeated attention executions, but no budget "
                f"of this model ({list(model.budgets)}) repeats a layer; use kv='per-loop'.",
                parameter="kv",
            )
    return kv


def _decode_step(model: LoopedNetwork) -> LayerGraph:
    """The captured decode step with the model's recipe replayed (built once per model)."""
    kept = decode_graphs(model)
    if kept.step is None:
        lg = model.layer_graph
        captured = capture_config(
            lg.config, dtype_from_str(lg.source.dtype), lg.source.attn_implementation, decode=True
        )
        device = str(next(model.parameters()).device)
        captured = PassManager([("retarget_device", {"to": device})])(captured)
        kept.step = PassManager(model.recipe)(captured)
    return kept.step


def cached_layer_graph(model: LoopedNetwork, kv: str = "per-loop", budgets: Iterable[int] | None = None) -> LayerGraph:
    """The decode-step LayerGraph of ``model`` under KV policy ``kv``, whose budget paths are
    the cached paths before binding (built once per model, policy and budget, every rewrite a
    pass run by the PassManager: a ``meta`` capture of the decode step, ``retarget_device`` to
    the model's device (before the passes that build budget paths, so one graph is copied), the
    model's recipe replayed, ``kv_cache`` and ``last_position``); later rewrites of the cached
    paths (the serving graph's ``fuse``) start from it.

    ``budgets`` (default: every budget) limits the paths ``kv_cache`` and ``last_position``
    rewrite to those asked for: a call that decodes at one budget (``looptool generate
    --budget 0``) rewrites one path, not the whole menu; paths asked for later are added."""
    return _layer_graph(model, DecodeKey("cached", check_policy(model, kv)), budgets)


def verify_layer_graph(model: LoopedNetwork, kv: str = "per-loop", budgets: Iterable[int] | None = None) -> LayerGraph:
    """:func:`cached_layer_graph` without the ``last_position`` pass: the paths of
    :func:`verify_paths` before binding (logits at every position of the step), from which an
    exported engine's verify graphs are lowered."""
    return _layer_graph(model, DecodeKey("verify", check_policy(model, kv)), budgets)


def _layer_graph(model: LoopedNetwork, key: DecodeKey, budgets: Iterable[int] | None) -> LayerGraph:
    """The budget paths of ``key`` (kind ``cached`` or ``verify``) for ``budgets``, the missing
    ones rewritten from the captured decode step and kept."""
    wanted = _wanted(model, budgets)
    kept = decode_graphs(model)
    done = kept.graphs.get(key)
    missing = [b for b in wanted if done is None or b not in done.paths]
    if missing:
        decode = _decode_step(model)
        steps = [("kv_cache", {"policy": key.kv})] + ([("last_position", {})] if key.kind == "cached" else [])
        built = PassManager(steps)(decode.replace(paths={b: decode.paths[b] for b in missing}))
        if done is not None:
            built = done.replace(paths=dict(sorted({**done.paths, **built.paths}.items())))
        kept.graphs[key] = done = built
    if set(done.paths) == set(wanted):
        return done
    return done.replace(paths={b: done.paths[b] for b in wanted})


def cached_paths(
    model: LoopedNetwork, kv: str = "per-loop", budgets: Iterable[int] | None = None
) -> dict[int, CachedPath]:
    """The cached budget paths of ``model`` under KV policy ``kv``: the paths of
    :func:`cached_layer_graph`, their attention reading the grouped KV cache as it is (the
    ``grouped_attention`` pass), bound to the model's own tensors (built once per model, policy
    and budget; ``budgets``, default every budget, limits which are built and returned). Each
    returns ``logits [batch, 1, vocab]``."""
    return _bound_paths(model, DecodeKey("cached", check_policy(model, kv)), budgets)


def verify_paths(
    model: LoopedNetwork, kv: str = "per-loop", budgets: Iterable[int] | None = None
) -> dict[int, CachedPath]:
    """:func:`cached_paths` whose head reads every position: each returns ``logits [batch, T,
    vocab]`` for the ``T`` tokens of the step (speculative decoding scores ``n`` drafted tokens
    and the one after them in one step). Same cache inputs, in the same order, as the cached
    path of the same budget."""
    return _bound_paths(model, DecodeKey("verify", check_policy(model, kv)), budgets)


def _bound_paths(model: LoopedNetwork, key: DecodeKey, budgets: Iterable[int] | None) -> dict[int, CachedPath]:
    """The paths of :func:`_layer_graph` for ``key``, grouped-attention rewritten and bound (kept)."""
    wanted = _wanted(model, budgets)
    bound = decode_graphs(model).paths.setdefault(key, {})
    missing = [b for b in wanted if b not in bound]
    if missing:
        lg = PassManager([("grouped_attention", {})])(_layer_graph(model, key, missing))
        for b, g in lg.paths.items():
            bound[b] = _bind(model, g, lg.module)
    return {b: bound[b] for b in wanted}


def _wanted(model: LoopedNetwork, budgets: Iterable[int] | None) -> tuple[int, ...]:
    """``budgets`` checked against the menu, sorted, each once (None: the whole menu)."""
    if budgets is None:
        return model.budgets
    return tuple(sorted({model.check_budget(b) for b in budgets}))


def rowwise_layer_graph(model: LoopedNetwork, kv: str = "per-loop") -> LayerGraph:
    """:func:`cached_layer_graph` with the ``rowwise_budget`` pass run (through the
    PassManager): its one path, key :data:`~looptool.passes.rowwise_budget.ROWWISE`, takes
    ``budgets`` (int64 ``[batch]``) after ``cache_position`` (built once per model and policy)."""
    key = DecodeKey("rowwise", kv)
    graphs = decode_graphs(model).graphs
    if key not in graphs:
        graphs[key] = PassManager([("rowwise_budget", {})])(cached_layer_graph(model, kv))
    return graphs[key]


def rowwise_path(model: LoopedNetwork, kv: str = "per-loop") -> CachedPath:
    """The row-wise-budget cached path: ``module(input_ids, attention_mask, position_ids,
    cache_position, budgets, *caches) -> logits [batch, 1, vocab]``, every row at its own
    budget, over the deepest budget's cache slots (``slots``; :func:`allocate_cache` works)."""
    bound = decode_graphs(model).paths.setdefault(DecodeKey("rowwise", kv), {})
    if ROWWISE not in bound:
        lg = PassManager([("grouped_attention", {})])(rowwise_layer_graph(model, kv))
        bound[ROWWISE] = _bind(model, lg.paths[ROWWISE], lg.module)
    return bound[ROWWISE]


def adaptive_layer_graph(model: LoopedNetwork, kv: str = "last-loop", exit_rule: str = "state") -> LayerGraph:
    """:func:`cached_layer_graph` with the ``adaptive_depth`` pass run (through the PassManager):
    its one path, key :data:`~looptool.passes.adaptive_depth.ADAPTIVE`, takes ``min_budget``,
    ``max_budget`` (int64 ``[batch]``) and ``exit_threshold`` (float32 ``[batch]``) after
    ``cache_position`` (built once per model, policy and exit rule)."""
    key = DecodeKey.adaptive(exit_rule, kv)
    graphs = decode_graphs(model).graphs
    if key not in graphs:
        graphs[key] = PassManager([("adaptive_depth", {"exit_rule": exit_rule})])(cached_layer_graph(model, kv))
    return graphs[key]


def adaptive_path(
    model: LoopedNetwork, kv: str = "last-loop", exit_rule: str = "state", *, skip: bool = True
) -> CachedPath:
    """The adaptive-depth cached path: ``module(input_ids, attention_mask, position_ids,
    cache_position, min_budget, max_budget, exit_threshold, *caches) -> (logits [batch, 1,
    vocab], depth [batch])``, over the deepest budget's cache slots. With ``skip`` (the
    default) the ``skip_exited`` pass lifts each masked loop or second pass into a segment the
    step runs only while some row is still active; ``skip=False`` keeps the masked path, which
    runs every step to the batch's deepest ``max_budget`` (bit-identical results)."""
    key = DecodeKey.adaptive(exit_rule, kv)
    bound = decode_graphs(model).paths.setdefault(key, {})
    name = ADAPTIVE if skip else f"{ADAPTIVE}-masked"
    if name not in bound:
        steps = [("grouped_attention", {})] + ([("skip_exited", {})] if skip else [])
        lg = PassManager(steps)(adaptive_layer_graph(model, kv, exit_rule))
        bound[name] = _bind(model, lg.paths[ADAPTIVE], lg.module)
    return bound[name]


def _bind(model: LoopedNetwork, graph: fx.Graph, captured: torch.nn.Module) -> CachedPath:
    """``graph`` run over the model's own tensors, with the bodies of its higher-order ops
    (``captured``'s, the decode capture's own) rather than the model's forward bodies of the
    same name: the two captures name their bodies alike, and under automatic dims a decode
    body can take a size argument the forward one does not."""
    bodies = own_bodies(captured, graph)
    missing = [
        n.target
        for n in graph.nodes
        if n.op == "get_attr" and n.target not in bodies and not _has_attr(model, n.target)
    ]
    if missing:
        raise LooptoolError(f"the cached decode graph reads '{missing[0]}', which the looped model does not hold.")
    slots = []
    for node in graph.nodes:
        kv = annotation(node).get("kv") if node.op == "placeholder" else None
        if kv:
            shape = node.meta["val"].shape
            slots.append(
                CacheSlot(
                    str(node.target), kv["layer"], kv["kind"], kv.get("execution", 1), int(shape[1]), int(shape[3])
                )
            )
    return CachedPath(shared_graph_module(model, graph, bodies=bodies), tuple(slots))


def _has_attr(root: torch.nn.Module, dotted: str) -> bool:
    obj = root
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def allocate_cache(path: CachedPath, batch: int, length: int, *, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Zeroed cache tensors for ``path``: one ``[batch, kv_heads, length, head_dim]`` per slot."""
    return [torch.zeros(batch, s.kv_heads, length, s.head_dim, dtype=dtype, device=device) for s in path.slots]


def kv_bytes_per_token(model: LoopedNetwork, budget: int, kv: str = "per-loop") -> int:
    """KV bytes one token occupies at ``budget`` under policy ``kv``, from the cache inputs
    of the cached path (what :func:`looptool.runtime.generation.generate` allocates per token)."""
    path = cached_paths(model, kv)[model.check_budget(budget)]
    itemsize = next(model.parameters()).element_size()
    return sum(s.kv_heads * s.head_dim * itemsize for s in path.slots)
