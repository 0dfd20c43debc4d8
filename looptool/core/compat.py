"""Every change looptool makes to another library's internals, in one place.

looptool replaces a few attributes of torch and gguf for the length of a block, each for speed
or quiet and none for results: tracing without stack traces, FakeTensor's dispatch cache off,
the ONNX exporter's decomposition retrace skipped when nothing needs decomposing, its torchlib
registry built once per opset, its torchvision notice dropped, and gguf's reader memoised
during a transformers GGUF load. Each is a :class:`Patch` naming what it replaces and the
library versions it is known for; the context manager of a patch applies it only for those
versions. Outside them, or when the target has another shape than the patch expects, the
block runs the library unchanged (the same results, without the speed-up) after a
:class:`CompatWarning` naming the installed version. ``tests/test_compat.py`` checks that
every patch applies to the installed versions.

Checked on torch 2.11 and 2.13 (the stack-trace setting: 2.13 only) and transformers 5.17 and 5.25
(the GGUF patch on 5.25; transformers 5.17 had no gguf installed where it was checked).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Version = tuple[int, int]  # (major, minor)


class CompatWarning(UserWarning):
    """A patch of another library that does not apply to the installed version: looptool runs
    that library unchanged (slower or noisier, never different)."""


@functools.cache
def installed_version(library: str) -> Version | None:
    """The installed ``(major, minor)`` version of ``library`` (its distribution's metadata,
    else its ``__version__``), or None when it is not installed."""
    try:
        text = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        try:
            text = str(importlib.import_module(library).__version__)
        except (ImportError, AttributeError):
            return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True)
class Patch:
    """One replacement of another library's attribute: what it does, the dotted ``target`` it
    replaces, and the ``library`` whose versions ``first`` to ``last`` (inclusive) it is known
    to apply to (the library whose internals the patch relies on)."""

    does: str
    target: str
    library: str
    first: Version
    last: Version

    def known(self) -> bool:
        """Whether the installed ``library`` is one this patch is known for; warns if not."""
        version = installed_version(self.library)
        if version is not None and self.first <= version <= self.last:
            return True
        have = "not installed" if version is None else _text(version)
        self.skipped(f"it is known for {self.library} {self.versions()}, and {self.library} here is {have}")
        return False

    def skipped(self, why: str) -> None:
        """Warn that the patch is not applied, and ``why``."""
        warnings.warn(
            f"looptool runs without its patch of {self.target} ({self.does}): {why}; results are unchanged.",
            CompatWarning,
            stacklevel=2,
        )

    def versions(self) -> str:
        """The versions it is known for, as text (``2.11 to 2.13``)."""
        first, last = _text(self.first), _text(self.last)
        return first if first == last else f"{first} to {last}"


def _text(version: Version) -> str:
    return ".".join(map(str, version))


_TORCH = ((2, 11), (2, 13))
STACK_TRACES = Patch(  # torch 2.11 has no such setting (checked): it traces with stack traces
    "traced nodes without a Python stack trace", "torch.fx.config.do_not_emit_stack_traces", "torch", (2, 13), (2, 13)
)
FAKE_TENSOR_CACHE = Patch(
    "FakeTensor's dispatch cache off", "torch._dynamo.config.fake_tensor_cache_enabled", "torch", *_TORCH
)
ONNX_DECOMPOSITION = Patch(
    "no decomposition retrace of a program whose every op has an ONNX translation",
    "torch.onnx._internal.exporter._fx_passes.decompose_with_registry",
    "torch",
    *_TORCH,
)
ONNX_REGISTRY = Patch(
    "one torchlib registry built per opset and copied",
    "torch.onnx._internal.exporter._registration.ONNXRegistry.from_torchlib",
    "torch",
    *_TORCH,
)
ONNX_TORCHVISION_NOTICE = Patch(
    "the exporter's 'torchvision is not installed' log records dropped",
    "torch.onnx._internal.exporter._registration (its logger)",
    "torch",
    *_TORCH,
)
GGUF_READER = Patch(
    "one GGUF reader per file and one tensor name map per architecture during a GGUF load",
    "gguf.GGUFReader and gguf.get_tensor_name_map (imported by transformers at call time)",
    "transformers",
    (5, 17),
    (5, 25),
)
PATCHES = (STACK_TRACES, FAKE_TENSOR_CACHE, ONNX_DECOMPOSITION, ONNX_REGISTRY, ONNX_TORCHVISION_NOTICE, GGUF_READER)


# ---------------------------------------------------------------------- the one way to replace an attribute
_INHERITED = object()  # saved for a class attribute the class itself does not define


class _Overrides:
    """The attributes :func:`overridden` holds replaced in this process: per ``(owner,
    attribute)`` its nesting depth and the value before, restored when the depth returns to 0."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth: dict[tuple[str, str], int] = {}
        self.saved: dict[tuple[str, str], object] = {}


