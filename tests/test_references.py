"""Every budget path against an independent reference built from the source's own modules.

The references here do not read looptool's graphs, annotations or pass code. They take the
Hugging Face model looptool converted, rebuild its decoder stack as a new ``ModuleList`` of
its *own* decoder-layer modules (plus small wrappers written from the papers' equations),
and run the source's own ``forward`` (embeddings, masks, rotary tables, final norm, head) on
it. The wrappers drive the layers' submodules (norms, attention, MLP / MoE block) directly:

* fixed-prefix looping (Accordion): each layer of the prefix ``S_k`` (Eq. 1) is followed by
  a second pass of the same layer whose branch writes enter the residual stream through
  ``tanh(g)`` per channel (Eq. 4/5), sequential, parallel-residual and branch-post-norm;
* elastic latent recurrence (ELR): the recurrent block as one wrapper that loops the block's
  layers ``k`` times with the state update of Sec. 3.1 / Eq. 2 (every update rule, with and
  without re-injection, exact and paper init), loop conditioning of Sec. 3.3 / Eq. 4 written
  with forward hooks on the branch modules, and route replay of Sec. 3.4 by replaying the
  MoE router module's loop-1 outputs.

Every new parameter is set to non-zero random values first, so the second passes, state
updates and modulations all contribute: a wrongly wired path cannot match.

Per-architecture facts (submodule names, branch order) live in ``_BRANCHES`` below: they
are the test's own knowledge of the Hugging Face code, independent of looptool's capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from looptool.capture import capture
from looptool.core.plan import UPDATE_RULES, PrefixLoop, RecurrentLoop
from looptool.passes import PassManager
from looptool.runtime.model import LoopedModel
from looptool.testing import tiny_model

TOL = dict(rtol=1e-4, atol=1e-5)
_sources: dict[str, tuple] = {}


def _source(arch: str):
    if arch not in _sources:
        source = tiny_model(arch, num_layers=5)
        _sources[arch] = (source, capture(source))
    return _sources[arch]


def _looped(arch: str, plan, seed: int = 1) -> tuple[nn.Module, LoopedModel, dict[str, torch.Tensor]]:
    """The converted model with every new parameter set to non-zero random values."""
    source, lg = _source(arch)
    model = LoopedModel(PassManager([(plan.kind + "_loop", plan.to_dict())])(lg))
    gen = torch.Generator().manual_seed(seed)
    params = {}
    with torch.no_grad():
        for name, p in model.new_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (0.5 if name.endswith("_gate") else 0.0))
            params[name] = p.detach().clone()
    return source, model, params


def _ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (2, 9), generator=gen)
    return ids, torch.ones_like(ids)


# ------------------------------------------------------------ branch drivers (HF modules)
def _out(value):
    return value[0] if isinstance(value, tuple) else value


def _attn(layer: nn.Module) -> nn.Module:
    return layer.attention if hasattr(layer, "attention") else layer.self_attn


def _sequential(layer, h, kw, write: Callable) -> torch.Tensor:
    """Pre-norm sequential layer (Llama, Qwen3-MoE): u = h + w_A(A(N_A h)), v = u + w_M(M(N_M u))."""
    u = h + write("attention", _out(_attn(layer)(hidden_states=layer.input_layernorm(h), **kw)))
    return u + write("mlp", layer.mlp(layer.post_attention_layernorm(u)))


def _post_norm(layer, h, kw, write: Callable) -> torch.Tensor:
    """Branch-post-norm layer (OLMo2): the write is the normed branch output."""
    u = h + write("attention", layer.post_attention_layernorm(_out(layer.self_attn(hidden_states=h, **kw))))
    return u + write("mlp", layer.post_feedforward_layernorm(layer.mlp(u)))


def _parallel(layer, h, kw, write: Callable) -> torch.Tensor:
    """Parallel-residual layer (GPT-NeoX): v = h + w_A(A(N_A h)) + w_M(M(N_M h))."""
    a = write("attention", _out(layer.attention(layer.input_layernorm(h), **kw)))
    return h + a + write("mlp", layer.mlp(layer.post_attention_layernorm(h)))


_BRANCHES = {"llama": _sequential, "qwen3_moe": _sequential, "olmo2": _post_norm, "gpt_neox": _parallel}


def _kind(layer: nn.Module, kind: str) -> str:
    """looptool's write kind for a branch: the MLP branch of a sparse-MoE layer is ``moe``."""
    return "moe" if kind == "mlp" and hasattr(layer.mlp, "experts") else kind


