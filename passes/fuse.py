"""The ``fuse`` pass: swap subgraphs of budget paths for looptool's fused ops.

Four patterns, found by role annotations and op targets (never module names or the
source's op names):

* ``gated_residual``: ``add(x, mul(tanh(g), f))`` where the ``mul``/``tanh`` are gate nodes
  of a second-pass write (Accordion Eq. 5) → ``looptool::gated_residual(x, g, f)``.
* ``adaptive_delta``: the recurrent-state update ``s_prev + [e ⊙] σ(W s̃ + b) ⊙
  softplus(γ) ⊙ (r − s_prev)`` emitted by ``recurrent_loop`` (ELR Eq. 2) →
  ``looptool::adaptive_delta(s_prev, r, s̃, W, b, γ, e)``.
* ``moe``: the source's experts implementation (sort by expert, grouped matmuls, gated
  SiLU, weighted un-sort and sum over top-k), as capture marked it
  (:mod:`looptool.capture.experts`) → ``looptool::moe(x, weights, ids, gate_up, down)``.
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
from collections import Counter

import torch
from torch import fx

import looptool.ops  # noqa: F401  (registers torch.ops.looptool.*)
from looptool.capture.experts import EXPERTS_KEY, OPERANDS
from looptool.core.errors import PassError
from looptool.core.graph import (
    ROLE_GATE,
    ROLE_MOE,
    ROLE_RESIDUAL,
    ROLE_STATE,
    LayerGraph,
    annotate,
    annotation,
    copy_graph,
    is_call,
    value_users,
)
from looptool.passes.manager import LOOPING_PASSES, register_pass

log = logging.getLogger(__name__)
_aten = torch.ops.aten
FUSABLE = ("gated_residual", "adaptive_delta", "modulate", "moe")


# before checkpoint: the patterns must be visible in the path, not outlined into regions
@register_pass("fuse", requires=LOOPING_PASSES, before=("checkpoint",))
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


def fused_counts(graph: fx.Graph, ops: tuple[str, ...] = FUSABLE) -> dict[str, int]:
    """How many of each fused op of ``ops`` a path holds (the ``fused`` annotation each
    replacement carries): after the ``fuse`` pass, the matches per op."""
    counts = Counter(annotation(n).get("fused") for n in graph.nodes)
    return {op: counts[op] for op in ops}


def _erase_dead(graph: fx.Graph, candidates) -> None:
    """Erase ``candidates`` that no longer have users (other than assertions), sinks first."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(candidates), key=order.__getitem__, reverse=True):
        if not value_users(node):
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
        if not is_call(add, _aten.add.Tensor) or add.kwargs or len(add.args) != 2:
            continue
        for i, arg in enumerate(add.args):
            if not (
                is_call(arg, _aten.mul.Tensor) and annotation(arg).get("role") == ROLE_GATE and len(arg.users) == 1
            ):
                continue
            tanh, f = arg.args
            if not (is_call(tanh, _aten.tanh.default) and annotation(tanh).get("role") == ROLE_GATE):
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
        if not (is_call(add, _aten.add.Tensor) and ann.get("role") == ROLE_STATE and ann.get("name") == "state"):
            continue
        s_prev, step = add.args
        exit = None
        dead = [step]
        if annotation(step).get("name") == "exit" and is_call(step, _aten.mul.Tensor):
            exit, step = step.args
            dead.append(step)
        if not (is_call(step, _aten.mul.Tensor) and annotation(step.args[0]).get("name") == "beta"):
            continue  # another update rule (delta, replace, residual): nothing to fuse
        beta, diff = step.args
        sig, rate = beta.args
        if not (
            is_call(diff, _aten.sub.Tensor)
            and diff.args[1] is s_prev
            and is_call(sig, _aten.sigmoid.default)
            and is_call(rate, _aten.softplus.default)
            and is_call(sig.args[0], _aten.linear.default)
        ):
            raise PassError(
                f"fuse: the adaptive-delta update at '{add.name}' does not have the shape recurrent_loop emits."
            )
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
        if not (is_call(add, _aten.add.Tensor) and ann.get("part") == "conditioning" and len(add.args) == 2):
            continue
        x_t, up_out = add.args
        if not (
            is_call(x_t, _aten.addcmul.default) and is_call(up_out, _aten.linear.default) and len(up_out.args) == 2
        ):
            continue
        down_out, up = up_out.args
        if not (is_call(down_out, _aten.linear.default) and len(down_out.args) == 2 and down_out.args[0] is x_t):
            continue
        shift, scale, x = x_t.args
        down = down_out.args[1]
        _swap_in(graph, add, "modulate", (x, scale, shift, down, up), ann.get("role", ROLE_STATE))
        graph.erase_node(add)
        _erase_dead(graph, [up_out, down_out, x_t])
        count += 1
    return count


# ---------------------------------------------------------------------------- mixture of experts
def _fuse_moe(graph: fx.Graph) -> int:
    """Replace every experts block capture marked (:mod:`looptool.capture.experts`) by
    ``looptool::moe``; the block's nodes are found from its ``combine`` node through the
    ``body`` marks, its operands by their marks (under route replay the routed operands are
    loop 1's)."""
    count = 0
    for combine in [n for n in graph.nodes if annotation(n).get(EXPERTS_KEY) == "combine"]:
        region: set[fx.Node] = set()
        operands: dict[str, fx.Node] = {}
        todo = [combine]
        while todo:
            for inp in todo.pop().all_input_nodes:
                part = annotation(inp).get(EXPERTS_KEY)
                if part == "body" and inp not in region:
                    region.add(inp)
                    todo.append(inp)
                elif part in OPERANDS:
                    operands[part] = inp
        # marked nodes no input path reaches: in-place writes to the block's own tensors
        region.update(u for n in list(region) for u in n.users if annotation(u).get(EXPERTS_KEY) == "body")
        if set(operands) != set(OPERANDS):
            raise PassError(
                f"fuse: the experts block of '{combine.name}' lost its {sorted(set(OPERANDS) - set(operands))} "
                "operand(s); please report this as a bug."
            )
        if any(u not in region and u is not combine for n in region for u in value_users(n)):
            continue  # an intermediate escapes the experts block: not safe to replace
        for user in list(combine.users):
            if user.target is _aten._assert_tensor_metadata.default:
                graph.erase_node(user)
        _swap_in(graph, combine, "moe", tuple(operands[p] for p in OPERANDS), ROLE_MOE)
        _erase_dead(graph, region | {combine})
        count += 1
    return count
