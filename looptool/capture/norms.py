"""Marking norm parameters: which parameters are a normalisation's scale or shift.

Capture gives a norm inside a layer the role of the branch it belongs to (a pre-norm is part
of the attention or MLP branch, and post- and q/k-norms are not marked at all), so a
parameter's role cannot tell a norm weight from a projection. A parameter is a *norm
parameter* when every node reading it is a normalisation op (layer/RMS norm weight or
bias) or a pointwise op whose other operand comes, through pointwise ops and casts inside
the same layer and role, from a normalisation op (``rsqrt``, ``layer_norm``, ``rms_norm``:
:data:`~looptool.capture.residual.NORM_TARGETS`). Pointwise preprocessing of the parameter
alone (``1 + w``, casts) is followed to its consumers first.

:func:`annotate_norm_parameters` records the answer on every ``get_attr`` node of a
parameter (:data:`~looptool.core.graph.NORM_PARAM_KEY`), so later stages (parameter-group
merging) read it instead of re-deriving it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from looptool.capture.clean import CAST_TARGETS
from looptool.capture.residual import NORM_TARGETS
from looptool.core.graph import NORM_PARAM_KEY, annotation


def annotate_norm_parameters(module: fx.GraphModule) -> None:
    """Mark every ``get_attr`` node of a parameter of ``module`` with whether that parameter
    (all its ``get_attr`` nodes together: a tied tensor is judged once) is a norm parameter."""
    by_tensor: dict[int, list[fx.Node]] = {}
    for node in module.graph.nodes:
        if node.op == "get_attr":
            tensor = _attr(module, str(node.target))
            if isinstance(tensor, torch.nn.Parameter):
                by_tensor.setdefault(id(tensor), []).append(node)
    for attrs in by_tensor.values():
        norm = is_norm_parameter(attrs)
        for node in attrs:
            annotation(node)[NORM_PARAM_KEY] = norm


def _attr(module: torch.nn.Module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in CAST_TARGETS or torch.Tag.pointwise in getattr(target, "tags", ()))


def is_norm_parameter(attrs: list[fx.Node]) -> bool:
    """True when every use of the parameter (read by the ``get_attr`` nodes ``attrs``) is a
    normalisation's scale or shift (see the module docstring)."""
    derived = set(attrs)  # nodes computed from the parameter (and constants) only
    consumers: list[fx.Node] = []
    todo = [u for a in attrs for u in a.users]
    while todo:
        node = todo.pop()
        if node in derived or node in consumers or not node.users:
            continue  # a node nothing reads (export's tensor-metadata asserts) computes nothing
        if _pointwise(node) and all(i in derived or i.op == "get_attr" for i in node.all_input_nodes):
            derived.add(node)
            todo.extend(node.users)
        else:
            consumers.append(node)
    if not consumers:
        return False
    for node in consumers:
        if node.target in NORM_TARGETS:
            continue  # layer_norm / rms_norm reading it as its weight or bias
        if not _pointwise(node):
            return False
        others = [i for i in node.all_input_nodes if i not in derived and i.op != "get_attr"]
        if not any(_from_norm(i, annotation(node)) for i in others):
            return False
    return True


def _from_norm(node: fx.Node, ann: dict) -> bool:
    """True if ``node`` is computed from a normalisation op through pointwise ops and casts
    without leaving the (layer, role) of ``ann``."""
    key = (ann.get("layer"), ann.get("role"))
    todo, seen = [node], set()
    while todo:
        cur = todo.pop()
        if cur in seen or (annotation(cur).get("layer"), annotation(cur).get("role")) != key:
            continue
        seen.add(cur)
        if cur.target in NORM_TARGETS:
            return True
        if _pointwise(cur):
            todo.extend(cur.all_input_nodes)
    return False
