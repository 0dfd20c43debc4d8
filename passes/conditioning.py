"""Loop-conditioned modulation for ELR budget paths (ELR, Sec. 3.3, Eq. 4).

Loop ``i`` of ``k`` is conditioned on ``c_i = MLP([phi(tau_i); phi(kappa)])`` with
``tau_i = i/k``, ``kappa = k/K`` and ``phi`` a sinusoidal embedding; the output block uses
``(tau, kappa) = (1, k/K)``. ``c_i`` depends only on ``(i, k)``, so each budget path
computes it once per forward from constants — never per token.

Each branch (attention, MLP/MoE) of every recurrent and output layer is modulated::

    x~ = (1 + lambda(c)) * N(x) + mu(c)         # N(x): the branch's own input norm
    x^ = x~ + A (g(c) * B x~)                   # gated low-rank correction
    y  = x + (1 + omega(c)) * f(x^)             # output rescale before the residual add

and from loop 2 on the recurrent input is re-normalised and re-injected (entry)::

    z_i = (1 + lambda_e(c_i)) * RMSNorm(s~_i) + mu_e(c_i) + eta(c_i) * h_in

with the exit factor ``pi_i + g_exit(c_i)`` scaling the state step. All heads
(``lambda, mu, omega, g, lambda_e, mu_e, eta, g_exit``) start at zero, so modulation is the
identity and later loops leave the state unchanged: the source function is preserved.
``A`` and ``B`` start small and random so that gradients reach ``g``.

Parameters added, with ``c = cond_dim``, ``r = rank``, ``d`` hidden and ``n`` modulated
branches (2 per recurrent and output layer)::

    2 (c^2 + c)                  conditioning MLP
  + 4 (c d + d)                  entry scale, shift, injection and exit heads
  + n (3 (c d + d) + (c r + r) + 2 d r)   per-branch heads and adapters
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from looptool.core.errors import PlanError
from looptool.core.graph import ROLE_STATE, LayerGraph, LayerInfo, NewParam, Write, annotate

_aten = torch.ops.aten
PREFIX = "loop.cond."
_ENTRY_HEADS = ("entry_scale", "entry_shift", "entry_inject", "exit")
_BRANCH_HEADS = ("scale", "shift", "out_scale")


def conditioning_param_count(cond_dim: int, rank: int, hidden: int, branches: int) -> int:
    """Parameters loop conditioning adds (the formula in this module's docstring)."""
    c, r, d = cond_dim, rank, hidden
    return 2 * (c * c + c) + 4 * (c * d + d) + branches * (3 * (c * d + d) + (c * r + r) + 2 * d * r)


def conditioned_layers(lg: LayerGraph, start: int, stop: int) -> tuple[LayerInfo, ...]:
    """The layers conditioning modulates (recurrent and output block), checked: every
    branch must have its own input norm (Eq. 4 scales the *normalised* input)."""
    layers = lg.layers[start:]
    for info in layers:
        raw = [w.kind for w in info.writes if w.norm is None]
        if raw:
            raise PlanError(
                f"loop conditioning scales each branch's normalised input, but the {raw[0]} branch "
                f"of layer {info.index} reads the residual stream without a norm (a post-norm "
                f"{lg.source.model_type} layer); convert with conditioning=False.",
                parameter="conditioning",
                rerun="convert",
            )
    return layers


def conditioning_params(lg: LayerGraph, plan, layers: tuple[LayerInfo, ...]) -> tuple[NewParam, ...]:
    """Declare the MLP, entry/exit heads and per-branch heads and adapters."""
    c, r, d = plan.cond_dim, plan.rank, lg.source.hidden_size
    if r > d:
        raise PlanError(f"conditioning rank {r} exceeds the hidden size {d}; use rank={d} or less.", parameter="rank")
    params = [
        NewParam(PREFIX + "mlp_in_weight", (c, c), init="normal", value=c**-0.5),
        NewParam(PREFIX + "mlp_in_bias", (c,), no_decay=True),
        NewParam(PREFIX + "mlp_out_weight", (c, c), init="normal", value=c**-0.5),
        NewParam(PREFIX + "mlp_out_bias", (c,), no_decay=True),
    ]
    for head in _ENTRY_HEADS:
        params += [NewParam(f"{PREFIX}{head}_weight", (d, c)), NewParam(f"{PREFIX}{head}_bias", (d,), no_decay=True)]
    for info in layers:
        for w in info.writes:
            base = f"{PREFIX}{info.index}.{w.kind}."
            for head in _BRANCH_HEADS:
                params += [
                    NewParam(base + head + "_weight", (d, c)),
                    NewParam(base + head + "_bias", (d,), no_decay=True),
                ]
            params += [
                NewParam(base + "gate_weight", (r, c)),
                NewParam(base + "gate_bias", (r,), no_decay=True),
                NewParam(base + "down", (r, d), init="normal", value=d**-0.5),  # B
                NewParam(base + "up", (d, r), init="normal", value=r**-0.5),  # A
            ]
    return tuple(params)


class Conditioner:
    """Emits conditioning vectors, heads and modulation into one budget path."""

    def __init__(self, graph: fx.Graph, lg: LayerGraph, plan, loops: int):
        self.graph, self.plan, self.loops = graph, plan, loops
        self.device = torch.device(lg.source.device)
        self.dtype = getattr(torch, lg.source.dtype.removeprefix("torch."))
        self.eps = lg.source.norm_eps or 1e-6
        self._attrs: dict[str, fx.Node] = {}

    # -------------------------------------------------------------- graph helpers
    def _op(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        annotate(node, ROLE_STATE, None, part="conditioning")
        return node

    def _attr(self, name: str) -> fx.Node:
        if name not in self._attrs:
            node = self.graph.get_attr(PREFIX + name)
            annotate(node, ROLE_STATE, None, part="conditioning")
            self._attrs[name] = node
        return self._attrs[name]

    def _head(self, c: fx.Node, name: str) -> fx.Node:
        return self._op(_aten.linear.default, c, self._attr(name + "_weight"), self._attr(name + "_bias"))

    def _sinusoid(self, x: float, n: int) -> fx.Node:
        """``phi(x)``: n features, sin then cos, geometric frequencies (x scaled by 100)."""
        parts = []
        for fn, m in ((_aten.sin.default, n // 2), (_aten.cos.default, n - n // 2)):
            j = self._op(_aten.arange.default, m, dtype=torch.float32, device=self.device)
            freqs = self._op(_aten.exp.default, self._op(_aten.mul.Tensor, j, -math.log(10000.0) / max(m, 1)))
            parts.append(self._op(fn, self._op(_aten.mul.Tensor, freqs, 100.0 * x)))
        return self._op(_aten.cat.default, parts)

    # -------------------------------------------------------------- public pieces
    def vector(self, tau: float, kappa: float) -> fx.Node:
        """``c = MLP([phi(tau); phi(kappa)])`` (Sec. 3.3)."""
        half = self.plan.cond_dim // 2
        emb = self._op(_aten.cat.default, [self._sinusoid(tau, half), self._sinusoid(kappa, self.plan.cond_dim - half)])
        emb = self._op(_aten._to_copy.default, emb, dtype=self.dtype)
        hidden = self._op(_aten.silu.default, self._head(emb, "mlp_in"))
        return self._head(hidden, "mlp_out")

    def loop_vector(self, i: int) -> fx.Node:
        """``c_i`` for loop ``i`` of this path's ``k`` loops."""
        return self.vector(i / self.loops, self.loops / self.plan.max_loops)

    def output_vector(self) -> fx.Node:
        """The output block's ``c`` with ``(tau, kappa) = (1, k/K)``."""
        return self.vector(1.0, self.loops / self.plan.max_loops)

    def entry(self, c: fx.Node, s_tilde: fx.Node, h_in: fx.Node) -> fx.Node:
        """``z_i = (1 + lambda_e) * RMSNorm(s~_i) + mu_e + eta * h_in`` for loops >= 2."""
        sq = self._op(_aten.mul.Tensor, s_tilde, s_tilde)
        mean = self._op(_aten.mean.dim, sq, [-1], True)
        normed = self._op(
            _aten.mul.Tensor, s_tilde, self._op(_aten.rsqrt.default, self._op(_aten.add.Tensor, mean, self.eps))
        )
        scaled = self._op(_aten.mul.Tensor, self._op(_aten.add.Tensor, self._head(c, "entry_scale"), 1.0), normed)
        shifted = self._op(_aten.add.Tensor, scaled, self._head(c, "entry_shift"))
        injected = self._op(_aten.mul.Tensor, self._head(c, "entry_inject"), h_in)
        return self._op(_aten.add.Tensor, shifted, injected)

    def exit_factor(self, c: fx.Node, first: bool) -> fx.Node:
        """``pi_i + g_exit(c_i)`` with ``pi_1 = 1`` and ``pi_{i>1} = 0``."""
        g = self._head(c, "exit")
        return self._op(_aten.add.Tensor, g, 1.0) if first else g

    def hooks(self, c: fx.Node):
        """(norm_hook, write_hook) that modulate every branch with conditioning vector ``c``."""

        def norm_hook(graph: fx.Graph, info: LayerInfo, write: Write, normed: fx.Node) -> fx.Node:
            base = f"{info.index}.{write.kind}."
            scale = self._op(_aten.add.Tensor, self._head(c, base + "scale"), 1.0)
            x_t = self._op(_aten.addcmul.default, self._head(c, base + "shift"), scale, normed)  # mu + (1+lambda) N
            # g(c) * (B x~) == (diag(g) B) x~: fold the per-path gate into B once, not per token
            gate = self._op(_aten.unsqueeze.default, self._head(c, base + "gate"), -1)
            down = self._op(_aten.linear.default, x_t, self._op(_aten.mul.Tensor, gate, self._attr(base + "down")))
            return self._op(_aten.add.Tensor, x_t, self._op(_aten.linear.default, down, self._attr(base + "up")))

        def write_hook(graph: fx.Graph, info: LayerInfo, write: Write, value: fx.Node) -> fx.Node:
            scale = self._op(_aten.add.Tensor, self._head(c, f"{info.index}.{write.kind}.out_scale"), 1.0)
            return self._op(_aten.mul.Tensor, scale, value)

        return norm_hook, write_hook
