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

from looptool.core.graph import LayerGraph, copy_graph, device_swap, retarget_bodies, shared_graph_module
from looptool.passes.manager import register_pass


@register_pass("retarget_device", replayable=False)
def retarget_device(lg: LayerGraph, config: dict) -> LayerGraph:
    """``config = {"to": "cpu"}`` (and optionally ``"from"``, default the capture device)."""
    src = torch.device(config.get("from", lg.source.device))
    dst = torch.device(config["to"])
    transform = device_swap(src, dst)
    graph = copy_graph(lg.graph, transform)
    module = shared_graph_module(lg.module, graph, lazy=True)  # never run itself: its code only if asked
    retarget_bodies(module, transform)  # as new objects, so the input LayerGraph's are untouched
    paths = {k: copy_graph(g, transform) for k, g in lg.paths.items()}
    source = dataclasses.replace(lg.source, device=str(dst))
    return lg.replace(module=module, paths=paths, source=source)