@functools.cache  # one per process: the attributes it replaces are the process's
def _overrides() -> _Overrides:
    return _Overrides()


@contextlib.contextmanager
def overridden(owner: str, name: str, value: object) -> Iterator[None]:
    """``<owner>.<name> = value`` for the block, ``owner`` the dotted path of a module or of a
    class in one (a torch config setting, a library function or classmethod looptool replaces
    while it calls that library); the previous value is restored on exit (a class's own
    descriptor, such as a ``classmethod``, as it was; an inherited one by deleting the
    override); nested and concurrent uses share one override (the first one's ``value``),
    which stays until the last of them exits. An owner without the attribute runs the block
    unchanged."""
    target = _resolve(owner)
    if not hasattr(target, name):
        yield
        return
    slot, held = (owner, name), _overrides()
    with held.lock:
        if not held.depth.get(slot):
            if isinstance(target, type):
                held.saved[slot] = vars(target).get(name, _INHERITED)
            else:
                held.saved[slot] = getattr(target, name)
            setattr(target, name, value)
        held.depth[slot] = held.depth.get(slot, 0) + 1
    try:
        yield
    finally:
        with held.lock:
            held.depth[slot] -= 1
            if not held.depth[slot]:
                saved = held.saved.pop(slot)
                if saved is _INHERITED:
                    delattr(target, name)
                else:
                    setattr(target, name, saved)


def _resolve(path: str) -> object:
    """The module, or the attribute of the longest importable module prefix, ``path`` names."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"no module in {path!r}")


@contextlib.contextmanager
def _setting(patch: Patch, value: object) -> Iterator[None]:
    """``patch.target`` (a config setting) set to ``value`` for the block."""
    owner, _, name = patch.target.rpartition(".")
    if not patch.known():
        yield
        return
    if not hasattr(_resolve(owner), name):
        patch.skipped(f"{owner} has no {name}")
        yield
        return
    with overridden(owner, name, value):
        yield


# ---------------------------------------------------------------------- tracing
def without_stack_traces() -> contextlib.AbstractContextManager[None]:
    """Trace without ``node.meta["stack_trace"]`` (:data:`STACK_TRACES`)."""
    return _setting(STACK_TRACES, True)


def without_fake_tensor_cache() -> contextlib.AbstractContextManager[None]:
    """Trace with FakeTensor's dispatch cache off (:data:`FAKE_TENSOR_CACHE`; read when a
    trace creates its fake mode)."""
    return _setting(FAKE_TENSOR_CACHE, False)


# ---------------------------------------------------------------------- the ONNX exporter
@contextlib.contextmanager
def decompose_only_what_onnx_lacks() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` skips its decomposition of an exported program
    whose every op has an ONNX translation (:data:`ONNX_DECOMPOSITION`).

    Before translating, the exporter runs ``ExportedProgram.run_decompositions`` with a table
    of the ops that have *no* translation. That retraces the whole program under fake tensors
    even when no op of it is in the table (looptool's graphs are already ATen graphs), and it
    costs about as much as the export's own trace: 0.85 s of a layer body's 1.7 s on the
    2-core machine. The retrace then changes no op, so it is skipped when every node is a
    call of a translated op (or an assertion the exporter removes next, or a Python
    ``operator``), the program has no nested graphs and its signature no mutations; anything
    else is decomposed as before."""
    if not ONNX_DECOMPOSITION.known():
        yield
        return
    try:
        from torch.export.graph_signature import InputKind, OutputKind
        from torch.onnx._internal.exporter import _decomp, _fx_passes

        decompose = _fx_passes.decompose_with_registry
        implemented_overloads = _decomp.get_onnx_implemented_overloads
    except (ImportError, AttributeError) as exc:
        ONNX_DECOMPOSITION.skipped(f"the exporter has another shape ({exc})")
        yield
        return
    plain_inputs = {InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR}
    assertions = _assertion_ops()

    def translatable(program, registry) -> bool:
        signature = program.graph_signature
        if any(s.kind not in plain_inputs for s in signature.input_specs):
            return False
        if any(s.kind != OutputKind.USER_OUTPUT for s in signature.output_specs):
            return False
        if any(m is not program.graph_module for m in program.graph_module.modules()):
            return False  # higher-order ops' subgraphs
        implemented = set(implemented_overloads(registry))
        for node in program.graph.nodes:
            if node.op in ("call_module", "call_method"):
                return False
            if node.op == "call_function" and not (
                node.target in implemented
                or node.target in assertions
                or getattr(node.target, "__module__", None) in ("operator", "_operator")
            ):
                return False
        return True

    def decompose_with_registry(program, registry):
        return program if translatable(program, registry) else decompose(program, registry)

    with overridden(_fx_passes.__name__, "decompose_with_registry", decompose_with_registry):
        yield


