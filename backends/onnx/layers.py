"""Compose serving graphs from ONNX functions: each distinct body is exported once.

A budget path is a sequence of the same few layer bodies (a layer's own pass, a repeated
layer's gated second pass, loop ``i`` of a recurrent block) over different weights, with
the same prologue (embedding, masks, rotary tables) and epilogue (norm, head) around them.
Tracing every budget from scratch re-exports each body dozens of times. Instead:

1. the serving graph is cut into units: every layer application (the ``checkpoint``
   pass's regions) and every run of glue between them; weights enter as inputs, and
   symbolic sizes a unit reads from outside are recomputed inside it from tensors, so a
   body depends on tensors only;
2. units with the same code (op for op, same weight shapes) share one body;
3. each distinct body is exported once with ``torch.onnx.export`` (dynamic batch, step and
   capacity) and becomes the ONNX function ``looptool.layers::Layer<k>``;
4. the top-level graph is assembled directly: the interface inputs, the weights as
   initializers, one function call per unit, the interface outputs. Nothing is traced per
   budget.

onnxruntime inlines model-local functions when it loads a graph, so a composed graph runs
(and is optimised) like a flat one, and the files stay small. Export falls back to tracing
a graph flat when composing it fails; validation checks either.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx
import torch
from torch import fx

from looptool.backends.interface import BUDGETS, DEPTH, LOGITS, ServingGraph, example_extras
from looptool.backends.onnx import body_cache as onnx_body_cache
from looptool.backends.onnx.store import to_numpy
from looptool.core.dtypes import named, of_torch
from looptool.core.errors import LooptoolError
from looptool.passes.adaptive_depth import EXIT_THRESHOLD, MAX_BUDGET, MIN_BUDGET

log = logging.getLogger(__name__)

LAYER_DOMAIN = "looptool.layers"
# Example sizes for the one eager run that records each body's inputs: distinct odd values
# that no model dimension is likely to equal, so the body exports keep them symbolic.
EXAMPLE_BATCH, EXAMPLE_STEP, EXAMPLE_CAPACITY = 11, 7, 19
_DIM_NAMES = {EXAMPLE_BATCH: "batch", EXAMPLE_STEP: "step", EXAMPLE_CAPACITY: "capacity"}
_DERIVED = {
    EXAMPLE_BATCH * EXAMPLE_STEP,
    EXAMPLE_BATCH * EXAMPLE_CAPACITY,
    EXAMPLE_STEP * EXAMPLE_CAPACITY,
    EXAMPLE_BATCH * EXAMPLE_STEP * EXAMPLE_CAPACITY,
}


class ComposeError(LooptoolError):
    """A graph could not be composed from functions (the flat export is used)."""


@dataclass
class LayerBody:
    """One distinct body: an FX graph of tensors (weights are inputs)."""

    index: int
    graph: fx.Graph
    weights: tuple[bool, ...]  # which inputs are model tensors (static shapes)
    module: fx.GraphModule = field(init=False)
    example: list[torch.Tensor] | None = None
    function: onnx.FunctionProto | None = None
    functions: list[onnx.FunctionProto] = field(default_factory=list)  # looptool functions it calls
    seconds: float = 0.0
    fusions: dict[str, int] = field(default_factory=dict)  # onnxruntime fusions applied to it
    error: str | None = None  # why its export failed, if it did
    key: str = ""  # its key in the library

    def __post_init__(self):
        self.module = fx.GraphModule(torch.nn.Module(), self.graph)

    @property
    def name(self) -> str:
        """The ONNX function name."""
        return f"Layer{self.index}"


@dataclass
class Unit:
    """One call of a body in a composed graph: the FX nodes it replaces and what it reads."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]  # placeholders, weights or other units' outputs, in body-input order
    graph: fx.Graph  # the body graph built from ``nodes`` (before deduplication)
    outputs: list[fx.Node] = field(default_factory=list)
    body: LayerBody | None = None


@dataclass
class Composition:
    """A serving graph as an ordered list of body calls (see :meth:`LayerLibrary.partition`)."""

    graph: fx.Graph
    module: fx.GraphModule  # the serving graph's module (weights and constants)
    units: list[Unit]


