"""Two speed-ups of ``torch.onnx.export``'s own steps, used around every export
(:func:`faster_exporter`): the torchlib registry built once per opset and copied, and the
decomposition retrace skipped for a program whose every op has a translation. Each patches
one function of torch's exporter for the duration of the block and steps aside (exporting as
before) when that exporter has another shape.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from looptool.core.tracing import overridden


@contextlib.contextmanager
def faster_exporter() -> Iterator[None]:
    """Both speed-ups: :func:`reused_torchlib_registry` and :func:`decompose_only_what_onnx_lacks`."""
    with reused_torchlib_registry(), decompose_only_what_onnx_lacks():
        yield


@contextlib.contextmanager
def decompose_only_what_onnx_lacks() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` skips its decomposition of an exported program
    whose every op has an ONNX translation.

    Before translating, the exporter runs ``ExportedProgram.run_decompositions`` with a table
    of the ops that have *no* translation. That retraces the whole program under fake tensors
    even when no op of it is in the table (looptool's graphs are already ATen graphs), and it
    costs about as much as the export's own trace: 0.85 s of a layer body's 1.7 s on the
    2-core machine. The retrace then changes no op, so it is skipped when every node is a
    call of a translated op (or an assertion the exporter removes next, or a Python
    ``operator``), the program has no nested graphs and its signature no mutations; anything
    else is decomposed as before. A torch whose exporter has another shape exports as before."""
    try:
        from torch.export.graph_signature import InputKind, OutputKind
        from torch.onnx._internal.exporter import _decomp, _fx_passes

        decompose = _fx_passes.decompose_with_registry
        implemented_overloads = _decomp.get_onnx_implemented_overloads
    except (ImportError, AttributeError):
        yield
        return
    plain_inputs = {InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR}

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
                or node.target in _ASSERTIONS
                or getattr(node.target, "__module__", None) in ("operator", "_operator")
            ):
                return False
        return True

    def decompose_with_registry(program, registry):
        return program if translatable(program, registry) else decompose(program, registry)

    with overridden(_fx_passes.__name__, "decompose_with_registry", decompose_with_registry):
        yield


_ASSERTIONS = {  # what the exporter's remove_assertion_nodes drops after decomposing
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
}


_REGISTRY_LOCK = threading.Lock()
_PRISTINE: dict[int, object] = {}  # opset version -> torch's registry of torchlib functions, as built


@contextlib.contextmanager
def reused_torchlib_registry() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` starts from a copy of one registry of torchlib
    functions per opset instead of building it again.

    The exporter builds that registry on every call (parsing the source of ~500 onnxscript
    functions: 0.55 s on the 2-core machine), and an ONNX export calls it once per layer body.
    The copy has its own per-op lists, so the custom translations the exporter registers into
    it never reach the kept one; the functions they list are torch's own, shared read-only.
    A torch whose registry has another shape exports as before."""
    try:
        from torch.onnx._internal.exporter import _registration

        registry_type = _registration.ONNXRegistry
        built = registry_type.__dict__["from_torchlib"]
        probe = registry_type()
        if not (
            isinstance(built, classmethod) and isinstance(probe.functions, dict) and hasattr(probe, "_opset_version")
        ):
            raise AttributeError("unexpected ONNXRegistry")
    except (ImportError, AttributeError, KeyError, TypeError):
        yield
        return

    def from_torchlib(cls, opset_version=probe.opset_version):
        with _REGISTRY_LOCK:
            if opset_version not in _PRISTINE:
                _PRISTINE[opset_version] = built.__func__(cls, opset_version)
            kept = _PRISTINE[opset_version]
        copy = cls()
        copy._opset_version = kept._opset_version
        copy.functions = {target: list(metas) for target, metas in kept.functions.items()}
        return copy

    with overridden(f"{_registration.__name__}.ONNXRegistry", "from_torchlib", classmethod(from_torchlib)):
        yield
