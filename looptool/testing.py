"""Tiny random-config Hugging Face models for tests, examples and benchmarks.

Each entry builds a real ``transformers`` model of the named ``model_type`` with hidden
size 64 and a handful of layers, so the whole pipeline runs on real architectures in
seconds (the mergekit approach: build tiny real models on the fly).
"""

from __future__ import annotations

import torch
import transformers

_COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(num_experts_per_tok=2, intermediate_size=96)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, intermediate_size=128),
    "mistral": dict(_COMMON, intermediate_size=128),
    "qwen2": dict(_COMMON, intermediate_size=128),
    "qwen3": dict(_COMMON, intermediate_size=128, head_dim=16),
    "gemma3_text": dict(
        _COMMON, intermediate_size=128, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "phi3": dict(_COMMON, intermediate_size=128, pad_token_id=0),
    "gpt2": dict(vocab_size=256, n_embd=64, n_head=4, n_positions=128),
    "gpt_neox": dict(
        vocab_size=256, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        use_parallel_residual=True,
    ),
    "olmo2": dict(_COMMON, intermediate_size=128),
    "mixtral": dict(_COMMON, num_local_experts=4, **_MOE),
    "qwen3_moe": dict(
        _COMMON, num_experts=4, moe_intermediate_size=96, head_dim=16, **_MOE,
    ),
    "olmoe": dict(_COMMON, num_experts=4, **_MOE),
    "qwen2_moe": dict(
        _COMMON, num_experts=4, moe_intermediate_size=96, shared_expert_intermediate_size=96,
        **_MOE,
    ),
}
TINY_MODEL_TYPES = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, num_layers: int = 4) -> transformers.PretrainedConfig:
    """A tiny random config of ``model_type`` (hidden 64, ``num_layers`` layers)."""
    kwargs = dict(TINY_CONFIGS[model_type])
    key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    kwargs[key] = num_layers
    if "layer_types" in kwargs:
        kwargs["layer_types"] = (kwargs["layer_types"] * num_layers)[:num_layers]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, num_layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of ``model_type``, fp32, eval mode, on CPU."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, num_layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()
