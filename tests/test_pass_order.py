"""Every graph rewrite goes through the PassManager, whose ordering declarations refuse a wrong
order; plan-specific switches live on the plan; gates and norm parameters are found by
metadata (NewParam.gate, capture's norm annotation), not by name."""

from __future__ import annotations

import pytest
import torch

import looptool
from looptool.capture import capture
from looptool.capture.norms import is_norm_parameter
from looptool.core.errors import PassError, PlanError
from looptool.core.graph import NORM_PARAM_KEY, ROLE_PARAM, annotation
from looptool.core.plan import PrefixLoop, RecurrentLoop
from looptool.passes import PassManager, check_order, get_pass, manager, must_precede, registered_passes
from looptool.testing import tiny_model
from looptool.train.data import PackedTokens


@pytest.fixture(scope="module")
def prefix():
    return looptool.convert(tiny_model("llama"), PrefixLoop(window=(1, 3), budgets=(0, 2)))


@pytest.fixture(scope="module")
def elr():
    return looptool.convert(tiny_model("qwen3_moe", num_layers=6), RecurrentLoop(recurrent=(1, 3), max_loops=3))


@pytest.fixture
def spy(monkeypatch):
    """Every registered pass wrapped to record ``(name, config)`` when the PassManager runs it
    (a direct call of a pass's graph function bypasses the registry and is not recorded)."""
    calls: list[tuple[str, dict]] = []
    for name in registered_passes():
        fn = get_pass(name)

        def wrapped(lg, config, _fn=fn, _name=name):
            calls.append((_name, config))
            return _fn(lg, config)

        wrapped.__dict__.update(fn.__dict__)  # replayable, requires, before, after
        monkeypatch.setitem(manager._registry(), name, wrapped)
    return calls


# ---------------------------------------------------------------------------- declarations
def test_declarations_name_registered_passes():
    names = set(registered_passes())
    for name in names:
        fn = get_pass(name)
        for declared in (*fn.requires, *fn.before, *fn.after):
            assert declared in names, (name, declared)


@pytest.mark.parametrize(
    "first,second",
    [
        ("kv_cache", "checkpoint"),
        ("fuse", "checkpoint"),
        ("ablate_repetitions", "fuse"),
        ("ablate_repetitions", "checkpoint"),
        ("router_outputs", "checkpoint"),
        ("router_outputs", "exit_outputs"),
        ("checkpoint", "exit_outputs"),
    ],
)
def test_the_ordering_constraints_are_declared(first, second):
    assert must_precede(first, second) and not must_precede(second, first)


def test_independent_passes_have_no_order():
    # kv_cache, last_position and fuse commute (checked graph by graph when they were declared)
    for a, b in [("kv_cache", "last_position"), ("kv_cache", "fuse"), ("last_position", "fuse")]:
        assert not must_precede(a, b) and not must_precede(b, a)
    check_order(["prefix_loop", "fuse", "kv_cache", "last_position"])
    check_order(["prefix_loop", "last_position", "kv_cache", "fuse"])


@pytest.mark.parametrize(
    "steps,first,second",
    [
        (["checkpoint", "fuse"], "fuse", "checkpoint"),
        (["checkpoint", "kv_cache"], "kv_cache", "checkpoint"),
        (["fuse", "ablate_repetitions"], "ablate_repetitions", "fuse"),
        (["exit_outputs", "checkpoint"], "checkpoint", "exit_outputs"),
        (["exit_outputs", "router_outputs"], "router_outputs", "exit_outputs"),
    ],
)
def test_a_wrong_order_is_refused_when_the_manager_is_built(steps, first, second):
    with pytest.raises(PassError) as info:
        PassManager([(name, {}) for name in steps])
    message = str(info.value)
    assert message == f"pass {first!r} must run before pass {second!r}, which comes earlier in the steps."


def test_a_wrong_order_is_refused_against_the_passes_already_applied(prefix):
    checkpointed = PassManager([("checkpoint", {})])(prefix.layer_graph)
    assert checkpointed.applied == ("prefix_loop", "checkpoint") and checkpointed.recipe == prefix.recipe
    for late in ("fuse", "ablate_repetitions"):
        with pytest.raises(PassError, match=f"pass '{late}' must run before pass 'checkpoint', which already ran"):
            PassManager([(late, {"layers": [1]} if late == "ablate_repetitions" else {})])(checkpointed)
    fused = PassManager([("fuse", {})])(prefix.layer_graph)
    with pytest.raises(PassError, match="pass 'ablate_repetitions' must run before pass 'fuse', which already ran"):
        PassManager([("ablate_repetitions", {"layers": [1]})])(fused)


def test_a_missing_required_pass_is_refused(prefix):
    with pytest.raises(
        PassError,
        match=r"pass 'fuse' needs pass 'prefix_loop' or 'recurrent_loop' to run first; "
        r"passes that ran before it: none\.",
    ):
        PassManager([("fuse", {})])(capture(tiny_model("llama")))
    with pytest.raises(PassError, match="pass 'exit_outputs' needs pass 'recurrent_loop' to run first"):
        PassManager([("exit_outputs", {})])(prefix.layer_graph)


