"""RL from verifiable rewards (GRPO at every budget): rewards, advantages, the loss's weights
and masks against hand computations, budget assignment, rollouts, an end-to-end run."""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.posttrain.rewards import RewardError, exact_match, load_reward, numeric, score
from looptool.posttrain.rl import GRPO, RLConfig, RLError, grpo_loss, leave_one_out_advantages
from looptool.posttrain.rollout import encode_prompt, sample, token_logprobs
from looptool.storage.resume import checkpoint_step
from looptool.testing import assert_same_weights, byte_tokenizer, kill_after_line, step_log, tiny_model
from looptool.train.sampling import assign_budgets, ratio_counts


# ---------------------------------------------------------------------------- rewards
def test_builtin_rewards():
    assert exact_match("q", " 42 \n", {"answer": 42}) == 1.0
    assert exact_match("q", "42.", {"answer": "42"}) == 0.0
    assert numeric("q", "it is -3.50 apples", {"answer": "-3.5"}) == 1.0
    assert numeric("q", "no number", {"answer": 1}) == 0.0
    with pytest.raises(RewardError, match="'answer' field, and this example has none"):
        exact_match("q", "1", {})


def test_reward_loading_and_bad_rewards(tmp_path):
    (tmp_path / "myreward.py").write_text(
        "def length(prompt, completion, example):\n    return len(completion)\n"
        "def boom(prompt, completion, example):\n    raise KeyError('x')\n"
        "def text(prompt, completion, example):\n    return 'yes'\n"
    )
    fn = load_reward(f"{tmp_path / 'myreward.py'}:length")
    assert score(fn, "p", "abc", {}) == 3.0
    assert load_reward("looptool.posttrain.rewards:numeric") is numeric
    with pytest.raises(RewardError, match="raised KeyError"):
        score(load_reward(f"{tmp_path / 'myreward.py'}:boom"), "p", "c", {})
    with pytest.raises(RewardError, match="returned 'yes'; it must return a finite number"):
        score(load_reward(f"{tmp_path / 'myreward.py'}:text"), "p", "c", {})
    with pytest.raises(RewardError, match="returned nan"):
        score(lambda p, c, e: math.nan, "p", "c", {})
    with pytest.raises(RewardError, match="neither a built-in"):
        load_reward("nope")
    with pytest.raises(RewardError, match="has no function 'missing'"):
        load_reward("looptool.posttrain.rewards:missing")
    with pytest.raises(RewardError, match="could not be imported"):
        load_reward("no_such_module_xyz:f")


# ---------------------------------------------------------------------------- GRPO math
def test_leave_one_out_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # baselines: mean of the other three = 1/3, 2/3, 2/3, 1/3
    torch.testing.assert_close(
        leave_one_out_advantages(r, normalize=False), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    )
    # population std of {1, 0, 0, 1} is 0.5
    torch.testing.assert_close(
        leave_one_out_advantages(r), torch.tensor([4 / 3, -4 / 3, -4 / 3, 4 / 3]), rtol=1e-5, atol=1e-5
    )
    same = leave_one_out_advantages(torch.tensor([[0.5, 0.5, 0.5]]))
    assert torch.equal(same, torch.zeros(1, 3))  # no signal when every rollout scores alike


def test_grpo_loss_weights_clipping_and_masking_by_hand():
    logp = torch.tensor(
        [
            [0.0, -1.0, -2.0, 0.0],  # row 0: ratios 0.2 and 10 (clipped to 5); mean log-ratio 0.35
            [0.0, -1.0, -1.0, -1.0],  # row 1: ratios 3, 3, 3: mean log-ratio ln 3 > ln 2, masked
            [0.0, -0.5, -0.5, 0.0],
        ],
        requires_grad=True,
    )  # row 2: ratios 0.1, 1: mean -1.15, masked
    sample = torch.tensor(
        [
            [0.0, -1.0 - math.log(0.2), -2.0 - math.log(10), 0.0],
            [0.0, -1.0 - math.log(3), -1.0 - math.log(3), -1.0 - math.log(3)],
            [0.0, -0.5 + math.log(10), -0.5, 0.0],
        ]
    )
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float)
    adv = torch.tensor([1.0, 2.0, -1.0])
    loss, stats = grpo_loss(logp, sample, mask, adv)
    n = 7.0  # every completion token counts in the normaliser
    assert stats["masked"] == 2
    torch.testing.assert_close(loss, torch.tensor(-(0.2 * 1.0 * -1.0 + 5.0 * 1.0 * -2.0) / n))
    loss.backward()
    grad = torch.zeros_like(logp)
    grad[0, 1], grad[0, 2] = -0.2 / n, -5.0 / n  # -w A / N, weights detached
    torch.testing.assert_close(logp.grad, grad)
    loose, stats = grpo_loss(logp.detach(), sample, mask, adv, max_mismatch=100.0, is_clip=(0.05, 20.0))
    assert stats["masked"] == 0
    terms = 1 * (0.2 * -1.0 + 10 * -2.0) + 2 * (3 * -1.0) * 3 + -1 * (0.1 * -0.5 + 1 * -0.5)
    torch.testing.assert_close(loose, torch.tensor(-terms / n), rtol=1e-5, atol=1e-5)


