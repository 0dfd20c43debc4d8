"""A test double of the parts of TensorRT's Python API that looptool calls, for machines
without TensorRT (all of this project's). An "engine" is a TensorRT variant graph run by
onnxruntime; tensors are read from and written to the raw addresses bound with
``set_tensor_address``, as TensorRT would. It checks looptool's *use* of the API (names,
shapes, profiles, addresses, buffers) and its plugin definitions (TensorRT's signature rules,
shape expressions evaluated on concrete shapes) — not TensorRT itself, nor the plugins' kernels."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import numpy as np

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def _view(ptr: int, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = int(np.prod(shape)) if len(shape) else 1
    buf = (ctypes.c_byte * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class Logger:
    WARNING = 2

    def __init__(self, level=None):
        self.level = level


class ExecutionContextAllocationStrategy:
    USER_MANAGED = "user_managed"


class _Context:
    def __init__(self, engine):
        self.engine, self.addresses, self.shapes, self.profiles, self.device_memory = engine, {}, {}, [], None

    def set_device_memory(self, ptr, size):
        self.device_memory = (ptr, size)

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_optimization_profile_async(self, index, stream):
        self.profiles.append(index)
        return True

    def execute_async_v3(self, stream):
        session = self.engine.session
        feeds = {}
        for i in session.get_inputs():
            shape = self.shapes.get(i.name, i.shape)
            if any(not isinstance(d, int) for d in shape):
                raise AssertionError(f"input {i.name} has no shape set")
            feeds[i.name] = _view(self.addresses[i.name], shape, _ORT_TO_NUMPY[i.type]).copy()
        outputs = session.run(None, feeds)
        for meta, value in zip(session.get_outputs(), outputs):
            target = _view(self.addresses[meta.name], value.shape, value.dtype)
            target[...] = value
        self.engine.runs += 1
        return True


class _Engine:
    def __init__(self, path: Path):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.device_memory_size_v2 = 4096
        self.runs = 0
        self.contexts = []

    def create_execution_context(self, strategy=None):
        assert strategy == ExecutionContextAllocationStrategy.USER_MANAGED
        ctx = _Context(self)
        self.contexts.append(ctx)
        return ctx


class Runtime:
    """``deserialize_cuda_engine(data)``: a fake engine file holds the variant's path."""

    directory: Path | None = None

    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes):
        return _Engine(Path(data.decode()))


class NetworkDefinitionCreationFlag:
    STRONGLY_TYPED = 1


class _Network:
    def __init__(self, flags):
        self.flags, self.inputs, self.path = flags, {}, None


class OnnxParser:
    """Reads the graph's inputs (name → shape with None for dynamic axes) into the network."""

    def __init__(self, network, logger):
        self.network, self.num_errors = network, 0

    def parse_from_file(self, path):
        import onnx

        model = onnx.load(path, load_external_data=False)
        for i in model.graph.input:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
            self.network.inputs[i.name] = dims
        self.network.path = path
        return True

    def get_error(self, i):  # pragma: no cover - parse never fails here
        return ""


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class _Config:
    def __init__(self):
        self.profiles = []

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    """``build_serialized_network`` checks that every profile covers every dynamic input
    with min ≤ opt ≤ max and the static axes as declared; the "plan" is the graph's path."""

    built: list = []

    def __init__(self, logger):
        self.logger = logger

    def create_network(self, flags):
        return _Network(flags)

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        assert network.flags == 1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED
        assert config.profiles, "no optimisation profile"
        for profile in config.profiles:
            for name, dims in network.inputs.items():
                if all(d is not None for d in dims):
                    assert name not in profile.shapes or profile.shapes[name][0] == tuple(dims), name
                    continue
                lo, opt, hi = profile.shapes[name]  # KeyError: a dynamic input without a profile
                assert len(lo) == len(dims), name
                for a, b, c, d in zip(lo, opt, hi, dims):
                    assert 1 <= a <= b <= c and (d is None or a == c == d), (name, lo, opt, hi, dims)
        Builder.built.append((network.path, [p.shapes for p in config.profiles]))
        return network.path.encode()


