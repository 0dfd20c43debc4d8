"""Compose budget graphs from layer functions: each distinct layer body is exported once.

A budget path is a sequence of the same few layer bodies (a layer's own pass, a repeated
layer's gated second pass, loop ``i`` of a recurrent block) over different weights. Tracing
every budget from scratch re-exports each body dozens of times. Instead:

1. every layer application of a serving graph is outlined (the ``checkpoint`` pass's
   regions, weights entering as inputs); symbolic sizes a region reads from outside are
   recomputed inside it from tensors, so a body depends on tensors only;
2. bodies with the same code (op for op, same weight shapes) get one key; the outer graph
   calls ``looptool::layer_call(inputs, key)`` instead (an opaque op whose fake kernel runs
   the body, so the exporter sees only the glue: embedding, masks, rotary tables, the ELR
   state updates, the head);
3. each distinct body is exported once with ``torch.onnx.export`` and becomes an ONNX
   function ``looptool.layers::Layer<k>``; each outer graph is exported (seconds) and its
   ``layer_call`` nodes become calls of those functions.

onnxruntime inlines model-local functions when it loads a graph, so the composed graph
runs (and is optimised) exactly like the flat one; the files stay small. The export of a
graph falls back to the flat path if composing it fails; validation checks either.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx
import torch
from torch import fx

from looptool.backends.serving import INPUTS, ServingGraph
from looptool.errors import LooptoolError

log = logging.getLogger(__name__)

LAYER_DOMAIN = "looptool.layers"
_TRACE_DOMAIN = "looptool.trace"  # placeholder nodes between the outer export and composing
# Example sizes for the one eager run that records each body's inputs. Distinct odd values
# that no model dimension is likely to equal, so the body exports keep them symbolic.
EXAMPLE_BATCH, EXAMPLE_STEP, EXAMPLE_CAPACITY = 11, 7, 19
_ACTIVE: dict[int, LayerBody] = {}  # bodies reachable by the layer_call op during an export


class ComposeError(LooptoolError):
    """A graph could not be composed from layer functions (the flat export is used)."""


@torch.library.custom_op("looptool::layer_call", mutates_args=())
def layer_call(inputs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """Run layer body ``key`` (export-time only; see :class:`LayerLibrary`)."""
    body = _body(key)
    outputs = body.module(*inputs)
    if body.example is None:
        body.example = [t.detach().clone() for t in inputs]
    return [o.clone() for o in outputs]


@layer_call.register_fake
def _layer_call_fake(inputs, key):
    return list(_body(key).module(*inputs))


def _body(key: int) -> LayerBody:
    if key not in _ACTIVE:
        raise ComposeError(f"layer body {key} is not registered (layer_call runs only inside LayerLibrary.active()).")
    return _ACTIVE[key]


@dataclass
class LayerBody:
    """One distinct layer body: an FX graph of tensors (weights are inputs)."""

    index: int
    graph: fx.Graph
    weights: tuple[bool, ...]  # which inputs are model tensors (static shapes)
    module: fx.GraphModule = field(init=False)
    example: list[torch.Tensor] | None = None
    function: onnx.FunctionProto | None = None
    functions: list[onnx.FunctionProto] = field(default_factory=list)  # looptool functions it calls
    seconds: float = 0.0

    def __post_init__(self):
        self.module = fx.GraphModule(torch.nn.Module(), self.graph)

    @property
    def name(self) -> str:
        """The ONNX function name."""
        return f"Layer{self.index}"


class LayerLibrary:
    """The distinct layer bodies of a set of serving graphs, each exported once."""

    def __init__(self):
        self.bodies: dict[str, LayerBody] = {}

    def outline(self, sg: ServingGraph) -> fx.GraphModule:
        """The serving graph with every layer application replaced by a ``layer_call``."""
        from looptool.graph import shared_graph_module
        from looptool.passes.checkpoint import Region, checkpoint_regions

        outer = checkpoint_regions(sg.module.graph, checkpoint=False)
        for node in list(outer.nodes):
            if node.op == "call_function" and isinstance(node.target, Region):
                inputs, body = _tensor_body(outer, node)
                weights = tuple(i.op == "get_attr" for i in inputs)
                key = _canonical(body, [i.meta.get("val") for i in inputs], weights)
                entry = self.bodies.get(key)
                if entry is None:
                    entry = self.bodies[key] = LayerBody(len(self.bodies), body, weights)
                node.target = torch.ops.looptool.layer_call.default
                node.args = (list(inputs), entry.index)
        outer.eliminate_dead_code()
        outer.lint()
        return shared_graph_module(sg.module, outer)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the bodies callable by ``layer_call`` (the op's fake kernel runs them)."""
        by_index = {b.index: b for b in self.bodies.values()}
        clash = set(_ACTIVE) & set(by_index)
        if clash:
            raise ComposeError("another layer library is active in this process; compose one export at a time.")
        _ACTIVE.update(by_index)
        try:
            yield
        finally:
            for index in by_index:
                _ACTIVE.pop(index, None)

    def record_examples(self, outer: fx.GraphModule, layout) -> None:
        """Run ``outer`` once on example inputs so every body it calls records its inputs."""
        if all(b.example is not None for b in self.bodies.values()):
            return
        with self.active(), torch.no_grad():
            outer(*example_inputs(outer, layout))

    def export_functions(self, export) -> None:
        """Export every body not yet exported: ``export(module, example, dynamic_shapes)``
        returns an ``onnx_ir`` model, turned here into an ONNX function."""
        for body in self.bodies.values():
            if body.function is not None:
                continue
            if body.example is None:
                raise ComposeError(f"layer body {body.index} has no example inputs; record them first.")
            t0 = time.perf_counter()
            shapes = [None if w else _dims(t, body) for t, w in zip(body.example, body.weights)]
            model = export(body.module, tuple(body.example), shapes)
            _check_symbolic(model, body)
            body.function, body.functions = _as_function(model, body.name)
            body.seconds = time.perf_counter() - t0
            log.info("exported layer body %d (%d nodes) in %.1f s", body.index, len(body.function.node), body.seconds)

    def compose(self, onnx_model) -> dict[str, int]:
        """Swap the ``layer_call`` placeholder nodes of an exported outer graph for calls of
        the layer functions and add the functions; returns calls per function."""
        import onnx_ir as ir

        by_index = {b.index: b for b in self.bodies.values()}
        counts: dict[str, int] = {}
        used: dict[int, LayerBody] = {}
        for node in list(onnx_model.graph):
            if node.domain != _TRACE_DOMAIN:
                continue
            body = by_index[node.attributes["key"].value]
            node.domain, node.op_type = LAYER_DOMAIN, body.name
            node.attributes.pop("key")
            used[body.index] = body
            counts[body.name] = counts.get(body.name, 0) + 1
        for body in used.values():
            for proto in [body.function, *body.functions]:
                fn = ir.serde.deserialize_function(proto)
                onnx_model.functions.setdefault(fn.identifier(), fn)
                for domain, version in fn.opset_imports.items():
                    onnx_model.opset_imports.setdefault(domain, version)
        if used:
            onnx_model.opset_imports[LAYER_DOMAIN] = 1
        return counts


