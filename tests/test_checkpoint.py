"""Activation checkpointing per layer application: exact, and it saves activation memory."""

from __future__ import annotations

import operator

import pytest
import torch

import looptool
from looptool.passes.checkpoint import Region, checkpoint_regions
from looptool.testing import tiny_model

PLANS = {
    "llama-prefix": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "gpt_neox-prefix": ("gpt_neox", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "olmo2-prefix": ("olmo2", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "qwen3_moe-prefix": ("qwen3_moe", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "llama-elr-cond": (
        "llama",
        looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True, cond_dim=16, rank=4),
    ),
    "qwen3_moe-elr-replay": ("qwen3_moe", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True)),
}


def _trained(name: str) -> looptool.LoopedModel:
    """A converted tiny model whose new parameters are moved off their initial values, so
    second passes and later loops contribute (zero gates would hide a wrong recompute)."""
    arch, plan = PLANS[name]
    model = looptool.convert(tiny_model(arch), plan)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.train()


def _loss_and_grads(model, ids, budget):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, budget=budget).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", PLANS)
def test_checkpointed_paths_are_exact(name):
    """Loss and every gradient equal the uncheckpointed path bit for bit at every budget."""
    model = _trained(name)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    for budget in model.budgets:
        model.gradient_checkpointing_disable()
        ref_loss, ref_grads = _loss_and_grads(model, ids, budget)
        model.gradient_checkpointing_enable()
        loss, grads = _loss_and_grads(model, ids, budget)
        assert torch.equal(loss, ref_loss), budget
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[k], ref_grads[k]) for k in grads), budget
        assert (
            any(n.startswith("loop.") and ref_grads[n].abs().sum() > 0 for n in ref_grads) or budget == model.budgets[0]
        )


def test_one_region_per_layer_application():
    """Budget k of a 4-layer prefix model with window 1:3 runs 4 + k layer applications."""
    model = _trained("llama-prefix")
    for budget in model.budgets:
        graph = checkpoint_regions(model.layer_graph.paths[budget])
        regions = [n.target for n in graph.nodes if isinstance(n.target, Region)]
        assert [(r.layer, r.execution) for r in regions] == sorted(
            [(i, 1) for i in range(4)] + [(i, 2) for i in range(1, 1 + budget)]
        )
        # every tensor op of a layer was outlined: outside the regions only their calls,
        # the picks of their outputs, and shape arithmetic remain
        outside = [
            n
            for n in graph.nodes
            if n.op == "call_function"
            and not isinstance(n.target, Region)
            and isinstance(n.meta.get("looptool", {}).get("layer"), int)
        ]
        assert all(n.target is operator.getitem or not isinstance(n.meta.get("val"), torch.Tensor) for n in outside)


def _saved_bytes(model, ids, budget) -> int:
    """Bytes autograd keeps for backward during one forward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids, budget=budget).loss.backward()
    return sum(seen.values())


def test_checkpointing_stops_activation_memory_growing_with_depth():
    model = _trained("llama-elr-cond")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    deep = model.budgets[-1]
    plain = _saved_bytes(model, ids, deep)
    model.gradient_checkpointing_enable()
    ckpt = _saved_bytes(model, ids, deep)
    assert plain > 2.5 * ckpt, (plain, ckpt)  # 4 applications of 2 layers x 3 loops held vs region edges
