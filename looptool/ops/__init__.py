"""looptool's fused ops (``torch.library`` custom ops with reference and fake kernels).

Importing this package registers ``torch.ops.looptool.gated_residual``,
``torch.ops.looptool.adaptive_delta``, ``torch.ops.looptool.modulate`` and
``torch.ops.looptool.moe``, each with a Triton kernel for CUDA tensors
(:mod:`looptool.ops.kernels`). The ``fuse`` pass
(:mod:`looptool.passes.fuse`) swaps the matching subgraphs of a budget path for them; the
ONNX backend lowers them to nodes of the ``looptool`` domain with ONNX function bodies.
"""

from looptool.ops.fused import (
    NAMESPACE,
    adaptive_delta,
    adaptive_delta_reference,
    gated_residual,
    gated_residual_reference,
    modulate,
    modulate_reference,
    moe,
    moe_reference,
)

__all__ = [
    "NAMESPACE",
    "adaptive_delta",
    "adaptive_delta_reference",
    "gated_residual",
    "gated_residual_reference",
    "modulate",
    "modulate_reference",
    "moe",
    "moe_reference",
]
