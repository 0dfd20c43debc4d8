"""Residual analysis: one decoder layer's stream, writes, branch norms and router, found by
data flow (see :mod:`looptool.capture`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from looptool.core.errors import CaptureError
from looptool.core.graph import (
    FORM_PARALLEL,
    FORM_SEQUENTIAL,
    ROLE_ATTENTION,
    ROLE_LAYER,
    ROLE_MLP,
    ROLE_MOE,
    ROLE_RESIDUAL,
    ROLE_ROUTER,
    LayerInfo,
    Write,
)

_ADD_TARGETS = {torch.ops.aten.add.Tensor, operator.add}


_ATTENTION_TARGETS = {
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._softmax.default,
    torch.ops.aten.softmax.int,
}


_TOPK_TARGETS = {torch.ops.aten.topk.default}


NORM_TARGETS = {  # normalisation ops (also read by looptool.posttrain.merge to find norm parameters)
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.layer_norm.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.rms_norm.default,
}


_MATMUL_TARGETS = {
    torch.ops.aten.linear.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.bmm.default,
}


def _is_ancestor(candidate: fx.Node, node: fx.Node, scope: set[fx.Node]) -> bool:
    """True if ``candidate`` feeds ``node`` through nodes of ``scope``."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp is candidate:
                return True
            if inp in scope and inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return False


def _branch_nodes(write: fx.Node, stream: fx.Node, scope: set[fx.Node]) -> set[fx.Node]:
    """Nodes of the layer between the stream value and a write (the branch computation)."""
    out = {write}
    todo = [write]
    while todo:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp is not stream and inp in scope and inp not in out:
                out.add(inp)
                todo.append(inp)
    return out


def _is_layer_add(node: fx.Node, scope: set[fx.Node], layer_module: str) -> bool:
    return (
        node in scope
        and node.op == "call_function"
        and node.target in _ADD_TARGETS
        and len(node.args) == 2
        and all(isinstance(a, fx.Node) for a in node.args)
        and not node.kwargs.get("alpha")
        and innermost_path(node) == layer_module
    )


def _sum_tree(
    root: fx.Node, scope: set[fx.Node], layer_module: str
) -> tuple[list[tuple[fx.Node, fx.Node]], list[fx.Node]]:
    """Flatten the sum rooted at ``root``: ``(leaf, add that reads it)`` for every addend and
    the adds of the tree. An operand that is itself a layer add read only by this sum is
    expanded, so ``a + b + c`` is three addends in any association and operand order
    (``(h + A) + M``, Cohere; ``(M + A) + h``, GPT-NeoX; ``h + (A + M)``); an add read
    elsewhere too (the stream a later branch reads) stays a leaf."""
    leaves: list[tuple[fx.Node, fx.Node]] = []
    tree = [root]

    def visit(add: fx.Node) -> None:
        for arg in add.args:
            if _is_layer_add(arg, scope, layer_module) and len(arg.users) == 1:
                tree.append(arg)
                visit(arg)
            else:
                leaves.append((arg, add))

    visit(root)
    return leaves, tree


