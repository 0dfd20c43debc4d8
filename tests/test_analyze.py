"""`looptool analyze`: every statistic against a hand computation that drives the source's
own Hugging Face modules in the order the papers' equations give (Accordion Eq. 1/5, ELR
Eq. 2), the repetition-ablation graph edit, and the command line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import looptool
from looptool.capture import capture
from looptool.cli import app
from looptool.core.errors import PassError
from looptool.core.graph import annotation, shared_graph_module
from looptool.eval.analyze import analyze
from looptool.passes import PassManager
from looptool.passes.ablate import ablate_repetitions
from looptool.passes.prefix_loop import gate_name
from looptool.report.plots import plot_analysis
from looptool.runtime.convert import plan_steps
from looptool.runtime.model import LoopedModel
from looptool.testing import tiny_model
from looptool.train.data import PackedTokens

ATOL = 2e-5


def _rows(seed: int = 3, rows: int = 2, seq: int = 12) -> PackedTokens:
    g = torch.Generator().manual_seed(seed)
    return PackedTokens(torch.randint(0, 256, (rows * seq,), generator=g), seq)


def _ids(data: PackedTokens) -> torch.Tensor:
    return torch.stack([data.row(i) for i in range(len(data))])


def _perturb(model, seed: int = 0, scale: float = 0.5) -> None:
    """Trained-like new parameters: every loop.* tensor moved off its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).norm(dim=-1)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1, eps=1e-8)


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def _kept(first: torch.Tensor, second: torch.Tensor) -> list[int]:
    """Per token, |S_first ∩ S_second| counted with Python sets."""
    return [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(first, second)]


class _Driver:
    """The source model's own modules (embedding, decoder layers' norms, attention and MLP/MoE,
    final norm, head) run in any schedule of layer applications, recording every write,
    residual-stream value and router choice."""

    def __init__(self, src, ids: torch.Tensor):
        self.src, self.ids = src, ids
        self.m = src.model
        h = self.m.embed_tokens(ids)
        self.embedded = h
        self.pe = self.m.rotary_emb(h, torch.arange(ids.shape[1])[None])
        self.routes: dict = {}

    def layer(self, index: int, h: torch.Tensor, key, gate_a=1.0, gate_f=1.0):
        """One application: ``h + gate_a·A(N(h))``, then ``+ gate_f·F(N(u))``; returns
        ``(output, attention write, MLP/MoE write)`` (the writes before gating)."""
        mod = self.m.layers[index]
        a = mod.self_attn(mod.input_layernorm(h), position_embeddings=self.pe, attention_mask=None)[0]
        u = h + gate_a * a
        router = getattr(mod.mlp, "gate", None)
        hook = (
            router.register_forward_hook(lambda _m, _i, out: self.routes.__setitem__(key, out[2]))
            if isinstance(router, torch.nn.Module)
            else None
        )
        f = mod.mlp(mod.post_attention_layernorm(u))
        if hook is not None:
            hook.remove()
        return u + gate_f * f, a, f

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.src.lm_head(self.m.norm(h))


def _accordion(src, model, ids, repeated, kind_f: str):
    """Accordion Eq. 1/5 by hand: layer ``i`` of ``repeated`` runs again on its own output
    with ``tanh(g)``-gated writes. Returns outputs per application, writes and the loss."""
    d = _Driver(src, ids)
    h, outs, writes = d.embedded, [], {}
    for i in range(len(d.m.layers)):
        h, a, f = d.layer(i, h, (i, 1))
        outs.append(((i, 1), h))
        writes[(i, 1)] = (a, f)
        if i in repeated:
            ta = torch.tanh(model.get_parameter(gate_name(i, "attention")))
            tf = torch.tanh(model.get_parameter(gate_name(i, kind_f)))
            h, a, f = d.layer(i, h, (i, 2), ta, tf)
            outs.append(((i, 2), h))
            writes[(i, 2)] = (a, f, ta, tf)
    return d, outs, writes, _ce(d.logits(h), ids)


