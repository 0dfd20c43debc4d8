"""``looptool.runtime.convert``: source model → looped model, in one call."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from looptool.capture import capture, capture_config, num_layers_of
from looptool.capture.sources import load_source
from looptool.core.errors import LooptoolError
from looptool.core.graph import dtype_from_str, float_dtype
from looptool.core.plan import LoopPlan, PrefixLoop, RecurrentLoop
from looptool.passes import PassManager
from looptool.runtime.model import LoopedModel
from looptool.runtime.tensors import bind_tensors, graph_tensors

log = logging.getLogger(__name__)

_PASS_OF_PLAN = {PrefixLoop: "prefix_loop", RecurrentLoop: "recurrent_loop"}


def plan_steps(plan: LoopPlan) -> list[tuple[str, dict]]:
    """The pass recipe that applies ``plan``."""
    try:
        return [(_PASS_OF_PLAN[type(plan)], plan.to_dict())]
    except KeyError:
        raise LooptoolError(f"{type(plan).__name__} is not a loop plan looptool can apply.") from None


def convert(
    source: nn.Module | str | os.PathLike,
    plan: LoopPlan | None = None,
    *,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoopedModel:
    """Capture ``source`` and loop it according to ``plan`` (default: ``PrefixLoop()``).

    ``source`` is a Hugging Face causal LM object (used as is: its parameters become the
    looped model's, nothing is copied), a model directory, a Hub model id (``org/name`` or
    ``org/name@revision``, through the Hugging Face cache), a ``.gguf`` file or ``"smollm2"``;
    ``dtype``/``device`` apply when looptool loads the source itself. Right after conversion
    every budget computes exactly what the source computes.
    """
    if isinstance(source, nn.Module):
        model = source
    else:
        loaded = load_source(source, dtype=dtype, device=device)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
    plan = plan or PrefixLoop()
    if hasattr(model, "config"):  # validate the plan before the (slower) capture
        plan = plan.resolve(num_layers_of(model.config))
    lg = capture(model)
    lg = PassManager(plan_steps(plan))(lg)
    return LoopedModel(lg, tokenizer=tokenizer)


def rebuild(
    config, recipe, *, dtype: torch.dtype, device: str, attn_implementation: str | None = None, tokenizer=None
) -> LoopedModel:
    """The structure of a looped model with weights on ``meta``: the source architecture of
    ``config`` built on ``meta`` in ``dtype``, captured, its graph retargeted to ``device`` and
    the ``recipe`` of passes replayed. Binding the weights is the caller's (load, cast)."""
    lg = capture_config(config, dtype, attn_implementation)  # served without building it after the first time
    # retargeted before the recipe: the captured graph is copied once, not every budget path
    # the recipe builds (the passes read the device from ``lg.source``)
    lg = PassManager([("retarget_device", {"to": str(device)})])(lg)
    lg = PassManager([(name, cfg) for name, cfg in recipe])(lg)
    return LoopedModel(lg, tokenizer=tokenizer)


def cast(model: LoopedModel, dtype: torch.dtype | str) -> LoopedModel:
    """A copy of ``model`` whose graphs and weights are in ``dtype``; ``model`` is untouched.

    A captured graph is specialised to its dtype, so an in-place ``model.to(dtype)`` is
    refused; this recaptures the source architecture in ``dtype`` on ``meta``, replays the
    model's recipe and binds cast copies of its tensors (each tied tensor cast once; tensors
    the new graphs keep in another dtype, such as fp32 rotary frequencies, keep it, and a
    tensor whose dtype does not change is shared, not copied). Trainability is kept.
    Returns ``model`` itself when it is already in ``dtype``.
    """
    source = model.layer_graph.source
    dtype = float_dtype(dtype)
    if dtype_from_str(source.dtype) == dtype:
        return model
    device = source.device
    new = rebuild(
        model.config,
        model.recipe,
        dtype=dtype,
        device=device,
        attn_implementation=source.attn_implementation,
        tokenizer=model.tokenizer,
    )
    old = graph_tensors(model)
    missing = sorted(set(graph_tensors(new)) - set(old))
    if missing:  # the replayed recipe must give the same tensors; anything else is a looptool bug
        raise LooptoolError(
            f"the {dtype} rebuild of this model has tensors the model lacks ({missing[:3]}); "
            "please report this as a bug."
        )
    cast_of: dict[int, torch.Tensor] = {}

    def tensor_for(name: str, placeholder: torch.Tensor) -> torch.Tensor:
        t = old[name]
        if id(t) not in cast_of:
            value = t.detach()
            cast_of[id(t)] = value if value.dtype == placeholder.dtype else value.to(placeholder.dtype)
        return cast_of[id(t)]

    trainable = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    bind_tensors(new, tensor_for, trainable=trainable)
    new.activation_checkpointing = model.activation_checkpointing
    new.train(model.training)
    return new
