"""Source models for the benchmarks: the real SmolLM2-135M, or random-weight models of
known shapes (no download: what a machine without network, like the GPU test machine, runs;
throughput and memory do not depend on the weight values); and the loop plan the benchmarks
give them (:func:`prefix_plan`)."""

from __future__ import annotations

import torch
import transformers

import looptool
from looptool.testing import tiny_model

SHAPES = {
    "smollm2-random": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}
NAMES = ("smollm2", "tiny", *SHAPES)


def source_model(shape: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer or None)``: the source HF causal LM of ``shape`` on ``device``."""
    if shape == "smollm2":
        from looptool.capture.sources import load_source

        src = load_source("smollm2", dtype=dtype, device=str(device))
        return src.model, src.tokenizer
    if shape == "tiny":
        return tiny_model("llama").to(device=device, dtype=dtype), None
    kwargs = dict(SHAPES[shape])
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), None


def prefix_plan(layers: int) -> looptool.PrefixLoop:
    """SmolLM2's window 8:20 of 30 layers scaled to a model of ``layers`` layers, with budgets
    0, m/4, m/2, 3m/4 and m of its m looped layers (SmolLM2: 0, 3, 6, 9, 12)."""
    start, stop = round(0.267 * layers), round(0.667 * layers)
    m = stop - start
    return looptool.PrefixLoop(window=(start, stop), budgets=tuple(sorted({0, m // 4, m // 2, 3 * m // 4, m})))