@pytest.fixture(scope="module")
def captured():
    """A tiny qwen3_moe (4 layers, 8 experts, top-2), captured once for both schemes."""
    src = tiny_model("qwen3_moe", num_layers=4, num_experts=8)
    return src, capture(src)


def _looped(lg, plan) -> LoopedModel:
    return LoopedModel(PassManager(plan_steps(plan.resolve(len(lg.layers))))(lg))


@pytest.fixture(scope="module")
def moe(captured):
    """The tiny qwen3_moe looped over window 1:4 (budgets 0, 1, 3) with trained-like gates."""
    src, lg = captured
    model = _looped(lg, looptool.PrefixLoop(window=(1, 4), budgets=(0, 1, 3)))
    _perturb(model)
    return src, model


@torch.no_grad()
def test_the_hand_driver_is_the_source_model(moe):
    src, _ = moe
    ids = _ids(_rows())
    d = _Driver(src, ids)
    h = d.embedded
    for i in range(len(d.m.layers)):
        h, _, _ = d.layer(i, h, (i, 1))
    torch.testing.assert_close(d.logits(h), src(input_ids=ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_prefix_statistics_match_a_hand_computation(moe):
    src, model = moe
    data = _rows()
    ids = _ids(data)
    repeated = (1, 2, 3)
    result = analyze(model, data, budget=3, batch=len(data), spacing=1)
    d, outs, writes, loss = _accordion(src, model, ids, repeated, "moe")
    assert result["loss"] == pytest.approx(loss, abs=1e-5)

    # second- vs first-pass writes, per kind, and the routed experts the second pass keeps
    assert [r["layer"] for r in result["repeats"]] == list(repeated)
    for row in result["repeats"]:
        i = row["layer"]
        first, second = writes[(i, 1)], writes[(i, 2)]
        for kind, j in (("attention", 0), ("moe", 1)):
            w1, w2, gate = first[j], second[j], second[2 + j]
            got = row["writes"][kind]
            n1, n2, ng = _norm(w1).mean(), _norm(w2).mean(), _norm(gate * w2).mean()
            assert got["first_norm"] == pytest.approx(float(n1), rel=1e-4)
            assert got["norm_ratio"] == pytest.approx(float(n2 / n1), rel=1e-4)
            assert got["gated_norm_ratio"] == pytest.approx(float(ng / n1), rel=1e-4)
            assert got["cosine"] == pytest.approx(float(_cos(w1, w2).mean()), abs=1e-5)
            assert got["gated_cosine"] == pytest.approx(float(_cos(w1, gate * w2).mean()), abs=1e-5)
            assert got["gate_mean_abs"] == pytest.approx(float(gate.abs().mean()), rel=1e-5)
        kept = _kept(d.routes[(i, 1)], d.routes[(i, 2)])
        experts = row["experts"]
        assert experts["top_k"] == 2
        assert experts["kept_mean"] == pytest.approx(sum(kept) / len(kept))
        assert experts["kept_histogram"] == pytest.approx([kept.count(c) / len(kept) for c in range(3)])

    # residual-stream cosine of each application with the previous one, and the logit lens
    cosines = result["residual_cosines"]
    lens = result["logit_lens"]
    assert [b["budget"] for b in lens] == [3]
    assert [(c["layer"], c["execution"]) for c in cosines] == [key for key, _ in outs]
    assert cosines[0]["cosine"] is None
    for j in range(1, len(outs)):
        assert cosines[j]["cosine"] == pytest.approx(float(_cos(outs[j - 1][1], outs[j][1]).mean()), abs=1e-5)
    for got, (_, h) in zip(lens[0]["applications"], outs):
        assert got["loss"] == pytest.approx(_ce(d.logits(h), ids), abs=1e-5)
    window = [c["cosine"] for c in cosines if c["layer"] in repeated]
    assert result["window_residual_cosine"]["min"] == pytest.approx(min(window))

    # Hydra effect: removing a repetition = running the path without that second pass
    hydra = result["hydra"]
    base = hydra["base_loss"]
    assert base == pytest.approx(loss, abs=1e-5)
    alone = {}
    for row in hydra["single"]:
        (i,) = row["layers"]
        alone[i] = _accordion(src, model, ids, set(repeated) - {i}, "moe")[3] - loss
        assert row["delta"] == pytest.approx(alone[i], abs=2e-5)
        assert abs(row["delta"]) > 1e-5  # trained-like gates: every repetition matters
    assert [r["layers"] for r in hydra["adjacent_pairs"]] == [[1, 2], [2, 3]]
    assert [r["layers"] for r in hydra["spaced_triplets"]] == [[1, 2, 3]]
    for row in hydra["adjacent_pairs"] + hydra["spaced_triplets"]:
        together = _accordion(src, model, ids, set(repeated) - set(row["layers"]), "moe")[3] - loss
        assert row["delta"] == pytest.approx(together, abs=2e-5)
        assert row["sum_of_single"] == pytest.approx(
            sum(r["delta"] for r in hydra["single"] if r["layers"][0] in row["layers"])
        )
        assert row["ratio"] == pytest.approx(row["delta"] / row["sum_of_single"])


@torch.no_grad()
def test_ablating_every_repetition_is_the_unlooped_path(moe):
    src, model = moe
    ids = _ids(_rows())
    mask = torch.ones_like(ids)
    full = model.layer_graph.paths[3]
    ablated = shared_graph_module(model, ablate_repetitions(full, [1, 2, 3]))
    assert torch.equal(ablated(ids, mask), model(ids, budget=0).logits)
    left = {annotation(n)["role"] for n in ablated.graph.nodes if annotation(n).get("repeat") == 2}
    assert left == {"residual"}  # the dead second-pass branches are gone: `stream + 0` stays
    some = shared_graph_module(model, ablate_repetitions(full, [2, 3]))
    assert torch.equal(some(ids, mask), model(ids, budget=1).logits)  # the prefix (1,) is budget 1
    assert not torch.equal(some(ids, mask), model(ids, budget=3).logits)
    with pytest.raises(PassError, match=r"does not repeat layer\(s\) \[0\]; it repeats \[1, 2, 3\]"):
        ablate_repetitions(full, [0])


@torch.no_grad()
def test_ablation_is_a_registered_pass(moe):
    _, model = moe
    ids = _ids(_rows())
    lg = PassManager([("ablate_repetitions", {"layers": [2]})])(model.layer_graph)
    assert lg.recipe[-1] == ("ablate_repetitions", {"layers": [2]})
    mask = torch.ones_like(ids)
    out = shared_graph_module(model, lg.paths[3])(ids, mask)
    ref = shared_graph_module(model, ablate_repetitions(model.layer_graph.paths[3], [2]))(ids, mask)
    assert torch.equal(out, ref)
    assert torch.equal(shared_graph_module(model, lg.paths[1])(ids, mask), model(ids, budget=1).logits)
    assert torch.equal(shared_graph_module(model, lg.paths[0])(ids, mask), model(ids, budget=0).logits)
    with pytest.raises(PassError, match="no budget path repeats"):
        PassManager([("ablate_repetitions", {"layers": [5]})])(model.layer_graph)


@torch.no_grad()
def test_elr_statistics_match_a_hand_computation(captured, tmp_path):
    """ELR Eq. 2 by hand (exact init, adaptive delta, re-injection): per-loop state update,
    mean β, exit factor and experts kept from loop 1, on a tiny qwen3_moe."""
    src, lg = captured
    model = _looped(lg, looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, init="exact"))
    _perturb(model, scale=0.05)
    data = _rows(seed=5)
    ids = _ids(data)
    result = analyze(model, data, budget=3, batch=len(data))
    assert "repeats" not in result and "hydra" not in result

    d = _Driver(src, ids)
    p = {name.removeprefix("loop.recurrent."): t for name, t in model.new_parameters()}
    h_in, _, _ = d.layer(0, d.embedded, (0, 1))

    def block(z, loop):
        for i in (1, 2):
            z, _, _ = d.layer(i, z, (i, loop))
        return z

    s = block(h_in, 1)  # loop 1 is the source block
    hand = {1: {"state_norm": _norm(s).mean()}}
    for loop in (2, 3):
        s_tilde = s + h_in
        r = block(s_tilde, loop)
        beta = torch.sigmoid(F.linear(s_tilde, p["beta_weight"], p["beta_bias"])) * F.softplus(p["beta_gamma"])
        new = s + p["exit_gate"] * (beta * (r - s))
        hand[loop] = {
            "update_norm": _norm(new - s).mean(),
            "prev_state_norm": _norm(s).mean(),
            "beta_mean": beta.mean(),
            "exit_factor_mean": p["exit_gate"].mean(),
            "exit_factor_mean_abs": p["exit_gate"].abs().mean(),
        }
        kept = [sum(_kept(d.routes[(i, 1)], d.routes[(i, loop)])) / ids.numel() for i in (1, 2)]
        hand[loop]["kept_mean_vs_loop1"] = sum(kept) / 2
        s = new
    final, _, _ = d.layer(3, s, (3, 1))
    assert result["loss"] == pytest.approx(_ce(d.logits(final), ids), abs=1e-5)
    loops = result["elr"]["loops"]
    assert [r["loop"] for r in loops] == [1, 2, 3] and result["elr"]["route_replay"] is False
    assert loops[0]["update_norm"] is None and loops[0]["beta_mean"] is None
    assert loops[0]["state_norm"] == pytest.approx(float(hand[1]["state_norm"]), rel=1e-5)
    for row in loops[1:]:
        for key, value in hand[row["loop"]].items():
            assert row[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), (row["loop"], key)
        assert row["relative_update"] == pytest.approx(row["update_norm"] / row["prev_state_norm"])
    written = plot_analysis(result, tmp_path)
    assert sorted(p.name for p in written) == ["elr_states.png", "logit_lens.png", "residual_cosines.png"]


def test_analyze_command_writes_json_and_plots(model_dir, tmp_path):
    """The CLI on a saved tiny Llama (window 1:3, converted gates: zero writes, so the Hydra
    ratios are undefined and say so); dense layers have no expert statistic."""
    text = tmp_path / "heldout.txt"
    text.write_text("We the People of the United States, in Order to form a more perfect Union. " * 6)
    out = tmp_path / "analysis"
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "analyze",
            str(model_dir),
            "--data",
            str(text),
            "--tokens",
            "96",
            "--seq-len",
            "24",
            "--batch",
            "2",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    result = json.loads((out / "analysis.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == [
        "analysis.json",
        "hydra.png",
        "logit_lens.png",
        "residual_cosines.png",
        "writes.png",
    ]
    assert result["budget"] == 2 and result["tokens"] == 96
    assert [b["budget"] for b in result["logit_lens"]] == [0, 1, 2]  # every budget without --budget
    assert [len(b["applications"]) for b in result["logit_lens"]] == [4, 5, 6]
    assert all(r["experts"] is None for r in result["repeats"])
    assert all(r["writes"]["mlp"]["gated_norm"] == 0.0 for r in result["repeats"])  # zero gates at conversion
    assert all(r["delta"] == 0.0 for r in result["hydra"]["single"])
    assert result["hydra"]["adjacent_pairs"][0]["ratio"] is None
    again = runner.invoke(app, ["analyze", str(model_dir), "--data", str(text), "--tokens", "96", "-o", str(out)])
    assert again.exit_code == 1 and "--overwrite" in again.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis", "heldout.txt"]  # no temp folder left
