"""How looptool runs torch's tracers (``torch.export`` in capture, ``torch.onnx.export`` in
the backends): without the Python stack trace torch.fx records on every traced node, and,
where it is measured to be slower, without FakeTensor's dispatch cache. Both settings are
patches of torch's configuration, kept with their version checks in :mod:`looptool.core.compat`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from looptool.core.compat import without_fake_tensor_cache, without_stack_traces


@contextlib.contextmanager
def fast_tracing(*, fake_tensor_cache: bool = True) -> Iterator[None]:
    """The settings looptool traces under: :func:`~looptool.core.compat.without_stack_traces`
    (looptool reads no stack trace of a traced node, and the ONNX backend strips them from the
    graphs it writes; extracting and symbolising one per node is about a tenth of a capture:
    three tiny-model captures took 8.7–9.6 s with them, 7.8 s without, on the 2-core machine),
    and with ``fake_tensor_cache=False``
    :func:`~looptool.core.compat.without_fake_tensor_cache`. The cache costs a fixed ~0.6 s a
    trace and pays back on long repeated layer stacks only. Measured on the 2-core machine
    (torch 2.13, 1 thread, alternating rounds, cache on / off): the forward export of a 2-layer
    tiny Llama 1.6 / 0.9 s, 4 layers 2.1 / 1.4 s, 8 layers 2.9 / 3.0 s, 16 layers 4.5 / 4.6 s,
    SmolLM2's 30 layers 8.7 / 10.9 s; SmolLM2's cached decode step 19.3 / 14.2 s; an ONNX
    export of two budgets of a tiny Llama (small per-layer bodies) 17.2 / 11.9 s. The traced
    graph has the same ops either way."""
    with without_stack_traces(), contextlib.ExitStack() as stack:
        if not fake_tensor_cache:
            stack.enter_context(without_fake_tensor_cache())
        yield
