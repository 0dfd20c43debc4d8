"""Fused ops (looptool::gated_residual / adaptive_delta / moe) and the fuse pass."""

from __future__ import annotations

import pytest
import torch

import looptool
from looptool.core.errors import PassError
from looptool.core.graph import annotation, shared_graph_module
from looptool.passes import PassManager
from looptool.passes.fuse import fuse_graph
from looptool.testing import tiny_model

MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


def _perturbed(model):
    """Non-zero gates and state-update weights, so fused ops really compute something."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def test_gated_residual_matches_formula_and_gradients():
    x, f = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    g = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out = torch.ops.looptool.gated_residual(x, g, f)
    assert torch.equal(out, x + torch.tanh(g) * f)
    torch.autograd.gradcheck(
        lambda a, b, c: torch.ops.looptool.gated_residual(a, b, c), (x.requires_grad_(), g, f.requires_grad_())
    )


def test_adaptive_delta_is_eq2_and_has_gradients():
    d = 6
    s, r, st = (torch.randn(2, 3, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(d, d, dtype=torch.float64, requires_grad=True)
    b, gamma, e = (torch.randn(d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    beta = torch.sigmoid(st @ w.T + b) * torch.nn.functional.softplus(gamma)
    expected = s + e * beta * (r - s)  # ELR Eq. 2 with the exit factor e
    assert torch.allclose(torch.ops.looptool.adaptive_delta(s, r, st, w, b, gamma, e), expected)
    assert torch.allclose(torch.ops.looptool.adaptive_delta(s, r, st, w, b, gamma, None), s + beta * (r - s))
    torch.autograd.gradcheck(lambda *a: torch.ops.looptool.adaptive_delta(*a), (s, r, st, w, b, gamma, e))


def test_moe_matches_dense_definition_and_has_gradients():
    g = torch.Generator().manual_seed(0)
    T, d, inter, E, k = 7, 8, 5, 4, 2
    x = torch.randn(T, d, generator=g, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(E, 2 * inter, d, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(E, d, inter, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), -1)
    w, ids = probs.topk(k, dim=-1)
    w.requires_grad_()
    expected = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            h = gate_up[e] @ x[t]
            expected[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    out = torch.ops.looptool.moe(x, w, ids, gate_up, down)
    assert torch.allclose(out, expected)
    torch.autograd.gradcheck(lambda a, b, c, dd: torch.ops.looptool.moe(a, b, ids, c, dd), (x, w, gate_up, down))


def test_fake_kernels_survive_torch_export():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.randn(8))
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.gate_up = torch.nn.Parameter(torch.randn(3, 10, 8))
            self.down = torch.nn.Parameter(torch.randn(3, 8, 5))

        def forward(self, x, f):
            y = torch.ops.looptool.gated_residual(x, self.gate, f)
            y = torch.ops.looptool.adaptive_delta(x, y, f, self.w, self.gate, self.gate, None)
            flat = y.reshape(-1, 8)
            w, ids = torch.softmax(flat @ self.w, -1)[:, :3].topk(2, dim=-1)
            return torch.ops.looptool.moe(flat, w, ids, self.gate_up, self.down)

    m = Block()
    x, f = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    dims = {0: torch.export.Dim("b"), 1: torch.export.Dim("s")}
    ep = torch.export.export(m, (x, f), dynamic_shapes=(dims, dims))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"looptool.gated_residual.default", "looptool.adaptive_delta.default", "looptool.moe.default"} <= targets
    x2, f2 = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    assert torch.equal(ep.module()(x2, f2), m(x2, f2))


def test_modulate_matches_eq4_elementwise_and_has_gradients():
    """The modulation by an explicit per-token, per-channel loop (not the op's own body)."""
    g = torch.Generator().manual_seed(1)
    d, r = 6, 2
    x = torch.randn(2, 3, d, generator=g, dtype=torch.float64, requires_grad=True)
    scale, shift = (torch.randn(d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    down = torch.randn(r, d, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(d, r, generator=g, dtype=torch.float64, requires_grad=True)
    out = torch.ops.looptool.modulate(x, scale, shift, down, up)
    xv, sc, sh, dn, u = (p.detach() for p in (x, scale, shift, down, up))  # the reference reads values only
    for b in range(2):
        for t in range(3):
            xt = [float(sh[c] + sc[c] * xv[b, t, c]) for c in range(d)]
            low = [sum(float(dn[j, c]) * xt[c] for c in range(d)) for j in range(r)]
            want = [xt[c] + sum(float(u[c, j]) * low[j] for j in range(r)) for c in range(d)]
            assert torch.allclose(out[b, t].detach(), torch.tensor(want, dtype=torch.float64))
    torch.autograd.gradcheck(lambda *a: torch.ops.looptool.modulate(*a), (x, scale, shift, down, up))


# ---------------------------------------------------------------------------- fuse pass
@pytest.mark.parametrize(
    "arch,scheme",
    [
        ("llama", "prefix"),
        ("gpt_neox", "prefix"),
        ("llama", "recurrent"),
        ("gpt_neox", "recurrent"),
        ("qwen3_moe", "prefix"),
        ("mixtral", "recurrent"),
        ("olmoe", "prefix"),
        ("qwen2_moe", "recurrent"),
        ("llama", "conditioned"),
        ("qwen3_moe", "conditioned"),
    ],
)
def test_fuse_counts_and_numerics(arch, scheme, input_ids):
    source = tiny_model(arch)
    if scheme == "prefix":
        plan = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
    else:
        plan = looptool.RecurrentLoop(
            recurrent=(1, 3), max_loops=3, route_replay=arch == "mixtral", conditioning=scheme == "conditioned", rank=4
        )
    model = _perturbed(looptool.convert(source, plan))
    parallel = arch == "gpt_neox"
    mask = torch.ones_like(input_ids)
    for k in model.budgets:
        graph, counts = fuse_graph(model.layer_graph.paths[k])
        if scheme == "prefix":
            # one gated write per repeated layer and kind; a parallel layer's two gated
            # writes meet in one add, of which one becomes the fused op
            assert counts["gated_residual"] == k * (1 if parallel else 2)
            assert counts["adaptive_delta"] == 0
            layer_runs = 4 + k
        else:
            assert counts["gated_residual"] == 0
            assert counts["adaptive_delta"] == k - 1  # loop 1 sets the state; loops 2..k update it
            layer_runs = 4 + 2 * (k - 1)
        # conditioning modulates both branches of each recurrent-layer run (2 per loop) and of
        # the output layer (layer 3), once each
        assert counts["modulate"] == (2 * (2 * k + 1) if scheme == "conditioned" else 0)
        assert counts["moe"] == (layer_runs if arch in MOE else 0)
        left = [n for n in graph.nodes if "grouped_mm" in str(n.target)]
        assert not left, f"unfused expert matmuls remain: {left[:2]}"
        with torch.no_grad():
            ref = model.path(k)(input_ids, mask)
            got = shared_graph_module(model, graph)(input_ids, mask)
        assert (got - ref).abs().max().item() <= 1e-6, f"{arch} {scheme} budget {k}"
        fused = [n for n in graph.nodes if annotation(n).get("fused")]
        assert len(fused) == sum(counts.values())


def test_fuse_pass_registered_pure_and_replayable(input_ids, tmp_path):
    source = tiny_model("llama")
    model = looptool.convert(source, looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    lg = model.layer_graph
    before = {k: len(g.nodes) for k, g in lg.paths.items()}
    fused = PassManager([("fuse", {})])(lg)
    assert {k: len(g.nodes) for k, g in lg.paths.items()} == before  # input untouched
    assert fused.recipe[-1] == ("fuse", {})
    targets = [str(n.target) for n in fused.paths[2].nodes]
    assert targets.count("looptool.gated_residual.default") == 4
    fused_model = looptool.LoopedModel(fused)
    with torch.no_grad():
        assert torch.equal(fused_model(input_ids, budget=2).logits, model(input_ids, budget=2).logits)
    fused_model.save_pretrained(tmp_path / "m")
    reloaded = looptool.load(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids, budget=2).logits, fused_model(input_ids, budget=2).logits)
    with pytest.raises(PassError, match="unknown op"):
        PassManager([("fuse", {"ops": ["nope"]})])(lg)
