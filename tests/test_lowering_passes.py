"""The lowering passes ``decode_interface`` and ``unflatten_crossings``: registered, run and
verified by the PassManager, pure (their input graphs are untouched), not recorded in the
recipe, and exact (the lowered graph computes what the cached path computes)."""

from __future__ import annotations

import pytest
import torch

import looptool
from looptool.core.errors import PassError
from looptool.core.graph import ROWWISE, STEP_INPUTS, annotation
from looptool.passes import PassManager, must_precede, registered_passes
from looptool.runtime.decode_graphs import allocate_cache, cached_layer_graph, cached_paths, rowwise_layer_graph
from looptool.testing import tiny_model

_aten = torch.ops.aten


@pytest.fixture(scope="module")
def prefix():
    model = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    _perturb(model)
    return model


@pytest.fixture(scope="module")
def replay():
    """MoE route replay (ELR Sec. 3.4): loop 1's flattened routing crosses into later loops."""
    plan = looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2, route_replay=True)
    model = looptool.convert(tiny_model("qwen3_moe"), plan)
    _perturb(model)
    return model


def _perturb(model) -> None:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _snapshot(lg) -> dict:
    return {k: [n.format_node() for n in g.nodes] for k, g in lg.paths.items()}


def test_the_lowering_passes_are_registered_and_not_replayed():
    from looptool.passes import get_pass

    for name in ("decode_interface", "unflatten_crossings"):
        assert name in registered_passes() and not get_pass(name).replayable
    for earlier in ("fuse", "last_position", "rowwise_budget"):
        assert must_precede(earlier, "decode_interface") and not must_precede("decode_interface", earlier)
    assert must_precede("decode_interface", "unflatten_crossings") and must_precede("fuse", "unflatten_crossings")