def translation() -> dict:
    """Custom translation for ``layer_call``: one placeholder node per call, later replaced
    by a function call (:meth:`LayerLibrary.compose`)."""
    import onnxscript

    trace = onnxscript.values.Opset(_TRACE_DOMAIN, 1)

    def _layer_call(inputs, key):
        outputs = len(_body(key).module.graph.output_node().args[0])
        return getattr(trace, _trace_schema(len(inputs), outputs))(*inputs, key=key)

    return {torch.ops.looptool.layer_call.default: _layer_call}


def _trace_schema(inputs: int, outputs: int) -> str:
    """Register (once) the schema of a placeholder op with this many inputs and outputs."""
    from onnx import defs

    name = f"Call{inputs}x{outputs}"
    if not defs.has(name, _TRACE_DOMAIN):
        tensor_types = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)", "tensor(int64)",
                        "tensor(int32)", "tensor(bool)"]
        schema = defs.OpSchema(
            name, _TRACE_DOMAIN, 1,
            inputs=[defs.OpSchema.FormalParameter(f"i{i}", f"T{i}") for i in range(inputs)],
            outputs=[defs.OpSchema.FormalParameter(f"o{i}", f"U{i}") for i in range(outputs)],
            type_constraints=[(f"T{i}", tensor_types, "") for i in range(inputs)]
            + [(f"U{i}", tensor_types, "") for i in range(outputs)],
            attributes=[defs.OpSchema.Attribute("key", defs.OpSchema.AttrType.INT, "layer body")],
        )
        defs.register_schema(schema)
    return name


def example_inputs(outer: fx.GraphModule, layout) -> list[torch.Tensor]:
    """A prefill step of ``EXAMPLE_STEP`` tokens for ``EXAMPLE_BATCH`` rows into caches of
    ``EXAMPLE_CAPACITY`` slots, on the graph's device and in the layout's dtype."""
    device = next((p.device for p in outer.parameters()), torch.device("cpu"))
    b, t, s = EXAMPLE_BATCH, EXAMPLE_STEP, EXAMPLE_CAPACITY
    placeholders = [n for n in outer.graph.nodes if n.op == "placeholder"]
    mask_dtype = placeholders[1].meta["val"].dtype if "val" in placeholders[1].meta else torch.long
    mask = torch.zeros(b, s, dtype=mask_dtype, device=device)
    mask[:, :t] = 1
    ids = torch.randint(0, 2, (b, t), generator=torch.Generator().manual_seed(0)).to(device)  # valid in any vocab
    dtype = getattr(torch, layout.dtype)
    caches = [torch.zeros(b, p.kv_heads, s, p.head_dim, dtype=dtype, device=device)
              for p in layout.pairs for _ in "kv"]
    steps = torch.arange(t, device=device)
    return [ids, mask, steps.expand(b, t), steps, *caches]


