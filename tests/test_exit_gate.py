"""Learned exits (the ``exit_gate`` pass, ``exit_rule="gate"``, ``train --exit-gate`` /
``--exit-gate-only``), on tiny models of both schemes and an MoE:

- at their initial values the heads change no budget (bit-identical logits) and start at the
  uniform exit distribution;
- ``auto`` at q = 0 and q = 1 is exactly the shallowest and the deepest budget, with the heads
  moved off init so that q in between mixes depths; each row's realised depth at the first
  token is the one the exit distribution of the heads' logits gives;
- the heads' logits equal the formula on the source model's own hidden states;
- both objectives equal a direct enumeration (value and gradient), and one trainer step's
  logged objective and its update of the heads match a direct computation;
- ``--exit-gate-only`` changes nothing but the heads, and the saved model reloads trainable;
- the ONNX adaptive-depth graph of the gate rule gives PyTorch's tokens and depths;
- the CLI runs ``train --exit-gate-only`` and ``generate --budget auto --exit-rule gate`` with
  their defaults, and every misuse is one sentence.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow
from looptool.passes.exit_gate import gate_logit, gate_names
from looptool.runtime.convert import add_exit_gates
from looptool.runtime.generation import generate
from looptool.serve.budgets import BudgetChoiceError, BudgetResolver
from looptool.testing import byte_tokenizer, left_padded_batch, move_off_init, tiny_model
from looptool.train.config import TrainingError
from looptool.train.exit_objective import exit_log_probs, expected_exit_loss, gate_fit_loss, token_losses
from looptool.train.trainer import TrainConfig, Trainer

MODELS = {
    "prefix": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "elr": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)),
    "elr-moe": ("qwen3_moe", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True)),
}
NEW = 4


def _scatter_heads(model, scale: float = 3.0, seed: int = 11):
    """The exit heads' weights drawn at ``scale`` (seeded), so that gates differ per token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.new_parameters():
            if name.startswith("loop.exit.") and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


@functools.cache
def _gated(name: str):
    """A tiny model converted with exit heads, every new parameter moved off init."""
    arch, plan = MODELS[name]
    model = looptool.convert(tiny_model(arch), plan, exit_gate=True)
    return _scatter_heads(move_off_init(model, 0.5))


