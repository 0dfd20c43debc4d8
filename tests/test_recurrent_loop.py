"""The recurrent_loop pass (ELR): exact init, update rules, paper init, route replay."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx import Interpreter

import looptool
from looptool.capture import capture
from looptool.core.errors import PlanError
from looptool.core.graph import annotation
from looptool.core.plan import UPDATE_RULES, RecurrentLoop
from looptool.passes import PassManager
from looptool.runtime.model import LoopedModel
from looptool.testing import tiny_model

MOE = {"mixtral", "qwen3_moe", "olmoe", "qwen2_moe"}
_captured: dict[str, tuple] = {}


def captured(arch):
    if arch not in _captured:
        source = tiny_model(arch)
        _captured[arch] = (source, capture(source))
    return _captured[arch]


def looped(arch, **plan) -> LoopedModel:
    source, lg = captured(arch)
    plan = RecurrentLoop(**{"recurrent": (1, 3), "max_loops": 3, **plan})
    return LoopedModel(PassManager([("recurrent_loop", plan.to_dict())])(lg))


def test_exact_init_is_bit_exact_for_every_rule(arch, input_ids):
    source, _ = captured(arch)
    with torch.no_grad():
        ref = source(input_ids=input_ids).logits
    for update in UPDATE_RULES:
        for reinject in (True, False):
            for replay in (False, True) if arch in MOE else (False,):
                model = looped(arch, update=update, reinject=reinject, route_replay=replay)
                with torch.no_grad():
                    for k in model.budgets:
                        got = model(input_ids, budget=k).logits
                        assert torch.equal(ref, got), f"{arch} {update} reinject={reinject} replay={replay} k={k}"


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "qwen3_moe"])
def test_perturbed_budgets_differ_gradients_flow_round_trip(arch, input_ids, tmp_path):
    source, _ = captured(arch)
    model = looped(arch)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.2)
        outs = {k: model(input_ids, budget=k).logits for k in model.budgets}
        ref = source(input_ids=input_ids).logits
    assert torch.equal(outs[1], ref)  # loop 1 is the source block whatever the new params
    assert not torch.equal(outs[2], outs[1]) and not torch.equal(outs[3], outs[2])
    model.zero_grad()
    model(input_ids, labels=input_ids, budget=3).loss.backward()
    for name, p in model.new_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.save_pretrained(tmp_path / "elr")
    loaded = looptool.load(tmp_path / "elr")
    assert loaded.plan == model.plan
    for k in model.budgets:
        assert torch.equal(outs[k], loaded(input_ids, budget=k).logits)


def test_paper_init_beta_is_half_softplus_zero(input_ids):
    model = looped("llama", init="paper", max_loops=2)
    values = []

    class Probe(Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if annotation(n).get("name") == "beta":
                values.append(out)
            return out

    with torch.no_grad():
        Probe(model.path(2)).run(input_ids, torch.ones_like(input_ids))
    assert len(values) == 2
    want = 0.5 * math.log(2.0)  # sigmoid(0) * softplus(0)
    for v in values:
        assert torch.allclose(v, torch.full_like(v, want))
    source, _ = captured("llama")
    # independent reference for loop 1 (Eq. 2, s_0 = h_in, re-injection): the source's own
    # decoder layers 1-2 run on 2 h_in through HF hooks, then s_1 = h_in + beta (r_1 - h_in)
    layers = source.model.layers
    with torch.no_grad():
        h_in = source(input_ids=input_ids, output_hidden_states=True).hidden_states[1]
        seen = {}
        pre = layers[1].register_forward_pre_hook(lambda m, args, kwargs: ((2 * h_in,), kwargs), with_kwargs=True)
        post = layers[2].register_forward_hook(
            lambda m, args, out: seen.setdefault("r", out[0] if isinstance(out, tuple) else out)
        )
        try:
            source(input_ids=input_ids)
        finally:
            pre.remove()
            post.remove()
        s_1 = h_in + want * (seen["r"] - h_in)
        states = []

        class States(Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if annotation(n).get("exit") == 1:
                    states.append(out)
                return out

        States(model.path(2)).run(input_ids, torch.ones_like(input_ids))
    torch.testing.assert_close(states[0], s_1, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the paper's init is not function-preserving: loop 1 sees 2 h_in
        assert not torch.equal(model(input_ids, budget=1).logits, source(input_ids=input_ids).logits)


def test_parameter_counts():
    d = 64
    counts = {update: looped("llama", update=update).added_parameter_count() for update in UPDATE_RULES}
    assert counts == {"adaptive-delta": d * d + 2 * d + d, "delta": 2 * d, "residual": d, "replace": d}
    assert looped("llama", init="paper").added_parameter_count() == d * d + 2 * d


def _topk_count(graph):
    return sum(1 for n in graph.nodes if n.target is torch.ops.aten.topk.default)


def test_route_replay_runs_each_router_once(input_ids):
    replay = looped("olmoe", route_replay=True, max_loops=4)
    dynamic = looped("olmoe", route_replay=False, max_loops=4)
    for k in replay.budgets:
        assert _topk_count(replay.layer_graph.paths[k]) == 4  # 4 MoE layers, each routed once
        assert _topk_count(dynamic.layer_graph.paths[k]) == 2 + 2 * k
    with torch.no_grad():
        for (_, a), (_, b) in zip(replay.new_parameters(), dynamic.new_parameters()):
            a.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
            b.copy_(a)
        assert torch.equal(replay(input_ids, budget=1).logits, dynamic(input_ids, budget=1).logits)
        assert not torch.equal(replay(input_ids, budget=3).logits, dynamic(input_ids, budget=3).logits)


def test_cost_model_is_d_eff():
    model = looped("llama", recurrent=(1, 3), max_loops=4)
    rows = model.cost_table()
    assert [r.layer_executions for r in rows] == [4, 6, 8, 10]  # L_in + k L_rec + L_out
    assert all(r.kv_bytes_per_token_last_loop == rows[0].kv_bytes_per_token for r in rows)
    assert rows[3].relative_kv == pytest.approx(10 / 4)


@pytest.mark.parametrize(
    "plan,message",
    [
        (dict(recurrent=(3, 3)), "not a non-empty range"),
        (dict(recurrent=(2, 9)), "inside the model's 4 layers"),
        (dict(max_loops=0), "max_loops must be a whole number >= 1"),
        (dict(update="momentum"), "update rule 'momentum' is unknown"),
        (dict(init="random"), "init 'random' is unknown"),
        (dict(route_replay=True), "route replay needs MoE layers"),
    ],
)
def test_invalid_plans(plan, message):
    with pytest.raises(PlanError, match=message):
        looptool.convert(tiny_model("llama"), RecurrentLoop(**plan))


def test_default_partition_is_the_middle_half():
    assert RecurrentLoop().resolve(30).recurrent == (7, 22)
    assert RecurrentLoop().resolve(24).recurrent == (6, 18)
    assert RecurrentLoop().resolve(4).budgets == (1, 2, 3, 4)


def test_conditioning_exact_at_init_on_every_architecture(arch, input_ids):
    source, _ = captured(arch)
    plan = dict(conditioning=True, cond_dim=32, rank=8, route_replay=arch in MOE)
    if arch == "olmo2":  # branch post-norm: no normalised branch input to modulate
        with pytest.raises(PlanError, match="reads the residual stream without a norm"):
            looped(arch, **plan)
        return
    model = looped(arch, **plan)
    with torch.no_grad():
        ref = source(input_ids=input_ids).logits
        for k in model.budgets:
            assert torch.equal(ref, model(input_ids, budget=k).logits), f"{arch} k={k}"


def test_conditioning_learns_and_round_trips(input_ids, tmp_path):
    from looptool.passes.conditioning import conditioning_param_count

    model = looped("qwen2", conditioning=True, cond_dim=32, rank=8)
    d, branches = 64, 2 * (2 + 1)  # recurrent layers 1-2 and output layer 3
    assert model.added_parameter_count() == (d * d + 2 * d) + conditioning_param_count(32, 8, d, branches)
    model.zero_grad()
    model(input_ids, labels=input_ids, budget=3).loss.backward()
    # at init, the heads that can move the function get gradients (zero heads, random c/A/B)
    grads = {n: p.grad for n, p in model.new_parameters()}
    assert grads["loop.cond.exit_weight"].abs().sum() > 0
    assert grads["loop.cond.1.attention.scale_weight"].abs().sum() > 0
    assert grads["loop.cond.3.mlp.gate_weight"].abs().sum() > 0
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(torch.randn_like(p) * 0.05)
        outs = {k: model(input_ids, budget=k).logits for k in model.budgets}
    model.zero_grad()
    model(input_ids, labels=input_ids, budget=3).loss.backward()
    for name, p in model.new_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert len({tuple(o.flatten()[:8].tolist()) for o in outs.values()}) == 3
    model.save_pretrained(tmp_path / "cond")
    loaded = looptool.load(tmp_path / "cond")
    for k in model.budgets:
        assert torch.equal(outs[k], loaded(input_ids, budget=k).logits)


def test_conditioning_vectors_do_not_depend_on_tokens():
    model = looped("llama", conditioning=True, cond_dim=16, rank=4, max_loops=3)
    for k, graph in model.layer_graph.paths.items():
        mlps = [
            n
            for n in graph.nodes
            if n.target is torch.ops.aten.silu.default and annotation(n).get("part") == "conditioning"
        ]
        assert len(mlps) == k + 1  # one c_i per loop plus the output block's
        for node in mlps:
            todo, seen = [node], set()
            while todo:
                cur = todo.pop()
                assert cur.op != "placeholder", "c_i must be computed from (i, k) only"
                for inp in cur.all_input_nodes:
                    if inp not in seen:
                        seen.add(inp)
                        todo.append(inp)


def test_conditioning_rank_larger_than_hidden_is_refused():
    with pytest.raises(PlanError, match="rank 65 exceeds the hidden size 64"):
        looped("llama", conditioning=True, cond_dim=16, rank=65)


def test_router_logits_are_exposed_with_replay_weights(input_ids):
    replay = looped("qwen3_moe", route_replay=True, max_loops=3)
    dynamic = looped("qwen3_moe", route_replay=False, max_loops=3)
    out = replay(input_ids, budget=3, output_router_logits=True)
    assert len(out.router_logits) == 4 and replay.router_logits_weights(3) == (1, 3, 3, 1)
    assert all(t.shape == (2 * 9, 4) for t in out.router_logits)  # tokens x experts
    out_d = dynamic(input_ids, budget=3, output_router_logits=True)
    assert len(out_d.router_logits) == 8 and dynamic.router_logits_weights(3) == (1,) * 8
    assert torch.equal(out.logits, replay(input_ids, budget=3).logits)
    # total weight is the same as counting every loop's evaluation (Sec. 3.4)
    assert sum(replay.router_logits_weights(3)) == sum(dynamic.router_logits_weights(3))


@pytest.mark.parametrize("init", ["exact", "paper"])
def test_exit_logits_are_the_shallower_budgets(init, input_ids):
    """Without conditioning the state after loop i does not depend on k, so exit i of the
    budget-k path must equal the budget-i path: an independent check of the exit graph."""
    model = looped("qwen3_moe", init=init, route_replay=True, max_loops=3)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.2)
        out = model(input_ids, budget=3, output_exit_logits=True, output_router_logits=True)
        shallow = {k: model(input_ids, budget=k).logits for k in (1, 2)}
        plain = model(input_ids, budget=3, output_router_logits=True)
    assert len(out.exit_logits) == 2 and not torch.equal(shallow[1], shallow[2])
    for i, logits in enumerate(out.exit_logits, start=1):
        torch.testing.assert_close(logits, shallow[i], rtol=0, atol=1e-6)
    assert torch.equal(out.logits, plain.logits)  # the last exit is the budget itself
    assert len(out.router_logits) == len(plain.router_logits)  # exit copies add no router outputs
    model.activation_checkpointing = True  # the exits also work on outlined (checkpointed) paths
    again = model(input_ids, budget=3, output_exit_logits=True)
    for a, b in zip(out.exit_logits, again.exit_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    model.zero_grad()
    again.exit_logits[0].sum().backward()  # exit 1 reads loop 1 only: under exact init that is the source block
    assert (model.get_parameter("loop.recurrent.beta_weight").grad is None) == (init == "exact")


def test_exit_logits_need_an_elr_model(input_ids):
    prefix = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
    with pytest.raises(looptool.LooptoolError, match="only in ELR models"):
        prefix(input_ids, budget=2, output_exit_logits=True)
