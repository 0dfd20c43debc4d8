"""The real SmolLM2-135M (GGUF from PyPI): exact conversion, one copy, save/load."""

from __future__ import annotations

import pytest
import torch

import looptool

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


@pytest.fixture(scope="module")
def looped(smollm2):
    plan = looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
    return looptool.convert(smollm2.model, plan, tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer(
        "The Constitution of the United States establishes three branches", return_tensors="pt"
    ).input_ids


def test_every_budget_is_bit_exact(smollm2, looped, ids):
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids).logits
        for k in looped.budgets:
            assert torch.equal(ref, looped(ids, budget=k).logits), f"budget {k}"


def test_greedy_generation_matches_source_generate(smollm2, looped, ids):
    ref = smollm2.model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for k in looped.budgets:
        assert torch.equal(looped.generate(ids, budget=k, max_new_tokens=8, eos_token_id=None), ref), f"budget {k}"


def test_parameter_bytes_are_source_plus_gates(smollm2, looped):
    src = {id(p): p for p in smollm2.model.parameters()}
    src_bytes = sum(p.numel() * 4 for p in src.values())
    own = sum(p.numel() * 4 for p in looped.parameters())
    assert own == src_bytes + 2 * 576 * 12 * 4
    assert looped.added_parameter_count() == 2 * 576 * 12


@pytest.fixture
def perturbed(looped):
    """The module's looped model with trained-like gates for one test, restored to the
    converted (zero) gates afterwards whether the test passes or fails."""
    saved = {n: p.detach().clone() for n, p in looped.new_parameters()}
    with torch.no_grad():
        for _, p in looped.new_parameters():
            p.normal_(0, 0.05)
    yield looped
    with torch.no_grad():
        for n, p in looped.new_parameters():
            p.copy_(saved[n])


def test_round_trip(smollm2, perturbed, ids, tmp_path):
    looped = perturbed
    with torch.no_grad():
        want = {k: looped(ids, budget=k).logits for k in looped.budgets}
    looped.save_pretrained(tmp_path / "sm")
    size = (tmp_path / "sm" / "model.safetensors").stat().st_size
    own = sum(p.numel() * 4 for p in looped.parameters()) + sum(b.numel() * b.element_size() for b in looped.buffers())
    assert own <= size <= own + 256 * 1024
    loaded = looptool.load(tmp_path / "sm")
    assert loaded.tokenizer is not None
    with torch.no_grad():
        for k in looped.budgets:
            assert torch.equal(want[k], loaded(ids, budget=k).logits), f"budget {k}"


def test_gguf_file_source(smollm2, smollm2_gguf, monkeypatch):
    """The fixture loaded the .gguf path itself; the named source ``"smollm2"`` loads that file."""
    from looptool.capture import sources

    assert smollm2.model.config.model_type == "llama" and smollm2.model.config.num_hidden_layers == 30
    assert smollm2.tokenizer is not None and smollm2.tokenizer("hello").input_ids
    seen = {}
    monkeypatch.setattr(
        sources, "_load_gguf", lambda path, dtype, device, origin: seen.update(path=path, origin=origin)
    )
    sources.load_source("smollm2")
    assert seen == {"path": smollm2_gguf, "origin": sources.SMOLLM2}


