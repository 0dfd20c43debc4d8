"""Capture a Hugging Face causal LM as an annotated FX graph.

``torch.export`` (dynamic batch and sequence) produces the graph; the unlifted
``GraphModule`` holds the *source's own* parameter objects, so nothing is copied. Then every
node is annotated with its layer and role (:mod:`looptool.core.graph`). This package is the only
place that knows about architectures: it finds the decoder-layer list, and identifies each
layer's residual stream by data flow:

* walking back from the layer's output through the layer's own ``add`` nodes: each sum is
  flattened into its addends (any association and operand order), the addend that is an
  ancestor of all the others is the *stream*, and the others are *writes* into it; one
  write per sum is a sequential layer (Llama), two are parallel writes (GPT-NeoX, Cohere);
* each write is classified by the ops between it and the stream: ``topk`` → MoE, attention
  (``scaled_dot_product_attention`` / ``softmax``) → attention, otherwise MLP.

Pre-norm (Llama), branch-post-norm (OLMo2, Gemma3), Conv1D (GPT-2), parallel residual
(GPT-NeoX, Cohere) and MoE (Mixtral, Qwen-MoE, OLMoE) layers all reduce to this form. A layer that
does not is refused with a :class:`~looptool.core.errors.CaptureError` naming what was missing.

Its modules, one job each: :mod:`~looptool.capture.export` (``torch.export`` of the forward
and of a cached decode step), :mod:`~looptool.capture.clean` (plain inputs, one output,
device-neutral ops), :mod:`~looptool.capture.residual` (residual analysis of one layer),
:mod:`~looptool.capture.annotate` (roles and layers of every node),
:mod:`~looptool.capture.experts` (the MoE experts implementation's layout),
:mod:`~looptool.capture.norms` (which parameters are norm scales/shifts) and
:mod:`~looptool.capture.facts` (architecture facts of the config); :func:`capture` runs them.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch import nn

from looptool.capture import config_cache
from looptool.capture.annotate import annotate_cache, annotate_graph
from looptool.capture.clean import CAST_TARGETS, clean_module
from looptool.capture.experts import annotate_experts
from looptool.capture.export import INPUT_NAMES, build_skeleton, export_decode_step, export_key, export_source
from looptool.capture.facts import (
    find_layers_path,
    hidden_size_of,
    kv_shape_of,
    layer_and_head_paths,
    moe_shape_of,
    norm_eps_of,
    num_layers_of,
)
from looptool.capture.norms import annotate_norm_parameters
from looptool.capture.residual import NORM_TARGETS
from looptool.core.errors import CaptureError
from looptool.core.graph import LayerGraph, SourceInfo

__all__ = [
    "CAST_TARGETS",
    "NORM_TARGETS",
    "annotate_cache",
    "annotate_graph",
    "build_skeleton",
    "capture",
    "capture_config",
    "export_decode_step",
    "export_source",
    "find_layers_path",
    "hidden_size_of",
    "kv_shape_of",
    "moe_shape_of",
    "norm_eps_of",
    "num_layers_of",
]
log = logging.getLogger(__name__)


def capture(model: nn.Module, *, decode: bool = False) -> LayerGraph:
    """Capture ``model`` (an HF causal LM, on any device including ``meta``) as a LayerGraph.

    The graph is specialised to the model's dtype and device (export bakes both in). No weight is
    copied: the LayerGraph's module holds the model's own parameter tensors. With
    ``decode=True`` the graph is one cached step (:func:`export_decode_step`); its cache
    writes are marked ``kv`` and each cache input says which layer it serves.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise CaptureError(
            f"{type(model).__name__} has no Hugging Face 'config'; wrap a transformers "
            "causal LM (AutoModelForCausalLM) or pass a model directory."
        )
    was_training = model.training
    model.eval()
    try:
        exported = export_decode_step(model) if decode else export_source(model)
    finally:
        model.train(was_training)
    layers_path, head_path = layer_and_head_paths(model, config)
    param = next(model.parameters())
    return _layer_graph(exported, config, layers_path, head_path, param.dtype, param.device, decode=decode)


def capture_config(
    config, dtype: torch.dtype, attn_implementation: str | None = None, *, decode: bool = False
) -> LayerGraph:
    """``capture(build_skeleton(config, dtype, attn_implementation), decode=decode)``: the
    architecture of ``config`` captured on ``meta``, without building it when
    :mod:`~looptool.capture.config_cache` holds a record of that capture (the same graph,
    on fresh ``meta`` tensors of the same names, shapes, dtypes and ties)."""
    key = config_cache.key_of(config, dtype, attn_implementation, decode)
    if key is None:  # not cached (the cache is off, or the config cannot be keyed)
        return capture(build_skeleton(config, dtype, attn_implementation), decode=decode)
    found = config_cache.served(key, config)
    if found is not None:
        gm, entry = found
        return _layer_graph(gm, config, entry["layers_path"], entry["head_path"], dtype, "meta", decode=decode)
    before = config_cache.snapshot(config)
    model = build_skeleton(config, dtype, attn_implementation)
    lg = capture(model, decode=decode)
    config_cache.record(key, model, before, export_key(model, decode=decode))
    return lg


def _layer_graph(
    exported: fx.GraphModule,
    config,
    layers_path: str,
    head_path: str | None,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    decode: bool,
) -> LayerGraph:
    """The LayerGraph of an unlifted export of ``config``'s architecture (its layers at
    ``layers_path``, its head at ``head_path``): cleaned, each node annotated."""
    n_layers = num_layers_of(config)
    module = clean_module(exported, None if decode else INPUT_NAMES)
    layers = annotate_graph(module.graph, layers_path, n_layers, head_path)
    annotate_experts(module.graph)
    if decode:
        annotate_cache(module.graph, n_layers)
    annotate_norm_parameters(module)
    num_experts, experts_per_token = moe_shape_of(config)
    kv_heads, head_dim = kv_shape_of(config)
    source = SourceInfo(
        model_type=getattr(config, "model_type", type(config).__name__),
        dtype=str(dtype),
        device=str(device),
        attn_implementation=getattr(config, "_attn_implementation", None),
        num_layers=n_layers,
        hidden_size=hidden_size_of(config),
        layers_path=layers_path,
        norm_eps=norm_eps_of(config),
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    log.info("captured %s: %d layers, %d nodes", source.model_type, n_layers, len(module.graph.nodes))
    return LayerGraph(module=module, layers=layers, source=source, config=config)