# ---------------------------------------------------------------------------- tensorrt.plugin
class _ShapeExprs(tuple):
    """Concrete shapes stand in for TensorRT's symbolic ones: ints do the same arithmetic."""

    def numel(self) -> int:
        return int(np.prod(self)) if self else 1


class TensorDesc:
    def __init__(self, shape_expr=(), dtype=None):
        self.shape_expr, self.dtype = _ShapeExprs(int(d) for d in shape_expr), dtype

    def like(self):
        return TensorDesc(self.shape_expr, self.dtype)


class KernelLaunchParams:
    def __init__(self):
        self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


class SymIntExprs(list):
    @classmethod
    def from_tuple(cls, exprs):
        return cls(int(e) for e in exprs)


def _check_signature(kind: str, name: str, fn, registered: dict) -> None:
    """TensorRT's rules for the decorated functions (``tensorrt.plugin._validate``): a
    register function annotates its tensors ``TensorDesc`` and returns ``TensorDesc`` or a
    tuple of them; autotune and aot_impl take the tensors, attributes (a subset, in order),
    ``outputs`` (and ``tactic``); an aot_impl annotates its return as a 4-tuple."""
    import inspect
    import typing

    sig = inspect.signature(fn)
    if kind == "register":
        ret = sig.return_annotation
        outs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
        assert outs and all(o is TensorDesc for o in outs), f"{name}: register must return TensorDesc(s), not {ret}"
        return
    desc = inspect.signature(registered[name]["register"]).parameters
    tensors = [n for n, p in desc.items() if p.annotation is TensorDesc]
    attrs = [n for n in desc if n not in tensors]
    params = list(sig.parameters)
    tail = {"autotune": ["outputs"], "aot_impl": ["outputs", "tactic"], "impl": ["outputs", "stream"]}[kind]
    middle = params[len(tensors) : len(params) - len(tail)]
    assert params[: len(tensors)] == tensors and params[len(params) - len(tail) :] == tail, (name, kind, params)
    assert middle == [a for a in attrs if a in middle], (name, kind, params)
    if kind == "aot_impl":
        ret = sig.return_annotation
        assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == 4, f"{name}: aot_impl return {ret}"


def _plugin_module() -> types.ModuleType:
    """A ``tensorrt.plugin`` that records registrations (``registered[name][kind]``), checks
    them as TensorRT would, and evaluates shape expressions on concrete shapes."""
    plugin = types.ModuleType("tensorrt.plugin")
    plugin.registered = {}

    def recorder(kind):
        def decorator_factory(name):
            def decorator(fn):
                _check_signature(kind, name, fn, plugin.registered)
                plugin.registered.setdefault(name, {})[kind] = fn
                return fn

            return decorator

        return decorator_factory

    for kind in ("register", "autotune", "aot_impl", "impl"):
        setattr(plugin, kind, recorder(kind))
    plugin.TensorDesc, plugin.KernelLaunchParams, plugin.SymIntExprs = TensorDesc, KernelLaunchParams, SymIntExprs
    plugin.SymInt32 = int
    plugin.AutoTuneCombination = str
    plugin.cdiv = lambda a, b: -(-int(a) // int(b))
    plugin.from_shape_expr = lambda shape, dtype: TensorDesc(shape, dtype)
    return plugin


def install(monkeypatch) -> types.ModuleType:
    """Put the fake ``tensorrt`` (and a ``tensorrt.plugin`` that records registrations) in
    ``sys.modules``."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "fake"
    trt.Logger, trt.Runtime, trt.Builder, trt.OnnxParser = Logger, Runtime, Builder, OnnxParser
    trt.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag
    trt.ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
    for dtype in ("float32", "float16", "bfloat16", "int32", "int64"):
        setattr(trt, dtype, dtype)  # data types by name
    plugin = _plugin_module()
    trt.plugin = plugin
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    return trt


def pretend_gpu(monkeypatch) -> None:
    """Make torch report one CUDA GPU (sm_90, named ``fake``) with a stream that does nothing;
    tensors stay on the CPU, where the test double reads and writes them."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake")
    monkeypatch.setattr(
        torch.cuda, "Stream", lambda device=None: type("S", (), {"cuda_stream": 0, "synchronize": lambda self: None})()
    )