class LayerLibrary:
    """The distinct bodies of a set of serving graphs, each exported once."""

    def __init__(self, *, ort_fusions: bool = False, fuse_ort: bool = False):
        self.bodies: dict[str, LayerBody] = {}
        self.ort_fusions = ort_fusions
        self.fuse_ort = fuse_ort  # lowered to onnxruntime's fused ops (looptool.backends.onnx.fuse_ort)

    def fusions(self) -> dict[str, dict[str, int]]:
        """onnxruntime fusions applied, per exported body."""
        return {b.name: b.fusions for b in self.bodies.values() if b.function is not None}

    def partition(self, sg: ServingGraph) -> Composition:
        """Cut ``sg`` into units (layer applications and the glue runs between them) and
        register their bodies; ``sg`` is built with ``unflatten=True`` (the
        ``unflatten_crossings`` pass: no flattened-token tensor crosses units). Reads ``sg``,
        rewrites nothing."""
        from looptool.passes.checkpoint import regions_of

        graph = sg.module.graph
        groups: list[list[fx.Node]] = list(regions_of(graph))
        in_layer = {n for region in groups for n in region}
        current: list[fx.Node] | None = None
        for node in graph.nodes:
            if node in in_layer:
                current = None  # a layer application ends a glue run
                continue
            if node.op != "call_function" or _is_symbolic(node):
                continue  # inputs, weights and sizes belong to no unit
            if current is None:
                current = []
                groups.append(current)
            current.append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        units = []
        for nodes in groups:
            nodes.sort(key=order.__getitem__)
            inputs, body = _unit_graph(nodes, order)
            units.append(Unit(nodes, inputs, body))
        wanted = {n for u in units for n in u.inputs} | set(_flatten(graph.output_node().args[0]))
        kept = []
        for unit in units:
            unit.outputs = [n for n in unit.nodes if n in wanted]
            if not unit.outputs:
                continue  # e.g. a lone metadata assertion
            _set_outputs(unit.graph, unit.outputs)
            weights = tuple(i.op == "get_attr" for i in unit.inputs)
            key = _canonical(unit.graph, [i.meta.get("val") for i in unit.inputs], weights)
            if key not in self.bodies:
                self.bodies[key] = LayerBody(len(self.bodies), unit.graph, weights, key=key)
            unit.body = self.bodies[key]
            kept.append(unit)
        return Composition(graph, sg.module, _topological(kept))

    def record_examples(self, comp: Composition, sg: ServingGraph) -> None:
        """Run the units once on example inputs so every body records its inputs. A unit whose
        inputs have other shapes than its body's recorded ones (same code over a shared ``[d]``
        vector in one graph and a per-row ``[batch, 1, d]`` one in the row-wise graph, whose
        nodes may carry no shape metadata) gets a body of its own."""
        placeholders = [n for n in comp.graph.nodes if n.op == "placeholder"]
        values: dict[fx.Node, torch.Tensor] = dict(zip(placeholders, example_inputs(comp, sg)))
        with torch.no_grad():
            for unit in comp.units:
                args = [values[i] if i in values else _fetch(comp.module, i) for i in unit.inputs]
                if unit.body.example is not None and _shapes(args) != _shapes(unit.body.example):
                    key = f"{unit.body.key}|{_shapes(args)}"
                    if key not in self.bodies:
                        self.bodies[key] = LayerBody(len(self.bodies), unit.graph, unit.body.weights, key=key)
                    unit.body = self.bodies[key]
                if unit.body.example is None:
                    unit.body.example = [a.detach().clone() for a in args]
                values.update(zip(unit.outputs, unit.body.module(*args)))

    def export_functions(self, comp: Composition, export: Callable) -> None:
        """Export the bodies ``comp`` calls that are not exported yet: ``export(module,
        example, dynamic_shapes)`` returns ``(onnx_ir model, fusion counts)`` (served from
        :mod:`looptool.backends.onnx.body_cache` for a body exported before); the model
        becomes an ONNX function. A body that cannot be exported fails every later call fast."""
        for body in {u.body.index: u.body for u in comp.units}.values():
            if body.function is not None:
                continue
            if body.error is not None:
                raise ComposeError(body.error)
            if body.example is None:
                raise ComposeError(f"body {body.index} has no example inputs; record them first.")
            t0 = time.perf_counter()
            try:
                shapes = [None if w else _dims(t, body) for t, w in zip(body.example, body.weights)]
                model, body.fusions = onnx_body_cache.cached(
                    export,
                    body.module,
                    body.example,
                    shapes,
                    code_key=body.key,
                    variant=f"ort_fusions={self.ort_fusions}" + (",fuse_ort" if self.fuse_ort else ""),
                )
                _check_symbolic(model, body)
                body.function, body.functions = _as_function(model, body.name)
            except Exception as exc:
                body.error = (
                    f"body {body.index}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                )
                raise
            body.seconds = time.perf_counter() - t0
            log.info("exported body %d (%d nodes) in %.1f s", body.index, len(body.function.node), body.seconds)

    def assemble(self, comp: Composition, sg: ServingGraph, opset: dict[str, int]):
        """The top-level ``onnx_ir`` model of a composition: interface inputs, weights as
        initializers, one function call per unit, interface outputs."""
        import onnx_ir as ir

        types = _interface_types(sg)
        placeholders = [n for n in comp.graph.nodes if n.op == "placeholder"]
        values: dict[fx.Node, ir.Value] = {}
        for node, name in zip(placeholders, sg.input_names):
            values[node] = ir.Value(name=name, type=ir.TensorType(types[name][0]), shape=ir.Shape(types[name][1]))
        graph_inputs = [values[n] for n in placeholders]
        initializers: dict[str, ir.Value] = {}
        nodes = []
        for unit in comp.units:
            args = []
            for i in unit.inputs:
                if i not in values:
                    if i.op != "get_attr":
                        raise ComposeError(f"unit input '{i.name}' is produced by no earlier unit.")
                    name = str(i.target)
                    if name not in initializers:
                        array = to_numpy(_fetch(comp.module, i))
                        initializers[name] = ir.Value(name=name, const_value=ir.tensor(array, name=name))
                    values[i] = initializers[name]
                args.append(values[i])
            call = ir.Node(
                LAYER_DOMAIN, unit.body.name, args, num_outputs=len(unit.outputs), name=f"call_{unit.outputs[-1].name}"
            )
            for node, out in zip(unit.outputs, call.outputs):
                out.name = node.name
                values[node] = out
            nodes.append(call)
        outputs = []
        for node, name in zip(_flatten(comp.graph.output_node().args[0]), sg.output_names):
            value = values[node]
            if value in outputs or value in graph_inputs:
                raise ComposeError(f"output '{name}' is not a distinct computed value.")
            value.name, value.type, value.shape = name, ir.TensorType(types[name][0]), ir.Shape(types[name][1])
            outputs.append(value)
        graph = ir.Graph(
            graph_inputs,
            outputs,
            nodes=nodes,
            initializers=list(initializers.values()),
            opset_imports={**opset, LAYER_DOMAIN: 1},
            name="looptool_serving",
        )
        model = ir.Model(graph, ir_version=10, producer_name="looptool")
        for body in {u.body.index: u.body for u in comp.units}.values():
            for proto in [body.function, *body.functions]:
                fn = ir.serde.deserialize_function(proto)
                model.functions.setdefault(fn.identifier(), fn)
                for domain, version in fn.opset_imports.items():
                    # onnxruntime resolves an inlined function's ops at the model's opset: the
                    # newest a body needs (opset-23 Attention in a fused body)
                    graph.opset_imports[domain] = max(graph.opset_imports.get(domain, version), version)
        for fn in model.functions.values():  # one opset per domain in the file (onnx's inliner requires it)
            for domain in fn.opset_imports:
                fn.opset_imports[domain] = graph.opset_imports[domain]
        return model


def example_inputs(comp: Composition, sg: ServingGraph) -> list[torch.Tensor]:
    """A prefill step of ``EXAMPLE_STEP`` tokens for ``EXAMPLE_BATCH`` rows into caches of
    ``EXAMPLE_CAPACITY`` slots, in the layout's dtype (row-wise and adaptive-depth graphs: their
    extra inputs from :func:`~looptool.backends.interface.example_extras`)."""
    layout = sg.layout
    b, t, s = EXAMPLE_BATCH, EXAMPLE_STEP, EXAMPLE_CAPACITY
    placeholders = [n for n in comp.graph.nodes if n.op == "placeholder"]
    mask = torch.zeros(b, s, dtype=placeholders[1].meta["val"].dtype)
    mask[:, :t] = 1
    ids = torch.randint(0, 2, (b, t), generator=torch.Generator().manual_seed(0))  # valid in any vocabulary
    dtype = getattr(torch, layout.dtype)
    caches = [torch.zeros(b, p.kv_heads, s, p.head_dim, dtype=dtype) for p in layout.pairs for _ in "kv"]
    steps = torch.arange(t)
    return [ids, mask, steps.expand(b, t), steps, *example_extras(sg, b), *caches]


def _interface_types(sg: ServingGraph) -> dict[str, tuple]:
    """ONNX element type and symbolic shape of every interface input and output."""
    import onnx_ir as ir

    float_type = getattr(ir.DataType, named(sg.layout.dtype).onnx)
    placeholders = [n for n in sg.module.graph.nodes if n.op == "placeholder"]
    mask = getattr(ir.DataType, of_torch(placeholders[1].meta["val"].dtype).onnx)
    out = {
        "input_ids": (ir.DataType.INT64, ["batch", "step"]),
        "attention_mask": (mask, ["batch", "capacity"]),
        "position_ids": (ir.DataType.INT64, ["batch", "step"]),
        "cache_position": (ir.DataType.INT64, ["step"]),
        BUDGETS: (ir.DataType.INT64, ["batch"]),
        MIN_BUDGET: (ir.DataType.INT64, ["batch"]),
        MAX_BUDGET: (ir.DataType.INT64, ["batch"]),
        EXIT_THRESHOLD: (ir.DataType.FLOAT, ["batch"]),
        DEPTH: (ir.DataType.INT64, ["batch"]),
        LOGITS: (float_type, ["batch", "step" if sg.every_position else 1, sg.vocab_size]),
    }
    past, present = sg.layout.names()
    for j, pair in enumerate(sg.layout.pairs):
        for name in (past[2 * j], past[2 * j + 1], present[2 * j], present[2 * j + 1]):
            out[name] = (float_type, ["batch", pair.kv_heads, "capacity", pair.head_dim])
    return out


def _shapes(tensors) -> tuple:
    """The shapes of a body's example inputs (non-tensors as None)."""
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tensors)