def test_gguf_cache_serves_transformers_own_load(smollm2, smollm2_gguf, monkeypatch):
    """A second load of the GGUF is served by the GGUF cache and equals the miss's load of the
    file (transformers' own, with the file parsed once: tests/test_gguf_cache.py shows that
    equal to transformers' load as it is): every tensor bit for bit, the tie, the config,
    the tokenizer, the logits."""
    from looptool.cache import caches
    from looptool.capture import sources

    stats = caches().gguf.stats  # the process's own: the fixture's load counted there
    direct = smollm2  # the fixture's load dequantised the file when this process missed the cache
    if not stats["miss"]:  # the cache was warm (a user's LOOPTOOL_CACHE): load it uncached
        with monkeypatch.context() as m:
            m.setenv("LOOPTOOL_CACHE", "off")
            direct = sources.load_source(smollm2_gguf)
    served = stats["disk"]
    hit = sources.load_source(smollm2_gguf)
    assert stats["disk"] == served + 1
    a, b = direct.model, hit.model
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.lm_head.weight is b.model.embed_tokens.weight
    assert a.config.to_dict() == b.config.to_dict()
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    text = "The Constitution of the United States — 1787, ünïcode 😀\n"
    ta, tb = direct.tokenizer, hit.tokenizer
    assert ta(text).input_ids == tb(text).input_ids and ta.all_special_tokens == tb.all_special_tokens
    chat = [{"role": "user", "content": "hi"}]
    assert ta.apply_chat_template(chat, tokenize=False) == tb.apply_chat_template(chat, tokenize=False)
    ids = torch.tensor([ta(text).input_ids])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_elr_every_update_rule_and_conditioning(smollm2, ids):
    from looptool.capture import capture
    from looptool.core.plan import UPDATE_RULES
    from looptool.passes import PassManager
    from looptool.passes.conditioning import conditioning_param_count
    from looptool.runtime.model import LoopedModel

    lg = capture(smollm2.model)
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids).logits
    model = LoopedModel(
        PassManager([("recurrent_loop", looptool.RecurrentLoop(recurrent=(8, 22), max_loops=4).to_dict())])(lg)
    )
    with torch.no_grad():
        for k in model.budgets:  # the default plan: exact at every loop count up to 4
            assert torch.equal(ref, model(ids, budget=k).logits), f"k={k}"
    assert model.added_parameter_count() == 576 * 576 + 3 * 576
    for update in UPDATE_RULES:
        for conditioning in (False, True):
            plan = looptool.RecurrentLoop(recurrent=(8, 22), max_loops=3, update=update, conditioning=conditioning)
            model = LoopedModel(PassManager([("recurrent_loop", plan.to_dict())])(lg))
            with torch.no_grad():
                for k in model.budgets:
                    assert torch.equal(ref, model(ids, budget=k).logits), f"{update} cond={conditioning} k={k}"
            if update == "adaptive-delta" and conditioning:
                # recurrent layers 8-21 and output layers 22-29: 2 branches each
                want = (576 * 576 + 2 * 576) + conditioning_param_count(256, 64, 576, 2 * (14 + 8))
                assert model.added_parameter_count() == want


def test_cached_decoding_equals_recompute_after_training_moves_gates(looped, ids):
    from looptool.runtime.generation import generate

    with torch.no_grad():
        for _, p in looped.new_parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    for k in looped.budgets:
        out = generate(looped, ids, budget=k, max_new_tokens=6, output_logits=True)
        with torch.no_grad():
            full = looped(out.sequences, budget=k).logits[:, ids.shape[1] - 1 : -1]
        assert (torch.stack(out.logits, 1) - full).abs().max().item() < 1e-4, k
        assert torch.equal(out.sequences[:, ids.shape[1] :], full.argmax(-1)), k


def test_int4_engine_answers_each_prompt_as_alone_in_any_batch(smollm2, looped, tmp_path):
    """SmolLM2 at int4 (default accuracy level: float activations): each prompt's greedy tokens
    in a batch of any size and mix of budgets equal its tokens alone, its logits within float
    noise (measured 9e-5; int8 activations, accuracy level 4, moved them by ~1 and changed 3 of 8
    answers: tests/bench/README.md, "int4 and int8 accuracy levels")."""
    from looptool.backends.onnx.export import export_onnx
    from looptool.backends.ort.runtime import Runtime
    from looptool.testing import batch_gaps

    export_onnx(looped, tmp_path / "int4", [0], quantize="int4", validate=False)  # + the row-wise graph
    rt = Runtime(tmp_path / "int4")
    texts = [
        "We the People",
        "The Constitution of the",
        "Four score and seven years ago",
        "Hello",
        "In the",
        "The capital of France is",
    ]
    prompts = [smollm2.tokenizer(t).input_ids for t in texts]
    budgets = [0, 12, 6, 0, 3, 12]
    worst, differ = batch_gaps(rt.generate, prompts, budgets, [[0, 1, 2, 3, 4, 5], [0, 1, 2], [5, 3]], 16)
    assert not differ, f"prompts {differ} decode differently in a batch than alone"
    assert worst <= 1e-3, f"a prompt's logits move by {worst:.2e} with its batch"