def test_decode_interface_is_pure_and_puts_the_path_in_interface_order(prefix):
    lg = cached_layer_graph(prefix, "per-loop", (2,))
    before = _snapshot(lg)
    out = PassManager([("decode_interface", {})])(lg)
    assert _snapshot(lg) == before  # the cached path is untouched
    assert out.applied[-1] == "decode_interface" and out.recipe == lg.recipe
    graph = out.paths[2]
    assert graph is not lg.paths[2]
    assert not any(n.target is _aten.index_copy_.default for n in graph.nodes)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert [n.target for n in placeholders[: len(STEP_INPUTS)]] == list(STEP_INPUTS)
    caches = placeholders[len(STEP_INPUTS) :]
    kinds = [annotation(n)["kv"]["kind"] for n in caches]
    assert kinds == ["k", "v"] * (len(caches) // 2) and len(caches) == 2 * (4 + 2)  # (L + k) attention executions
    logits, *presents = graph.output_node().args[0]
    assert len(presents) == len(caches)
    for cache, present in zip(caches, presents):  # present j is the last write of past j
        while present.op != "placeholder":
            present = present.args[0]
        assert present is cache


@pytest.mark.parametrize("kind", [2, ROWWISE])
def test_decode_interface_computes_what_the_cached_path_computes(prefix, kind):
    """Bit-identical logits, and the returned caches equal those the cached path writes in place."""
    from looptool.backends.interface import rowwise_serving_graph, serving_graph

    if kind == ROWWISE:
        from looptool.runtime.decode_graphs import rowwise_path

        path, sg = rowwise_path(prefix), rowwise_serving_graph(prefix, fuse=False)
        extra = [torch.tensor([2, 0])]
    else:
        path, sg = cached_paths(prefix, "per-loop", (2,))[2], serving_graph(prefix, 2, fuse=False)
        extra = []
    ids = torch.randint(3, 250, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 8, dtype=prefix.mask_dtype)
    mask[:, :5] = 1
    position, cache_position = torch.arange(5).expand(2, 5), torch.arange(5)
    caches = allocate_cache(path, 2, 8, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        want = path.module(ids, mask, position, cache_position, *extra, *caches)
        fresh = [torch.zeros_like(c) for c in caches]
        by_slot = {(s.layer, s.execution, s.kind): c for s, c in zip(path.slots, fresh)}
        ordered = [by_slot[p.layer, p.execution, kind] for p in sg.layout.pairs for kind in "kv"]
        got, *presents = sg.module(ids, mask, position, cache_position, *extra, *ordered)
    assert torch.equal(got, want)
    written = {(s.layer, s.execution, s.kind): c for s, c in zip(path.slots, caches)}
    for (pair, kind), present in zip([(p, k) for p in sg.layout.pairs for k in "kv"], presents):
        assert torch.equal(present, written[pair.layer, pair.execution, kind])


def test_grouped_attention_reads_the_grouped_cache_without_repeating_it(prefix):
    """Every attention execution of a cached path (4 layers + 2 second passes) reads the
    ``[batch, kv_heads, length, head_dim]`` cache with ``enable_gqa`` instead of a per-query-head
    copy; the input path is untouched (the cached paths the runtime binds are checked bit-exact
    against the unrewritten serving graphs in the test above)."""
    lg = cached_layer_graph(prefix, "per-loop", (2,))
    before = _snapshot(lg)
    graph = PassManager([("grouped_attention", {})])(lg).paths[2]
    assert _snapshot(lg) == before
    attention = [n for n in graph.nodes if n.target is _aten.scaled_dot_product_attention.default]
    assert len(attention) == 4 + 2 and all(n.kwargs["enable_gqa"] for n in attention)
    heads, kv_heads = prefix.config.num_attention_heads, prefix.config.num_key_value_heads
    for n in attention:
        q, k, v = (x.meta["val"] for x in n.args[:3])
        assert q.shape[1] == heads and k.shape[1] == v.shape[1] == kv_heads < heads
    original = [n for n in lg.paths[2].nodes if n.target is _aten.scaled_dot_product_attention.default]
    assert all(n.args[1].meta["val"].shape[1] == heads for n in original)  # repeated before the pass


def test_decode_interface_refuses_a_path_that_writes_no_cache(prefix):
    lg = prefix.layer_graph  # budget paths of the forward: no cache input, nothing to lower
    with pytest.raises(PassError, match="pass 'decode_interface' needs pass 'kv_cache' to run first"):
        PassManager([("decode_interface", {})])(lg)


def test_decode_interface_must_follow_the_passes_it_lowers(prefix):
    lowered = PassManager([("decode_interface", {})])(cached_layer_graph(prefix, "per-loop", (2,)))
    with pytest.raises(PassError, match="pass 'fuse' must run before pass 'decode_interface', which already ran"):
        PassManager([("fuse", {})])(lowered)
    with pytest.raises(PassError, match="must run before pass 'decode_interface', which comes earlier"):
        PassManager([("decode_interface", {}), ("rowwise_budget", {})])


def test_unflatten_crossings_is_pure_and_exact_on_route_replay(replay):
    """Loop 1's flattened top-k weights and experts reach loop 2 as ``[batch, step, k]`` views,
    flattened again inside loop 2: the graph gains views and computes the same."""
    from looptool.backends.interface import rowwise_serving_graph

    lg = PassManager([("fuse", {}), ("decode_interface", {})])(rowwise_layer_graph(replay))
    before = _snapshot(lg)
    out = PassManager([("unflatten_crossings", {})])(lg)
    assert _snapshot(lg) == before and out.recipe == lg.recipe and out.applied[-1] == "unflatten_crossings"
    (graph,), (old,) = out.paths.values(), lg.paths.values()

    def added(target) -> int:
        return sum(n.target is target for n in graph.nodes) - sum(n.target is target for n in old.nodes)

    views, flattens = added(_aten.view.default), added(_aten.flatten.using_ints)
    assert views >= 2 and flattens >= views and added(_aten.sym_size.int) == 2 * views  # batch and step sizes
    assert len(graph.nodes) == len(old.nodes) + 3 * views + flattens
    flat, carried = rowwise_serving_graph(replay), rowwise_serving_graph(replay, unflatten=True)
    assert flat.layout == carried.layout and flat.fused == carried.fused
    ids = torch.randint(3, 250, (2, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=replay.mask_dtype)
    caches = [torch.zeros(2, p.kv_heads, 6, p.head_dim) for p in flat.layout.pairs for _ in "kv"]
    args = (ids, mask, torch.arange(4).expand(2, 4), torch.arange(4), torch.tensor([2, 1]), *caches)
    with torch.no_grad():
        for a, b in zip(flat.module(*args), carried.module(*args)):
            assert torch.equal(a, b)


def test_unflatten_crossings_copies_a_path_without_crossings(prefix):
    lg = PassManager([("decode_interface", {})])(cached_layer_graph(prefix, "per-loop", (2,)))
    out = PassManager([("unflatten_crossings", {})])(lg)
    assert out.paths[2] is not lg.paths[2]
    assert [n.format_node() for n in out.paths[2].nodes] == [n.format_node() for n in lg.paths[2].nodes]