def _is_symbolic(node: fx.Node) -> bool:
    """A size or other Python scalar computed in the graph (recomputed where it is read)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _fetch(module: torch.nn.Module, node: fx.Node) -> torch.Tensor:
    obj = module
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def _flatten(value) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _unit_graph(nodes: list[fx.Node], order: dict) -> tuple[list[fx.Node], fx.Graph]:
    """``(inputs, body graph without output)`` of one unit: tensors and weights read from
    outside are inputs; sizes read from outside are recomputed in the body from tensors."""
    members = set(nodes)
    inputs: list[fx.Node] = []
    chain: list[fx.Node] = []

    def need(source: fx.Node) -> None:
        if source in members or source in chain or source in inputs:
            return
        if source.op == "call_function" and _is_symbolic(source):
            chain.append(source)
            for s in source.all_input_nodes:
                need(s)
        else:
            inputs.append(source)

    for node in nodes:
        for source in node.all_input_nodes:
            need(source)
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = body.placeholder(f"in{i}")
        env[node].meta = dict(node.meta)
    for node in sorted([*nodes, *chain], key=order.__getitem__):
        env[node] = body.node_copy(node, lambda n: env[n])
    return inputs, body


def _set_outputs(body: fx.Graph, outputs: list[fx.Node]) -> None:
    by_name = {n.name: n for n in body.nodes}
    body.output(tuple(by_name[n.name] for n in outputs))
    body.eliminate_dead_code()
    body.lint()


def _topological(units: list[Unit]) -> list[Unit]:
    """Units ordered so that each reads only earlier units' outputs (graph order breaks ties)."""
    producer = {n: u for u in units for n in u.outputs}
    done: list[Unit] = []
    state: dict[int, str] = {}

    def visit(unit: Unit) -> None:
        if state.get(id(unit)) == "done":
            return
        if state.get(id(unit)) == "active":
            raise ComposeError("units depend on each other in a cycle.")
        state[id(unit)] = "active"
        for i in unit.inputs:
            if i in producer:
                visit(producer[i])
        state[id(unit)] = "done"
        done.append(unit)

    for unit in units:
        visit(unit)
    return done