def _assertion_ops() -> frozenset:
    """What the exporter's ``remove_assertion_nodes`` drops after decomposing."""
    aten = torch.ops.aten
    return frozenset(
        {
            aten.sym_constrain_range_for_size.default,
            aten._assert_async.default,
            aten._assert_async.msg,
            aten._assert_scalar.default,
            aten._assert_tensor_metadata.default,
        }
    )


class _Registries:
    """torch's registries of torchlib functions as built, per opset version (``kept``), and how
    many operators torch had when each was built (``built_with``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: dict[int, object] = {}
        self.built_with: dict[int, int] = {}


@functools.cache  # one per process: what torch's exporter would build again on every call
def _registries() -> _Registries:
    return _Registries()


@contextlib.contextmanager
def reused_torchlib_registry() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` starts from a copy of one registry of torchlib
    functions per opset instead of building it again (:data:`ONNX_REGISTRY`).

    The exporter builds that registry on every call (parsing the source of ~500 onnxscript
    functions: 0.55 s on the 2-core machine), and an ONNX export calls it once per layer body.
    The copy has its own per-op lists, so the custom translations the exporter registers into
    it never reach the kept one; the functions they list are torch's own, shared read-only.
    The registry holds a translation for each operator that exists when it is built, so it is
    built again once more operators are registered (an import of
    ``torch.ao.quantization.fx._decomposed``, a custom op library)."""
    if not ONNX_REGISTRY.known():
        yield
        return
    try:
        from torch.onnx._internal.exporter import _registration

        registry_type = _registration.ONNXRegistry
        built = registry_type.__dict__["from_torchlib"]
        operators = torch._C._dispatch_get_all_op_names
        probe = registry_type()
        if not (
            isinstance(built, classmethod) and isinstance(probe.functions, dict) and hasattr(probe, "_opset_version")
        ):
            raise AttributeError("ONNXRegistry has another shape")
    except (ImportError, AttributeError, KeyError, TypeError) as exc:
        ONNX_REGISTRY.skipped(f"the exporter has another shape ({type(exc).__name__}: {exc})")
        yield
        return

    def from_torchlib(cls, opset_version=probe.opset_version):
        count, held = len(operators()), _registries()
        with held.lock:
            if opset_version not in held.kept or held.built_with.get(opset_version) != count:
                held.kept[opset_version] = built.__func__(cls, opset_version)
                held.built_with[opset_version] = count
            kept = held.kept[opset_version]
        copy = cls()
        copy._opset_version = kept._opset_version
        copy.functions = {target: list(metas) for target, metas in kept.functions.items()}
        return copy

    with overridden(f"{_registration.__name__}.ONNXRegistry", "from_torchlib", classmethod(from_torchlib)):
        yield


class _DropRecords(logging.Filter):
    """Drops the log records whose message starts with ``prefix``; the others pass."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def without_torchvision_notice() -> Iterator[None]:
    """Within the block, the ONNX exporter's registry does not log, once per export, every
    torchvision op it cannot register when torchvision is absent (:data:`ONNX_TORCHVISION_NOTICE`;
    serving graphs never hold one, so the records are noise for looptool)."""
    if not ONNX_TORCHVISION_NOTICE.known():
        yield
        return
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    notice = _DropRecords("torchvision is not installed")
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


# ---------------------------------------------------------------------- transformers' GGUF load
@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf's ``GGUFReader`` and ``get_tensor_name_map`` are memoised
    (:data:`GGUF_READER`).

    transformers' GGUF load constructs a ``GGUFReader`` of the same file three times (for the
    config, the weights and the tokenizer), each parsing every metadata field (SmolLM2's
    49,152-token vocabulary: about 6 s a time on the 2-core machine), and builds gguf's tensor
    name map again for every module of the model (397 times for SmolLM2, about 9 s in all).
    Both are functions of their arguments only, and transformers only reads what they return,
    so one reader per file and one map per architecture serve the whole load. transformers
    imports both names from ``gguf`` at call time, so replacing the module's attributes
    (:func:`overridden`, restored on leaving) reaches it. Without ``gguf`` installed the block
    changes nothing (the load then says what to install)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    if not GGUF_READER.known():
        yield
        return
    reader_class = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with overridden("gguf", "GGUFReader", reader), overridden("gguf", "get_tensor_name_map", name_map):
        yield
