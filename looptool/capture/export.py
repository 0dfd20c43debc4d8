"""``torch.export`` of a source model: the full forward (dynamic batch and sequence) and one
cached decode step over a caller-owned static KV cache."""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from looptool.capture import cache as capture_cache
from looptool.capture.facts import kv_shape_of, num_layers_of
from looptool.core.errors import CaptureError
from looptool.core.tracing import without_stack_traces

INPUT_NAMES = ("input_ids", "attention_mask")


def export_source(model: nn.Module, seq_len: int = 8, batch: int = 2) -> fx.GraphModule:
    """``torch.export`` the model's full-sequence forward (dynamic batch/sequence), unlifted.

    The returned GraphModule's parameters and buffers are the model's own tensor objects.
    """
    device = next(model.parameters()).device
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    dims = {0: Dim.AUTO, 1: Dim.AUTO}
    return _export(
        model,
        {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False},
        {"input_ids": dims, "attention_mask": dims, "use_cache": None},
        capture_cache.key_of(model, {"decode": False, "seq_len": seq_len, "batch": batch}),
    )


def export_decode_step(model: nn.Module, seq_len: int = 3, cache_len: int = 8, batch: int = 2) -> fx.GraphModule:
    """``torch.export`` one cached step of the model (prefill or decode), unlifted.

    The step is the way transformers' export-with-static-cache wrappers run a model: a
    ``StaticCache`` whose layers hold caller-owned tensors, written in place with
    ``index_copy_`` at ``cache_position`` (``T`` consecutive slots), and attention over
    all ``cache_len`` slots masked by a ``[batch, cache_len]`` attention mask. Inputs:
    ``input_ids [B, T]``, ``attention_mask [B, S]``, ``position_ids [B, T]``,
    ``cache_position [T]`` and ``2 * layers`` caches ``[B, kv_heads, S, head_dim]``
    (layer ``i``: keys ``caches_{2i}``, values ``caches_{2i+1}``); output: logits.
    """
    key = capture_cache.key_of(model, {"decode": True, "seq_len": seq_len, "cache_len": cache_len, "batch": batch})
    config = model.config.get_text_config()
    n_layers = num_layers_of(config)
    kv_heads, head_dim = kv_shape_of(config)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    caches = [
        torch.zeros(batch, kv_heads, cache_len, head_dim, dtype=dtype, device=device) for _ in range(2 * n_layers)
    ]
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, cache_len, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq_len, device=device).expand(batch, seq_len),
        "cache_position": torch.arange(seq_len, device=device),
        "caches": caches,
    }
    # Named dims shared by all inputs: one batch, one step length, one cache length (per-input
    # AUTO dims would give every cache its own symbols, and export time grows with them).
    b, t, s = Dim("batch"), Dim("step"), Dim("cache_len")
    shapes = {
        "input_ids": {0: b, 1: t},
        "attention_mask": {0: b, 1: s},
        "position_ids": {0: b, 1: t},
        "cache_position": {0: t},
        "caches": [{0: b, 2: s}] * len(caches),
    }
    forward = type(model).forward
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

    def step(input_ids, attention_mask, position_ids, cache_position, caches):
        cache = _bind_static_cache(config, caches, cache_position)
        out = forward(
            model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_kw: cache},
        )
        return out.logits

    model.forward = step  # export traces the step with the model's own parameter names
    try:
        return _export(model, inputs, shapes, key)
    finally:
        del model.forward


class _CallerOwnedLayer(StaticLayer):
    """A static cache layer over caller-owned tensors that writes the step's keys/values
    at ``cache_position`` (no in-place position counter, so a layer copied by a looping
    pass writes the same slots as the original)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor):
        super().__init__(keys.shape[2])
        self.keys, self.values, self.positions = keys, values, cache_position
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = cache_position[0]  # the mask's query offset
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values


def _bind_static_cache(config, caches: list[torch.Tensor], cache_position: torch.Tensor) -> StaticCache:
    """A transformers ``StaticCache`` whose layers write into ``caches`` (full-length layers
    throughout: sliding windows are applied by the mask, as the export wrappers do)."""
    cache = StaticCache(config=config, max_cache_len=caches[0].shape[2])
    for i in range(len(cache.layers)):
        cache.layers[i] = _CallerOwnedLayer(caches[2 * i], caches[2 * i + 1], cache_position)
    return cache


def _export(model: nn.Module, kwargs: dict, dynamic_shapes: dict, key: dict | None = None) -> fx.GraphModule:
    """The unlifted export of ``model`` (served by the capture cache under ``key``, if any)."""

    def export() -> torch.export.ExportedProgram:
        try:
            with without_stack_traces():
                return torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:  # torch.export raises many types; say which model failed
            raise CaptureError(
                f"torch.export could not capture {type(model).__name__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})."
            ) from exc

    return capture_cache.exported_module(model, key, export)


def build_skeleton(config, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """The source architecture of ``config`` on ``meta`` (no weights), in eval mode."""
    import transformers

    kwargs: dict = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()