def test_budget_assignment_by_ratio_and_pass_rate():
    assert ratio_counts(7, [4, 1, 1, 1]) == [4, 1, 1, 1]
    assert ratio_counts(8, [4, 1, 1, 1]) == [5, 1, 1, 1]
    assert sum(ratio_counts(13, [4, 1, 1, 1])) == 13
    got = assign_budgets((1, 2, 3, 4), [4, 1, 1, 1], 7, key="a")
    assert sorted(got) == [1, 1, 1, 1, 2, 3, 4]
    rates = [0.9, 0.0, 1.0, 0.5, None, 0.2, 0.95]
    cur = assign_budgets((1, 2, 3, 4), [4, 1, 1, 1], 7, pass_rates=rates, key="a")
    assert cur[1] == 4 and cur[5] == 3  # the hardest prompts go deepest
    assert {cur[i] for i in (0, 2, 6)} == {1}  # the easiest stay at one loop
    with pytest.raises(ValueError, match="one non-negative weight per budget"):
        assign_budgets((1, 2), [1, 1, 1], 3)


# ---------------------------------------------------------------------------- rollouts
@pytest.fixture(scope="module")
def elr():
    tok = byte_tokenizer()
    model = looptool.convert(tiny_model("llama"), looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3), tokenizer=tok)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.2)
    return model, tok


def test_rollouts_are_scored_where_they_were_sampled(elr):
    """The right-padded re-layout must give the training forward the sampler's positions:
    per-loop caching is exact, so log-probs agree to float precision."""
    model, tok = elr
    prompts = [tok("hello").input_ids, tok("a").input_ids]
    ro = sample(model, tok, prompts, budget=3, n=3, max_new_tokens=6, temperature=0.8, seed=1)
    assert ro.ids.shape[0] == 6 and ro.prompt_index == [0, 0, 0, 1, 1, 1]
    assert ro.mask[0, : len(prompts[0])].sum() == 0 and ro.tokens > 0
    with torch.no_grad():
        lp = token_logprobs(model, ro.ids, 3, 0.8)
    torch.testing.assert_close(lp * ro.mask, ro.sample_logprobs, rtol=0, atol=1e-5)
    again = sample(model, tok, prompts, budget=3, n=3, max_new_tokens=6, temperature=0.8, seed=1)
    assert torch.equal(again.ids, ro.ids)  # seeded


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
            for a, b in [(1, 1), (2, 3), (4, 4), (3, 0)]
        )
    )
    return path


def test_grpo_runs_logs_per_budget_and_reloads(elr, tmp_path):
    model, tok = elr
    model.save_pretrained(tmp_path / "m")
    cfg = RLConfig(
        data=[str(_prompts(tmp_path))],
        output=str(tmp_path / "out"),
        reward="numeric",
        steps=2,
        prompts=4,
        rollouts=3,
        max_new_tokens=4,
        lr=1e-3,
        ratio=[2, 1, 1],
    )
    rl = GRPO(tmp_path / "m", cfg)
    before = {n: p.detach().clone() for n, p in rl.model.named_parameters()}
    summary = rl.run()
    assert set(summary) == {"1", "2", "3"}
    log = [json.loads(line) for line in (tmp_path / "out" / "rl_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and {k for r in log for k in r["budgets"]} == {"1", "2", "3"}
    assert all(r["budgets"]["1"]["prompts"] == 2 for r in log)  # 2:1:1 of 4 prompts
    assert all(0 <= b["pass_rate"] <= 1 for r in log for b in r["budgets"].values())
    loaded = looptool.load(tmp_path / "out")
    changed = [n for n, p in loaded.named_parameters() if not torch.equal(p, before[n])]
    assert changed or all(r["loss"] == 0 for r in log)  # an update happened unless every advantage was 0
    with pytest.raises(looptool.LooptoolError, match="already exists"):
        GRPO(tmp_path / "m", cfg)


def test_bad_rl_settings(elr, tmp_path):
    model, _ = elr
    model.save_pretrained(tmp_path / "m")
    data = [str(_prompts(tmp_path))]
    with pytest.raises(RLError, match="leave-one-out baseline needs another rollout"):
        GRPO(tmp_path / "m", RLConfig(data=data, output=str(tmp_path / "o"), rollouts=1))
    with pytest.raises(RLError, match="ratio has 2 weights for the 3 budgets"):
        GRPO(tmp_path / "m", RLConfig(data=data, output=str(tmp_path / "o"), ratio=[1, 1]))
    with pytest.raises(RewardError, match="neither a built-in"):
        GRPO(tmp_path / "m", RLConfig(data=data, output=str(tmp_path / "o"), reward="bogus"))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))  # no partial output
    tok = byte_tokenizer()
    with pytest.raises(looptool.LooptoolError, match="need a tokenizer with a chat template"):
        encode_prompt(tok, {"prompt": "x"}, chat=True)


