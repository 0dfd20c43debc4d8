"""One graph for every budget: the window of a fixed-prefix plan as ONNX ``Loop`` nodes.

The row-wise graph (:func:`looptool.backends.interface.rowwise_serving_graph`) already serves
every budget of the menu in one graph, each row at its own budget, but it runs every second
pass for every row and masks the ones a row's budget does not take: it costs the deepest
budget whatever its rows ask for. Its composed form (:mod:`looptool.backends.onnx.layers`)
calls, for window layer ``l``, one body for the first pass and another (the gated one) for the
second, both over ``l``'s weights.

This module rewrites that composed graph so that each window layer is one ``Loop`` of one or
two passes over one call of the gated body (Accordion Eq. 1 and 5 in the project's words:
budget ``k`` runs layer ``l`` of the window a second time, behind per-channel ``tanh`` gates,
when ``l`` is among the window's first ``k`` layers):

* pass ``i`` (the loop's iteration) reads the gates ``+inf`` on pass 0 (``tanh(+inf)`` is
  exactly 1, so ``x + 1 * f`` is the ungated first pass bit for bit) and the layer's gates on
  pass 1; the row mask of the second pass (``budgets >= t``) is all true on pass 0;
* pass ``i`` reads the cache pair of its own execution (per-loop KV): an ``If`` on the pass
  picks the first or second pass's cache, cut to the positions written so far
  (``max(cache_position) + 1``: the rows share one write clock, so every position a row attends
  to), the body writes this step's keys and values into that copy and attends over it, and
  returns only the step's new entries (a scan output); inputs with the capacity axis (the
  attention mask) are cut alike, once per graph;
  after the loop they are written into the bound caches in place (``ScatterElements`` on the
  buffers the caller binds as both past and present); a second pass that did not run writes
  the entries its cache already held;
* the trip count is ``1 + (max(budgets) >= t)``: a batch costs its deepest row, and a batch
  whose rows share budget ``b`` costs budget ``b`` plus the loop's own overhead.

Each weight then has exactly one consumer node in the graph (the body call, first pass and
second alike), so onnxruntime pre-packs it once: the graph opens as one session with one
packed copy of the weights (onnxruntime packs a weight once per consuming kernel; a ``Loop``
body is one kernel per node whatever its trip count).

The rewrite reads the composition's FX nodes to pair the two passes' inputs; anything it
cannot pair raises :class:`~looptool.backends.onnx.layers.ComposeError` and the export keeps
the masked row-wise graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from looptool.backends.onnx.layers import LAYER_DOMAIN, ComposeError, Composition, Unit
from looptool.core.dtypes import of_torch
from looptool.core.graph import annotation

_aten = torch.ops.aten


@dataclass
class WindowLayer:
    """The two passes of one window layer in a composition, their inputs paired."""

    layer: int
    first: Unit
    second: Unit
    threshold: int  # the smallest budget that runs the second pass
    state_in: fx.Node  # the first pass's hidden-state input
    writes: list[tuple[fx.Node, fx.Node]]  # (first pass's cache write, second pass's), in output order
    gates: list[fx.Node]  # the second pass's gate tensors (weights)
    mask: fx.Node  # the second pass's row mask, bool [batch, 1, ...]

    @property
    def caches(self) -> list[tuple[fx.Node, fx.Node]]:
        """(first pass's cache, second pass's cache) of each write: the placeholders written."""
        return [(w1.args[0], w2.args[0]) for w1, w2 in self.writes]

    def state_out(self, unit: Unit) -> fx.Node:
        """The output of ``unit`` (one of the two passes) that is the layer's hidden state."""
        written = {w for pair in self.writes for w in pair}
        return next(o for o in unit.outputs if o not in written)


def window_layers(comp: Composition) -> list[WindowLayer]:
    """Pair each second pass of ``comp`` (a composed row-wise Accordion graph) with its first."""
    passes: dict[tuple[int, int], Unit] = {}
    for unit in comp.units:
        keys = {(annotation(n).get("layer"), annotation(n).get("repeat") or 1) for n in unit.nodes}
        if len(keys) == 1 and None not in next(iter(keys)):
            passes[next(iter(keys))] = unit
    return [_pair(layer, passes[layer, 1], second) for (layer, rep), second in sorted(passes.items()) if rep == 2]


