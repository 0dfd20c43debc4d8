"""Cached generation at every budget: exact against the source's own generate, cached
decoding equal to full recomputation, KV bytes measured from the allocated caches."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from conftest import converted

import looptool
from looptool.core.errors import LooptoolError
from looptool.engine.sampling import SamplingParams
from looptool.runtime.decode_graphs import (
    DecodeKey,
    allocate_cache,
    cached_layer_graph,
    cached_paths,
    decode_graphs,
    kv_bytes_per_token,
)
from looptool.runtime.generation import generate
from looptool.testing import tiny_model

ELR_PLAN = looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)
NEW = 6


def _prompt(batch: int = 2, length: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(source, prompt, attention_mask=None, new=NEW) -> torch.Tensor:
    return source.generate(
        prompt,
        attention_mask=attention_mask,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@contextlib.contextmanager
def _perturbed(model):
    """Move the new (gate / state) parameters away from their exact init, then restore."""
    g = torch.Generator().manual_seed(7)
    saved = {n: p.detach().clone() for n, p in model.new_parameters()}
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    try:
        yield model
    finally:
        with torch.no_grad():
            for n, p in model.new_parameters():
                p.copy_(saved[n])


def _check_cached_equals_recompute(model, prompt) -> None:
    """Cached greedy decoding == the full-sequence path at every step (per-loop)."""
    for budget in model.budgets:
        out = generate(model, prompt, budget=budget, max_new_tokens=NEW, output_logits=True)
        full = model(out.sequences, budget=budget).logits
        start = prompt.shape[1] - 1
        recomputed = full[:, start : start + NEW]
        cached = torch.stack(out.logits, dim=1)
        assert (cached - recomputed).abs().max().item() < 1e-5, budget
        assert torch.equal(out.sequences[:, prompt.shape[1] :], recomputed.argmax(-1)), budget


def test_prefix_loop_generation_every_architecture(arch):
    source, looped = converted(arch)
    prompt = _prompt()
    ref = _hf_greedy(source, prompt)
    for budget in looped.budgets:
        assert torch.equal(looped.generate(prompt, budget=budget, max_new_tokens=NEW, eos_token_id=None), ref), budget
    with _perturbed(looped):
        _check_cached_equals_recompute(looped, prompt)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma3_text", "qwen3_moe"])
def test_recurrent_generation(arch):
    source = tiny_model(arch)
    extra = {"route_replay": True} if arch == "qwen3_moe" else {"conditioning": arch == "llama"}
    model = looptool.convert(source, dataclasses.replace(ELR_PLAN, **extra))
    prompt = _prompt()
    ref = _hf_greedy(source, prompt)
    for budget in model.budgets:
        out = generate(model, prompt, budget=budget, max_new_tokens=NEW)
        assert torch.equal(out.sequences, ref), budget
    with _perturbed(model):
        _check_cached_equals_recompute(model, prompt)


def test_left_padded_batch_matches_source_generate():
    source, looped = converted("llama")
    prompt = _prompt(batch=3, length=8)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # rows of different lengths, left-padded
    mask[2, :1] = 0
    prompt = prompt.masked_fill(mask == 0, 0)
    ref = _hf_greedy(source, prompt, attention_mask=mask)
    for budget in looped.budgets:
        out = looped.generate(prompt, attention_mask=mask, budget=budget, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(out, ref), budget


def test_kv_bytes_measured_from_allocated_caches():
    _, looped = converted("llama")
    L = len(looped.layer_graph.layers)
    costs = {c.budget: c for c in looped.cost_table()}
    per_token_source = costs[0].kv_bytes_per_token
    prompt = _prompt(batch=2, length=5)
    for budget in looped.budgets:
        per_loop = generate(looped, prompt, budget=budget, max_new_tokens=3, kv="per-loop")
        last_loop = generate(looped, prompt, budget=budget, max_new_tokens=3, kv="last-loop")
        assert per_loop.kv_bytes_per_token == per_token_source * (L + budget) / L  # Accordion Eq. 6
        assert last_loop.kv_bytes_per_token == per_token_source  # ELR Sec. 3.4
        assert per_loop.kv_bytes == sum(
            c.nbytes for c in allocate_cache(cached_paths(looped)[budget], 2, 8, dtype=torch.float32, device="cpu")
        )
        assert kv_bytes_per_token(looped, budget) == costs[budget].kv_bytes_per_token


def test_elr_kv_bytes_follow_d_eff():
    model = looptool.convert(tiny_model("llama"), ELR_PLAN)
    costs = {c.budget: c for c in model.cost_table()}
    for k in model.budgets:
        out = generate(model, _prompt(1, 4), budget=k, max_new_tokens=2)
        assert out.kv_bytes_per_token == costs[k].kv_bytes_per_token  # D_eff attention layers
        assert (
            generate(model, _prompt(1, 4), budget=k, max_new_tokens=2, kv="last-loop").kv_bytes_per_token
            == costs[1].kv_bytes_per_token
        )


def test_last_loop_differs_from_per_loop_only_when_loops_repeat():
    model = looptool.convert(tiny_model("llama"), ELR_PLAN)
    prompt = _prompt(1, 6)
    with _perturbed(model):
        one = [
            generate(model, prompt, budget=1, max_new_tokens=4, kv=kv, output_logits=True).logits
            for kv in ("per-loop", "last-loop")
        ]
        deep = [
            generate(model, prompt, budget=3, max_new_tokens=4, kv=kv, output_logits=True).logits
            for kv in ("per-loop", "last-loop")
        ]
    assert all(torch.equal(a, b) for a, b in zip(*one))  # one loop: the same single slot
    assert torch.equal(deep[0][0], deep[1][0])  # prefill attends within the step: identical
    assert (deep[0][-1] - deep[1][-1]).abs().max() > 1e-6  # decode reads final-loop entries


def test_sampling_is_seeded_and_respects_eos():
    _, looped = converted("llama")
    prompt = _prompt(2, 5)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11)
    a = generate(looped, prompt, budget=2, max_new_tokens=8, sampling=sampled)
    b = generate(looped, prompt, budget=2, max_new_tokens=8, sampling=sampled)
    c = generate(looped, prompt, budget=2, max_new_tokens=8, sampling=SamplingParams(temperature=0.9, seed=12))
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)
    greedy = generate(looped, prompt, budget=2, max_new_tokens=8)
    eos = int(greedy.sequences[0, 6])  # row 0's second new token
    stopped = generate(looped, prompt, budget=2, max_new_tokens=8, eos_token_id=eos, pad_token_id=1)
    row = stopped.sequences[0, 5:].tolist()
    assert row[1] == eos and set(row[2:]) <= {1}


def test_step_callback_can_end_generation():
    """``on_step`` returning True (a caller's stop condition, e.g. lm-eval's stop strings) ends
    decoding after that step; the tokens so far equal the full run's prefix."""
    _, looped = converted("llama")
    prompt = _prompt(2, 5)
    full = generate(looped, prompt, budget=2, max_new_tokens=8)
    seen = []
    short = generate(looped, prompt, budget=2, max_new_tokens=8, on_step=lambda t: seen.append(t) or len(seen) == 3)
    assert short.new_tokens == 3 and len(seen) == 3
    assert torch.equal(short.sequences, full.sequences[:, :8])


