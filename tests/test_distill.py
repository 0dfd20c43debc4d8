"""Budget-matched multi-teacher on-policy distillation: the reverse KL by hand, a teacher
equal to the student gives zero loss and zero gradient, teachers run at the student's
budget, and bad teachers are refused."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.posttrain.distill import DistillConfig, Distiller, DistillError, parse_teachers, reverse_kl
from looptool.storage.resume import checkpoint_step
from looptool.testing import assert_same_weights, byte_tokenizer, kill_after_line, step_log, tiny_model


def test_reverse_kl_by_hand():
    s = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]]]))  # [1, 3, 2] logits (log-probs)
    t = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.5, 0.5]]]))
    mask = torch.tensor([[0, 1, 1]])  # tokens 1 and 2 are the completion: predicted by positions 0 and 1
    kl0 = 0.5 * torch.log(torch.tensor(0.5 / 0.25)) + 0.5 * torch.log(torch.tensor(0.5 / 0.75))
    kl1 = 0.9 * torch.log(torch.tensor(0.9 / 0.5)) + 0.1 * torch.log(torch.tensor(0.1 / 0.5))
    torch.testing.assert_close(reverse_kl(s, t, mask), (kl0 + kl1) / 2)
    # its gradient is the true gradient of KL(p_s || p_t) with respect to the student's logits
    logits = torch.randn(2, 5, 7, requires_grad=True)
    teacher, m = torch.randn(2, 5, 7), torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    reverse_kl(logits, teacher, m).backward()
    ref = logits.detach().clone().requires_grad_(True)
    ls, lt = torch.log_softmax(ref[:, :-1], -1), torch.log_softmax(teacher[:, :-1], -1)
    ((ls.exp() * (ls - lt)).sum(-1) * m[:, 1:]).sum().div(m[:, 1:].sum()).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_parse_teachers():
    assert parse_teachers(["math=./a", "copy=./b"]) == {"math": "./a", "copy": "./b"}
    with pytest.raises(DistillError, match="is not DOMAIN=PATH"):
        parse_teachers(["./a"])
    with pytest.raises(DistillError, match="twice"):
        parse_teachers(["m=./a", "m=./b"])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill")
    tok = byte_tokenizer()
    student = looptool.convert(
        tiny_model("llama"), looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3), tokenizer=tok
    )
    with torch.no_grad():
        for _, p in student.new_parameters():
            p.normal_(0, 0.2)
    student.save_pretrained(root / "student")
    with torch.no_grad():
        for _, p in student.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student.save_pretrained(root / "other")
    looptool.convert(
        tiny_model("llama"), looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2), tokenizer=tok
    ).save_pretrained(root / "shallow")
    (root / "p.jsonl").write_text(
        "".join(
            json.dumps({"prompt": p, "domain": d}) + "\n" for p, d in [("ab", "copy"), ("1+1=", "math"), ("cd", "copy")]
        )
    )
    return root


def test_teacher_equal_to_student_has_zero_loss_and_gradient(dirs, tmp_path):
    cfg = DistillConfig(
        data=[str(dirs / "p.jsonl")],
        teachers={"copy": str(dirs / "student"), "math": str(dirs / "student")},
        output=str(tmp_path / "o"),
        steps=1,
        prompts=3,
        rollouts=2,
        max_new_tokens=4,
    )
    d = Distiller(dirs / "student", cfg)
    assert d.teachers["copy"] is d.teachers["math"]  # one teacher for two domains is loaded once
    from looptool.posttrain.rollout import sample

    for k in (1, 3):
        ro = sample(d.model, d.tokenizer, d.prompts, budget=k, n=2, max_new_tokens=4, temperature=1.0, seed=0)
        domains = [d.records[j]["domain"] for j in ro.prompt_index]
        d.model.zero_grad()
        loss = d.loss(ro.ids, ro.mask, domains, k)
        loss.backward()
        assert loss.item() == 0.0
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in d.model.parameters())


def test_teachers_run_at_the_students_budget(dirs, tmp_path):
    """The loss equals an independent computation with each row's teacher at budget k,
    and differs from one with the teacher at another budget."""
    cfg = DistillConfig(
        data=[str(dirs / "p.jsonl")],
        teachers={"copy": str(dirs / "other"), "math": str(dirs / "student")},
        output=str(tmp_path / "o"),
        steps=2,
        prompts=3,
        max_new_tokens=4,
        lr=1e-3,
    )
    d = Distiller(dirs / "student", cfg)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    other, student = d.teachers["copy"], d.teachers["math"]  # references run directly, outside d.loss
    with torch.no_grad():
        got = d.loss(ids, mask, ["copy", "math"], 2)
        s = student(ids, budget=2).logits
        t = torch.cat([other(ids[:1], budget=2).logits, student(ids[1:], budget=2).logits])
        t_wrong = torch.cat([other(ids[:1], budget=3).logits, student(ids[1:], budget=3).logits])
    torch.testing.assert_close(got, reverse_kl(s, t, mask))
    assert not torch.allclose(got, reverse_kl(s, t_wrong, mask))
    summary = d.run()
    assert summary["steps"] == 2 and (tmp_path / "o" / "distill_log.jsonl").exists()
    assert looptool.load(tmp_path / "o").plan == student.plan
    assert d.teachers["copy"] is not d.teachers["math"]


def test_bad_teachers_and_domains(dirs, tmp_path):
    base = dict(data=[str(dirs / "p.jsonl")], output=str(tmp_path / "o"))
    with pytest.raises(DistillError, match="has no budget 3"):
        Distiller(
            dirs / "student",
            DistillConfig(**base, teachers={"copy": str(dirs / "shallow"), "math": str(dirs / "student")}),
        )
    with pytest.raises(DistillError, match="domain 'math', which no teacher covers"):
        Distiller(dirs / "student", DistillConfig(**base, teachers={"copy": str(dirs / "student")}))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def _distill_args(root: Path, out: Path, *extra: str) -> list[str]:
    """``looptool distill`` of a 2-layer ELR student (k = 1, 2) from a perturbed copy: 4 steps."""
    return [
        "distill",
        str(root / "student"),
        "--teacher",
        f"copy={root / 'teacher'}",
        "--data",
        str(root / "p.jsonl"),
        "-o",
        str(out),
        "--steps",
        "4",
        "--prompts",
        "2",
        "--rollouts",
        "2",
        "--max-new-tokens",
        "3",
        "--lr",
        "1e-2",
        "--device",
        "cpu",
        *extra,
    ]


def test_distill_resume_after_kill_matches_uninterrupted_run(tmp_path):
    student = looptool.convert(
        tiny_model("llama", num_layers=2),
        looptool.RecurrentLoop(recurrent=(0, 1), max_loops=2),
        tokenizer=byte_tokenizer(),
    )
    student.save_pretrained(tmp_path / "student")
    with torch.no_grad():
        for _, p in student.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student.save_pretrained(tmp_path / "teacher")
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "domain": "copy"}) + "\n" for p in ("ab", "cd", "e"))
    )
    killed = tmp_path / "killed"
    status, lines = kill_after_line(
        [sys.executable, "-m", "looptool", *_distill_args(tmp_path, killed, "--save-every", "2")], "step 3 "
    )
    assert status == -signal.SIGKILL, "the run ended before the kill; the test proves nothing: " + "".join(lines[-5:])
    assert checkpoint_step(killed) == 2  # killed between checkpoints, with step 3 run past the one at step 2
    ref = CliRunner().invoke(
        app, _distill_args(tmp_path, tmp_path / "ref")
    )  # uninterrupted, checkpoint only at the end
    assert ref.exit_code == 0, ref.output
    res = CliRunner().invoke(app, _distill_args(tmp_path, killed, "--save-every", "2", "--resume"))
    assert res.exit_code == 0, res.output
    assert step_log(killed / "distill_log.jsonl") == step_log(tmp_path / "ref" / "distill_log.jsonl")
    assert_same_weights(killed, tmp_path / "ref", tmp_path / "student")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    complete = CliRunner().invoke(app, _distill_args(tmp_path, killed, "--resume"))
    assert complete.exit_code == 0 and "already complete (4 steps)" in complete.output, complete.output
