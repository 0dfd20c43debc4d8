"""A stored form of an unlifted exported ``GraphModule`` that is quick to read back.

``torch.export.load`` rebuilds every symbolic shape by parsing its text with sympy and
decodes a dataclass tree per node: about 11 s for SmolLM2's 2,400-node graph, longer than
many exports. The capture cache keeps instead what the rest of the capture reads from the
unlifted module (:func:`program_of`): each node's name, op, target, arguments, type and
metadata, the graph's code generator, and where every parameter, buffer and submodule sits.
It is pickled with torch's ``GraphPickler`` reductions (which store ``FakeTensor``/``SymInt``
node values by description), on Python's C pickler (:func:`dumps`). Node values with the
same description (shape expressions, strides, dtype, device, layout, ``requires_grad``) are
stored once and shared read-only by the nodes that had them: SmolLM2's 2,253 tensor values have 50 descriptions, and reading it back
takes about 0.3 s.

No tensor of the model is stored: its parameters and buffers are recorded by name with a
shape/dtype/kind check and rebound to the *current* model's own tensor objects by
:func:`build` (a mismatch raises :class:`StaleProgram`); tensors the export created itself
(lifted constants) are stored and cloned per build.

Entries are pickles, like torch's own compile caches: the cache directory must be writable
only by its user (:mod:`looptool.capture.cache` checks that before reading it).
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx
from torch import nn

from looptool.core.graph import lazy_graph_module


class StaleProgram(ValueError):
    """A stored program does not fit the model it is built for (its tensors differ)."""


class _Ref:
    """Node ``index`` of the program's node list, standing for that node in arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return (_Ref, (self.index,))