def _pair(layer: int, first: Unit, second: Unit) -> WindowLayer:
    writes_first = [o for o in first.outputs if o.target is _aten.index_copy.default]
    writes_second = [o for o in second.outputs if o.target is _aten.index_copy.default]
    # a cache a pass writes may also be read for its shape by every unit (the symbolic capacity)
    caches_first = [o.args[0] for o in writes_first]
    caches_second = [o.args[0] for o in writes_second]
    state = [i for i in second.inputs if i in first.outputs]
    state_in = [i for i in first.inputs if i not in second.inputs and i not in caches_first]
    only_second = [i for i in second.inputs if i not in first.inputs and i not in state and i not in caches_second]
    gates = [i for i in only_second if i.op == "get_attr"]
    masks = [i for i in only_second if i.op == "call_function"]
    if (
        len(state) != 1
        or len(state_in) != 1
        or len(masks) != 1
        or not gates
        or len(gates) + len(masks) != len(only_second)
        or [o for o in first.outputs if o not in writes_first] != state
        or len(second.outputs) != len(first.outputs)
        or len(writes_first) != len(writes_second)
        or not all(c.op == "placeholder" for c in caches_first + caches_second)
    ):
        raise ComposeError(f"the two passes of window layer {layer} cannot be paired for a loop.")
    threshold = _threshold(masks[0])
    return WindowLayer(
        layer, first, second, threshold, state_in[0], list(zip(writes_first, writes_second)), gates, masks[0]
    )


def _threshold(mask: fx.Node) -> int:
    """``t`` of the row mask ``view(budgets >= t)`` the row-wise pass emitted."""
    node = mask
    while node.op == "call_function" and node.target in (_aten.view.default, _aten.reshape.default):
        node = node.args[0]
    if node.op != "call_function" or node.target is not _aten.ge.Scalar or not isinstance(node.args[1], int):
        raise ComposeError(f"the row mask '{mask.name}' is not budgets >= t.")
    return int(node.args[1])


def loop_window(model, comp: Composition) -> dict[int, int]:
    """Rewrite ``model`` (the ``onnx_ir`` model :meth:`LayerLibrary.assemble` made of ``comp``)
    in place: each window layer's two calls become one ``Loop``. Returns each looped layer's
    threshold (the smallest budget that runs its second pass). A :class:`ComposeError` (passes
    that cannot be paired) is raised before anything in ``model`` changes."""
    import onnx_ir as ir

    graph = model.graph
    calls = {node.name: node for node in graph}
    inputs = {value.name: value for value in graph.inputs}
    if "budgets" not in inputs or "cache_position" not in inputs:
        raise ComposeError("only the row-wise graph (inputs budgets and cache_position) can be looped.")
    layers = window_layers(comp)
    if not layers:
        return {}  # no fixed-prefix window (an ELR plan): nothing to loop here
    builder = _Builder(graph, inputs["budgets"], inputs["cache_position"])
    out = {}
    for wl in layers:
        first, second = calls[_call_name(wl.first)], calls[_call_name(wl.second)]
        _loop_layer(ir, builder, wl, first, second)
        out[wl.layer] = wl.threshold
    return out


def _call_name(unit: Unit) -> str:
    return f"call_{unit.outputs[-1].name}"