@pytest.mark.parametrize("name", list(MODELS))
def test_heads_at_init_change_no_budget(name):
    arch, plan = MODELS[name]
    plain = move_off_init(looptool.convert(tiny_model(arch), plan), 0.5)
    gated = add_exit_gates(plain)
    assert gated.exit_gates == plain.budgets[:-1] and not plain.exit_gates
    # the loop parameters are the same objects, not copies
    shared = dict(gated.new_parameters())
    assert all(shared[n] is p for n, p in plain.new_parameters())
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in plain.budgets:
            assert torch.equal(plain(ids, budget=k).logits, gated(ids, budget=k).logits), k
        out = gated(ids, budget=plain.budgets[-1], output_exit_gates=True)
    # zero weights, biases at the uniform exit distribution over the menu
    log_p = exit_log_probs(torch.stack(out.exit_gate_logits))
    assert torch.allclose(log_p.exp(), torch.full_like(log_p, 1 / len(plain.budgets)), atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_q_ends_are_the_shallowest_and_deepest_budgets(name):
    model = _gated(name)
    prompt, mask = left_padded_batch(3)
    run = functools.partial(generate, model, prompt, attention_mask=mask, max_new_tokens=NEW, output_logits=True)
    lo, hi = min(model.budgets), max(model.budgets)
    for q, fixed in ((0.0, lo), (1.0, hi)):
        auto = run(budget="auto", exit_rule="gate", exit_threshold=q)
        ref = run(budget=fixed, kv="last-loop")
        assert torch.equal(auto.sequences, ref.sequences), (name, q)
        assert all(torch.equal(a, b) for a, b in zip(auto.logits, ref.logits)), (name, q)
        assert bool((auto.depths == fixed).all())
    # forced ends: min_budget and max_budget inside the menu
    mid = sorted(model.budgets)[1]
    assert bool((run(budget="auto", exit_rule="gate", exit_threshold=0.0, min_budget=mid).depths == mid).all())
    assert bool((run(budget="auto", exit_rule="gate", exit_threshold=1.0, max_budget=mid).depths == mid).all())
    mixed = run(budget="auto", exit_rule="gate")  # the default q = 0.5
    assert len(set(mixed.depths.flatten().tolist())) > 1, mixed.depths  # the heads really decide


@pytest.mark.parametrize("name", ["prefix", "elr"])
def test_first_token_depth_follows_the_exit_distribution(name):
    """Each row's depth at its first token (the prefill) is the first gated depth whose cumulative
    exit probability, from the heads' logits at its last prompt position, reaches q."""
    model = _gated(name)
    prompt = torch.randint(3, 200, (8, 6), generator=torch.Generator().manual_seed(5))
    gated = model.exit_gates
    with torch.no_grad():
        z = torch.stack(model(prompt, budget=max(model.budgets), output_exit_gates=True).exit_gate_logits)[:, :, -1]
    cdf = 1 - torch.cumprod(1 - torch.sigmoid(z.double()), 0)  # [gated depths, rows]
    seen = set()
    for q in (0.2, 0.5, 0.8):
        expected = [next((d for d, c in zip(gated, cdf[:, r]) if c >= q), max(model.budgets)) for r in range(8)]
        auto = generate(model, prompt, max_new_tokens=1, budget="auto", exit_rule="gate", exit_threshold=q)
        assert auto.depths[:, 0].tolist() == expected, (q, cdf)
        seen.update(expected)
    assert len(seen) > 1


def test_head_logits_equal_the_formula_on_the_source_hidden_states():
    """Fixed-prefix looping with zero loop gates: the state at depth 0 and 1 is the source's hidden
    state after the first window layer, at depth 2 after the second (second passes add nothing)."""
    source = tiny_model("llama")
    model = _scatter_heads(
        looptool.convert(source, looptool.PrefixLoop(window=(1, 4), budgets=(0, 1, 2, 3)), exit_gate=True)
    )
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = source(ids, output_hidden_states=True).hidden_states
        out = model(ids, budget=3, output_exit_gates=True)
    params = dict(model.named_parameters())
    for depth, z, state in zip((0, 1, 2), out.exit_gate_logits, (hidden[2], hidden[2], hidden[3])):
        weight, bias = (params[n] for n in gate_names(depth))
        direct = (state / state.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight).sum(-1) + bias
        assert torch.allclose(z, direct, atol=1e-5), depth
        assert torch.allclose(z, gate_logit(state, weight, bias), atol=1e-5)


def _direct_objective(losses, z, mask, beta):
    """The expected loss minus beta x entropy, enumerated per token in float64."""
    total, count = 0.0, 0
    n = z.shape[0]
    for idx in zip(*torch.nonzero(mask, as_tuple=True)):
        lam = [torch.sigmoid(z[(i, *idx)].double()) for i in range(n)]
        p = []
        for i in range(n + 1):
            stay = math.prod(1 - lam[j] for j in range(i)) if i else torch.tensor(1.0, dtype=torch.float64)
            p.append(stay * lam[i] if i < n else stay)
        expected = sum(pi * losses[(i, *idx)].double() for i, pi in enumerate(p))
        entropy = -sum(pi * torch.log(pi) for pi in p)
        total, count = total + expected - beta * entropy, count + 1
    return total / count


def test_objectives_equal_a_direct_enumeration():
    g = torch.Generator().manual_seed(2)
    losses = torch.rand(3, 2, 5, generator=g) * 4
    z = (torch.randn(2, 2, 5, generator=g) * 2).requires_grad_(True)
    mask = torch.rand(2, 5, generator=g) > 0.3
    loss, stats = expected_exit_loss(losses, z, mask, beta=0.1)
    zd = z.detach().clone().requires_grad_(True)
    direct = _direct_objective(losses, zd, mask, 0.1)
    assert abs(loss.item() - direct.item()) < 1e-5
    (grad,) = torch.autograd.grad(loss, z)
    (grad_direct,) = torch.autograd.grad(direct, zd)
    assert torch.allclose(grad.double(), grad_direct.double(), atol=1e-6)
    assert 0 <= stats["mean_exit"] <= 2 and stats["entropy"] > 0
    # the gate-only stage: BCE against "the next depth gains at most gamma"
    fit, fit_stats = gate_fit_loss(losses, z, mask, gamma=0.5)
    labels = (losses[:-1] - losses[1:] <= 0.5).double()
    lam = torch.sigmoid(z.detach().double())
    bce = -(labels * lam.log() + (1 - labels) * (1 - lam).log())
    assert abs(fit.item() - float(bce[:, mask].mean())) < 1e-5
    assert fit_stats["stop_share"] == pytest.approx(float(labels[:, mask].mean()))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("exit-data") / "train.txt"
    path.write_text(" ".join(f"the {i % 13} cat sat on mat {i % 7}." for i in range(400)))
    return path


@pytest.mark.parametrize("name", ["prefix", "elr"])
def test_trainer_step_matches_a_direct_objective(name, tmp_path, text_file):
    """One ``exit_gate`` step: the logged expected loss equals per-budget forwards' token losses
    under the heads' exit distribution, and AdamW's first update moves every head element by
    ``-lr * sign(grad)`` of that direct objective (non-zero new parameters, checked)."""
    arch, plan = MODELS[name]
    model = _scatter_heads(move_off_init(looptool.convert(tiny_model(arch), plan, tokenizer=byte_tokenizer()), 0.3))
    model = _scatter_heads(add_exit_gates(model), scale=0.5)
    model.save_pretrained(tmp_path / "in")
    cfg = TrainConfig(
        data=[str(text_file)], output=str(tmp_path / "out"), steps=1, seq_len=12, batch=2, lr=1e-3, device="cpu",
        exit_gate=True, exit_beta=0.2, warmup=0.0,
    )  # fmt: skip
    trainer = Trainer(tmp_path / "in", cfg)
    ids, labels = trainer.data.labeled_batch(0, cfg.batch, cfg.seed)
    heads = {n: p for n, p in model.named_parameters() if n.startswith("loop.exit.")}
    for p in model.parameters():
        p.requires_grad_(p in set(heads.values()))
    menu = model.budgets
    losses = torch.stack([token_losses(model(ids, budget=d).logits, labels) for d in menu]).detach()
    z = torch.stack(model(ids, budget=menu[-1], output_exit_gates=True).exit_gate_logits)[:, :, :-1]
    direct = _direct_objective(losses, z, labels[:, 1:] != -100, 0.2)
    grads = dict(zip(heads, torch.autograd.grad(direct, list(heads.values()))))
    trainer.run()
    logged = trainer.records[0]["exit"]
    entropy = float(
        -(exit_log_probs(z.detach()).exp() * exit_log_probs(z.detach())).sum(0)[labels[:, 1:] != -100].mean()
    )
    assert logged["expected_loss"] - 0.2 * logged["entropy"] == pytest.approx(float(direct), abs=1e-5)
    assert logged["entropy"] == pytest.approx(entropy, abs=1e-5)
    trained = dict(looptool.load(tmp_path / "out").named_parameters())
    for n, p in heads.items():
        step = (trained[n] - p).detach()
        moved = grads[n].abs() > 1e-7
        assert moved.any() and torch.allclose(step[moved], -1e-3 * grads[n][moved].sign(), atol=2e-5), n


def test_gate_only_stage_moves_only_the_heads(tmp_path, text_file):
    arch, plan = MODELS["prefix"]
    model = move_off_init(looptool.convert(tiny_model(arch), plan, tokenizer=byte_tokenizer()), 0.3)
    model.save_pretrained(tmp_path / "in")  # no heads yet: the stage adds them
    cfg = TrainConfig(
        data=[str(text_file)], output=str(tmp_path / "out"), steps=2, seq_len=12, batch=2, new_lr=1e-2,
        device="cpu", exit_gate_only=True,
    )  # fmt: skip
    Trainer(tmp_path / "in", cfg).run()
    out = looptool.load(tmp_path / "out")
    assert out.exit_gates == (0, 1) and all(p.requires_grad for p in out.parameters())
    before = dict(model.named_parameters())
    for name, p in out.named_parameters():
        if name.startswith("loop.exit.") and name.endswith(".weight"):
            assert float(p.abs().max()) > 0, name  # moved off its zero init
        elif not name.startswith("loop.exit."):
            assert torch.equal(p, before[name]), name


def test_misuse_is_one_sentence(tmp_path, text_file):
    plain = looptool.convert(tiny_model("llama"), MODELS["prefix"][1])
    prompt, mask = left_padded_batch(2)
    with pytest.raises(LooptoolError, match="has none") as err:
        generate(plain, prompt, attention_mask=mask, max_new_tokens=2, budget="auto", exit_rule="gate")
    assert err.value.parameter == "exit_rule"
    with pytest.raises(LooptoolError, match=r"in \[0, 1\]"):
        generate(_gated("prefix"), prompt, max_new_tokens=2, budget="auto", exit_rule="gate", exit_threshold=1.5)
    with pytest.raises(TrainingError, match="give one of them"):
        TrainConfig(data=[str(text_file)], output="x", exit_gate=True, exit_gate_only=True).check()
    with pytest.raises(TrainingError, match="drop override"):
        TrainConfig(data=[str(text_file)], output="x", exit_gate=True, override=0.2).check()
    resolver = BudgetResolver.create("m", (0, 1, 2))
    gate = BudgetResolver.create("m", (0, 1, 2), exit_rule="gate")
    assert gate.choose("m", "auto") == AutoRow(0, 2, 0.5)  # the gate rule's default q
    assert resolver.choose("m", "auto", exit_threshold=3.0) == AutoRow(0, 2, 3.0)
    with pytest.raises(BudgetChoiceError, match="cumulative exit probability"):
        gate.choose("m", "auto", exit_threshold=3.0)


def test_onnx_gate_graph_matches_pytorch(tmp_path):
    from looptool.backends.onnx.export import export_onnx
    from looptool.backends.ort.runtime import Runtime

    model = _gated("elr")
    report = export_onnx(model, tmp_path / "e", kv="last-loop", budgets="3", rowwise=False, adaptive="gate")
    assert [b.budget for b in report.adaptive] == ["adaptive.gate"]
    rt = Runtime(tmp_path / "e")
    prompt, mask = left_padded_batch(3)
    depths = set()
    for q in (0.0, 0.5, 1.0):
        auto = dict(max_new_tokens=NEW, budget="auto", exit_rule="gate", exit_threshold=q)
        ours, ref = (
            rt.generate(prompt, attention_mask=mask, **auto),
            generate(model, prompt, attention_mask=mask, **auto),
        )
        assert torch.equal(ours.sequences, ref.sequences) and torch.equal(ours.depths, ref.depths), q
        depths.update(ref.depths.flatten().tolist())
    assert len(depths) > 1


def test_cli_gate_only_then_generate_auto_gate(tmp_path, text_file):
    runner = CliRunner()
    arch, plan = MODELS["prefix"]
    looptool.convert(tiny_model(arch), plan, tokenizer=byte_tokenizer()).save_pretrained(tmp_path / "in")
    common = ["--data", str(text_file), "--steps", "1", "--seq-len", "12", "--batch", "2", "--device", "cpu"]
    joint = runner.invoke(app, ["train", str(tmp_path / "in"), "-o", str(tmp_path / "joint"), *common, "--exit-gate"])
    assert joint.exit_code == 0 and "exit-gate over depths [0, 1, 2]: last step expected loss" in joint.output
    res = runner.invoke(
        app, ["train", str(tmp_path / "joint"), "-o", str(tmp_path / "out"), *common, "--exit-gate-only"]
    )
    assert res.exit_code == 0, res.output
    assert "exit-gate-only over depths [0, 1, 2]: last step stop share" in res.output  # no budget draws to report
    assert looptool.load(tmp_path / "out").exit_gates == (0, 1)
    args = ["generate", str(tmp_path / "out"), "-p", "the cat", "--max-new-tokens", "3", "--budget", "auto"]
    deepest = runner.invoke(app, [*args, "--exit-rule", "gate", "--exit-threshold", "1"])
    assert deepest.exit_code == 0, deepest.output
    fixed = runner.invoke(app, ["generate", str(tmp_path / "out"), "-p", "the cat", "--max-new-tokens", "3",
                                "--budget", "2", "--kv", "last-loop"])  # fmt: skip
    assert deepest.stdout == fixed.stdout
    assert "gate exit probability ≥ 0.5" in runner.invoke(app, [*args, "--exit-rule", "gate"]).output
    ungated = runner.invoke(app, ["generate", str(tmp_path / "in"), *args[2:], "--exit-rule", "gate"])
    assert (
        ungated.exit_code != 0 and "looptool train MODEL_DIR" in ungated.output and "--exit-gate-only" in ungated.output
    )
    bad = runner.invoke(app, [*args, "--exit-rule", "gate", "--exit-threshold", "2"])
    assert bad.exit_code != 0 and "in [0, 1]" in bad.output


def test_served_auto_reads_the_gate(tmp_path):
    """A PyTorch server with exit_rule 'gate': q = 1 answers as the deepest budget and reports
    its depth in ``cost``; its default threshold mixes depths; q above 1 is a 400 naming the field."""
    pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")
    from fastapi.testclient import TestClient

    from looptool.serve.app import create_app
    from looptool.serve.models import open_model
    from looptool.serve.scheduler import Scheduler

    arch, plan = MODELS["prefix"]
    model = looptool.convert(tiny_model(arch), plan, tokenizer=byte_tokenizer(), exit_gate=True)
    _scatter_heads(move_off_init(model, 0.5)).save_pretrained(tmp_path / "m")
    served = open_model(tmp_path / "m", name="m", runtime="pytorch", device="cpu", kv="last-loop", exit_rule="gate")
    scheduler = Scheduler(served.engine, max_batch=2, capacity=64, max_queue=4)
    app = create_app(served, scheduler, BudgetResolver.create("m", served.budgets, exit_rule="gate"))
    body = {"model": "m", "prompt": "the cat", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        deepest = client.post("/v1/completions", json={**body, "budget": "auto", "exit_threshold": 1}).json()
        fixed = client.post("/v1/completions", json={**body, "model": "m@2"}).json()
        default = client.post("/v1/completions", json={**body, "budget": "auto"}).json()
        bad = client.post("/v1/completions", json={**body, "budget": "auto", "exit_threshold": 1.5})
    assert deepest["choices"][0]["text"] == fixed["choices"][0]["text"]
    assert deepest["cost"]["mean_depth"] == 2.0
    assert 0 <= default["cost"]["mean_depth"] <= 2
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "exit_threshold"


def test_heads_are_merged_saved_and_reloaded_like_every_parameter(tmp_path):
    from looptool.posttrain.merge import merge

    base = _gated("elr")
    expert = _scatter_heads(looptool.convert(tiny_model("llama"), MODELS["elr"][1], exit_gate=True), seed=5)
    merged = merge(base, [expert], "loop=1")  # the loop.* group (loop parameters and exit heads) from the expert
    heads = {n: p for n, p in expert.named_parameters() if n.startswith("loop.exit.")}
    assert heads and all(torch.equal(dict(merged.named_parameters())[n], p) for n, p in heads.items())
    merged.save_pretrained(tmp_path / "merged")
    again = looptool.load(tmp_path / "merged")
    assert again.exit_gates == merged.exit_gates
    prompt, mask = left_padded_batch(2)
    auto = dict(attention_mask=mask, max_new_tokens=NEW, budget="auto", exit_rule="gate")
    a, b = generate(merged, prompt, **auto), generate(again, prompt, **auto)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.depths, b.depths)


@pytest.mark.parametrize(
    "plan",
    [
        looptool.RecurrentLoop(recurrent=(1, 3), max_loops=4),
        looptool.PrefixLoop(window=(0, 4), budgets=(0, 1, 2, 3, 4)),
    ],
    ids=["elr-4-loops", "prefix-5-budgets"],
)
def test_skipping_exited_steps_is_bit_identical_with_gates_carried_across_steps(plan):
    """Three or more gates: the running survival crosses lifted steps; the skipping path (the
    default) equals the masked one bit for bit, tokens, logits and depths, at mixed depths."""
    from looptool.runtime.adaptive import AutoDepth
    from looptool.testing import AutoStep

    model = _scatter_heads(move_off_init(looptool.convert(tiny_model("llama"), plan, exit_gate=True), 0.5))
    assert len(model.exit_gates) >= 3
    prompt, mask = left_padded_batch(4)
    position = (mask.cumsum(-1) - 1).clamp_min(0)
    outs = {}
    for skip in (True, False):
        step = AutoStep(model, 4, 7, AutoDepth.resolve(model, exit_rule="gate", exit_threshold=0.5), None, skip=skip)
        with torch.no_grad():
            outs[skip] = (step(prompt, mask, position, torch.arange(7)), step.depths(1))
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    assert len(set(outs[True][1].flatten().tolist())) > 1, outs[True][1]
    ref = generate(model, prompt, attention_mask=mask, max_new_tokens=NEW, budget="auto", exit_rule="gate")
    assert ref.depths.shape == (4, NEW)