# ------------------------------------------------------------ reference stacks
class _SecondPass(nn.Module):
    """The second pass of one prefix layer: every branch write scaled by tanh(g) (Eq. 5)."""

    def __init__(self, layer: nn.Module, index: int, arch: str, params: dict):
        super().__init__()
        self.layer, self.index, self.drive, self.params = layer, index, _BRANCHES[arch], params

    def forward(self, hidden_states, *args, **kwargs):
        def gated(kind, value):
            return torch.tanh(self.params[f"loop.prefix.{self.index}.{_kind(self.layer, kind)}_gate"]) * value

        return self.drive(self.layer, hidden_states, kwargs, gated)


@contextlib.contextmanager
def _stack(source: nn.Module, layers: list[nn.Module]):
    """Run ``source`` with its decoder stack replaced by ``layers`` (restored afterwards)."""
    base = source.base_model
    old, old_n = base.layers, base.config.num_hidden_layers
    base.layers, base.config.num_hidden_layers = nn.ModuleList(layers), len(layers)
    try:
        yield
    finally:
        base.layers, base.config.num_hidden_layers = old, old_n


def _run(source, layers, ids, mask) -> torch.Tensor:
    with torch.no_grad(), _stack(source, layers):
        return source(input_ids=ids, attention_mask=mask, use_cache=False).logits


def prefix_reference(source, arch: str, plan: PrefixLoop, budget: int, params: dict, ids, mask) -> torch.Tensor:
    """Accordion Eq. 1: layers ``start .. start+k-1`` each run twice in a row."""
    start = plan.window[0]
    layers: list[nn.Module] = []
    for i, layer in enumerate(source.base_model.layers):
        layers.append(layer)
        if start <= i < start + budget:
            layers.append(_SecondPass(layer, i, arch, params))
    return _run(source, layers, ids, mask)