class _Builder:
    """Small helpers that emit top-level nodes once (constants, the trip counts)."""

    def __init__(self, graph, budgets, cache_position):
        import onnx_ir as ir

        self.ir, self.graph = ir, graph
        self.cache_position = cache_position
        self.head: list = []  # nodes that go first in the graph
        self._trips: dict[int, object] = {}
        self._index: dict[tuple, object] = {}
        self._used: tuple | None = None
        self._axes: dict[int, object] = {}
        self._cuts: dict[tuple, object] = {}
        self._max = self._node("ReduceMax", [budgets], {"keepdims": 0}, name="looped_max_budget").outputs[0]

    def _node(self, op: str, inputs, attributes=None, name: str | None = None):
        node = self.ir.node(op, inputs, attributes or {}, name=name)
        if name:
            node.outputs[0].name = name
        self.head.append(node)
        if len(self.head) > 1:
            self.graph.insert_after(self.head[-2], node)
        elif len(self.graph):
            self.graph.insert_before(next(iter(self.graph)), node)
        else:
            self.graph.append(node)
        return node

    def const(self, name: str, values) -> object:
        """An int64 constant (a scalar or a vector) at the head of the graph."""
        return self._node("Constant", [], {"value": self.ir.tensor(np.array(values, np.int64))}, name=name).outputs[0]

    def used(self, axis: int) -> list:
        """``Slice`` inputs that keep positions ``[0, max(cache_position) + 1)`` of ``axis``: every
        position a row attends to (the rows share one write clock), however long the bound
        buffers are."""
        if self._used is None:
            last = self._node("ReduceMax", [self.cache_position], {"keepdims": 1}, name="looped_last_position")
            used = self._node("Add", [last.outputs[0], self.const("looped_one_position", [1])], name="looped_used")
            self._used = (self.const("looped_from", [0]), used.outputs[0])
        if axis not in self._axes:
            self._axes[axis] = self.const(f"looped_axis{axis}", [axis])
        return [*self._used, self._axes[axis]]

    def cut(self, value, axis: int):
        """``value`` sliced to the used positions of ``axis`` (once per value)."""
        key = (value.name, axis)
        if key not in self._cuts:
            self._cuts[key] = self._node("Slice", [value, *self.used(axis)], name=f"looped_cut_{value.name}").outputs[0]
        return self._cuts[key]

    def index(self, cache, shape) -> object:
        """The ``ScatterElements`` indices that write this step's slots into a cache like ``cache``
        (``[batch, heads, capacity, dim]``): ``cache_position`` broadcast to ``[batch, heads,
        step, dim]``, made once per cache shape (every layer of most models shares it)."""
        key = (str(shape[1]), str(shape[3]))
        if key not in self._index:
            tag = f"looped_index{len(self._index)}"
            slots = self._node(
                "Reshape", [self.cache_position, self.const(f"{tag}_const_slots", [1, 1, -1, 1])], name=f"{tag}_slots"
            )
            dims = self._node("Shape", [cache], name=f"{tag}_cache_shape")
            keep = self._node(
                "Mul", [dims.outputs[0], self.const(f"{tag}_const_keep", [1, 1, 0, 1])], name=f"{tag}_keep"
            )
            one = self._node("Add", [keep.outputs[0], self.const(f"{tag}_const_one", [0, 0, 1, 0])], name=f"{tag}_rows")
            self._index[key] = self._node("Expand", [slots.outputs[0], one.outputs[0]], name=tag).outputs[0]
        return self._index[key]

    def trip(self, threshold: int):
        """int64 scalar ``1 + (max(budgets) >= threshold)``."""
        if threshold not in self._trips:
            t = self.const(f"looped_t{threshold}", threshold)
            ge = self._node("GreaterOrEqual", [self._max, t], name=f"looped_runs_t{threshold}")
            cast = self._node(
                "Cast", [ge.outputs[0]], {"to": self.ir.DataType.INT64}, name=f"looped_second_t{threshold}"
            )
            one = self.const(f"looped_one_t{threshold}", 1)
            self._trips[threshold] = self._node(
                "Add", [one, cast.outputs[0]], name=f"looped_trip_t{threshold}"
            ).outputs[0]
        return self._trips[threshold]


