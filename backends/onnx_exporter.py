"""The ONNX exporter as looptool runs it: ``torch.onnx.export`` under two of
:mod:`looptool.core.compat`'s patches of its internals (each behind its version check)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from looptool.core.compat import (  # noqa: F401  (_PRISTINE: read by tests/test_onnx_body_cache.py)
    _PRISTINE,
    decompose_only_what_onnx_lacks,
    reused_torchlib_registry,
    without_torchvision_notice,
)


@contextlib.contextmanager
def faster_exporter() -> Iterator[None]:
    """Both speed-ups, :func:`~looptool.core.compat.reused_torchlib_registry` and
    :func:`~looptool.core.compat.decompose_only_what_onnx_lacks`, and the exporter's
    torchvision notice dropped (:func:`~looptool.core.compat.without_torchvision_notice`)."""
    with reused_torchlib_registry(), decompose_only_what_onnx_lacks(), without_torchvision_notice():
        yield
