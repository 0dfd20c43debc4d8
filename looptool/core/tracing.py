"""How looptool runs torch's tracers (``torch.export`` in capture, ``torch.onnx.export`` in
the backends): without the Python stack trace torch.fx records on every traced node, and,
where it is measured to be slower, without FakeTensor's dispatch cache; and
:func:`overridden`, the one way looptool replaces a library's module or class attribute for a
block (these config settings, the ONNX exporter's decomposition step and registry, gguf's
reader)."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH: dict[tuple[str, str], int] = {}  # (owner, attribute) -> nesting depth
_SAVED: dict[tuple[str, str], object] = {}  # the value before, restored when the depth returns to 0
_INHERITED = object()  # saved for a class attribute the class itself does not define


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
    slot = (owner, name)
    with _LOCK:
        if not _DEPTH.get(slot):
            if isinstance(target, type):
                _SAVED[slot] = vars(target).get(name, _INHERITED)
            else:
                _SAVED[slot] = getattr(target, name)
            setattr(target, name, value)
        _DEPTH[slot] = _DEPTH.get(slot, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[slot] -= 1
            if not _DEPTH[slot]:
                saved = _SAVED.pop(slot)
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


def without_stack_traces() -> contextlib.AbstractContextManager[None]:
    """Trace without ``node.meta["stack_trace"]`` (``torch.fx.config.do_not_emit_stack_traces``).

    looptool reads no stack trace of a traced node, and the ONNX backend strips them from the
    graphs it writes; extracting and symbolising one per node is about a tenth of a capture
    (three tiny-model captures: 8.7–9.6 s with them, 7.8 s without, on the 2-core machine)."""
    return overridden("torch.fx.config", "do_not_emit_stack_traces", True)


@contextlib.contextmanager
def fast_tracing(*, fake_tensor_cache: bool = True) -> Iterator[None]:
    """The settings looptool traces under: :func:`without_stack_traces`, and with
    ``fake_tensor_cache=False`` FakeTensor's dispatch cache off
    (``torch._dynamo.config.fake_tensor_cache_enabled``, read when a trace creates its
    fake mode). The cache costs a fixed ~0.6 s a trace and pays back on long repeated layer
    stacks only. Measured on the 2-core machine (torch 2.13, 1 thread, alternating rounds,
    cache on / off): the forward export of a 2-layer tiny Llama 1.6 / 0.9 s, 4 layers 2.1 /
    1.4 s, 8 layers 2.9 / 3.0 s, 16 layers 4.5 / 4.6 s, SmolLM2's 30 layers 8.7 / 10.9 s;
    SmolLM2's cached decode step 19.3 / 14.2 s; an ONNX export of two budgets of a tiny Llama
    (small per-layer bodies) 17.2 / 11.9 s. The traced graph has the same ops either way."""
    with without_stack_traces(), contextlib.ExitStack() as stack:
        if not fake_tensor_cache:
            stack.enter_context(overridden("torch._dynamo.config", "fake_tensor_cache_enabled", False))
        yield