def _sinusoid(x: float, n: int) -> torch.Tensor:
    """phi(x): n//2 sines then the rest cosines at geometric frequencies, x scaled by 100."""
    parts = []
    for fn, m in ((torch.sin, n // 2), (torch.cos, n - n // 2)):
        freqs = torch.exp(torch.arange(m, dtype=torch.float32) * (-math.log(10000.0) / max(m, 1)))
        parts.append(fn(freqs * 100.0 * x))
    return torch.cat(parts)


class _Conditioning:
    """ELR Sec. 3.3: the loop vector c = MLP([phi(tau); phi(kappa)]) and its heads."""

    def __init__(self, params: dict, plan: RecurrentLoop, eps: float):
        self.p, self.plan, self.eps = params, plan, eps

    def head(self, c: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(c, self.p[f"loop.cond.{name}_weight"], self.p[f"loop.cond.{name}_bias"])

    def vector(self, tau: float, kappa: float) -> torch.Tensor:
        half = self.plan.cond_dim // 2
        emb = torch.cat([_sinusoid(tau, half), _sinusoid(kappa, self.plan.cond_dim - half)])
        return self.head(F.silu(self.head(emb, "mlp_in")), "mlp_out")

    def entry(self, c, s_tilde, h_in) -> torch.Tensor:
        """z_i = (1 + lambda_e) RMSNorm(s~_i) + mu_e + eta h_in (no norm weight)."""
        normed = s_tilde * torch.rsqrt(s_tilde.pow(2).mean(-1, keepdim=True) + self.eps)
        return (
            (1 + self.head(c, "entry_scale")) * normed
            + self.head(c, "entry_shift")
            + self.head(c, "entry_inject") * h_in
        )

    @contextlib.contextmanager
    def modulating(self, layer: nn.Module, index: int, c: torch.Tensor):
        """Eq. 4 on both branches of ``layer`` through forward hooks on its own modules:
        x~ = (1 + lambda) N(x) + mu, x^ = x~ + A(g * B x~); branch output times (1 + omega)."""
        branches = [
            ("attention", layer.input_layernorm, _attn(layer)),
            (_kind(layer, "mlp"), layer.post_attention_layernorm, layer.mlp),
        ]
        handles = []
        for kind, norm, branch in branches:
            base = f"{index}.{kind}."

            def on_norm(module, args, out, base=base):
                x_t = (1 + self.head(c, base + "scale")) * out + self.head(c, base + "shift")
                gate = self.head(c, base + "gate")
                return x_t + F.linear(
                    gate * F.linear(x_t, self.p[f"loop.cond.{base}down"]), self.p[f"loop.cond.{base}up"]
                )

            def on_branch(module, args, out, base=base):
                scale = 1 + self.head(c, base + "out_scale")
                return (scale * out[0], *out[1:]) if isinstance(out, tuple) else scale * out

            handles += [norm.register_forward_hook(on_norm), branch.register_forward_hook(on_branch)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class _Replay:
    """ELR Sec. 3.4: MoE routers run on loop 1; later loops get loop 1's router outputs."""

    def __init__(self, layers: list[nn.Module]):
        self.routers = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts")]
        self.seen: dict[int, object] = {}

    @contextlib.contextmanager
    def loop(self, i: int):
        def hook(module, args, out):
            if i == 1:
                self.seen[id(module)] = out
                return None
            return self.seen[id(module)]

        handles = [r.register_forward_hook(hook) for r in self.routers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class _Recurrence(nn.Module):
    """The recurrent block run ``loops`` times with the state update of ELR Eq. 2."""

    def __init__(self, layers, first: int, plan: RecurrentLoop, params: dict, loops: int, cond: _Conditioning | None):
        super().__init__()
        self.block, self.first, self.plan, self.p, self.loops, self.cond = (
            nn.ModuleList(layers),
            first,
            plan,
            params,
            loops,
            cond,
        )
        self.replay = _Replay(layers) if plan.route_replay else None

    def _apply_block(self, z, kw, i: int, c) -> torch.Tensor:
        with self.replay.loop(i) if self.replay else contextlib.nullcontext():
            for j, layer in enumerate(self.block):
                with self.cond.modulating(layer, self.first + j, c) if self.cond else contextlib.nullcontext():
                    z = _out(layer(z, **kw))
        return z

    def forward(self, hidden_states, *args, **kw):
        plan, p, h_in = self.plan, self.p, hidden_states
        exact = plan.init == "exact"
        s = h_in  # s_0 under the paper's init
        for i in range(1, self.loops + 1):
            c = self.cond.vector(i / self.loops, self.loops / plan.max_loops) if self.cond else None
            if exact and i == 1:  # the source block itself
                s = self._apply_block(h_in, kw, i, c)
                continue
            s_tilde = s + h_in if plan.reinject else s
            z = self.cond.entry(c, s_tilde, h_in) if self.cond and i >= 2 else s_tilde
            r = self._apply_block(z, kw, i, c)
            if plan.update == "residual":
                step = r
            elif plan.update == "replace":
                step = r - s
            elif plan.update == "delta":
                step = p["loop.recurrent.delta_rate"] * (r - s)
            else:  # adaptive delta: beta = sigmoid(W s~ + b) * softplus(gamma)
                beta = torch.sigmoid(F.linear(s_tilde, p["loop.recurrent.beta_weight"], p["loop.recurrent.beta_bias"]))
                step = beta * F.softplus(p["loop.recurrent.beta_gamma"]) * (r - s)
            if self.cond:  # exit factor pi_i + g_exit(c_i), pi_1 = 1
                step = (self.cond.head(c, "exit") + (1.0 if i == 1 else 0.0)) * step
            elif exact:
                step = p["loop.recurrent.exit_gate"] * step
            s = s + step
        return s


class _Modulated(nn.Module):
    """An output-block layer under the output conditioning vector (tau = 1, kappa = k/K)."""

    def __init__(self, layer, index: int, cond: _Conditioning, c: torch.Tensor):
        super().__init__()
        self.layer, self.index, self.cond, self.c = layer, index, cond, c

    def forward(self, hidden_states, *args, **kw):
        with self.cond.modulating(self.layer, self.index, self.c):
            return self.layer(hidden_states, *args, **kw)


def recurrent_reference(source, plan: RecurrentLoop, loops: int, params: dict, ids, mask) -> torch.Tensor:
    """ELR Sec. 3.1: input block, recurrent block looped ``loops`` times, output block."""
    start, stop = plan.recurrent
    all_layers = list(source.base_model.layers)
    cond = _Conditioning(params, plan, source.config.rms_norm_eps) if plan.conditioning else None
    layers = all_layers[:start] + [_Recurrence(all_layers[start:stop], start, plan, params, loops, cond)]
    for j, layer in enumerate(all_layers[stop:], start=stop):
        layers.append(_Modulated(layer, j, cond, cond.vector(1.0, loops / plan.max_loops)) if cond else layer)
    return _run(source, layers, ids, mask)


# ------------------------------------------------------------ tests
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "olmo2", "qwen3_moe"])
def test_prefix_budgets_match_the_reference_with_trained_gates(arch):
    plan = PrefixLoop(window=(1, 4))
    source, model, params = _looped(arch, plan)
    ids, mask = _ids()
    outs = {}
    with torch.no_grad():
        for k in model.budgets:
            outs[k] = model(ids, attention_mask=mask, budget=k).logits
            torch.testing.assert_close(outs[k], prefix_reference(source, arch, model.plan, k, params, ids, mask), **TOL)
    assert not torch.allclose(outs[0], outs[max(model.budgets)], atol=1e-3)  # the gates matter


def test_prefix_reference_rejects_a_second_pass_on_the_wrong_layer():
    """The comparison can fail: the reference with its second passes one layer late differs."""
    plan = PrefixLoop(window=(1, 4))
    source, model, params = _looped("llama", plan)
    ids, mask = _ids()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, budget=2).logits
        layers = list(source.base_model.layers)
        shifted = layers[:3] + [_SecondPass(layers[1], 1, "llama", params)] + layers[3:]  # after layer 2, not 1
        shifted.insert(5, _SecondPass(layers[2], 2, "llama", params))
        wrong = _run(source, shifted, ids, mask)
    assert (ours - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("init", ["exact", "paper"])
@pytest.mark.parametrize("reinject", [True, False])
@pytest.mark.parametrize("update", UPDATE_RULES)
def test_recurrent_budgets_match_the_reference(update, reinject, init):
    plan = RecurrentLoop(recurrent=(1, 3), max_loops=3, update=update, reinject=reinject, init=init)
    source, model, params = _looped("llama", plan)
    ids, mask = _ids()
    outs = {}
    with torch.no_grad():
        for k in model.budgets:
            outs[k] = model(ids, attention_mask=mask, budget=k).logits
            torch.testing.assert_close(outs[k], recurrent_reference(source, model.plan, k, params, ids, mask), **TOL)
    assert not torch.allclose(outs[1], outs[3], atol=1e-3)


@pytest.mark.parametrize(
    "arch,init,route_replay",
    [
        ("llama", "exact", False),
        ("llama", "paper", False),
        ("qwen3_moe", "exact", True),
        ("qwen3_moe", "paper", True),
    ],
)
def test_conditioned_recurrence_matches_the_reference(arch, init, route_replay):
    plan = RecurrentLoop(
        recurrent=(1, 3), max_loops=3, conditioning=True, cond_dim=8, rank=4, init=init, route_replay=route_replay
    )
    source, model, params = _looped(arch, plan)
    ids, mask = _ids()
    with torch.no_grad():
        for k in model.budgets:
            torch.testing.assert_close(
                model(ids, attention_mask=mask, budget=k).logits,
                recurrent_reference(source, model.plan, k, params, ids, mask),
                **TOL,
            )


def test_route_replay_matches_only_the_replaying_reference():
    """Without replay in the reference (routers re-run every loop) the MoE path differs."""
    plan = RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True, init="paper")
    source, model, params = _looped("qwen3_moe", plan)
    ids, mask = _ids()
    unreplayed = dataclasses.replace(model.plan, route_replay=False)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, budget=3).logits
        torch.testing.assert_close(ours, recurrent_reference(source, model.plan, 3, params, ids, mask), **TOL)
        rerouted = recurrent_reference(source, unreplayed, 3, params, ids, mask)
    assert (ours - rerouted).abs().max() > 1e-4
