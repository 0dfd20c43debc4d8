"""The annotated layer graph that passes read and rewrite.

A :class:`LayerGraph` is the captured FX ``GraphModule`` of a source model (its graph plus
the source parameters, shared, never copied), a per-layer description of the residual
structure (:class:`LayerInfo`), the new parameters that passes declared, and, once a
looping pass ran, one straight-line FX graph per budget (the *budget paths*).

Every node carries ``node.meta["looptool"] = {"layer": int | None, "role": str}``. Passes
read roles and layer indices, never module names: all per-architecture knowledge stays in
:mod:`looptool.capture`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from looptool.core.errors import PassError

META_KEY = "looptool"

# Roles a node can have.
ROLE_INPUT = "input"
ROLE_PARAM = "param"
ROLE_EMBEDDING = "embedding"
ROLE_PROLOGUE = "prologue"  # masks, rotary tables: computed once, read by every layer
ROLE_ATTENTION = "attention"
ROLE_MLP = "mlp"
ROLE_MOE = "moe"
ROLE_ROUTER = "router"
ROLE_RESIDUAL = "residual"  # the adds that write a branch into the residual stream
ROLE_LAYER = "layer"  # other nodes of a layer that belong to no single branch
ROLE_FINAL_NORM = "final_norm"
ROLE_HEAD = "head"
ROLE_OUTPUT = "output"
ROLE_GATE = "gate"  # nodes added by a looping pass to gate a second-pass write
ROLE_SHAPE = "shape"  # symbolic-size arithmetic (SymInt values), shared by all layers
ROLE_STATE = "state"  # recurrent-state update nodes added by the recurrence pass (ELR Eq. 2)
ROLES = frozenset(
    {
        ROLE_INPUT,
        ROLE_PARAM,
        ROLE_EMBEDDING,
        ROLE_PROLOGUE,
        ROLE_ATTENTION,
        ROLE_MLP,
        ROLE_MOE,
        ROLE_ROUTER,
        ROLE_RESIDUAL,
        ROLE_LAYER,
        ROLE_FINAL_NORM,
        ROLE_HEAD,
        ROLE_OUTPUT,
        ROLE_GATE,
        ROLE_SHAPE,
        ROLE_STATE,
    }
)
WRITE_KINDS = (ROLE_ATTENTION, ROLE_MLP, ROLE_MOE)
# On a parameter's ``get_attr`` nodes (set by capture): True when the tensor is a normalisation's
# scale or shift (pre-, post-, q/k- or final norm), so no later stage re-derives it.
NORM_PARAM_KEY = "norm_param"

FORM_SEQUENTIAL = "sequential"  # u = h + A(h); v = u + M(u)  (pre-norm or post-norm branch)
FORM_PARALLEL = "parallel"  # v = h + A(h) + M(h)  (GPT-NeoX, GPT-J)


@dataclass(frozen=True)
class Write:
    """One branch write into the residual stream: ``add`` consumes ``node`` as its addend."""

    node: str
    add: str
    kind: str  # one of WRITE_KINDS
    norm: str | None = None  # the branch's normalised input (pre-norm); None if it reads the stream raw


@dataclass(frozen=True)
class LayerInfo:
    """Residual structure of one decoder layer, by node name in the captured graph."""

    index: int
    nodes: tuple[str, ...]
    input: str
    output: str
    writes: tuple[Write, ...]
    form: str

    def write(self, kind: str) -> Write | None:
        """The write of the given kind, or None."""
        return next((w for w in self.writes if w.kind == kind), None)


@dataclass(frozen=True)
class NewParam:
    """A parameter a pass adds under the ``loop.`` namespace."""

    name: str  # full dotted name, starting with "loop."
    shape: tuple[int, ...]
    init: str = "zeros"  # "zeros", "fill" (every element = value) or "normal" (std = value)
    no_decay: bool = False
    value: float = 0.0
    # a gate some looped computation writes through (zero at conversion: that computation is
    # then the identity); the trainer's gate floor keeps these open (LoopedModel.gate_parameters)
    gate: bool = False


@dataclass(frozen=True)
class SourceInfo:
    """What the capture was specialised to (torch.export bakes dtype and device into the graph)."""

    model_type: str
    dtype: str
    device: str
    attn_implementation: str | None
    num_layers: int
    hidden_size: int
    layers_path: str
    mask_dtype: str = "torch.int64"
    # Architecture facts the passes and the runtime need, recorded once by capture so that no
    # other module reads the Hugging Face config (None where the architecture has none).
    norm_eps: float | None = None  # the RMSNorm epsilon of the source's layers
    num_experts: int | None = None  # routed experts per MoE layer
    experts_per_token: int | None = None  # top-k of the MoE router
    kv_heads: int = 0  # key/value heads of one attention layer
    head_dim: int = 0


ROWWISE = "rowwise"  # the row-wise-budget path's key beside the integer budgets: LayerGraph.paths, engine manifests
ADAPTIVE = "adaptive"  # the adaptive-depth path's key beside the integer budgets: LayerGraph.paths, engines' graphs
BUDGETS = "budgets"  # the row-wise path's extra input: int64 [batch], each row's budget
# the step inputs of a cached decode path, in the order of the decode interface of exported engines
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position")
ROWWISE_STEP_INPUTS = (*STEP_INPUTS, BUDGETS)  # the row-wise path: each row's budget after the step inputs


@dataclass
class LayerGraph:
    """A captured model plus its layer annotations, declared new parameters and budget paths.

    Passes treat a LayerGraph as immutable: they return a new one (:meth:`replace`) whose
    graphs are new objects; the parameter-holding ``module`` is shared, never copied.
    """

    module: fx.GraphModule
    layers: tuple[LayerInfo, ...]
    source: SourceInfo
    config: Any = None
    new_params: tuple[NewParam, ...] = ()
    paths: dict[int, fx.Graph] = field(default_factory=dict)
    recipe: tuple[tuple[str, dict], ...] = ()
    plan: Any = None
    # every pass the PassManager applied, replayable or not, in order: what its ordering
    # declarations are checked against (the recipe holds the replayable ones with configs)
    applied: tuple[str, ...] = ()

    @property
    def graph(self) -> fx.Graph:
        """The captured source graph (budget paths are built from it)."""
        return self.module.graph

    def replace(self, **changes: Any) -> LayerGraph:
        """A shallow copy with some fields replaced (passes use this to stay pure)."""
        return dataclasses.replace(self, **changes)

    def node_map(self, graph: fx.Graph | None = None) -> dict[str, fx.Node]:
        """Name → node for ``graph`` (default: the captured graph)."""
        return {n.name: n for n in (graph or self.graph).nodes}


def parameter_reader_roles(graph: fx.Graph) -> dict[str, set[str]]:
    """Parameter/buffer name → the roles of the nodes that read it in ``graph`` (through
    its ``get_attr`` node): how a pass or the trainer tells an embedding from a head
    without reading architecture-specific names."""
    out: dict[str, set[str]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            out.setdefault(str(node.target), set()).update(annotation(u).get("role") for u in node.users)
    return out


def annotation(node: fx.Node) -> dict:
    """The looptool annotation of a node (layer index and role)."""
    return node.meta.get(META_KEY, {})


def annotate(node: fx.Node, role: str, layer: int | None, **extra: Any) -> None:
    """Set a node's annotation; a fresh dict so copied nodes never share it."""
    node.meta[META_KEY] = {"role": role, "layer": layer, **extra}