def _tensor_body(outer: fx.Graph, call: fx.Node) -> tuple[list[fx.Node], fx.Graph]:
    """``(tensor inputs, body graph)`` of one region call; symbolic sizes the region reads
    from outside are recomputed in the body from tensors (added as inputs if needed)."""
    region = call.target
    args = list(call.args)
    inputs: list[fx.Node] = [a for a in args if _is_tensor(a)]
    chains: list[fx.Node] = []
    for arg in args:
        if not _is_tensor(arg):
            _symbolic_chain(arg, chains, inputs)
    order = {n: i for i, n in enumerate(outer.nodes)}
    chains.sort(key=order.__getitem__)
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = body.placeholder(f"in{i}")
        env[node].meta = dict(node.meta)
    for node in chains:
        env[node] = body.node_copy(node, lambda n: env[n])
    inner = {p: a for p, a in zip((n for n in region.graph.nodes if n.op == "placeholder"), args)}
    for node in region.graph.nodes:
        if node.op == "placeholder":
            env[node] = env[inner[node]]
        else:
            env[node] = body.node_copy(node, lambda n: env[n])
    return inputs, body


def _is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and (node.op == "get_attr" or isinstance(node.meta.get("val"), torch.Tensor)
                                          or node.meta.get("val") is None)


def _symbolic_chain(node: fx.Node, chain: list[fx.Node], inputs: list[fx.Node]) -> None:
    """Collect the nodes computing symbolic size ``node`` from tensors (which join ``inputs``)."""
    if node in chain or node in inputs:
        return
    if not isinstance(node, fx.Node) or node.op != "call_function":
        raise ComposeError(f"a layer reads the symbolic size '{node}' that is not computed from tensors.")
    chain.append(node)
    for source in node.all_input_nodes:
        if _is_tensor(source):
            if source not in inputs:
                inputs.append(source)
        else:
            _symbolic_chain(source, chain, inputs)


def _canonical(body: fx.Graph, vals: list, weights: tuple[bool, ...]) -> str:
    """A key equal for bodies with the same code and the same weight shapes."""
    index: dict[fx.Node, int] = {}
    parts: list[str] = []
    for i, node in enumerate(body.nodes):
        index[node] = i
        if node.op == "placeholder":
            j = len([n for n in index if n.op == "placeholder"]) - 1
            val = vals[j]
            shape = tuple(val.shape) if weights[j] and isinstance(val, torch.Tensor) else None
            parts.append(f"P{weights[j]}{getattr(val, 'dtype', None)}{shape}")
            continue
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        parts.append(f"{node.op}:{_target_name(node.target)}:{args}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__qualname__', None) or target}"


def _dims(example: torch.Tensor, body: LayerBody) -> dict:
    """Named dynamic dims of one activation input, recognised by their example sizes."""
    from torch.export import Dim

    names = {EXAMPLE_BATCH: "batch", EXAMPLE_STEP: "step", EXAMPLE_CAPACITY: "capacity"}
    derived = {EXAMPLE_BATCH * EXAMPLE_STEP, EXAMPLE_BATCH * EXAMPLE_CAPACITY, EXAMPLE_STEP * EXAMPLE_CAPACITY,
               EXAMPLE_BATCH * EXAMPLE_STEP * EXAMPLE_CAPACITY}
    out = {}
    for d, size in enumerate(example.shape):
        if size in derived:
            raise ComposeError(f"layer body {body.index} reads a tensor with a flattened dynamic dimension ({size}); using the flat export.")
        if size in names:
            out[d] = _DIMS.setdefault(names[size], Dim(names[size]))
    return out


_DIMS: dict = {}  # one Dim object per name, so equal names are one symbol within an export


def _check_symbolic(model, body: LayerBody) -> None:
    """Refuse a body export that specialised a batch, step or capacity dimension."""
    dynamic = {EXAMPLE_BATCH, EXAMPLE_STEP, EXAMPLE_CAPACITY}
    for value, tensor, weight in zip(model.graph.inputs, body.example, body.weights):
        if weight or value.shape is None:
            continue
        for dim, size in zip(value.shape, tensor.shape):
            if isinstance(dim, int) and size in dynamic:
                raise ComposeError(f"layer body {body.index} was exported with a fixed size {size}; using the flat export.")


def _as_function(model, name: str) -> tuple[onnx.FunctionProto, list[onnx.FunctionProto]]:
    """An exported body model as an ONNX function (initializers become Constant nodes)."""
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)
    graph = proto.graph
    constants = [onnx.helper.make_node("Constant", [], [init.name], value=init) for init in graph.initializer]
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    if set(outputs) & set(inputs):
        raise ComposeError(f"layer body {name} returns one of its inputs unchanged; using the flat export.")
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in proto.opset_import]
    function = onnx.helper.make_function(LAYER_DOMAIN, name, inputs, outputs, [*constants, *graph.node], opsets)
    return function, list(proto.functions)


def export_quietly(call):
    """Run an exporter call with its chatty warnings about axis names filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*axis name.*", category=UserWarning)
        return call()
