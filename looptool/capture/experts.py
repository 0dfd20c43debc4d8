"""Recognising transformers' grouped-experts implementation inside captured MoE branches.

A MoE branch computes its experts as: gather the routed token copies, one grouped matmul
with the concatenated ``gate|up`` expert weights, ``silu(gate) * up``, a grouped matmul with
the ``down`` weights, then a routing-weighted un-sort and a sum over the top-k. That layout is
a fact of the source implementation, so it is recognised here, once, at capture, and marked
on the nodes (annotation key ``experts``): ``combine`` (the ``[tokens, hidden]`` result),
``body`` (every node between), ``input``, ``weights`` and ``ids`` (the routed operands) and
``gate_up`` / ``down`` (the expert tensors). The ``fuse`` pass replaces a marked block by
``looptool::moe`` reading only these marks.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from looptool.core.graph import META_KEY, ROLE_MOE, ROLE_ROUTER, annotation, is_call, value_users

_aten = torch.ops.aten
EXPERTS_KEY = "experts"
OPERANDS = ("input", "weights", "ids", "gate_up", "down")


def annotate_experts(graph: fx.Graph) -> int:
    """Mark every grouped-experts block of ``graph`` (see the module docstring); returns how many."""
    count = 0
    for gmm_up in [n for n in graph.nodes if _is_grouped_mm(n)]:
        if len(gmm_up.args) < 2:
            continue
        gate_up = _expert_weight(gmm_up.args[1])
        match = _match_experts(gmm_up, gate_up) if gate_up is not None else None
        if match is None:
            continue
        combine, x, weights, ids, down, region = match
        for node in region:
            _mark(node, "body")
        for node, part in (
            (combine, "combine"),
            (x, "input"),
            (weights, "weights"),
            (ids, "ids"),
            (gate_up, "gate_up"),
            (down, "down"),
        ):
            _mark(node, part)
        count += 1
    return count


def _mark(node: fx.Node, part: str) -> None:
    node.meta[META_KEY] = {**annotation(node), EXPERTS_KEY: part}


_GROUPED = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}


def _is_grouped_mm(node) -> bool:
    return (
        isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "_opname", None) in _GROUPED
    )


def _expert_weight(node) -> fx.Node | None:
    """The 3-D expert tensor behind ``transpose(w, -2, -1)`` (the grouped matmul's operand)."""
    if (
        is_call(node, _aten.transpose.int)
        and node.args[0].op == "get_attr"
        and tuple(node.args[1:]) in ((-2, -1), (1, 2))
    ):
        return node.args[0]
    return None


def _shape_of(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


_MASKED_FILL = (_aten.masked_fill.Scalar, _aten.masked_fill_.Scalar)


def _is_padding_mask(node, of: fx.Node) -> bool:
    """Whether ``node`` zeroes rows of ``of`` by a mask (``masked_fill(of, mask, 0)``):
    transformers 5.17's experts zero the rows of expert ids past the last expert, rows a
    router's top-k never produces, so such a block computes what ``looptool::moe`` computes."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in _MASKED_FILL
        and node.args[0] is of
        and node.args[2] == 0
    )


def _under_padding_mask(node):
    """``node``'s input if ``node`` is such a padding mask, else ``node``."""
    return node.args[0] if isinstance(node, fx.Node) and _is_padding_mask(node, node.args[0]) else node


def _past_padding_mask(node: fx.Node) -> fx.Node:
    """The padding mask applied to ``node``'s result, if that is its one use, else ``node``."""
    users = value_users(node)
    return users[0] if len(users) == 1 and _is_padding_mask(users[0], node) else node


def _in_place_on(node: fx.Node, of: fx.Node) -> bool:
    """Whether ``node`` is an aten in-place op (``clamp_``) writing ``of``, its first argument
    (transformers 5.17 clamps the sorted expert ids in place)."""
    target = node.target
    name = getattr(target, "_opname", "") if node.op == "call_function" else ""
    return name.endswith("_") and not name.startswith("_") and bool(node.args) and node.args[0] is of


def _match_experts(gmm_up: fx.Node, gate_up: fx.Node):
    """Walk the grouped experts subgraph from its first grouped matmul; None if it is not
    the gated-SiLU pattern the ``moe`` op computes."""
    # up: chunk(gmm_up, 2, -1) → silu(chunk[0]) * chunk[1] → grouped matmul with down
    up = _past_padding_mask(gmm_up)
    chunk = next(iter(value_users(up)), None)
    if (
        len(value_users(up)) != 1
        or not is_call(chunk, _aten.chunk.default)
        or tuple(chunk.args[1:]) not in ((2, -1), (2, 1))
    ):
        return None
    parts = {u.args[1]: u for u in value_users(chunk) if u.target is operator.getitem}
    if set(parts) != {0, 1} or len(value_users(parts[0])) != 1:
        return None
    silu = value_users(parts[0])[0]
    if not is_call(silu, _aten.silu.default) or len(value_users(silu)) != 1:
        return None
    act = value_users(silu)[0]
    if not (is_call(act, _aten.mul.Tensor) and act.args == (silu, parts[1]) and len(value_users(act)) == 1):
        return None
    gmm_down = value_users(act)[0]
    down = _expert_weight(gmm_down.args[1]) if _is_grouped_mm(gmm_down) else None
    if down is None:
        return None
    # combine: the first node after the down projection shaped like the experts' input x
    gathered = _under_padding_mask(gmm_up.args[0])
    if not is_call(gathered, _aten.index.Tensor):
        return None
    x = gathered.args[0]
    x_shape = _shape_of(x)
    combine, node = None, gmm_down
    for _ in range(8):
        users = value_users(node)
        if len(users) != 1:
            return None
        node = users[0]
        if _shape_of(node) == x_shape:
            combine = node
            break
    if combine is None or not is_call(combine, _aten.sum.dim_IntList):
        return None
    # everything the combine depends on, stopping at x, parameters and the router's output
    region: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [combine]
    while todo:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp in region or inp in leaves:
                continue
            role = annotation(inp).get("role")
            if inp is x or inp.op in ("get_attr", "placeholder") or role != ROLE_MOE:
                leaves.add(inp)
            else:
                region.add(inp)
                todo.append(inp)
    tensors = [n for n in leaves if _shape_of(n) is not None and n not in (x, gate_up, down)]
    routed = [n for n in tensors if annotation(n).get("role") == ROLE_ROUTER]
    if len(routed) != 2 or len(tensors) != 2:
        return None
    ids = next((n for n in routed if not n.meta["val"].is_floating_point()), None)
    weights = next((n for n in routed if n.meta["val"].is_floating_point()), None)
    if ids is None or weights is None or _shape_of(ids) != _shape_of(weights):
        return None
    for n in list(region):  # in-place ops on the block's own tensors whose results nothing reads
        region.update(u for u in value_users(n) if _in_place_on(u, n) and not value_users(u))
    if any(u not in region and u is not combine for n in region for u in value_users(n)):
        return None  # an intermediate escapes the experts block: not safe to replace
    return combine, x, weights, ids, down, region
