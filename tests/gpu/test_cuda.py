"""CUDA checks (run by tests/gpu/run.sh on a GPU machine; skipped with a reason elsewhere).

Four architectures cover the layer forms: llama (dense pre-norm), gpt_neox (parallel
residual), olmo2 (branch post-norm), qwen3_moe (MoE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import looptool
from looptool.testing import byte_tokenizer, tiny_model
from looptool.train.trainer import TrainConfig, Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run tests/gpu/run.sh on one"),
]
SOTU = Path(__file__).resolve().parents[1] / "data" / "sotu"
ARCHS = ["llama", "gpt_neox", "olmo2", "qwen3_moe"]
SCHEMES = {
    "prefix": looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)),
    "recurrent": looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3),
}


def _ids(device="cuda") -> torch.Tensor:
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)


def _differences(source, model, ids) -> dict[int, float]:
    """Largest |source logits - looped logits| at every budget (0.0: bit-identical)."""
    with torch.no_grad():
        ref = source(input_ids=ids).logits
        return {k: (model(ids, budget=k).logits - ref).abs().max().item() for k in model.budgets}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_conversion_is_exact_on_cuda(arch, scheme):
    """Under PyTorch's math attention every budget equals the source bit for bit. With the
    default attention kernels the source runs unmasked grouped-query attention (``is_causal``,
    ``enable_gqa``: a flash kernel) while the captured graph passes its causal mask, so CUDA
    picks another kernel: equal to fp32 rounding (at most 3.9e-7 on an H200), not bit for
    bit; gpt_neox, without grouped heads, stays bit-identical."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    source = tiny_model(arch).to("cuda")
    model = looptool.convert(source, SCHEMES[scheme])
    assert next(model.parameters()).is_cuda and model.layer_graph.source.device.startswith("cuda")
    ids = _ids()
    with sdpa_kernel(SDPBackend.MATH):
        math = _differences(source, model, ids)
    default = _differences(source, model, ids)
    print(f"{arch}-{scheme}: largest difference per budget, math attention {math}, default kernels {default}")
    assert not any(math.values()), math
    assert max(default.values()) < 1e-4, default


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_equals_hf_generate_on_cuda(arch):
    source = tiny_model(arch).to("cuda")
    model = looptool.convert(source, SCHEMES["prefix"])
    ids = _ids()
    ref = source.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for k in model.budgets:
        assert torch.equal(model.generate(ids, budget=k, max_new_tokens=8, eos_token_id=None), ref), k


@pytest.mark.parametrize("scheme", SCHEMES)
def test_speculative_and_adaptive_depth_on_cuda(scheme):
    """Depth per token on the GPU, with new parameters moved off their init: greedy
    self-speculation gives budget k's tokens for every (draft, target) pair, and
    ``budget="auto"`` at threshold 0 gives the deepest budget's (last-loop KV)."""
    from looptool.runtime.generation import generate

    model = looptool.convert(tiny_model("llama").to("cuda"), SCHEMES[scheme])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(torch.randn(p.shape, generator=g).to("cuda") * 0.01)
    ids = _ids()
    for k in model.budgets:
        plain = generate(model, ids, budget=k, max_new_tokens=8).sequences
        for j in (b for b in model.budgets if b < k):
            out = generate(model, ids, budget=k, max_new_tokens=8, draft_budget=j, draft_tokens=3)
            assert torch.equal(out.sequences, plain), (k, j)
    deepest = max(model.budgets)
    auto = generate(model, ids, budget="auto", exit_threshold=0.0, max_new_tokens=8)
    assert torch.equal(auto.sequences, generate(model, ids, budget=deepest, kv="last-loop", max_new_tokens=8).sequences)
    assert bool((auto.depths == deepest).all())
    # learned exits on the GPU: q = 0 is the shallowest budget, q = 1 the deepest
    from looptool.runtime.convert import add_exit_gates

    gated = add_exit_gates(model)
    with torch.no_grad():
        for name, p in gated.new_parameters():
            if name.startswith("loop.exit.") and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g).to("cuda") * 3)
    for q, budget in ((0.0, min(model.budgets)), (1.0, deepest)):
        auto = generate(gated, ids, budget="auto", exit_rule="gate", exit_threshold=q, max_new_tokens=8)
        fixed = generate(gated, ids, budget=budget, kv="last-loop", max_new_tokens=8)
        assert torch.equal(auto.sequences, fixed.sequences) and bool((auto.depths == budget).all()), q


def test_to_cuda_and_load_on_cuda(tmp_path):
    source = tiny_model("qwen3_moe")
    model = looptool.convert(source, SCHEMES["recurrent"])
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.1)
    model.save_pretrained(tmp_path / "m")
    on_cpu = {k: model(_ids("cpu"), budget=k).logits for k in model.budgets}
    model.to("cuda")
    loaded = looptool.load(tmp_path / "m", device="cuda")
    with torch.no_grad():
        for k in model.budgets:
            moved, fresh = model(_ids(), budget=k).logits, loaded(_ids(), budget=k).logits
            assert torch.equal(moved, fresh)
            torch.testing.assert_close(moved.cpu(), on_cpu[k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_and_load_in_a_dtype_on_cuda(dtype, tmp_path):
    """A bf16/fp16 copy of an fp32 model on CUDA (looptool.cast, load(dtype=)) equals the
    source converted in that dtype on CUDA, at every budget, with trained new parameters."""
    source = tiny_model("llama")
    source.save_pretrained(tmp_path / "src")
    model = looptool.convert(source, SCHEMES["prefix"]).to("cuda")
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.1)
    model.save_pretrained(tmp_path / "m")
    cast, loaded = looptool.cast(model, dtype), looptool.load(tmp_path / "m", device="cuda", dtype=dtype)
    ref = looptool.convert(str(tmp_path / "src"), SCHEMES["prefix"], dtype=dtype, device="cuda")
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.new_parameters(), ref.new_parameters(), strict=True):
            q.copy_(p.to(dtype))
        for k in model.budgets:
            want = ref(_ids(), budget=k).logits
            assert torch.equal(cast(_ids(), budget=k).logits, want), k
            assert torch.equal(loaded(_ids(), budget=k).logits, want), k


