"""The Triton kernels of looptool's fused ops against their torch references.

On a machine without CUDA they run under ``TRITON_INTERPRET=1`` on CPU tensors (set in
conftest before triton is imported); ``tests/gpu`` runs the same launchers on CUDA. fp32
must match the reference to float rounding; in fp16/bf16 a kernel (fp32 math inside) must
be no further from the fp32 result than the reference computed in that dtype is.
"""

from __future__ import annotations

import pytest
import torch

from looptool.ops import fused

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
kernels = pytest.importorskip("looptool.ops.kernels")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = (torch.float16, torch.bfloat16)


def _randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _check_low_precision(kernel, reference, args, dtype):
    """kernel(args in ``dtype``) is no further from the fp32 result *on the same rounded
    inputs* than the reference computed in ``dtype`` is, give or take two output ulps."""
    low = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    exact = reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in low])
    got, ref_low = kernel(*low), reference(*low)
    assert got.dtype == ref_low.dtype == dtype
    err = (got.float() - exact).abs().max().item()
    ref_err = (ref_low.float() - exact).abs().max().item()
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    assert err <= ref_err + 2 * ulp, (err, ref_err, ulp)


def test_interpreter_is_on_where_there_is_no_gpu():
    assert kernels.INTERPRET == (not torch.cuda.is_available())


@pytest.mark.parametrize(
    "shape,gate_shape", [((2, 5, 48), (48,)), ((7, 33), (33,)), ((3, 4, 16), (3, 4, 16)), ((2, 3, 8), (1, 1, 8))]
)
def test_gated_residual(shape, gate_shape):
    x, f, gate = _randn(*shape), _randn(*shape, seed=1), _randn(*gate_shape, seed=2)
    ref = fused.gated_residual_reference(x, gate, f)
    torch.testing.assert_close(kernels.gated_residual(x, gate, f), ref, rtol=1e-6, atol=1e-6)
    for dtype in LOW:
        _check_low_precision(kernels.gated_residual, fused.gated_residual_reference, (x, gate, f), dtype)


@pytest.mark.parametrize("with_exit", [True, False])
def test_adaptive_delta(with_exit):
    d = 40
    s, r, st = _randn(2, 5, d), _randn(2, 5, d, seed=1), _randn(2, 5, d, seed=2)
    w, b = _randn(d, d, scale=d**-0.5, seed=3), _randn(d, seed=4)
    gamma = _randn(d, scale=15.0, seed=5)  # both sides of softplus's threshold (20)
    gamma[:3] = torch.tensor([25.0, 20.0, -30.0])
    e = _randn(d, seed=6) if with_exit else None
    args = (s, r, st, w, b, gamma, e)
    torch.testing.assert_close(
        kernels.adaptive_delta(*args), fused.adaptive_delta_reference(*args), rtol=1e-5, atol=1e-5
    )
    for dtype in LOW:
        _check_low_precision(kernels.adaptive_delta, fused.adaptive_delta_reference, args, dtype)


@pytest.mark.parametrize("rank,d", [(4, 48), (16, 40), (20, 64)])
def test_modulate(rank, d):
    x = _randn(2, 7, d)
    scale, shift = 1 + _randn(d, scale=0.3, seed=1), _randn(d, scale=0.3, seed=2)
    down, up = _randn(rank, d, scale=d**-0.5, seed=3), _randn(d, rank, scale=rank**-0.5, seed=4)
    args = (x, scale, shift, down, up)
    torch.testing.assert_close(kernels.modulate(*args), fused.modulate_reference(*args), rtol=1e-5, atol=1e-5)
    for dtype in LOW:
        _check_low_precision(kernels.modulate, fused.modulate_reference, args, dtype)


def _moe_case(tokens, d, inter, experts, top_k, seed=0, skew=False):
    x = _randn(tokens, d, seed=seed)
    gate_up, down = (
        _randn(experts, 2 * inter, d, scale=d**-0.5, seed=seed + 1),
        _randn(experts, d, inter, scale=inter**-0.5, seed=seed + 2),
    )
    logits = _randn(tokens, experts, seed=seed + 3)
    if skew:  # expert 0 never chosen, expert 1 by every token: empty and multi-block experts
        logits[:, 0] = -1e4
        logits[:, 1] = 1e4
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize(
    "tokens,d,inter,experts,top_k,skew",
    [(37, 48, 40, 6, 2, False), (16, 32, 24, 4, 1, False), (50, 32, 16, 5, 2, True), (3, 16, 16, 8, 4, False)],
)
def test_moe(tokens, d, inter, experts, top_k, skew):
    args = _moe_case(tokens, d, inter, experts, top_k, skew=skew)
    torch.testing.assert_close(kernels.moe(*args), fused.moe_reference(*args), rtol=1e-5, atol=1e-5)
    for dtype in LOW:
        _check_low_precision(kernels.moe, fused.moe_reference, args, dtype)