def _canonical(body: fx.Graph, vals: list, weights: tuple[bool, ...]) -> str:
    """A key equal for bodies with the same code and the same weight shapes."""
    index: dict[fx.Node, int] = {}
    parts: list[str] = []
    inputs = 0
    for i, node in enumerate(body.nodes):
        index[node] = i
        if node.op == "placeholder":
            val = vals[inputs]
            shape = tuple(val.shape) if weights[inputs] and isinstance(val, torch.Tensor) else None
            parts.append(f"P{weights[inputs]}{getattr(val, 'dtype', None)}{shape}")
            inputs += 1
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

    out = {}
    for d, size in enumerate(example.shape):
        if size in _DERIVED:
            raise ComposeError(f"body {body.index} reads a tensor with a flattened dynamic dimension ({size}).")
        if size in _DIM_NAMES:
            out[d] = Dim(_DIM_NAMES[size])
    return out


def _check_symbolic(model, body: LayerBody) -> None:
    """Refuse a body export that fixed a batch, step or capacity dimension."""
    for value, tensor, weight in zip(model.graph.inputs, body.example, body.weights):
        if weight or value.shape is None:
            continue
        for dim, size in zip(value.shape, tensor.shape):
            if isinstance(dim, int) and size in _DIM_NAMES:
                raise ComposeError(f"body {body.index} was exported with a fixed size {size}.")


def _as_function(model, name: str) -> tuple[onnx.FunctionProto, list[onnx.FunctionProto]]:
    """An exported body model as an ONNX function (initializers become Constant nodes)."""
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)
    graph = proto.graph
    constants = [onnx.helper.make_node("Constant", [], [init.name], value=init) for init in graph.initializer]
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    if len(inputs) != len(model.graph.inputs) or set(outputs) & set(inputs):
        raise ComposeError(f"body {name} passes an input through unchanged or lost an input.")
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in proto.opset_import]
    function = onnx.helper.make_function(LAYER_DOMAIN, name, inputs, outputs, [*constants, *graph.node], opsets)
    return function, list(proto.functions)