def test_cli_rl_reward_that_raises_exits_1_without_output(elr, tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app

    model, _ = elr
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "bad.py").write_text("def r(prompt, completion, example):\n    return {}['missing']\n")
    res = CliRunner().invoke(
        app,
        [
            "rl",
            str(tmp_path / "m"),
            "--data",
            str(_prompts(tmp_path)),
            "-o",
            str(tmp_path / "o"),
            "--reward",
            f"{tmp_path / 'bad.py'}:r",
            "--steps",
            "1",
            "--prompts",
            "1",
            "--rollouts",
            "2",
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 1, res.output
    assert "the reward function r raised KeyError" in res.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


# ---------------------------------------------------------------------------- checkpoints and resume
# a reward that varies (so every step updates the weights) and, with STOP_AT=N in the
# environment, raises KeyboardInterrupt at its (N+1)-th call: a Ctrl-C at a known point
_REWARD = """import os
calls = 0
def parity(prompt, completion, example):
    global calls
    calls += 1
    if os.environ.get("STOP_AT") and calls > int(os.environ["STOP_AT"]):
        raise KeyboardInterrupt
    return float(sum(completion.encode()) % 2)
"""


@pytest.fixture
def small(tmp_path) -> Path:
    """The smallest ELR model that has two budgets (2 layers, k = 1, 2), saved in ``tmp_path``."""
    model = looptool.convert(
        tiny_model("llama", num_layers=2),
        looptool.RecurrentLoop(recurrent=(0, 1), max_loops=2),
        tokenizer=byte_tokenizer(),
    )
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "parity.py").write_text(_REWARD)
    return tmp_path / "m"


def _rl_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """``looptool rl`` on the ``small`` model: 4 steps of 2 prompts (one per budget, routed by
    the pass-rate curriculum) × 2 rollouts."""
    return [
        "rl",
        str(tmp_path / "m"),
        "--data",
        str(_prompts(tmp_path)),
        "-o",
        str(out),
        "--reward",
        f"{tmp_path / 'parity.py'}:parity",
        "--steps",
        "4",
        "--prompts",
        "2",
        "--rollouts",
        "2",
        "--ratio",
        "1:1",
        "--max-new-tokens",
        "3",
        "--lr",
        "1e-2",
        "--device",
        "cpu",
        *extra,
    ]


def test_rl_resume_after_kill_matches_uninterrupted_run(small, tmp_path):
    killed = tmp_path / "killed"
    status, lines = kill_after_line(
        [sys.executable, "-m", "looptool", *_rl_args(tmp_path, killed, "--save-every", "2")], "step 3 "
    )
    assert status == -signal.SIGKILL, "the run ended before the kill; the test proves nothing: " + "".join(lines[-5:])
    assert checkpoint_step(killed) == 2  # killed between checkpoints, with step 3 run past the one at step 2
    ref = CliRunner().invoke(app, _rl_args(tmp_path, tmp_path / "ref"))  # uninterrupted, checkpoint only at the end
    assert ref.exit_code == 0, ref.output
    again = CliRunner().invoke(app, _rl_args(tmp_path, killed))
    assert again.exit_code == 1 and "already exists" in again.output, again.output
    changed = CliRunner().invoke(app, _rl_args(tmp_path, killed, "--resume", "--temperature", "0.5"))
    assert changed.exit_code == 1 and "these settings differ: temperature" in changed.output, changed.output
    res = CliRunner().invoke(app, _rl_args(tmp_path, killed, "--save-every", "2", "--resume"))
    assert res.exit_code == 0, res.output
    assert step_log(killed / "rl_log.jsonl") == step_log(tmp_path / "ref" / "rl_log.jsonl")  # budgets, rewards, losses
    assert_same_weights(killed, tmp_path / "ref", small)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    log = (killed / "rl_log.jsonl").read_text()
    complete = CliRunner().invoke(app, _rl_args(tmp_path, killed, "--resume"))
    assert complete.exit_code == 0 and "already complete (4 steps); nothing to resume" in complete.output, (
        complete.output
    )
    assert (killed / "rl_log.jsonl").read_text() == log  # nothing re-ran


def test_rl_ctrl_c_before_the_first_checkpoint_and_resume_without_one(small, tmp_path):
    res = CliRunner().invoke(app, _rl_args(tmp_path, tmp_path / "o", "--save-every", "2"), env={"STOP_AT": "2"})
    assert res.exit_code == 130, res.output
    assert "interrupted before the first checkpoint; nothing was saved" in res.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))
    with pytest.raises(looptool.LooptoolError, match="holds no checkpoint to resume"):  # a model, not a run
        GRPO(small, RLConfig(data=[str(_prompts(tmp_path))], output=str(small), resume=True))
    with pytest.raises(looptool.LooptoolError, match="save_every must be at least 0"):
        GRPO(small, RLConfig(data=[str(_prompts(tmp_path))], output=str(tmp_path / "o"), save_every=-1))