def test_moe_blocks_route_every_pair_once_to_its_expert():
    _, _, ids, _, _ = _moe_case(50, 8, 8, 5, 2, skew=True)
    block = 16
    rows, block_expert, used = kernels.moe_blocks(ids, 5, block)
    flat = ids.reshape(-1)
    real = rows[rows >= 0]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair exactly once
    assert used.item() % block == 0 and (rows[used.item() :] == -1).all()
    for b in range(used.item() // block):
        pairs = rows[b * block : (b + 1) * block]
        pairs = pairs[pairs >= 0]
        assert pairs.numel() and (flat[pairs] == block_expert[b]).all()  # a block holds one expert's pairs
    counts = torch.bincount(flat, minlength=5)
    assert used.item() == sum(-(-c // block) * block for c in counts.tolist())  # no block for expert 0


def test_cuda_dispatch_runs_the_triton_launchers():
    for name in ("gated_residual", "adaptive_delta", "modulate", "moe"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"looptool::{name}", "CUDA"), name
    assert set(kernels.LAUNCHERS) == {"gated_residual", "adaptive_delta", "modulate", "moe"}


# ---------------------------------------------------------------------------- the MoE steps (TensorRT's plugins)
MOE_CASES = [  # tokens, d, inter, experts, top_k, skew
    (37, 48, 40, 6, 2, False),
    (16, 32, 24, 4, 1, False),
    (50, 32, 16, 5, 2, True),
    (3, 16, 16, 8, 4, False),
    (70, 16, 16, 40, 8, False),  # 560 pairs: the align kernel's pair steps (PAIRS = 64 for 40 experts) loop
]


@pytest.mark.parametrize("tokens,d,inter,experts,top_k,skew", MOE_CASES)
def test_moe_align_routes_like_moe_blocks(tokens, d, inter, experts, top_k, skew):
    """One program computes ``moe_blocks``' routing (the same rows in the same order, the
    token of each pair instead of the pair, the same block experts and rows in use) and each
    pair's row."""
    from looptool.ops import moe_kernels

    _, _, ids, _, _ = _moe_case(tokens, d, inter, experts, top_k, skew=skew)
    rows, block_expert, used, pair_row = moe_kernels.moe_align(ids, experts, 16)
    ref_rows, ref_blocks, ref_used = kernels.moe_blocks(ids, experts, 16)
    assert rows.dtype == block_expert.dtype == used.dtype == pair_row.dtype == torch.int32
    assert rows.numel() == 16 * block_expert.numel() == 16 * moe_kernels.max_blocks(tokens * top_k, experts, 16)
    assert torch.equal(rows.long(), torch.where(ref_rows >= 0, ref_rows // top_k, -1))
    assert torch.equal(block_expert.long(), ref_blocks) and torch.equal(used.long(), ref_used)
    pairs = torch.arange(tokens * top_k, device=ids.device)
    assert torch.equal(ref_rows[pair_row.reshape(-1).long()], pairs)  # each pair's row holds that pair


@pytest.mark.parametrize("tokens,d,inter,experts,top_k,skew", MOE_CASES[:3])
def test_each_moe_step_computes_its_part_of_the_reference(tokens, d, inter, experts, top_k, skew):
    """Gate-up: ``silu(x W_gateᵀ) ⊙ x W_upᵀ`` of each row's token and block expert (0 on
    padding); down: ``act W_downᵀ`` in fp32; combine: ``Σ_j w_tj · out[row(t, j)]``. fp32,
    to float rounding."""
    from looptool.ops import moe_kernels

    x, weights, ids, gate_up, down = _moe_case(tokens, d, inter, experts, top_k, skew=skew)
    rows, block_expert, used, pair_row = moe_kernels.moe_align(ids, experts, 16)
    n = int(used)
    expert = block_expert.long().repeat_interleave(16)[:n]
    token = rows[:n].long()
    xs = torch.where((token >= 0)[:, None], x[token.clamp(min=0)], 0.0)
    hidden = torch.einsum("rd,rhd->rh", xs, gate_up[expert])
    gate, up = hidden.chunk(2, dim=-1)
    act = moe_kernels.moe_gate_up(x, gate_up, rows, block_expert, used, 16)
    torch.testing.assert_close(act[:n], torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    out = moe_kernels.moe_down(act, down, block_expert, used, 16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[:n], torch.einsum("ri,rdi->rd", act[:n], down[expert]), rtol=1e-5, atol=1e-5)
    y = moe_kernels.moe_combine(out, pair_row, weights)
    torch.testing.assert_close(y, (out[pair_row.long()] * weights[..., None]).sum(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,d,inter,experts,top_k,skew", MOE_CASES)
def test_the_four_moe_steps_equal_the_moe_reference(tokens, d, inter, experts, top_k, skew):
    """Align → gate-up → down → combine (what a TensorRT engine runs) is ``moe_reference``:
    fp32 to float rounding, and the fused launcher's result; fp16/bf16 no further from the
    fp32 result than the reference in that dtype."""
    from looptool.ops import moe_kernels

    args = _moe_case(tokens, d, inter, experts, top_k, skew=skew)
    got = moe_kernels.moe_steps(*args)
    torch.testing.assert_close(got, fused.moe_reference(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, kernels.moe(*args), rtol=1e-6, atol=1e-6)
    for dtype in LOW:
        _check_low_precision(moe_kernels.moe_steps, fused.moe_reference, args, dtype)
