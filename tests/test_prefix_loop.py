"""The prefix_loop pass and LoopedModel on every supported architecture."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import TINY_PLAN, converted

import looptool
from looptool.capture import capture
from looptool.core.errors import InternalError, LooptoolError, PassError
from looptool.core.graph import annotation
from looptool.passes import PassManager, register_pass, unregister_pass
from looptool.testing import tiny_model


def test_fresh_conversion_is_bit_exact_at_every_budget(arch, input_ids):
    source, looped = converted(arch)
    with torch.no_grad():
        ref = source(input_ids=input_ids).logits
        for k in looped.budgets:
            assert torch.equal(ref, looped(input_ids, budget=k).logits), f"{arch} budget {k}"


def test_perturbed_gates_make_budgets_differ_and_gradients_flow(arch, input_ids):
    source = tiny_model(arch)
    looped = looptool.convert(source, TINY_PLAN)
    with torch.no_grad():
        for _, p in looped.new_parameters():
            p.normal_(0, 0.5)
        outs = {k: looped(input_ids, budget=k).logits for k in looped.budgets}
        ref = source(input_ids=input_ids).logits
    assert torch.equal(outs[0], ref)  # budget 0 is the source, always
    assert not torch.equal(outs[1], outs[0]) and not torch.equal(outs[2], outs[1])
    looped.zero_grad()
    looped(input_ids, labels=input_ids, budget=2).loss.backward()
    for name, p in looped.new_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    shared = looped.get_submodule(looped.layer_graph.source.layers_path + ".1")
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.parameters())


def test_gate_gradient_at_zero_init_is_nonzero(input_ids):
    # tanh'(0) = 1, so zero-initialised gates still learn (Eq. 5)
    _, looped = converted("llama")
    looped.zero_grad()
    looped(input_ids, labels=input_ids, budget=2).loss.backward()
    for name, p in looped.new_parameters():
        assert p.grad.abs().sum() > 0, name
    looped.zero_grad()


def test_node_counts_per_budget():
    _, looped = converted("llama")
    lg = looped.layer_graph
    base = len(lg.graph.nodes)
    for k, graph in lg.paths.items():
        extra = sum(len(lg.layers[i].nodes) + 3 * len(lg.layers[i].writes) for i in looped.plan.repeated_layers(k))
        assert len(graph.nodes) == base + extra
        gates = [n for n in graph.nodes if annotation(n)["role"] == "gate" and n.op == "get_attr"]
        assert len(gates) == 2 * k
        repeats = collections.Counter(
            annotation(n).get("layer") for n in graph.nodes if annotation(n).get("repeat") == 2
        )
        assert set(repeats) == set(range(1, 1 + k))


def test_one_copy_of_every_weight():
    source, looped = converted("llama")
    d, m = 64, 2
    src_bytes = sum(p.numel() * p.element_size() for p in source.parameters())
    looped_bytes = sum(p.numel() * p.element_size() for p in looped.parameters())
    assert looped_bytes == src_bytes + 2 * d * m * 4
    assert looped.added_parameter_count() == 2 * d * m
    p1 = dict(looped.path(1).named_parameters(remove_duplicate=False))
    p2 = dict(looped.path(2).named_parameters(remove_duplicate=False))
    shared = set(p1) & set(p2)
    assert shared and all(p1[n] is p2[n] for n in shared)
    own = dict(looped.named_parameters())
    assert all(p1[n] is own[n] for n in p1)
    source_ptrs = {p.data_ptr() for p in source.parameters()}
    assert all(p.data_ptr() in source_ptrs for n, p in own.items() if not n.startswith("loop."))


def test_gates_are_no_decay_and_named_under_loop():
    _, looped = converted("gpt_neox")
    names = {n for n, _ in looped.new_parameters()}
    assert names == looped.no_decay_parameter_names()
    assert "loop.prefix.1.attention_gate" in names and "loop.prefix.2.mlp_gate" in names


def test_pass_is_pure_and_recorded():
    lg = capture(tiny_model("llama"))
    before = [(n.name, n.target) for n in lg.graph.nodes]
    out = PassManager([("prefix_loop", TINY_PLAN.to_dict())])(lg)
    assert [(n.name, n.target) for n in lg.graph.nodes] == before
    assert not lg.paths and not lg.new_params and lg.recipe == ()
    assert out.recipe == (("prefix_loop", TINY_PLAN.to_dict()),)
    with pytest.raises(PassError, match="already looped"):
        PassManager([("prefix_loop", TINY_PLAN.to_dict())])(out)


@pytest.fixture
def temporary_passes():
    """Register test passes for one test only (the registry is global)."""
    names = []

    def register(name, fn):
        register_pass(name)(fn)
        names.append(name)

    yield register
    for name in names:
        unregister_pass(name)


def test_pass_manager_names_the_failing_pass(temporary_passes):
    def breaker(lg, config):
        graph = lg.paths[0]
        for node in graph.nodes:
            node.meta.pop("looptool", None)
            break
        return lg.replace()

    def crasher(lg, config):
        return {}["missing"]

    temporary_passes("test_break_annotations", breaker)
    temporary_passes("test_crash", crasher)
    lg = PassManager([("prefix_loop", TINY_PLAN.to_dict())])(capture(tiny_model("llama")))
    with pytest.raises(PassError, match="after pass 'test_break_annotations'"):
        PassManager([("test_break_annotations", {})])(lg)
    with pytest.raises(PassError, match="no pass named 'nope'"):
        PassManager([("nope", {})])
    # a crash inside a pass is a looptool bug, not a user error: not a LooptoolError, traceback kept
    with pytest.raises(InternalError, match="pass 'test_crash' crashed .KeyError") as info:
        PassManager([("test_crash", {})])(lg)
    assert not isinstance(info.value, LooptoolError) and isinstance(info.value.__cause__, KeyError)


def test_temporary_passes_are_gone():
    from looptool.passes import registered_passes

    assert not any(name.startswith("test_") for name in registered_passes())


def test_loss_matches_hf(input_ids):
    source, looped = converted("qwen2")
    labels = input_ids.clone()
    labels[:, :3] = -100
    with torch.no_grad():
        ref = source(input_ids=input_ids, labels=labels).loss
        got = looped(input_ids, labels=labels, budget=0).loss
    assert torch.equal(ref, got)


def test_padding_mask_matches_source():
    source, looped = converted("llama")
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(
            source(input_ids=ids, attention_mask=mask).logits, looped(ids, attention_mask=mask, budget=2).logits
        )


def test_bad_budget_is_refused(input_ids):
    _, looped = converted("llama")
    with pytest.raises(LooptoolError, match=r"budget 7 is not in this model's budget menu \[0, 1, 2\]"):
        looped(input_ids, budget=7)
    assert looped.default_budget == 2


def test_convert_validates_plan_before_capturing():
    with pytest.raises(LooptoolError, match="window 3:9"):
        looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(3, 9)))


def test_forward_supports_or_refuses_hugging_face_arguments():
    model = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = model(ids, labels=ids, budget=2)
    same = model(
        ids,
        labels=ids,
        budget=2,
        position_ids=torch.arange(6).expand(2, 6),
        use_cache=False,
        return_dict=True,
        output_attentions=False,
        past_key_values=None,
    )
    assert torch.equal(plain.logits, same.logits) and torch.equal(plain.loss, same.loss)
    # loss arguments reach Hugging Face's loss: a token-count normaliser changes the mean
    summed = model(ids, labels=ids, budget=2, num_items_in_batch=1).loss
    torch.testing.assert_close(summed, plain.loss * 2 * 5)
    for kwargs, message in [
        (dict(position_ids=torch.arange(1, 7).expand(2, 6)), "position_ids other than 0..seq-1"),
        (dict(use_cache=True), "use_cache=True is not supported"),
        (dict(output_hidden_states=True), "output_hidden_states=True is not supported"),
        (dict(token_type_ids=ids), "unsupported argument 'token_type_ids'"),
    ]:
        with pytest.raises(looptool.LooptoolError, match=message):
            model(ids, budget=2, **kwargs)
