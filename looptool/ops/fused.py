"""The fused looptool ops: ``looptool::gated_residual``, ``looptool::adaptive_delta``,
``looptool::modulate`` and ``looptool::moe`` as ``torch.library`` custom ops.

Each op has a reference implementation in plain torch that performs the very same
arithmetic, in the same order, as the subgraph the ``fuse`` pass replaces (so fusing is
bit-exact in eager fp32), a fake kernel so the ops survive ``torch.export``, an autograd
formula obtained by differentiating the reference implementation, and a CUDA kernel: the
Triton launchers of :mod:`looptool.ops.kernels`, imported on the first CUDA call (so a
CPU-only install never imports triton).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

NAMESPACE = "looptool"


# ---------------------------------------------------------------------------- gated residual
def gated_residual_reference(x: Tensor, gate: Tensor, f: Tensor) -> Tensor:
    """``x + tanh(gate) * f``: a second-pass write into the residual stream (Accordion Eq. 5)."""
    return x + torch.tanh(gate) * f


@torch.library.custom_op(f"{NAMESPACE}::gated_residual", mutates_args=())
def gated_residual(x: Tensor, gate: Tensor, f: Tensor) -> Tensor:
    """``x + tanh(gate) ⊙ f`` (Accordion Eq. 5); ``gate`` broadcasts over the channels."""
    return gated_residual_reference(x, gate, f)


@gated_residual.register_fake
def _gated_residual_fake(x: Tensor, gate: Tensor, f: Tensor) -> Tensor:
    shape = torch.broadcast_shapes(x.shape, gate.shape, f.shape)
    return x.new_empty(shape, dtype=torch.result_type(x, f))


# ---------------------------------------------------------------------------- adaptive delta
def adaptive_delta_reference(
    s_prev: Tensor, r: Tensor, s_tilde: Tensor, weight: Tensor, bias: Tensor, gamma: Tensor, exit: Tensor | None = None
) -> Tensor:
    """ELR state update ``s_i = s_{i-1} + e ⊙ β_i ⊙ (r_i − s_{i-1})`` with
    ``β_i = σ(W s̃_i + b) ⊙ softplus(γ)`` (ELR Eq. 2); ``e`` is the exit factor (None: 1).

    The operations and their order match what ``passes/recurrent_loop.py`` emits, so the
    fused op is bit-exact against the unfused path.
    """
    step = r - s_prev
    beta = torch.sigmoid(torch.nn.functional.linear(s_tilde, weight, bias)) * torch.nn.functional.softplus(gamma)
    step = beta * step
    if exit is not None:
        step = exit * step
    return s_prev + step


@torch.library.custom_op(f"{NAMESPACE}::adaptive_delta", mutates_args=())
def adaptive_delta(
    s_prev: Tensor, r: Tensor, s_tilde: Tensor, weight: Tensor, bias: Tensor, gamma: Tensor, exit: Tensor | None = None
) -> Tensor:
    """The ELR adaptive-delta state update, gate computation included (ELR Eq. 2)."""
    return adaptive_delta_reference(s_prev, r, s_tilde, weight, bias, gamma, exit)


@adaptive_delta.register_fake
def _adaptive_delta_fake(s_prev, r, s_tilde, weight, bias, gamma, exit=None):
    shapes = [s_prev.shape, r.shape, s_tilde.shape[:-1] + (weight.shape[0],), gamma.shape]
    if exit is not None:
        shapes.append(exit.shape)
    return s_prev.new_empty(torch.broadcast_shapes(*shapes))


# ---------------------------------------------------------------------------- conditioning modulation
def modulate_reference(x: Tensor, scale: Tensor, shift: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """A branch's loop-conditioned input (ELR Sec. 3.3, Eq. 4): ``x~ = shift + scale ⊙ x``,
    then ``x~ + A (B' x~)`` with ``B' = diag(g(c)) B`` [r, d] (``down``) and ``A`` [d, r] (``up``).

    ``x`` is the branch's normalised input, ``scale = 1 + λ(c)`` and ``shift = μ(c)`` per
    channel; the operations and their order are the ones ``passes/conditioning.py`` emits."""
    x_t = torch.addcmul(shift, scale, x)
    return x_t + torch.nn.functional.linear(torch.nn.functional.linear(x_t, down), up)


@torch.library.custom_op(f"{NAMESPACE}::modulate", mutates_args=())
def modulate(x: Tensor, scale: Tensor, shift: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """Loop-conditioned branch input with its gated low-rank correction (ELR Eq. 4)."""
    return modulate_reference(x, scale, shift, down, up)


@modulate.register_fake
def _modulate_fake(x, scale, shift, down, up):
    return x.new_empty(torch.broadcast_shapes(x.shape, scale.shape, shift.shape))


# ---------------------------------------------------------------------------- mixture of experts
def moe_reference(
    x: Tensor, routing_weights: Tensor, expert_ids: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    """Top-k expert dispatch, gated-SiLU expert FFN and weighted combine.

    ``x`` [T, d] tokens; ``routing_weights`` / ``expert_ids`` [T, k] the router's top-k
    choice; ``gate_up_proj`` [E, 2I, d] (gate rows first, then up rows) and ``down_proj``
    [E, d, I]. Returns ``Σ_j w_tj · down_e (silu(gate_e x_t) ⊙ up_e x_t)``, e = ids[t, j].

    Token-expert pairs are sorted by expert and each expert runs one matmul over its
    tokens, then pairs are restored to token order and summed over ``k`` — the arithmetic
    of the source's grouped experts implementation, so the result matches it.
    """
    tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat_ids)
    xs = x[perm // top_k]
    weights = routing_weights.reshape(-1)[perm]
    counts = torch.bincount(sorted_ids, minlength=gate_up_proj.shape[0]).tolist()
    inter = down_proj.shape[2]
    hidden = xs.new_zeros(xs.shape[0], 2 * inter)
    start = 0
    for e, n in enumerate(counts):
        if n:
            hidden[start : start + n] = torch.mm(xs[start : start + n], gate_up_proj[e].transpose(-2, -1))
        start += n
    gate, up = hidden.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    out = xs.new_zeros(xs.shape[0], down_proj.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = torch.mm(act[start : start + n], down_proj[e].transpose(-2, -1))
        start += n
    out = out * weights.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


@torch.library.custom_op(f"{NAMESPACE}::moe", mutates_args=())
def moe(x: Tensor, routing_weights: Tensor, expert_ids: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """Mixture-of-experts dispatch + expert FFN + weighted combine (see :func:`moe_reference`)."""
    return moe_reference(x, routing_weights, expert_ids, gate_up_proj, down_proj)


@moe.register_fake
def _moe_fake(x, routing_weights, expert_ids, gate_up_proj, down_proj):
    return x.new_empty(x.shape[0], down_proj.shape[1])


# ---------------------------------------------------------------------------- autograd
def _register_reference_autograd(op, reference: Callable[..., Tensor], n_inputs: int) -> None:
    """Backward of ``op`` = the vector-Jacobian product of its reference implementation."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[t if isinstance(t, Tensor) else None for t in inputs])
        ctx.is_tensor = [isinstance(t, Tensor) for t in inputs]

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        inputs = [
            t.detach().requires_grad_(t.is_floating_point()) if is_t else None for t, is_t in zip(saved, ctx.is_tensor)
        ]
        with torch.enable_grad():
            out = reference(*inputs)
        wrt = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
        return tuple(next(grads) if t is not None and t.requires_grad else None for t in inputs)[:n_inputs]

    op.register_autograd(backward, setup_context=setup_context)


_register_reference_autograd(gated_residual, gated_residual_reference, 3)
_register_reference_autograd(adaptive_delta, adaptive_delta_reference, 7)
_register_reference_autograd(moe, moe_reference, 5)
_register_reference_autograd(modulate, modulate_reference, 5)


# ---------------------------------------------------------------------------- CUDA kernels
def _register_triton(op, name: str, reference: Callable[..., Tensor]) -> None:
    """CUDA implementation of ``op``: the Triton launcher ``looptool.ops.kernels.<name>``,
    imported on first use; the reference where triton is missing (a CUDA torch without it)."""

    def cuda(*args):
        try:
            from looptool.ops import kernels
        except ImportError:  # pragma: no cover - CUDA torch wheels ship triton
            return reference(*args)
        return kernels.LAUNCHERS[name](*args)

    op.register_kernel("cuda")(cuda)


for _op, _name, _ref in (
    (gated_residual, "gated_residual", gated_residual_reference),
    (adaptive_delta, "adaptive_delta", adaptive_delta_reference),
    (modulate, "modulate", modulate_reference),
    (moe, "moe", moe_reference),
):
    _register_triton(_op, _name, _ref)