def _loop_layer(ir, b: _Builder, wl: WindowLayer, first, second) -> None:
    """Replace the calls ``first`` and ``second`` of window layer ``wl`` by one ``Loop``."""
    tag = f"looped_l{wl.layer}"
    outer = dict(zip(wl.second.inputs, second.inputs))  # fx node -> top-level value
    outer_first = dict(zip(wl.first.inputs, first.inputs))
    state_type = ir.TensorType(getattr(ir.DataType, of_torch(wl.state_in.meta["val"].dtype).onnx))
    # the loop body: (iteration, condition, state) -> (condition, state, new cache entries...)
    it = ir.Value(name=f"{tag}_i", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name=f"{tag}_cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    state = ir.Value(name=f"{tag}_h", type=state_type)
    body: list = []

    def emit(op, inputs, attributes=None, name=None, num_outputs=1):
        node = ir.node(op, inputs, attributes or {}, num_outputs=num_outputs, name=name)
        if name and num_outputs == 1:
            node.outputs[0].name = name
        body.append(node)
        return node

    zero = emit("Constant", [], {"value": ir.tensor(np.array(0, np.int64))}, name=f"{tag}_zero").outputs[0]
    is_first = emit("Equal", [it, zero], name=f"{tag}_first").outputs[0]
    args = {next(i for i in wl.second.inputs if i in wl.first.outputs): state}
    for j, (c1, c2) in enumerate(wl.caches):
        picked = []
        for branch, source in (("then", outer_first[c1]), ("else", outer[c2])):
            out = ir.Value(name=f"{tag}_c{j}_{branch}", type=ir.TensorType(_elem(source)))
            cut = ir.Node("", "Slice", [source, *b.used(2)], outputs=[out])  # the positions written so far
            picked.append(ir.Graph([], [out], nodes=[cut], name=f"{tag}_c{j}_{branch}"))
        args[c2] = emit(
            "If",
            [is_first],
            {
                "then_branch": ir.AttrGraph("then_branch", picked[0]),
                "else_branch": ir.AttrGraph("else_branch", picked[1]),
            },
            name=f"{tag}_cache{j}",
        ).outputs[0]
    for g in wl.gates:
        source = outer[g]
        inf = emit("Constant", [], {"value": ir.tensor(np.array(np.inf, _numpy(source)))}, name=f"{tag}_{g.name}_open")
        args[g] = emit("Where", [is_first, inf.outputs[0], source], name=f"{tag}_{g.name}").outputs[0]
    args[wl.mask] = emit("Or", [is_first, outer[wl.mask]], name=f"{tag}_rows").outputs[0]
    capacity = str(wl.caches[0][1].meta["val"].shape[2])
    for i in wl.second.inputs:
        if i not in args and i.op != "get_attr" and (axis := _axis_of(i, capacity)) is not None:
            args[i] = b.cut(outer[i], axis)  # e.g. the attention mask [batch, 1, step, capacity]
    call = ir.Node(
        LAYER_DOMAIN,
        second.op_type,
        [args.get(i, outer.get(i)) for i in wl.second.inputs],
        num_outputs=len(second.outputs),
        name=f"{tag}_call",
    )
    body.append(call)
    state_at = wl.second.outputs.index(wl.state_out(wl.second))
    state_out = call.outputs[state_at]
    state_out.name, state_out.type = f"{tag}_h_out", state_type
    news = []
    for j, (_, node) in enumerate(wl.writes):
        new = emit(
            "Gather", [call.outputs[wl.second.outputs.index(node)], b.cache_position], {"axis": 2}, name=f"{tag}_new{j}"
        )
        new.outputs[0].type = ir.TensorType(_elem(outer[wl.caches[j][1]]))
        news.append(new.outputs[0])
    cond_out = emit("Identity", [cond], name=f"{tag}_cond_out").outputs[0]
    cond_out.type = ir.TensorType(ir.DataType.BOOL)
    loop_body = ir.Graph([it, cond, state], [cond_out, state_out, *news], nodes=body, name=f"{tag}_body")
    loop = ir.Node(
        "",
        "Loop",
        [b.trip(wl.threshold), None, outer_first[wl.state_in]],
        {"body": ir.AttrGraph("body", loop_body)},
        num_outputs=1 + len(news),
        name=f"{tag}",
    )
    loop.outputs[0].name = f"{tag}_state"
    after: list = [loop]

    def top(op, inputs, attributes=None, name=None):
        node = ir.node(op, inputs, attributes or {}, name=name)
        node.outputs[0].name = name
        after.append(node)
        return node.outputs[0]

    zero_i = top("Constant", [], {"value": ir.tensor(np.array(0, np.int64))}, name=f"{tag}_pass0")
    one_i = top("Constant", [], {"value": ir.tensor(np.array(1, np.int64))}, name=f"{tag}_pass1")
    replaced_old, replaced_new = [], []
    for j, ((c1, c2), scan) in enumerate(zip(wl.caches, loop.outputs[1:])):
        scan.name = f"{tag}_scan{j}"
        first_new = top("Gather", [scan, zero_i], {"axis": 0}, name=f"{tag}_first_new{j}")
        index = b.index(outer_first[c1], c1.meta["val"].shape)
        held = top("Gather", [outer[c2], b.cache_position], {"axis": 2}, name=f"{tag}_held{j}")
        both = top(
            "Concat",
            [scan, top("Unsqueeze", [held, zero_i], name=f"{tag}_held_u{j}")],
            {"axis": 0},
            name=f"{tag}_both{j}",
        )
        second_new = top("Gather", [both, one_i], {"axis": 0}, name=f"{tag}_second_new{j}")
        old_first = first.outputs[wl.first.outputs.index(wl.writes[j][0])]
        old_second = second.outputs[wl.second.outputs.index(wl.writes[j][1])]
        for old, cache, new in ((old_first, outer_first[c1], first_new), (old_second, outer[c2], second_new)):
            written = top(
                "ScatterElements", [cache, index, new], {"axis": 2}, name=f"{tag}_present{j}_{'ab'[cache is outer[c2]]}"
            )
            replaced_old.append(old)
            replaced_new.append(written)
    replaced_old.append(second.outputs[state_at])
    replaced_new.append(loop.outputs[0])
    b.graph.insert_before(first, after)
    _replace(b.graph, replaced_old, replaced_new)
    b.graph.remove([first, second], safe=True)


def _axis_of(node: fx.Node, capacity: str) -> int | None:
    """The axis of ``node``'s value that is the caches' capacity (by its symbol), if any."""
    val = node.meta.get("val")
    dims = [str(d) for d in getattr(val, "shape", ())]
    return dims.index(capacity) if capacity in dims else None


def _replace(graph, old: list, new: list) -> None:
    """Every use of ``old[i]`` reads ``new[i]``; a graph output keeps its name."""
    import onnx_ir as ir

    for o, n in zip(old, new):
        if o in graph.outputs:
            name = o.name
            o.name = f"{name}_replaced"
            n.name, n.type, n.shape = name, o.type, o.shape
        ir.convenience.replace_all_uses_with(o, n, replace_graph_outputs=True)


def _elem(value):
    import onnx_ir as ir

    if value.type is not None:
        return value.type.dtype
    return ir.DataType.FLOAT


def _numpy(value) -> type:
    return _elem(value).numpy()
