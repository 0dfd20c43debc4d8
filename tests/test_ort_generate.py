"""Greedy and sampled tokens from exported engines equal LoopedModel generation, token for
token, at every budget and both KV policies, on four architectures and both schemes."""

from __future__ import annotations

import pytest
import torch
from looptool.backends.onnx import export_onnx
from looptool.backends.ort import Runtime

import looptool
from looptool.generation import generate
from looptool.testing import tiny_model

CASES = {  # dense, parallel residual, post-norm (sandwich norms, sliding windows), MoE via looptool::moe
    "llama-recurrent": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True)),
    "gpt_neox-prefix": ("gpt_neox", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "gemma3_text-prefix": ("gemma3_text", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "qwen3_moe-prefix": ("qwen3_moe", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each case converted, its new parameters trained-like (non-zero), exported with both policies."""
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for case, (arch, plan) in CASES.items():
        model = looptool.convert(tiny_model(arch), plan)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, p in model.new_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        export_onnx(model, root / case, "all", kv="all", validate=False)  # the tests below compare more than validation does
        out[case] = (model, Runtime(root / case))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_pytorch_generation(exported, case):
    model, rt = exported[case]
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    distinct = set()
    for kv in rt.kv_policies:
        for k in model.budgets:
            ref = generate(model, ids, attention_mask=mask, budget=k, kv=kv, max_new_tokens=12, output_logits=True)
            got = rt.generate(ids, attention_mask=mask, budget=k, kv=kv, max_new_tokens=12, output_logits=True)
            assert torch.equal(got.sequences, ref.sequences), (case, kv, k)
            assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) < 1e-4
            assert got.kv_bytes == ref.kv_bytes
            distinct.add(tuple(got.sequences[0, 7:].tolist()))
    assert len(distinct) > 1  # the budgets (and policies) do compute different things


def test_sampling_and_eos_follow_pytorch(exported):
    model, rt = exported["llama-recurrent"]
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(8))
    kwargs = dict(budget=2, max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    assert torch.equal(rt.generate(ids, **kwargs).sequences, generate(model, ids, **kwargs).sequences)
    greedy = generate(model, ids, budget=2, max_new_tokens=10).sequences
    eos = int(greedy[0, 7])  # a token row 0 emits: that row stops there and pads afterwards
    ref = generate(model, ids, budget=2, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    got = rt.generate(ids, budget=2, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got.sequences, ref.sequences) and got.new_tokens == ref.new_tokens
    streamed = []
    rt.generate(ids[:1], budget=2, max_new_tokens=4, on_step=lambda t: streamed.append(int(t[0])))
    assert streamed == generate(model, ids[:1], budget=2, max_new_tokens=4).sequences[0, 5:].tolist()
