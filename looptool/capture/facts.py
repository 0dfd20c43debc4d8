"""Architecture facts read from a Hugging Face config or module tree (the only place that
reads them: the rest of looptool reads :class:`~looptool.core.graph.SourceInfo`)."""

from __future__ import annotations

from torch import nn

from looptool.core.errors import CaptureError


def num_layers_of(config) -> int:
    """Number of decoder layers of a (possibly multimodal) HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise CaptureError(
            f"the model config ({type(config).__name__}) has no 'num_hidden_layers'; "
            "looptool needs a decoder-only causal LM."
        )
    return n


def hidden_size_of(config) -> int:
    """Hidden (residual stream) width of an HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def moe_shape_of(config) -> tuple[int | None, int | None]:
    """``(routed experts, experts per token)`` of an HF MoE config; ``(None, None)`` if dense."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else (None, None)


def context_length_of(config) -> int | None:
    """The positions an HF config was built for (``max_position_embeddings`` or what the config
    class maps it to, e.g. GPT-2's ``n_positions``); None where the config names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def norm_eps_of(config) -> float | None:
    """The RMSNorm epsilon of an HF config, None where the layers use another norm."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    eps = getattr(text, "rms_norm_eps", None)
    return float(eps) if eps else None


def kv_shape_of(config) -> tuple[int, int]:
    """``(key/value heads, head dim)`` of one attention layer of an HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden_size_of(config) // heads
    return int(kv_heads), int(head_dim)


def find_layers_path(model: nn.Module, num_layers: int) -> str:
    """Dotted path of the ``ModuleList`` that holds the decoder layers."""
    candidates = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers and name
    ]
    if not candidates:
        raise CaptureError(
            f"no ModuleList of {num_layers} decoder layers was found in "
            f"{type(model).__name__}; looptool supports decoder-only models whose layers "
            "live in one nn.ModuleList."
        )
    return min(candidates, key=lambda n: n.count("."))


def module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, mod in model.named_modules() if mod is target), None)


def layer_and_head_paths(model: nn.Module, config) -> tuple[str, str | None]:
    """Where the model's decoder-layer list and its output head (None: it has none) are."""
    return find_layers_path(model, num_layers_of(config)), module_path(model, model.get_output_embeddings())