def verify_graph(graph: fx.Graph, where: str) -> None:
    """Lint an FX graph and check that every node carries a valid looptool annotation."""
    try:
        graph.lint()
    except Exception as exc:  # fx raises RuntimeError with the offending node
        raise PassError(f"{where}: the graph is malformed ({exc}).") from exc
    for node in graph.nodes:
        ann = node.meta.get(META_KEY)
        if ann is None or ann.get("role") not in ROLES:
            raise PassError(
                f"{where}: node '{node.name}' ({node.target}) has no valid looptool role "
                f"annotation; every pass must annotate the nodes it creates."
            )


def verify_layer_graph(lg: LayerGraph, where: str) -> None:
    """Check a LayerGraph after a pass: graphs lint, roles present, layer info consistent."""
    verify_graph(lg.graph, f"{where} (captured graph)")
    names = lg.node_map()
    for info in lg.layers:
        for name in (info.input, info.output, *(w.node for w in info.writes)):
            if name not in names:
                raise PassError(f"{where}: layer {info.index} refers to missing node '{name}'.")
    declared = {p.name for p in lg.new_params}
    for budget, graph in lg.paths.items():
        verify_graph(graph, f"{where} (budget {budget} path)")
        for node in graph.nodes:
            if node.op == "get_attr" and str(node.target).startswith("loop."):
                if node.target not in declared:
                    raise PassError(f"{where}: budget {budget} reads '{node.target}', which no pass declared.")


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` or ``"float32"`` → ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def float_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` (a torch dtype or its name) as a floating-point dtype a looped model can run
    in, or one sentence (a :class:`~looptool.core.errors.LooptoolError`)."""
    from looptool.core.errors import LooptoolError

    try:
        value = dtype_from_str(dtype) if isinstance(dtype, str) else dtype
    except ValueError:
        value = None
    if value not in FLOAT_DTYPES:
        raise LooptoolError(
            f"dtype {dtype!r} is not a floating-point dtype a looped model can run in; "
            "use float32, float16 or bfloat16."
        )
    return value


def subgraph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """``nodes`` (in graph order) copied into a graph of ``inputs`` (placeholders ``in0``, ...,
    each with its node's meta) that returns the tuple of ``outputs``' copies."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}")
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return graph