def analyse_layer(index: int, nodes: list[fx.Node], layer_module: str) -> tuple[LayerInfo, dict, set]:
    scope = set(nodes)
    escaping = [n for n in nodes if any(u not in scope for u in n.users)]
    if len(escaping) != 1:
        names = ", ".join(n.name for n in escaping) or "none"
        raise CaptureError(
            f"layer {index} has {len(escaping)} values used outside it ({names}); looptool "
            "expects one residual-stream output per decoder layer."
        )
    output = escaping[0]
    residual_adds: list[fx.Node] = []
    steps: list[tuple[list[tuple[fx.Node, fx.Node]], fx.Node]] = []  # ([(write, add)], stream-before)
    stream = output
    while _is_layer_add(stream, scope, layer_module):
        leaves, tree = _sum_tree(stream, scope, layer_module)
        values = [leaf for leaf, _ in leaves]
        bases = [v for v in values if all(o is v or _is_ancestor(v, o, scope) for o in values)]
        if len(bases) != 1:
            break
        steps.append(([(leaf, add) for leaf, add in leaves if leaf is not bases[0]], bases[0]))
        residual_adds.extend(tree)
        stream = bases[0]
    if stream in scope or not steps:
        raise CaptureError(
            f"layer {index}: no residual stream was found (walking back from output "
            f"'{output.name}' did not reach the layer input through residual adds); this "
            "architecture's layer structure is not supported."
        )
    layer_input = stream
    form = FORM_PARALLEL if any(len(parts) > 1 for parts, _ in steps) else FORM_SEQUENTIAL
    writes: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (write, add, stream-before)
    for parts, base in reversed(steps):  # steps run output → input
        writes.extend((w, a, base) for w, a in parts)
    roles: dict[fx.Node, str] = {n: ROLE_LAYER for n in nodes}
    router_logits: set[fx.Node] = set()  # the router's logits matmul, for the balance loss
    infos: list[Write] = []
    for write, add, base in writes:
        branch = _branch_nodes(write, base, scope) - set(residual_adds)
        targets = {n.target for n in branch}
        if targets & _TOPK_TARGETS:
            kind = ROLE_MOE
        elif targets & _ATTENTION_TARGETS:
            kind = ROLE_ATTENTION
        else:
            kind = ROLE_MLP
        for n in branch:
            roles[n] = kind
        if kind == ROLE_MOE:
            router = _router_nodes(branch, write, layer_module)
            for n in router:
                roles[n] = ROLE_ROUTER
            matmuls = [n for n in nodes if n in router and n.target in _MATMUL_TARGETS]
            if matmuls:
                router_logits.add(matmuls[0])
        norm = _branch_norm(branch, base, layer_module)
        infos.append(Write(node=write.name, add=add.name, kind=kind, norm=norm.name if norm is not None else None))
    kinds = [w.kind for w in infos]
    if ROLE_ATTENTION not in kinds or len(set(kinds)) != len(kinds):
        raise CaptureError(
            f"layer {index}: expected one attention write and one MLP/MoE write into the "
            f"residual stream, found {kinds}; this layer structure is not supported."
        )
    for add in residual_adds:
        roles[add] = ROLE_RESIDUAL
    info = LayerInfo(
        index=index,
        nodes=tuple(n.name for n in nodes),
        input=layer_input.name,
        output=output.name,
        writes=tuple(infos),
        form=form,
    )
    return info, roles, router_logits


def is_shape(node: fx.Node) -> bool:
    """Symbolic-size arithmetic: its value is a SymInt/int, not a tensor."""
    val = node.meta.get("val")
    return (
        val is not None
        and not isinstance(val, torch.Tensor)
        and not (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))
    )


def _branch_norm(branch: set[fx.Node], stream: fx.Node, layer_module: str) -> fx.Node | None:
    """The output of the normalisation that a branch applies to the residual stream first
    (``input_layernorm`` of a pre-norm layer), or None when the branch reads the stream
    raw (OLMo2-style post-norm). A norm is a direct child module of the layer that reads
    the stream, normalises (rsqrt / layer_norm) and does no matmul."""
    readers = [n for n in stream.users if n in branch]
    paths = {innermost_path(n) or "" for n in readers}
    if len(paths) != 1:
        return None
    path = paths.pop()
    if not path.startswith(layer_module + ".") or "." in path[len(layer_module) + 1 :]:
        return None
    members = {n for n in branch if innermost_path(n) == path}
    targets = {n.target for n in members}
    if not targets & NORM_TARGETS or targets & _MATMUL_TARGETS:
        return None
    outputs = [n for n in members if any(u in branch and u not in members for u in n.users)]
    return outputs[0] if len(outputs) == 1 else None


def _router_nodes(branch: set[fx.Node], write: fx.Node, layer_module: str) -> set[fx.Node]:
    """The MoE router: the nodes of the submodule that computes ``topk`` (expert indices and
    routing weights). Empty when the router is not a submodule of its own (then it cannot
    be told apart from the experts and route replay is refused)."""
    out: set[fx.Node] = set()
    for topk in (n for n in branch if n.target in _TOPK_TARGETS):
        path = innermost_path(topk) or ""
        if not path.startswith(layer_module + ".") or (innermost_path(write) or "").startswith(path):
            continue
        out |= {
            n for n in branch if (innermost_path(n) or "") == path or (innermost_path(n) or "").startswith(path + ".")
        }
    return out if write not in out else set()


def innermost_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]
