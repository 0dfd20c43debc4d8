"""How looptool runs torch's tracers (``torch.export`` in capture, ``torch.onnx.export`` in
the backends): without the Python stack trace torch.fx records on every traced node."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0
_SAVED: object = None


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Trace without ``node.meta["stack_trace"]`` (``torch.fx.config.do_not_emit_stack_traces``).

    looptool reads no stack trace of a traced node, and the ONNX backend strips them from the
    graphs it writes; extracting and symbolising one per node is about a tenth of a capture
    (three tiny-model captures: 8.7–9.6 s with them, 7.8 s without, on the 2-core machine).
    The user's setting is restored on exit; nested and concurrent uses share one override. A
    torch without the setting traces as before."""
    global _DEPTH, _SAVED
    import torch.fx.config as fx_config

    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _SAVED = fx_config.do_not_emit_stack_traces
            fx_config.do_not_emit_stack_traces = True
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                fx_config.do_not_emit_stack_traces = _SAVED