def test_checkpointing_on_cuda_matches():
    model = looptool.convert(tiny_model("llama").to("cuda"), SCHEMES["prefix"])
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.2)
    model.train()
    ids = _ids()
    results = []
    for ckpt in (False, True):
        model.activation_checkpointing = ckpt
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, budget=2).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for n in g0:  # embedding backward accumulates with atomics on CUDA: equal up to order
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-6)


def test_compiled_path_on_cuda():
    model = looptool.convert(tiny_model("llama").to("cuda"), SCHEMES["prefix"])
    ids = _ids()
    with torch.no_grad():
        ref = model(ids, budget=2).logits
        model.compile()
        torch.testing.assert_close(model(ids, budget=2).logits, ref, rtol=1e-4, atol=1e-4)


def test_trainer_on_cuda_with_bf16_checkpoint_and_compile(tmp_path):
    path = tmp_path / "looped"
    looptool.convert(tiny_model("llama"), SCHEMES["prefix"], tokenizer=byte_tokenizer()).save_pretrained(path)
    cfg = TrainConfig(
        data=[str(SOTU / "1790*.txt")],
        output=str(tmp_path / "out"),
        tokens=64 * 4 * 4,
        seq_len=64,
        batch=4,
        lr=1e-3,
        new_lr=1e-2,
        bf16=True,
        device="cuda",
        checkpoint=True,
        save_every=2,
    )
    trainer = Trainer(path, cfg)
    summary = trainer.run()
    assert summary["steps"] == 4 and all(r["loss"][0] == r["loss"][0] for r in trainer.records)
    assert next(trainer.model.parameters()).is_cuda
    reloaded = looptool.load(tmp_path / "out", device="cuda")
    assert any(p.abs().sum() > 0 for _, p in reloaded.new_parameters())


def test_post_training_on_cuda(tmp_path):
    """GRPO, distillation and the intermediate-exit loss run on the GPU: rollouts sampled on
    CUDA score to the sampler's log-probs, and the outputs reload."""
    import json

    from looptool.posttrain.distill import DistillConfig, Distiller
    from looptool.posttrain.rl import GRPO, RLConfig
    from looptool.posttrain.rollout import sample, token_logprobs

    tok = byte_tokenizer()
    model = looptool.convert(tiny_model("llama"), SCHEMES["recurrent"], tokenizer=tok).to("cuda")
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.2)
    ro = sample(model, tok, [tok("hello").input_ids], budget=3, n=4, max_new_tokens=6, temperature=1.0, seed=0)
    with torch.no_grad():
        lp = token_logprobs(model, ro.ids, 3)
    torch.testing.assert_close((lp * ro.mask.cuda()).cpu(), ro.sample_logprobs, rtol=0, atol=1e-4)
    out = model(ro.ids.cuda(), budget=3, output_exit_logits=True)
    assert len(out.exit_logits) == 2 and out.exit_logits[0].is_cuda
    model.save_pretrained(tmp_path / "m")
    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1), "domain": "add"}) + "\n" for a in range(4))
    )
    GRPO(
        tmp_path / "m",
        RLConfig(
            data=[str(data)],
            output=str(tmp_path / "rl"),
            reward="numeric",
            steps=2,
            prompts=3,
            rollouts=4,
            max_new_tokens=4,
            device="cuda",
        ),
    ).run()
    Distiller(
        tmp_path / "m",
        DistillConfig(
            data=[str(data)],
            teachers={"add": str(tmp_path / "rl")},
            output=str(tmp_path / "d"),
            steps=2,
            prompts=2,
            max_new_tokens=4,
            device="cuda",
        ),
    ).run()
    assert looptool.load(tmp_path / "d").plan == model.plan


def test_tensorrt_step_engine_serves_a_mixed_budget_batch_on_cuda(tmp_path):
    """Built TensorRT engines (default precision, fp16; the Triton kernels as plugins) driven by
    the scheduler through the TensorRT step engine: a mixed-budget batch gives the greedy tokens
    of the onnxruntime step engine over the same directory's graphs (CPU)."""
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(
            f"TensorRT is not installed here ({type(exc).__name__}); the CPU suite covers it under a test double"
        )
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_trt_engine import _serve

    from looptool.backends.ort.engine import OrtStepEngine
    from looptool.backends.ort.runtime import Runtime as OrtRuntime
    from looptool.backends.tensorrt.export import export_tensorrt
    from looptool.engine import open_engine

    model = looptool.convert(
        tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)), tokenizer=byte_tokenizer()
    )
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(0.1)
    out = tmp_path / "engine"
    export_tensorrt(model, out, "all", max_batch=4, max_prefill=64, max_capacity=128)  # builds the engines here
    opened = open_engine(out)
    assert opened.runtime == "tensorrt"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    budgets = [2, 0, 0, 2]
    got = _serve(opened.engine, prompts, budgets, 6)
    assert got == _serve(OrtStepEngine(OrtRuntime(out)), prompts, budgets, 6)
