"""The ``fuse`` pass: swap subgraphs of budget paths for looptool's fused ops.

Four patterns, found by role annotations and op targets (never module names):

* ``gated_residual``: ``add(x, mul(tanh(g), f))`` where the ``mul``/``tanh`` are gate nodes
  of a second-pass write (Accordion Eq. 5) → ``looptool::gated_residual(x, g, f)``.
* ``adaptive_delta``: the recurrent-state update ``s_prev + [e ⊙] σ(W s̃ + b) ⊙
  softplus(γ) ⊙ (r − s_prev)`` emitted by ``recurrent_loop`` (ELR Eq. 2) →
  ``looptool::adaptive_delta(s_prev, r, s̃, W, b, γ, e)``.
* ``moe``: the source's experts implementation (sort by expert, grouped matmuls, gated
  SiLU, weighted un-sort and sum over top-k) between a router's top-k output and the
  combined ``[tokens, hidden]`` result → ``looptool::moe(x, weights, ids, gate_up, down)``.
  The router itself (softmax, top-k, renormalisation) stays as it is, so cross-loop route
  replay (ELR Sec. 3.4) feeds loop 1's routing into every loop's fused experts.

* ``modulate``: a loop-conditioned branch input (ELR Sec. 3.3, Eq. 4) as ``conditioning``
  emits it, ``add(x~, linear(linear(x~, B'), A))`` with ``x~ = addcmul(μ, 1 + λ, N(x))`` →
  ``looptool::modulate(N(x), 1 + λ, μ, B', A)``.

The fused ops compute the same arithmetic in the same order, so a fused path matches the
unfused one (bit-exact for the gate and the state update; within float rounding for MoE).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter

import torch
from looptool.passes.manager import register_pass
from torch import fx

import looptool.ops  # noqa: F401  (registers torch.ops.looptool.*)
from looptool.errors import PassError
from looptool.graph import (
    ROLE_GATE,
    ROLE_MOE,
    ROLE_RESIDUAL,
    ROLE_ROUTER,
    ROLE_STATE,
    LayerGraph,
    annotate,
    annotation,
    copy_graph,
)

log = logging.getLogger(__name__)
_aten = torch.ops.aten
FUSABLE = ("gated_residual", "adaptive_delta", "modulate", "moe")


@register_pass("fuse")
def fuse(lg: LayerGraph, config: dict) -> LayerGraph:
    """Fuse every budget path; ``config["ops"]`` picks the patterns (default: all)."""
    ops = tuple(config.get("ops", FUSABLE))
    unknown = sorted(set(ops) - set(FUSABLE))
    if unknown:
        raise PassError(f"fuse: unknown op(s) {unknown}; choose from {list(FUSABLE)}.")
    if not lg.paths:
        raise PassError("fuse: the graph has no budget paths yet; run a looping pass before fuse.")
    paths = {k: fuse_graph(g, ops)[0] for k, g in lg.paths.items()}
    return lg.replace(paths=paths)


def fuse_graph(graph: fx.Graph, ops: tuple[str, ...] = FUSABLE) -> tuple[fx.Graph, Counter]:
    """A fused copy of a budget path and the number of matches per op (input untouched)."""
    new = copy_graph(graph)
    counts: Counter = Counter()
    if "gated_residual" in ops:
        counts["gated_residual"] = _fuse_gated_residual(new)
    if "adaptive_delta" in ops:
        counts["adaptive_delta"] = _fuse_adaptive_delta(new)
    if "modulate" in ops:
        counts["modulate"] = _fuse_modulate(new)
    if "moe" in ops:
        counts["moe"] = _fuse_moe(new)
    new.lint()
    log.debug("fused %s", dict(counts))
    return new, counts


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _users(node: fx.Node) -> list[fx.Node]:
    """Users that consume the value (export's dtype/shape assertions do not)."""
    return [u for u in node.users if u.target is not _aten._assert_tensor_metadata.default]


def _erase_dead(graph: fx.Graph, candidates) -> None:
    """Erase ``candidates`` that no longer have users (other than assertions), sinks first."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(candidates), key=order.__getitem__, reverse=True):
        if not _users(node):
            for check in list(node.users):
                graph.erase_node(check)
            graph.erase_node(node)


def _swap_in(graph: fx.Graph, old: fx.Node, op: str, args: tuple, role: str) -> fx.Node:
    """Insert ``looptool::<op>(*args)`` before ``old``, give it ``old``'s metadata and layer
    annotation (with ``role`` and ``fused=op``) and route ``old``'s users to it; the caller
    erases ``old`` and the subgraph it replaced."""
    with graph.inserting_before(old):
        fused = graph.call_function(getattr(torch.ops.looptool, op).default, args)
    fused.meta = {k: v for k, v in old.meta.items() if k != "looptool"}
    ann = annotation(old)
    annotate(fused, role, ann.get("layer"), **{k: v for k, v in ann.items() if k not in ("role", "layer")}, fused=op)
    old.replace_all_uses_with(fused)
    return fused


# ---------------------------------------------------------------------------- gated residual
def _fuse_gated_residual(graph: fx.Graph) -> int:
    count = 0
    for add in list(graph.nodes):
        if not _is(add, _aten.add.Tensor) or add.kwargs or len(add.args) != 2:
            continue
        for i, arg in enumerate(add.args):
            if not (_is(arg, _aten.mul.Tensor) and annotation(arg).get("role") == ROLE_GATE and len(arg.users) == 1):
                continue
            tanh, f = arg.args
            if not (_is(tanh, _aten.tanh.default) and annotation(tanh).get("role") == ROLE_GATE):
                continue
            gate = tanh.args[0]
            x = add.args[1 - i]  # IEEE addition is commutative, so operand order is free
            _swap_in(graph, add, "gated_residual", (x, gate, f), annotation(add).get("role", ROLE_RESIDUAL))
            graph.erase_node(add)
            _erase_dead(graph, [arg, tanh])
            count += 1
            break
    return count


# ---------------------------------------------------------------------------- adaptive delta
def _fuse_adaptive_delta(graph: fx.Graph) -> int:
    count = 0
    for add in list(graph.nodes):
        ann = annotation(add)
        if not (_is(add, _aten.add.Tensor) and ann.get("role") == ROLE_STATE and ann.get("name") == "state"):
            continue
        s_prev, step = add.args
        exit = None
        dead = [step]
        if annotation(step).get("name") == "exit" and _is(step, _aten.mul.Tensor):
            exit, step = step.args
            dead.append(step)
        if not (_is(step, _aten.mul.Tensor) and annotation(step.args[0]).get("name") == "beta"):
            continue  # another update rule (delta, replace, residual): nothing to fuse
        beta, diff = step.args
        sig, rate = beta.args
        if not (_is(diff, _aten.sub.Tensor) and diff.args[1] is s_prev and _is(sig, _aten.sigmoid.default)
                and _is(rate, _aten.softplus.default) and _is(sig.args[0], _aten.linear.default)):
            raise PassError(f"fuse: the adaptive-delta update at '{add.name}' does not have the shape recurrent_loop emits.")
        linear = sig.args[0]
        s_tilde, weight, bias = linear.args
        r, gamma = diff.args[0], rate.args[0]
        _swap_in(graph, add, "adaptive_delta", (s_prev, r, s_tilde, weight, bias, gamma, exit), ROLE_STATE)
        graph.erase_node(add)
        _erase_dead(graph, [*dead, step, beta, diff, sig, rate, linear])
        count += 1
    return count


# ---------------------------------------------------------------------------- conditioning modulation
def _fuse_modulate(graph: fx.Graph) -> int:
    count = 0
    for add in list(graph.nodes):
        ann = annotation(add)
        if not (_is(add, _aten.add.Tensor) and ann.get("part") == "conditioning" and len(add.args) == 2):
            continue
        x_t, up_out = add.args
        if not (_is(x_t, _aten.addcmul.default) and _is(up_out, _aten.linear.default) and len(up_out.args) == 2):
            continue
        down_out, up = up_out.args
        if not (_is(down_out, _aten.linear.default) and len(down_out.args) == 2 and down_out.args[0] is x_t):
            continue
        shift, scale, x = x_t.args
        down = down_out.args[1]
        _swap_in(graph, add, "modulate", (x, scale, shift, down, up), ann.get("role", ROLE_STATE))
        graph.erase_node(add)
        _erase_dead(graph, [up_out, down_out, x_t])
        count += 1
    return count


# ---------------------------------------------------------------------------- mixture of experts
_GROUPED = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}


def _is_grouped_mm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "_opname", None) in _GROUPED


def _expert_weight(node) -> fx.Node | None:
    """The 3-D expert tensor behind ``transpose(w, -2, -1)`` (the grouped matmul's operand)."""
    if _is(node, _aten.transpose.int) and node.args[0].op == "get_attr" and tuple(node.args[1:]) in ((-2, -1), (1, 2)):
        return node.args[0]
    return None


def _shape_of(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _fuse_moe(graph: fx.Graph) -> int:
    count = 0
    for gmm_up in [n for n in graph.nodes if _is_grouped_mm(n)]:
        if gmm_up.graph is not graph or len(gmm_up.args) < 2:
            continue
        gate_up = _expert_weight(gmm_up.args[1])
        if gate_up is None:
            continue
        match = _match_experts(gmm_up, gate_up)
        if match is None:
            continue
        combine, x, weights, ids, down, region = match
        for user in list(combine.users):
            if user.target is _aten._assert_tensor_metadata.default:
                graph.erase_node(user)
        _swap_in(graph, combine, "moe", (x, weights, ids, gate_up, down), ROLE_MOE)
        _erase_dead(graph, region | {combine})
        count += 1
    return count


def _match_experts(gmm_up: fx.Node, gate_up: fx.Node):
    """Walk the grouped experts subgraph from its first grouped matmul; None if it is not
    the gated-SiLU pattern the ``moe`` op computes."""
    # up: chunk(gmm_up, 2, -1) → silu(chunk[0]) * chunk[1] → grouped matmul with down
    chunk = next(iter(_users(gmm_up)), None)
    if len(_users(gmm_up)) != 1 or not _is(chunk, _aten.chunk.default) or tuple(chunk.args[1:]) not in ((2, -1), (2, 1)):
        return None
    parts = {u.args[1]: u for u in _users(chunk) if u.target is operator.getitem}
    if set(parts) != {0, 1} or len(_users(parts[0])) != 1:
        return None
    silu = _users(parts[0])[0]
    if not _is(silu, _aten.silu.default) or len(_users(silu)) != 1:
        return None
    act = _users(silu)[0]
    if not (_is(act, _aten.mul.Tensor) and act.args == (silu, parts[1]) and len(_users(act)) == 1):
        return None
    gmm_down = _users(act)[0]
    down = _expert_weight(gmm_down.args[1]) if _is_grouped_mm(gmm_down) else None
    if down is None:
        return None
    # combine: the first node after the down projection shaped like the experts' input x
    gathered = gmm_up.args[0]
    if not _is(gathered, _aten.index.Tensor):
        return None
    x = gathered.args[0]
    x_shape = _shape_of(x)
    combine, node = None, gmm_down
    for _ in range(8):
        users = _users(node)
        if len(users) != 1:
            return None
        node = users[0]
        if _shape_of(node) == x_shape:
            combine = node
            break
    if combine is None or not _is(combine, _aten.sum.dim_IntList):
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
    if any(u not in region and u is not combine for n in region for u in _users(n)):
        return None  # an intermediate escapes the experts block: not safe to replace
    return combine, x, weights, ids, down, region
