"""Annotating a cleaned graph: every node's layer and role, and the KV-cache inputs of a
decode step (:mod:`looptool.core.graph` defines the roles)."""

from __future__ import annotations

import torch
import torch.fx as fx

from looptool.capture.residual import analyse_layer, innermost_path, is_shape
from looptool.core.errors import CaptureError
from looptool.core.graph import (
    ROLE_EMBEDDING,
    ROLE_FINAL_NORM,
    ROLE_HEAD,
    ROLE_INPUT,
    ROLE_OUTPUT,
    ROLE_PARAM,
    ROLE_PROLOGUE,
    ROLE_SHAPE,
    LayerInfo,
    annotate,
    annotation,
)


def annotate_graph(graph: fx.Graph, layers_path: str, n_layers: int, head_path: str | None) -> tuple[LayerInfo, ...]:
    """Annotate every node of a captured graph with layer and role; return the layer infos."""
    by_layer: dict[int, list[fx.Node]] = {i: [] for i in range(n_layers)}
    for node in graph.nodes:
        layer = _layer_of(node, layers_path)
        if layer is not None and node.op == "call_function" and not is_shape(node):
            by_layer[layer].append(node)
    missing = [i for i, ns in by_layer.items() if not ns]
    if missing:
        raise CaptureError(
            f"no graph nodes were attributed to decoder layer(s) {missing[:5]}; the export "
            "lost the module structure needed to find them."
        )
    infos = []
    layer_roles: dict[fx.Node, tuple[str, int]] = {}
    logits_nodes: set[fx.Node] = set()
    for index, nodes in by_layer.items():
        info, roles, router_logits = analyse_layer(index, nodes, f"{layers_path}.{index}")
        infos.append(info)
        layer_roles.update({n: (r, index) for n, r in roles.items()})
        logits_nodes |= router_logits
    for prev, nxt in zip(infos, infos[1:]):
        if nxt.input != prev.output:
            raise CaptureError(
                f"layer {nxt.index} does not read layer {prev.index}'s output; looptool "
                "needs the decoder layers to form one residual chain."
            )
    seen_layers = False
    for node in graph.nodes:
        if node in layer_roles:
            role, index = layer_roles[node]
            annotate(node, role, index, **({"router_logits": True} if node in logits_nodes else {}))
            seen_layers = True
        elif node.op == "placeholder":
            annotate(node, ROLE_INPUT, None)
        elif node.op == "get_attr":
            annotate(node, ROLE_PARAM, None)
        elif node.op == "output":
            annotate(node, ROLE_OUTPUT, None)
        elif is_shape(node):
            annotate(node, ROLE_SHAPE, None)
        elif not seen_layers:
            is_embedding = node.target is torch.ops.aten.embedding.default
            annotate(node, ROLE_EMBEDDING if is_embedding else ROLE_PROLOGUE, None)
        else:
            path = innermost_path(node)
            is_head = head_path is not None and path is not None and path.startswith(head_path)
            annotate(node, ROLE_HEAD if is_head else ROLE_FINAL_NORM, None)
    return tuple(infos)


def annotate_cache(graph: fx.Graph, n_layers: int) -> None:
    """Mark the KV cache of a decode-step graph: each ``caches_*`` input gets
    ``kv = {"layer", "kind"}`` and its in-place write (``index_copy_``) ``kv = kind``.

    Refuses a graph in which a cache is written more than once, read other than through
    its write (or for its size), or not written by exactly one decoder layer.
    """
    for node in graph.nodes:
        if node.op != "placeholder" or not str(node.target).startswith("caches_"):
            continue
        writes = [u for u in node.users if u.target is torch.ops.aten.index_copy_.default and u.args[0] is node]
        layers = {annotation(u).get("layer") for u in writes}
        readers = [u for u in node.users if u not in writes and annotation(u).get("role") != ROLE_SHAPE]
        if len(writes) != 1 or readers or None in layers:
            raise CaptureError(
                f"cached decoding: cache input '{node.target}' is not written exactly once by one "
                "decoder layer's attention; this architecture's cache layout is not supported."
            )
        index = int(str(node.target).split("_")[-1])
        kind = "k" if index % 2 == 0 else "v"
        ann = annotation(node)
        ann["kv"] = {"layer": layers.pop(), "kind": kind}
        annotation(writes[0])["kv"] = kind
    marked = sum(1 for n in graph.nodes if n.op == "placeholder" and "kv" in annotation(n))
    if marked != 2 * n_layers:
        raise CaptureError(
            f"cached decoding: found {marked} cache inputs for {n_layers} layers; expected {2 * n_layers}."
        )


def _layer_of(node: fx.Node, layers_path: str) -> int | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    prefix = layers_path + "."
    for path, _ in stack.values():
        if path.startswith(prefix):
            head = path[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None
