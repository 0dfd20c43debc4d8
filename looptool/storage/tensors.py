"""The tensors a looped model's budget paths read (what a save stores), and rebinding them
(loading, casting). Duck-typed over the model: storage imports nothing from the runtime."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork


def graph_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a budget path reads (parameters and buffers, persistent or not), by name;
    a tied tensor appears under each of its names."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def bind_tensors(
    model: LoopedNetwork,
    tensor_for: Callable[[str, torch.Tensor], torch.Tensor],
    *,
    trainable: Collection[str] | None = None,
) -> None:
    """Replace every tensor of ``model`` (typically its ``meta`` placeholders) with
    ``tensor_for(name, placeholder)``.

    Names for which ``tensor_for`` returns the same tensor object stay tied (one object, one
    copy). Parameters become ``nn.Parameter`` objects that require grad when ``trainable``
    is None or names them.
    """
    trainable = set(trainable) if trainable is not None else None
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    bound: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(returned) → (returned, kept alive; bound object)
    for name, placeholder in graph_tensors(model).items():
        raw = tensor_for(name, placeholder)
        if id(raw) not in bound:
            obj = nn.Parameter(raw, requires_grad=trainable is None or name in trainable) if name in params else raw
            bound[id(raw)] = (raw, obj)
        obj = bound[id(raw)][1]
        *path, leaf = name.split(".")
        mod = model
        for part in path:
            mod = mod._modules[part]
        if name in params:
            mod._parameters[leaf] = obj
        else:
            mod._buffers[leaf] = obj