def copy_graph(graph: fx.Graph, transform=None) -> fx.Graph:
    """A new graph with the same nodes (meta shallow-copied, annotations preserved).

    ``transform(node, args, kwargs) -> (args, kwargs)`` may rewrite each node's arguments.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if transform is not None:
            args, kwargs = transform(node, args, kwargs)
        env[node] = copy_node(new, node, args, kwargs)
    return new


def copy_node(graph: fx.Graph, node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """``graph.node_copy(node)`` with the copy's arguments given (already mapped into
    ``graph``): the same node, name, type and shallow-copied metadata.

    It creates the node bare and sets its arguments after, which skips the scan
    ``Graph.create_node`` makes of every argument for raw ``SymInt`` values (a pytree walk,
    most of the time of copying a graph) that a node of an existing graph passed already.
    """
    copied = graph.create_node(node.op, node.target, (), {}, node.name, node.type)
    if args:
        copied.args = tuple(args)
    if kwargs:
        copied.kwargs = dict(kwargs)
    copied.meta = copy.copy(node.meta)
    return copied


def lazy_graph_module(root: torch.nn.Module | dict, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when first needed (a
    call, ``.code``), not at construction: capture and load build several modules of the
    whole source graph that no one runs (about 0.25 s each for SmolLM2)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # older torch: generate it now
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def shared_graph_module(
    owner: torch.nn.Module, graph: fx.Graph, *, lazy: bool = False, bodies: dict[str, fx.GraphModule] | None = None
) -> fx.GraphModule:
    """A GraphModule running ``graph`` whose attributes are ``owner``'s own submodules
    (``lazy``: its code generated on first use, :func:`lazy_graph_module`), except the
    higher-order-op bodies named in ``bodies``, which are those (see :func:`own_bodies`).

    ``fx.GraphModule`` would otherwise build fresh intermediate modules; re-pointing the
    top-level children at ``owner``'s makes every path read the very same parameter and
    buffer objects (one copy of the weights), even after they are re-bound on load.
    """
    root = owner
    if bodies:  # owner's children and tensors, with these bodies in place of any of the same name
        root = torch.nn.Module()
        root._modules = {**owner._modules, **bodies}
        root._parameters, root._buffers = owner._parameters, owner._buffers
    gm = lazy_graph_module(root, graph) if lazy else fx.GraphModule(root, graph)
    for name in list(gm._modules):
        gm._modules[name] = root._modules[name]
    return gm


def own_bodies(module: torch.nn.Module, graph: fx.Graph) -> dict[str, fx.GraphModule]:
    """The higher-order-op bodies (top-level GraphModule children of ``module``) that
    ``graph`` reads, by name: what a graph captured apart from its owner must keep when it is
    bound to that owner's tensors."""
    found = {}
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(module._modules.get(str(node.target)), fx.GraphModule):
            found[str(node.target)] = module._modules[str(node.target)]
    return found


def is_call(node: Any, target: Any) -> bool:
    """Whether ``node`` is an FX node calling ``target``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def value_users(node: fx.Node) -> list[fx.Node]:
    """The users that consume ``node``'s value (export's dtype/shape assertions do not)."""
    return [u for u in node.users if u.target is not torch.ops.aten._assert_tensor_metadata.default]


def device_swap(src: torch.device, dst: torch.device):
    """A :func:`copy_graph` transform replacing every ``torch.device`` argument equal to
    ``src`` (in ``arange(device=...)``, ``to(device=...)`` and the like) by ``dst``."""

    def swap(value):
        if isinstance(value, torch.device) and value == src:
            return dst
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    def transform(node, args, kwargs):
        return swap(tuple(args)), {k: swap(v) for k, v in kwargs.items()}

    return transform


def retarget_bodies(module: torch.nn.Module, transform) -> None:
    """Replace ``module``'s GraphModule children (the bodies of higher-order ops, e.g. a
    rotary embedding under ``torch.autocast(enabled=False)`` in some transformers versions)
    by copies whose graphs ``transform`` rewrote; the originals are untouched."""
    for name, child in list(module._modules.items()):
        if isinstance(child, fx.GraphModule):
            new = fx.GraphModule(child, copy_graph(child.graph, transform))
            retarget_bodies(new, transform)
            module._modules[name] = new
