"""The ``retarget_device`` pass: rewrite device constants baked into captured graphs.

A graph captured on one device (``meta`` when loading) holds that device in
``arange(device=...)``, ``to(device=...)`` and similar arguments. This pass replaces every
``torch.device`` argument equal to ``from`` by ``to`` in the captured graph and in every
budget path. It is not recorded in the recipe: the device is where a model runs, not part
of what it is.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from looptool.core.graph import LayerGraph, copy_graph, shared_graph_module
from looptool.passes.manager import register_pass


@register_pass("retarget_device", replayable=False)
def retarget_device(lg: LayerGraph, config: dict) -> LayerGraph:
    """``config = {"to": "cpu"}`` (and optionally ``"from"``, default the capture device)."""
    src = torch.device(config.get("from", lg.source.device))
    dst = torch.device(config["to"])

    def swap(value):
        if isinstance(value, torch.device) and value == src:
            return dst
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    def transform(node, args, kwargs):
        return swap(tuple(args)), {k: swap(v) for k, v in kwargs.items()}

    graph = copy_graph(lg.graph, transform)
    module = shared_graph_module(lg.module, graph, lazy=True)  # never run itself: its code only if asked
    # Higher-order ops (e.g. a rotary embedding under ``torch.autocast(enabled=False)`` in
    # some transformers versions) keep their bodies as GraphModule children: retarget those
    # too, as new objects, so the input LayerGraph's are untouched.
    for name, child in list(module._modules.items()):
        if isinstance(child, fx.GraphModule):
            module._modules[name] = _retarget_body(child, transform)
    paths = {k: copy_graph(g, transform) for k, g in lg.paths.items()}
    source = dataclasses.replace(lg.source, device=str(dst))
    return lg.replace(module=module, paths=paths, source=source)


def _retarget_body(body: fx.GraphModule, transform) -> fx.GraphModule:
    """A copy of a higher-order op's body graph (and its nested bodies), retargeted."""
    new = fx.GraphModule(body, copy_graph(body.graph, transform))
    for name, child in list(new._modules.items()):
        if isinstance(child, fx.GraphModule):
            new._modules[name] = _retarget_body(child, transform)
    return new