def test_bad_generation_input():
    _, looped = converted("llama")
    prompt = _prompt(1, 4)
    with pytest.raises(LooptoolError, match="budget 7 is not in"):
        generate(looped, prompt, budget=7)
    with pytest.raises(LooptoolError, match="prompt is empty"):
        generate(looped, prompt[:, :0], budget=0)
    with pytest.raises(LooptoolError, match="non-negative"):
        generate(looped, prompt, budget=0, max_new_tokens=-1)
    with pytest.raises(LooptoolError, match="unknown KV cache policy"):
        generate(looped, prompt, budget=0, kv="sometimes")
    flat = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0,)))
    with pytest.raises(LooptoolError, match="no budget of this model"):
        generate(flat, prompt, budget=0, kv="last-loop")


def test_kv_cache_pass_routes_every_attention_execution():
    from looptool.core.errors import PassError
    from looptool.passes import PassManager

    _, looped = converted("llama")
    L = len(looped.layer_graph.layers)
    for kv in ("per-loop", "last-loop"):
        for budget, path in cached_paths(looped, kv).items():
            graph = path.module.graph
            caches = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("caches_")]
            writes = [n for n in graph.nodes if n.target is torch.ops.aten.index_copy_.default]
            assert len(writes) == 2 * (L + budget)  # one K and one V write per attention execution
            assert len(caches) == (2 * (L + budget) if kv == "per-loop" else 2 * L)
            assert len({w.args[0] for w in writes}) == len(caches)  # every slot written
    with pytest.raises(PassError, match="decode-step capture"):
        PassManager([("kv_cache", {"policy": "per-loop"})])(looped.layer_graph)


def test_cached_paths_build_only_the_budgets_asked_for():
    """A call that decodes at one budget rewrites and binds that budget's path alone; the
    others are added when asked for, and every path equals the one a whole-menu build gives."""
    source, _ = converted("llama")
    model = looptool.convert(source, looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))  # derived cache its own
    one = cached_paths(model, "per-loop", [2])
    assert list(one) == [2]
    assert list(cached_layer_graph(model, "per-loop", [2]).paths) == [2]
    assert list(decode_graphs(model).graphs[DecodeKey("cached", "per-loop")].paths) == [2]  # nothing else rewritten
    full = cached_paths(model, "per-loop")
    assert list(full) == [0, 1, 2] and full[2] is one[2]  # the path built first is kept, the rest added
    assert list(cached_layer_graph(model, "per-loop").paths) == [0, 1, 2]
    fresh = looptool.convert(source, looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
    for budget, path in cached_paths(fresh, "per-loop").items():  # built the whole menu at once
        assert path.module.code == full[budget].module.code and path.slots == full[budget].slots
    prompt = _prompt()
    with _perturbed(model):
        want = generate(model, prompt, budget=2, max_new_tokens=NEW).sequences
    with _perturbed(fresh):
        assert torch.equal(generate(fresh, prompt, budget=2, max_new_tokens=NEW).sequences, want)
    with pytest.raises(LooptoolError):
        cached_paths(model, "per-loop", [5])  # not on the menu