class OwnTensor(NamedTuple):
    """A parameter or buffer of the model, rebound by name at build time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool


@dataclass
class Program:
    """What :func:`build` needs to make the unlifted module again (see the module docstring)."""

    records: list[tuple]  # (name, op, target, args, kwargs, type, meta) per node, in order
    codegen: object  # the graph's code generator (pytree in/out specs of the forward)
    # (dotted name, "parameter" | "buffer", persistent, OwnTensor | stored constant tensor)
    tensors: list[tuple[str, str, bool, object]] = field(default_factory=list)
    # (dotted path, nested Program of a GraphModule body | a tensor-free module object)
    modules: list[tuple[str, object]] = field(default_factory=list)

    def shape_env(self):
        """The ShapeEnv the node values belong to (None when all shapes are static)."""
        for record in self.records:
            env = getattr(getattr(record[6].get("val"), "fake_mode", None), "shape_env", None)
            if env is not None:
                return env
        return None


def program_of(gm: fx.GraphModule, own: dict[str, torch.Tensor]) -> Program:
    """The stored form of ``gm`` (an unlifted export of the model whose tensors are ``own``)."""
    return _program_of(gm, own, {})


def _program_of(gm: fx.GraphModule, own: dict[str, torch.Tensor], values: dict) -> Program:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def ref(a):
        return fx.node.map_arg(a, lambda n: _Ref(index[n]))

    records = [
        (n.name, n.op, n.target, ref(n.args), ref(n.kwargs), n.type, _meta(n.meta, values)) for n in gm.graph.nodes
    ]
    program = Program(records=records, codegen=gm.graph._codegen)
    bodies: list[str] = []
    for path, module in gm.named_modules(remove_duplicate=False):
        if any(path.startswith(b + ".") for b in bodies):
            continue  # inside a body, stored with it
        if module is not gm and isinstance(module, fx.GraphModule):
            program.modules.append((path, _program_of(module, {}, values)))
            bodies.append(path)
            continue
        if module is not gm and type(module) is not nn.Module:
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                raise ValueError(f"submodule '{path}' ({type(module).__name__}) holds tensors")
            program.modules.append((path, _GuardsStandIn() if _is_guards(module) else module))
            bodies.append(path)
            continue
        prefix = f"{path}." if path else ""
        for name, t in module._parameters.items():
            if t is not None:
                program.tensors.append((prefix + name, "parameter", True, _stored(prefix + name, t, own)))
        for name, t in module._buffers.items():
            if t is not None:
                persistent = name not in module._non_persistent_buffers_set
                program.tensors.append((prefix + name, "buffer", persistent, _stored(prefix + name, t, own)))
    return program


class _GuardsStandIn:
    """Stands for the export's ``_guards_fn``: its generated input-shape check cannot be
    pickled, and capture drops its call (:func:`~looptool.capture.clean.clean_module`), so a
    build gets ``GuardsFn()``, whose forward does nothing."""

    def __reduce__(self):
        return (_GuardsStandIn, ())


def _is_guards(module: nn.Module) -> bool:
    return type(module).__name__ == "GuardsFn" and type(module).__module__ == "torch.export._unlift"


def _stored(name: str, t: torch.Tensor, own: dict[str, torch.Tensor]):
    if own.get(name) is t:
        return OwnTensor(tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
    return t.detach().clone()  # a constant the export made (not the model's): stored as it is


def _meta(meta: dict, values: dict) -> dict:
    out = dict(meta)
    val = out.get("val")
    if isinstance(val, torch.Tensor):  # one stored value per description (read-only metadata)
        key = (
            tuple(map(str, val.shape)),
            tuple(map(str, val.stride())),
            str(val.storage_offset()),
            val.dtype,
            val.device,
            val.layout,
            val.requires_grad,
            type(val),
        )
        out["val"] = values.setdefault(key, val)
    return out


def build(program: Program, own: dict[str, torch.Tensor]) -> fx.GraphModule:
    """The unlifted module of ``program``: fresh graph, nodes and top-level metadata dicts;
    its parameters and buffers are ``own``'s tensor objects (raises :class:`StaleProgram`
    when ``own`` lacks one or it differs in shape, dtype or kind)."""
    gm = lazy_graph_module(nn.Module(), fx.Graph())  # capture cleans it, never runs it
    for name, kind, persistent, stored in program.tensors:
        if isinstance(stored, OwnTensor):
            t = own.get(name)
            if t is None or OwnTensor(tuple(t.shape), t.dtype, isinstance(t, nn.Parameter)) != stored:
                raise StaleProgram(f"the model's tensor '{name}' differs from the stored program's")
        else:
            t = stored.clone()
        _assign(gm, name, t, kind, persistent)
    for path, module in program.modules:
        if isinstance(module, _GuardsStandIn):
            from torch.export._unlift import GuardsFn

            module = GuardsFn()
        _assign(gm, path, build(module, {}) if isinstance(module, Program) else module, "module", True)
    graph = fx.Graph()
    nodes: list[fx.Node] = []

    def node_of(a):
        return nodes[a.index] if isinstance(a, _Ref) else a

    for name, op, target, args, kwargs, type_, meta in program.records:
        node = graph.create_node(op, target, (), {}, name, type_)  # arguments set after: see copy_node
        args, kwargs = fx.node.map_aggregate(args, node_of), fx.node.map_aggregate(kwargs, node_of)
        if args:
            node.args = tuple(args)
        if kwargs:
            node.kwargs = dict(kwargs)
        node.meta = dict(meta)
        nodes.append(node)
    graph._codegen = program.codegen
    gm.graph = graph  # recompiles
    return gm


def _assign(root: nn.Module, dotted: str, obj, kind: str, persistent: bool) -> None:
    *prefix, last = dotted.split(".")
    module = root
    for part in prefix:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if kind == "parameter":
        module.register_parameter(last, obj)
    elif kind == "buffer":
        module.register_buffer(last, obj, persistent=persistent)
    else:
        module.add_module(last, obj)


def dumps(program: Program) -> bytes:
    """``program`` as bytes: torch's ``GraphPickler`` reductions (every node metadata key kept)
    on Python's C pickler (:func:`_fast_pickler`); what that pickler cannot hold falls back to
    ``GraphPickler`` itself. :func:`loads` reads either."""
    from torch.fx import _graph_pickler as gp

    options = gp.Options(ops_filter=None, node_metadata_key_filter=None)
    with _quiet():
        try:
            with gp.patch_pytree_map_over_slice(), io.BytesIO() as stream:
                _fast_pickler()(stream, options).dump(program)
                return stream.getvalue()
        except Exception:  # e.g. a value only dill pickles: GraphPickler's own pickler
            return gp.GraphPickler.dumps(program, options)


@functools.lru_cache(maxsize=1)
def _fast_pickler() -> type:
    """``GraphPickler`` on the standard library's C ``pickle.Pickler``.

    Where ``dill`` is installed (lm-eval and datasets pull it in), torch's ``GraphPickler``
    derives from dill's pure-Python pickler: storing SmolLM2's program took 1.9 s that way
    and 0.3–0.6 s on the C pickler, the same bytes but for the pickler's own framing. This
    class takes ``GraphPickler``'s reductions (FakeTensor, SymInt, ops, GraphModule, ShapeEnv
    descriptions) and persistent state token as they are, so ``GraphPickler.loads`` reads its
    output like its own."""
    from torch.fx import _graph_pickler as gp

    class FastGraphPickler(pickle.Pickler):
        _PASSTHROUGH_TYPES = gp.GraphPickler._PASSTHROUGH_TYPES
        reducer_override = gp.GraphPickler.reducer_override
        persistent_id = gp.GraphPickler.persistent_id

        def __init__(self, file: io.BytesIO, options) -> None:
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.options = options
            self._unpickle_state = gp._UnpickleStateToken(object())
            self._meta_tensor_describer = gp.MetaTensorDescriber(copy_data=False)

    return FastGraphPickler


def loads(data: bytes) -> Program:
    """The Program :func:`dumps` wrote (node values in a fresh ``FakeTensorMode``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with _quiet():
        program = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(program, Program):
        raise TypeError(f"the entry holds a {type(program).__name__}, not a stored program")
    return program


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():  # pytree/dill deprecation notices about export's specs
        warnings.simplefilter("ignore")
        yield
