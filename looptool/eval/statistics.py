"""Reading a budget path for :mod:`looptool.eval.analyze` and accumulating its statistics.

The graph readers find what the analysis measures by annotation alone (layer applications,
the logit lens, repeated layers, gated writes); the accumulators keep per-token running
means and histograms over batches (the conventions of :mod:`looptool.eval.analyze`), and
:class:`Recorder` runs a path node by node, handing chosen values to probes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from looptool.core.errors import LooptoolError
from looptool.core.graph import ROLE_FINAL_NORM, ROLE_GATE, ROLE_HEAD, ROLE_RESIDUAL, ROLE_SHAPE, annotation
from looptool.passes.checkpoint import application_members


class AnalysisError(LooptoolError):
    """A path whose annotations do not support the requested statistic."""


# --------------------------------------------------------------------------- graph reading
@dataclass(frozen=True)
class Application:
    """One execution of a decoder layer in a budget path: ``execution`` is 2 for a repeated
    layer's second pass, ``i`` for loop ``i`` of a recurrent block, else 1; ``output`` is
    the residual-stream value it leaves (the layer's last residual add)."""

    layer: int
    execution: int
    output: fx.Node

    def as_dict(self) -> dict:
        return {"layer": self.layer, "execution": self.execution}


def layer_applications(graph: fx.Graph) -> list[Application]:
    """Every layer application of ``graph`` in execution order, found by annotation: the
    nodes of one ``(layer, execution)`` and the residual add among them that something
    outside the application reads."""
    apps = []
    for (layer, execution), members in application_members(graph).items():
        inside = set(members)
        outs = [
            n for n in members if annotation(n).get("role") == ROLE_RESIDUAL and any(u not in inside for u in n.users)
        ]
        if len(outs) != 1:
            raise AnalysisError(
                f"layer {layer} (execution {execution}) of this path leaves {len(outs)} residual values "
                "instead of one; its residual stream cannot be read."
            )
        apps.append(Application(layer, execution, outs[0]))
    return apps


def lens_graph(graph: fx.Graph) -> tuple[fx.Graph, fx.Node, list[fx.Node]]:
    """The path's own final norm and LM head as a graph of the residual stream (the
    logit lens): ``(lens, stream, extras)`` where ``lens(stream_value, *extra_values)``
    returns the logits, ``stream`` is the node the head reads in ``graph`` and ``extras``
    are the other values it reads there (symbolic sizes), passed in as they were."""
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    members = {n for n in graph.nodes if annotation(n).get("role") in (ROLE_FINAL_NORM, ROLE_HEAD)}
    if outs[0] not in members:
        raise AnalysisError(
            "this path's logits are not computed by nodes annotated as the final norm and head; "
            "the logit lens needs them."
        )
    needed: set[fx.Node] = set()
    stack = [outs[0]]
    while stack:
        node = stack.pop()
        if node in members and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    reads = list(dict.fromkeys(i for n in graph.nodes if n in needed for i in n.all_input_nodes if i not in needed))
    extras = [n for n in reads if n.op == "placeholder" or annotation(n).get("role") == ROLE_SHAPE]
    streams = [n for n in reads if n.op != "get_attr" and n not in extras]
    if len(streams) != 1:
        raise AnalysisError(
            f"the final norm reads {len(streams)} residual-stream values instead of one; "
            "the logit lens cannot be built for this path."
        )
    lens = fx.Graph()
    env = {streams[0]: lens.placeholder("stream")}
    env.update({n: lens.placeholder(f"extra{i}") for i, n in enumerate(extras)})
    for node in graph.nodes:
        if node in needed or (node.op == "get_attr" and node in reads):
            env[node] = lens.node_copy(node, lambda a: env[a])
    lens.output(env[outs[0]])
    return lens, streams[0], extras


def repeated_layers_of(graph: fx.Graph) -> list[int]:
    """The layers a budget path runs twice (annotated ``repeat=2``)."""
    return sorted(
        {
            annotation(n)["layer"]
            for n in graph.nodes
            if annotation(n).get("repeat") == 2 and isinstance(annotation(n).get("layer"), int)
        }
    )


def gated_write_parts(gated: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``(tanh(g), raw write)`` of a gated second-pass write ``tanh(g) * write``."""
    gate = [a for a in gated.args if isinstance(a, fx.Node) and annotation(a).get("role") == ROLE_GATE]
    raw = [a for a in gated.args if isinstance(a, fx.Node) and annotation(a).get("role") != ROLE_GATE]
    if len(gate) != 1 or len(raw) != 1:
        raise AnalysisError(f"the gated write '{gated.name}' is not tanh(g) * write; cannot split it.")
    return gate[0], raw[0]


# --------------------------------------------------------------------------- accumulation
class Mean:
    """A running mean (float64 sums)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def add(self, values: torch.Tensor) -> None:
        self.total += float(values.double().sum())
        self.count += values.numel()

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-token L2 norm over the hidden (last) dimension."""
    return x.float().reshape(-1, x.shape[-1]).norm(dim=-1)


def token_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token cosine over the hidden (last) dimension."""
    a, b = torch.broadcast_tensors(a.float(), b.float())
    return F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1, eps=1e-8)


def kept_experts(first: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Per token, how many of its ``first`` top-k experts ``later`` selects again."""
    k = first.shape[-1]
    a, b = first.reshape(-1, k), later.reshape(-1, later.shape[-1])
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


@dataclass
class Overlap:
    """Expert overlap between two executions of one router — Accordion's "routed experts the
    second pass keeps from the first" (and ELR's experts a later loop keeps from loop 1): per
    token ``|S_first ∩ S_later|`` of the top-k sets, accumulated as a histogram over 0..k."""

    top_k: int = 0
    counts: torch.Tensor | None = None

    def add(self, first: torch.Tensor, later: torch.Tensor) -> None:
        self.top_k = first.shape[-1]
        hist = torch.bincount(kept_experts(first, later).cpu(), minlength=self.top_k + 1)
        self.counts = hist if self.counts is None else self.counts + hist

    def as_dict(self) -> dict | None:
        if self.counts is None:
            return None
        total = int(self.counts.sum())
        mean = float((self.counts * torch.arange(self.top_k + 1)).sum()) / total
        return {
            "top_k": self.top_k,
            "kept_mean": mean,
            "kept_fraction": mean / self.top_k,
            "kept_histogram": [float(c) / total for c in self.counts],
        }


@dataclass
class WriteStats:
    """First- vs second-pass write of one kind in one repeated layer — Accordion's "second-pass
    writes are comparable in size to first-pass writes but nearly orthogonal": mean per-token
    norms of both (and of the gated write ``tanh(g) ⊙ w₂``, Eq. 5), their ratio, the mean
    per-token cosines, and the mean ``|tanh(g)|``."""

    first_norm: Mean = field(default_factory=Mean)
    second_norm: Mean = field(default_factory=Mean)
    gated_norm: Mean = field(default_factory=Mean)
    cosine: Mean = field(default_factory=Mean)
    gated_cosine: Mean = field(default_factory=Mean)
    gate_abs: Mean = field(default_factory=Mean)

    def as_dict(self) -> dict:
        n1, n2, ng = self.first_norm.value, self.second_norm.value, self.gated_norm.value
        return {
            "first_norm": n1,
            "second_norm": n2,
            "gated_norm": ng,
            "norm_ratio": n2 / n1 if n1 else None,
            "gated_norm_ratio": ng / n1 if n1 else None,
            "cosine": self.cosine.value,
            "gated_cosine": self.gated_cosine.value,
            "gate_mean_abs": self.gate_abs.value,
        }


class Recorder(fx.Interpreter):
    """Runs a budget path node by node and hands chosen values to probes:
    ``probes[node]`` are called as ``probe(value, env)`` right after ``node`` ran (``env``
    still holds the node's inputs)."""

    def __init__(self, gm: fx.GraphModule, probes: dict[fx.Node, list[Callable[[Any, dict], None]]]):
        super().__init__(gm)
        self.probes = probes

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        for probe in self.probes.get(n, ()):
            probe(value, self.env)
        return value


# --------------------------------------------------------------------------- per-token helpers
def state_update(stats: dict, prev: torch.Tensor, state: torch.Tensor) -> None:
    """``‖s_i − s_{i−1}‖`` and ``‖s_{i−1}‖`` per token (ELR Eq. 2's state update)."""
    stats.setdefault("update_norm", Mean()).add(token_norms(state - prev))
    stats.setdefault("prev_norm", Mean()).add(token_norms(prev))
    stats.setdefault("state_norm", Mean()).add(token_norms(state))


def exit_factor(stats: dict, factor: torch.Tensor) -> None:
    stats.setdefault("exit", Mean()).add(factor)
    stats.setdefault("exit_abs", Mean()).add(factor.abs())


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` against ``ids`` (as ``LoopedModel``)."""
    return ForCausalLMLoss(logits, ids, vocab_size=logits.shape[-1])


def predicted_tokens(ids: torch.Tensor) -> int:
    return ids.numel() - ids.shape[0]