# ---------------------------------------------------------------------------- call sites
def test_lazy_paths_go_through_the_manager(elr, spy):
    elr._paths.clear()
    elr.gradient_checkpointing_enable()
    try:
        ids = torch.randint(0, 256, (2, 6))
        with torch.no_grad():
            out = elr(ids, budget=3, output_router_logits=True, output_exit_logits=True)
    finally:
        elr.gradient_checkpointing_disable()
        elr._paths.clear()
    assert spy == [
        ("router_outputs", {}),
        ("checkpoint", {"checkpoint": True, "shard_layers": False}),
        ("exit_outputs", {}),
    ]
    assert len(out.exit_logits) == 2 and out.router_logits


def test_cached_decode_paths_go_through_the_manager(prefix, spy):
    prefix.derived.clear()
    prefix.generate(torch.randint(0, 256, (1, 4)), budget=2, max_new_tokens=2)
    names = [name for name, _ in spy]
    # the decode-step capture moved to the model's device, the recipe replayed on it, the cache
    # passes, then the runtime's own attention over the grouped cache
    assert names == ["retarget_device", "prefix_loop", "kv_cache", "last_position", "grouped_attention"] and spy[2] == (
        "kv_cache",
        {"policy": "per-loop"},
    )


def test_the_serving_graph_fuses_through_the_manager(prefix, spy):
    from looptool.backends.interface import serving_graph
    from looptool.passes.fuse import fuse_graph
    from looptool.runtime.decode_graphs import cached_paths

    cached_paths(prefix, "per-loop")
    spy.clear()
    sg = serving_graph(prefix, 2)
    assert spy == [("fuse", {}), ("decode_interface", {})]  # the lowering to the decode interface too
    assert sg.fused == dict(fuse_graph(cached_paths(prefix, "per-loop")[2].module.graph)[1])
    assert sg.fused["gated_residual"] == 4


def test_a_serving_graph_for_composing_unflattens_through_the_manager(prefix, spy):
    from looptool.backends.interface import rowwise_serving_graph
    from looptool.runtime.decode_graphs import rowwise_path

    rowwise_path(prefix, "per-loop")
    spy.clear()
    rowwise_serving_graph(prefix, unflatten=True)
    assert spy == [("fuse", {}), ("decode_interface", {}), ("unflatten_crossings", {})]


def test_the_hydra_ablation_goes_through_the_manager(prefix, spy):
    from looptool.eval.analyze import hydra_effect

    data = PackedTokens(torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)), 12)
    result = hydra_effect(prefix, 2, data, batch=2, spacing=1)
    ablations = [config for name, config in spy if name == "ablate_repetitions"]
    assert ablations == [{"layers": [1]}, {"layers": [2]}, {"layers": [1, 2]}]
    assert [row["layers"] for row in result["adjacent_pairs"]] == [[1, 2]]


# ---------------------------------------------------------------------------- plans
def test_plan_switches_live_on_the_plan():
    p = PrefixLoop(window=(2, 6), budgets=(0, 2)).resolve(8)
    r = RecurrentLoop(recurrent=(2, 5), max_loops=3, conditioning=True, cond_dim=16, rank=4).resolve(8)
    assert p.looped_layers() == range(2, 6) and p.frozen_layers() == range(2)
    assert r.looped_layers() == range(2, 5) and r.frozen_layers() == range(2)
    assert p.caption() == "window 2:6"
    assert r.caption() == "recurrent 2:5 (adaptive-delta, init exact, re-injection, conditioning d=16 r=4)"
    assert p.budget_columns == ("budget", "layers") and r.budget_columns == ("loops", "D_eff")
    assert not p.has_loop_exits and r.has_loop_exits
    with pytest.raises(PlanError, match="unresolved"):
        PrefixLoop().looped_layers()


# ---------------------------------------------------------------------------- metadata
def test_gates_are_found_by_their_declaration(prefix, elr):
    assert [n for n, _ in prefix.gate_parameters()] == [
        f"loop.prefix.{i}.{k}_gate" for i in (1, 2) for k in ("attention", "mlp")
    ]
    assert [n for n, _ in elr.gate_parameters()] == ["loop.recurrent.exit_gate"]
    conditioned = looptool.convert(
        tiny_model("llama"), RecurrentLoop(recurrent=(1, 3), max_loops=2, conditioning=True, cond_dim=8, rank=2)
    )
    assert conditioned.gate_parameters() == []  # conditioning's gate_weight/gate_bias are projections, not gates
    params = dict(prefix.named_parameters())
    assert all(p is params[n] for n, p in prefix.gate_parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt_neox"])
def test_capture_marks_norm_parameters(arch):
    lg = capture(tiny_model(arch))
    params = dict(lg.module.named_parameters(remove_duplicate=False))
    attrs = [n for n in lg.graph.nodes if n.op == "get_attr" and str(n.target) in params]
    assert attrs and all(annotation(n)["role"] == ROLE_PARAM and NORM_PARAM_KEY in annotation(n) for n in attrs)
    norms = {str(n.target) for n in attrs if annotation(n)[NORM_PARAM_KEY]}
    assert norms and all("norm" in name for name in norms)  # (names only to check: capture reads none)
    assert all(annotation(n)[NORM_PARAM_KEY] == is_norm_parameter([n]) for n in attrs)
