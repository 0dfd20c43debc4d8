"""``looptool.convert``: source model → looped model, in one call."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from looptool.capture import capture, num_layers_of
from looptool.errors import LooptoolError
from looptool.model import LoopedModel
from looptool.passes import PassManager
from looptool.plan import LoopPlan, PrefixLoop, RecurrentLoop
from looptool.sources import load_source

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
    looped model's, nothing is copied), a model directory, a ``.gguf`` file or
    ``"smollm2"``; ``dtype``/``device`` apply when looptool loads the source itself.
    Right after conversion every budget computes exactly what the source computes.
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
