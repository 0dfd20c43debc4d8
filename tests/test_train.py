"""Mixed-depth training: sampler counts, data errors, resume after kill -9, NaN stop, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import looptool
from looptool.testing import byte_tokenizer
from looptool.train.data import (
    IGNORE,
    CompletionExamples,
    DataError,
    PackedTokens,
    find_files,
    read_documents,
    split_files,
    tokenize_files,
    training_rows,
)
from looptool.train.sampling import BudgetSampler
from looptool.train.trainer import TrainConfig, Trainer, TrainingError

SOTU = Path(__file__).resolve().parent / "data" / "sotu"  # in-repo subset (tests/data/sotu/README.md)
HELD_TRAIN = str(Path(__file__).with_name("held_train.py"))  # a run that waits for its kill before it ends


# ---------------------------------------------------------------------------- sampler
def test_override_counts_per_optimizer_step():
    s = BudgetSampler((0, 3, 6, 9, 12), override=0.25, grad_accum=8, seed=1)
    positions = []
    for step in range(20):
        forced = [m for m in range(8) if s.overridden(step, m)]
        assert len(forced) == 2  # round(f * G)
        positions.append(tuple(forced))
        assert all(s.budget(step, m) == 0 for m in forced)
    assert len(set(positions)) > 1  # positions rotate


def test_override_counts_per_rank_and_rotation():
    s = BudgetSampler((1, 2, 3, 4), override=0.25, grad_accum=2, world=8, seed=0)
    seen = set()
    for step in range(6):
        for micro in range(2):
            ranks = [r for r in range(8) if s.overridden(step, micro, r)]
            assert len(ranks) == 2 and (ranks[1] - ranks[0]) % 8 == 1  # contiguous block
            seen.add(tuple(ranks))
            drawn = {s.budget(step, micro, r) for r in range(8) if r not in ranks}
            assert len(drawn) == 1  # every other rank draws the same budget
    assert len(seen) > 2


def test_realised_frequencies_match_eq3():
    s = BudgetSampler((1, 2, 3, 4), override=0.1, grad_accum=10, seed=3)
    draws = [s.budget(step, m) for step in range(2000) for m in range(10)]
    exp = s.expected()
    assert exp["p_shallowest"] == pytest.approx(0.25 + 0.75 * 0.1)  # 1/K + (1 - 1/K) f
    assert exp["mean_budget"] == pytest.approx(0.1 * 1 + 0.9 * 2.5)  # f + (1 - f)(K + 1)/2
    assert sum(k == 1 for k in draws) / len(draws) == pytest.approx(exp["p_shallowest"], abs=0.015)
    assert sum(draws) / len(draws) == pytest.approx(exp["mean_budget"], abs=0.03)


# ---------------------------------------------------------------------------- data
def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        find_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt/.md/.jsonl files"):
        find_files(tmp_path / "empty")
    (tmp_path / "bin.txt").write_bytes(b"abc\x00def")
    with pytest.raises(DataError, match="looks binary"):
        read_documents(tmp_path / "bin.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match="line 2 has no string 'text' field"):
        read_documents(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="has no tokenizer"):
        tokenize_files([tmp_path / "bad.jsonl"], None)
    with pytest.raises(DataError, match="fewer than one sequence"):
        PackedTokens(torch.arange(10), 64)


def test_jsonl_packing_and_split_are_deterministic(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.jsonl").write_text(
            "".join(json.dumps({"text": f"doc {i}-{j} " * 20}) + "\n" for j in range(3))
        )
    files = find_files(tmp_path)
    train, val = split_files(files, 0.2, seed=0)
    assert len(val) == 1 and not set(train) & set(val)
    assert split_files(files, 0.2, seed=0) == (train, val)
    packed = PackedTokens(tokenize_files(train, byte_tokenizer()), 32)
    assert torch.equal(packed.batch(5, 3, seed=1), packed.batch(5, 3, seed=1))
    assert not torch.equal(packed.batch(5, 3, seed=1), packed.batch(5, 3, seed=2))


# ---------------------------------------------------------------------------- training runs
def _cli(model_dir, out, *extra, save_every: int = 1, launcher: tuple[str, ...] = ("-m", "looptool")):
    return [
        sys.executable,
        *launcher,
        "train",
        str(model_dir),
        "--data",
        str(SOTU / "179*.txt"),
        "-o",
        str(out),
        "--tokens",
        "12k",
        "--seq-len",
        "64",
        "--batch",
        "4",
        "--grad-accum",
        "2",
        "--lr",
        "3e-3",
        "--new-lr",
        "3e-2",
        "--override",
        "0.5",
        "--save-every",
        str(save_every),
        *extra,
    ]


def _losses(out: Path) -> list:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_resume_after_kill_matches_uninterrupted_run(model_dir, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(_cli(model_dir, ref), check=True, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    # held_train.py: the run waits before its final checkpoint, so the kill comes before its end
    # however fast it runs or however late this process polls
    held = _cli(model_dir, killed, save_every=4, launcher=(HELD_TRAIN,))
    proc = subprocess.Popen(held, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    lines = 0
    while time.time() < deadline:  # kill -9 once a checkpoint exists and the run has gone past it
        log = killed / "train_log.jsonl"
        lines = len(log.read_text().splitlines()) if log.exists() else 0
        if lines >= 6:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before the kill; the test proves nothing"
    assert len(_losses(ref)) == 23
    # the kill landed mid-run, after a checkpoint: the last checkpoint (in OUTPUT, or in .OUTPUT.old
    # when the kill fell between the two renames of a commit) is a step in 4..20 and the run had
    # logged steps past it, which the resume must drop and redo
    state = (
        killed / "trainer_state.pt"
        if (killed / "trainer_state.pt").exists()
        else tmp_path / ".killed.old" / "trainer_state.pt"
    )
    step = torch.load(state, weights_only=False)["step"]
    assert 4 <= step < 23 and step % 4 == 0 and lines >= 6, (step, lines)
    res = subprocess.run(_cli(model_dir, killed, "--resume"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _losses(killed) == _losses(ref)  # same per-step losses, bit for bit
    a, b = load_file(ref / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = looptool.load(killed)
    assert all(p.abs().sum() > 0 for _, p in model.new_parameters())  # gates trained
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_resume_requires_same_command(model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(data=[str(SOTU / "1790*.txt")], output=str(out), tokens=512, seq_len=64, batch=4, lr=1e-3)
    Trainer(model_dir, cfg).run()
    with pytest.raises(TrainingError, match="exists; pass resume=True"):
        Trainer(model_dir, cfg)
    changed = TrainConfig(**{**cfg.__dict__, "lr": 5e-3, "resume": True})
    with pytest.raises(TrainingError, match="settings differ: lr"):
        Trainer(model_dir, changed)


def _train_args(model_dir, out, *extra: str) -> list[str]:
    return [
        "train",
        str(model_dir),
        "--data",
        str(SOTU / "1790*.txt"),
        "-o",
        str(out),
        "--seq-len",
        "64",
        "--batch",
        "4",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        *extra,
    ]


def test_train_ctrl_c_names_the_last_checkpoint(model_dir, tmp_path, monkeypatch):
    """Ctrl-C at step 3 of a run of the default length (2M tokens: 7812 steps of 4 × 64)."""
    from typer.testing import CliRunner

    import looptool.train.trainer as train_module
    from looptool.cli import app

    def lr_factor(step: int, *args) -> float:
        if step == 3:
            raise KeyboardInterrupt
        return original(step, *args)

    original = train_module.lr_factor
    monkeypatch.setattr(train_module, "lr_factor", lr_factor)
    res = CliRunner().invoke(app, _train_args(model_dir, tmp_path / "run", "--save-every", "2"))
    assert res.exit_code == 130, res.output
    assert f"the last checkpoint (after step 2) is in '{tmp_path / 'run'}'" in res.output
    assert "rerun the same command with --resume to continue from it" in res.output
    assert "/7812" in res.output  # the progress bar's total: --tokens 2M by default


def test_train_steps_and_resume_of_a_complete_run(model_dir, tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app

    out = tmp_path / "run"
    both = CliRunner().invoke(app, _train_args(model_dir, out, "--steps", "3", "--tokens", "1k"))
    assert (
        both.exit_code == 1 and "--tokens and --steps both set the length of the run; give one of them" in both.output
    )
    with pytest.raises(TrainingError, match="tokens and steps both set the length of the run"):
        TrainConfig(data=[], output=str(out), tokens=1000, steps=3).check()
    res = CliRunner().invoke(app, _train_args(model_dir, out, "--steps", "3"))
    assert res.exit_code == 0, res.output
    log = (out / "train_log.jsonl").read_text()
    assert [json.loads(line)["step"] for line in log.splitlines()] == [0, 1, 2]
    done = CliRunner().invoke(app, _train_args(model_dir, out, "--steps", "3", "--resume"))
    assert done.exit_code == 0 and f"the run in '{out}' is already complete (3 steps); nothing to resume" in done.output
    assert (out / "train_log.jsonl").read_text() == log  # not re-run, not rewritten
    longer = CliRunner().invoke(app, _train_args(model_dir, out, "--steps", "4", "--resume"))
    assert longer.exit_code == 1 and "these settings differ: steps" in longer.output, longer.output


def _train_into_file(args: list[str], stdout: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m looptool ARGS`` with stdout written to the file ``stdout`` (not a terminal)."""
    with open(stdout, "w") as f:
        return subprocess.run(
            [sys.executable, "-m", "looptool", *args],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )


@pytest.fixture(scope="module")
def run_into_file(model_dir, tmp_path_factory) -> tuple[Path, str]:
    """A 6-step run with stdout in a file, a progress line every step (LOOPTOOL_PROGRESS_EVERY=0):
    its output directory and its stdout."""
    out = tmp_path_factory.mktemp("train-file") / "run"
    stdout = out.parent / "stdout.txt"
    res = _train_into_file(_train_args(model_dir, out, "--steps", "6"), stdout, LOOPTOOL_PROGRESS_EVERY="0")
    assert res.returncode == 0, res.stderr[-2000:]
    return out, stdout.read_text()


def test_train_prints_progress_lines_when_stdout_is_a_file(run_into_file):
    """Where the live display cannot draw (stdout in a file), plain lines carry the progress:
    step of the total, tokens, the loss of each budget drawn, tokens/s and the time left."""
    import re

    _, stdout = run_into_file
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    pattern = re.compile(
        r"step (\d+)/6 · tokens ([\d,]+)/1,536 · loss (k=\d: \d+\.\d{3}(?:, k=\d: \d+\.\d{3})*) · "
        r"[\d,]+ tok/s · ETA (\d+:\d\d:\d\d)$"
    )
    found = [pattern.match(line) for line in lines]
    assert all(found), lines
    assert [int(m[1]) for m in found] == [1, 2, 3, 4, 5, 6]  # 0 seconds apart: every step
    assert [int(m[2].replace(",", "")) for m in found] == [256 * s for s in range(1, 7)]
    budgets = [k for m in found for k in re.findall(r"k=(\d)", m[3])]
    assert set(budgets) <= {"0", "1", "2"} and len(budgets) == 6  # one micro-batch per step, one budget each
    assert found[-1][4] == "0:00:00"


def test_progress_lines_come_at_the_interval_with_window_rates():
    """The first step, then once ``every`` seconds have passed, and the last step; the loss per
    budget, tokens/s and ETA cover the steps since the previous line."""
    import io

    from looptool.cli.train import ProgressLines

    now = [0.0]
    stream = io.StringIO()
    lines = ProgressLines(stream, total_steps=10, every=30.0, clock=lambda: now[0])
    for step in range(10):
        now[0] += 10.0  # 10 s a step, 100 tokens a step
        lines({"step": step, "budgets": [step % 2], "loss": [step + 0.5 * (step % 2)], "tokens": 100 * (step + 1)})
    assert stream.getvalue().splitlines() == [
        "step 1/10 · tokens 100/1,000 · loss k=0: 0.000 · 10 tok/s · ETA 0:01:30",
        "step 4/10 · tokens 400/1,000 · loss k=0: 2.000, k=1: 2.500 · 10 tok/s · ETA 0:01:00",
        "step 7/10 · tokens 700/1,000 · loss k=0: 5.000, k=1: 5.500 · 10 tok/s · ETA 0:00:30",
        "step 10/10 · tokens 1,000/1,000 · loss k=0: 8.000, k=1: 8.500 · 10 tok/s · ETA 0:00:00",
    ]


def test_train_summary_says_what_trainer_state_is(run_into_file):
    out, stdout = run_into_file
    size = (out / "trainer_state.pt").stat().st_size
    assert size > 1.5 * (out / "model.safetensors").stat().st_size  # AdamW: two moments per weight
    assert "trainer_state.pt (" in stdout and "× the weights) holds the optimizer state" in stdout
    assert "that --resume continues from" in stdout and "--no-save-optimizer" in stdout


def test_no_save_optimizer_saves_a_final_model_that_resume_refuses(model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import looptool.train.trainer as train_module
    from looptool.cli import app

    out = tmp_path / "run"
    res = _train_into_file(_train_args(model_dir, out, "--steps", "2", "--no-save-optimizer"), tmp_path / "stdout.txt")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (out / "trainer_state.pt").exists()
    assert "no trainer_state.pt (--no-save-optimizer): the model is final" in (tmp_path / "stdout.txt").read_text()
    trained = looptool.load(out)
    assert any(p.abs().sum() > 0 for _, p in trained.new_parameters())  # trained: the gates start at zero
    weights = (out / "model.safetensors").read_bytes()
    resumed = CliRunner().invoke(app, _train_args(model_dir, out, "--steps", "2", "--resume"))
    assert resumed.exit_code == 1, resumed.output
    assert (
        f"error: '{out}' holds a model without the optimizer state that resume continues from (no "
        "trainer_state.pt, as a run with --no-save-optimizer leaves it); start a new run with it as the model and "
        "another output. (option --resume)"
    ) in " ".join(resumed.output.split())
    assert (out / "model.safetensors").read_bytes() == weights  # left as it was

    def lr_factor(step: int, *args) -> float:  # Ctrl-C at step 3, after the checkpoint of step 2
        if step == 3:
            raise KeyboardInterrupt
        return original(step, *args)

    original = train_module.lr_factor
    monkeypatch.setattr(train_module, "lr_factor", lr_factor)
    run = tmp_path / "interrupted"
    res = CliRunner().invoke(app, _train_args(model_dir, run, "--save-every", "2", "--no-save-optimizer"))
    assert res.exit_code == 130, res.output
    assert (
        f"the model of the last checkpoint is in '{run}', without the optimizer state (--no-save-optimizer), so "
        "--resume cannot continue it" in " ".join(res.output.split())
    )
    assert not (run / "trainer_state.pt").exists() and (run / "model.safetensors").exists()


def test_nan_loss_stops_with_step_and_budget(model_dir, tmp_path):
    out = tmp_path / "nan"
    cfg = TrainConfig(
        data=[str(SOTU / "179*.txt")],
        output=str(out),
        tokens=64 * 4 * 6,
        seq_len=64,
        batch=4,
        lr=1e30,
        weight_decay=0.0,
        warmup=0.0,
        clip=1e30,
        save_every=1,
    )
    with pytest.raises(TrainingError, match=r"at step \d+ \(budget \d\); stopping. The last checkpoint"):
        Trainer(model_dir, cfg).run()
    assert (out / "trainer_state.pt").exists()
    looptool.load(out)  # the last good checkpoint still loads


def test_freeze_below_window_freezes_only_lower_layers(model_dir, tmp_path):
    cfg = TrainConfig(
        data=[str(SOTU / "1790*.txt")],
        output=str(tmp_path / "f"),
        tokens=256,
        seq_len=64,
        batch=4,
        freeze_below_window=True,
    )
    trainer = Trainer(model_dir, cfg)
    frozen = {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
    layer0 = {n for n, _ in trainer.model.named_parameters() if n.startswith("model.layers.0.")}
    assert trainer.model.config.tie_word_embeddings is False
    assert frozen == layer0 | {"model.embed_tokens.weight"}  # the untied embedding is below the block too
    tied_dir = tmp_path / "tied"
    looptool.convert(
        looptool.testing.tiny_model("llama", tie_word_embeddings=True),
        looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)),
        tokenizer=byte_tokenizer(),
    ).save_pretrained(tied_dir)
    tied = Trainer(tied_dir, TrainConfig(**{**cfg.__dict__, "output": str(tmp_path / "g")}))
    frozen = {n for n, p in tied.model.named_parameters() if not p.requires_grad}
    assert frozen == layer0  # tied to the trained LM head: the embedding keeps training


def test_depth_curriculum_unlocks_deeper_budgets_in_order():
    s = BudgetSampler((3, 0, 9, 6), grad_accum=4, seed=2, curriculum_steps=40)
    assert [s.menu_at(t) for t in (0, 9, 10, 19, 20, 30, 39, 40)] == [
        (0,),
        (0,),
        (0, 3),
        (0, 3),
        (0, 3, 6),
        (0, 3, 6, 9),
        (0, 3, 6, 9),
        (3, 0, 9, 6),
    ]
    drawn = {t: {s.budget(t, m) for m in range(4)} for t in range(60)}
    assert drawn[0] == {0} and all(d <= {0, 3} for t, d in drawn.items() if t < 20)
    assert set().union(*(drawn[t] for t in range(40, 60))) == {0, 3, 6, 9}
    assert all(
        s.budget(t, m) == BudgetSampler((3, 0, 9, 6), grad_accum=4, seed=2, curriculum_steps=40).budget(t, m)
        for t in range(60)
        for m in range(4)
    )  # a function of the step: resumable


def test_gate_floor_holds_then_releases(model_dir, tmp_path):
    base = dict(
        data=[str(SOTU / "1790*.txt")], tokens=64 * 4 * 8, seq_len=64, batch=4, lr=1e-3, new_lr=1e-3, warmup=0.0
    )
    held = Trainer(model_dir, TrainConfig(**base, output=str(tmp_path / "held"), gate_floor=0.3, gate_floor_until=1.0))
    held.run()
    gates = [p for n, p in held.model.named_parameters() if n.endswith("gate")]
    assert gates and all(float(g.detach().min()) >= 0.3 for g in gates)
    released = Trainer(
        model_dir, TrainConfig(**base, output=str(tmp_path / "rel"), gate_floor=0.3, gate_floor_until=0.5)
    )
    assert released.floor_steps == 4
    with pytest.raises(TrainingError, match="gate_floor must be non-negative"):
        TrainConfig(**base, output="x", gate_floor=-1).check()


# ---------------------------------------------------------------------------- completion format
def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_completion_rows_target_only_the_completion(tmp_path):
    tok = byte_tokenizer()
    path = _jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2=", "completion": "4"}, {"prompt": "ab", "completion": "cde"}])
    rows = training_rows([str(path)], tok, seq_len=12, format="completion")
    assert isinstance(rows, CompletionExamples) and len(rows) == 2
    for r, (prompt, completion) in enumerate([("2+2=", "4"), ("ab", "cde")]):
        p = tok(prompt, add_special_tokens=True).input_ids
        c = tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert rows.ids[r, : len(p) + len(c)].tolist() == p + c
        assert rows.labels[r, : len(p)].tolist() == [IGNORE] * len(p)  # no loss on the prompt
        assert rows.labels[r, len(p) : len(p) + len(c)].tolist() == c  # the completion and its EOS
        assert (rows.labels[r, len(p) + len(c) :] == IGNORE).all()  # nor on the padding
    ids, labels = rows.labeled_batch(0, 4, seed=0)  # wraps into the next epoch
    assert ids.shape == labels.shape == (4, 12)
    assert torch.equal(rows.labeled_batch(1, 3, seed=5)[0], rows.labeled_batch(1, 3, seed=5)[0])


@pytest.mark.parametrize(
    "records,message",
    [
        ([{"prompt": "a"}], "needs string 'prompt' and 'completion'"),
        ([{"prompt": "a", "completion": ""}], "empty completion"),
        ([{"prompt": "a" * 20, "completion": "b"}], "more than seq_len 12"),
    ],
)
def test_completion_data_errors(tmp_path, records, message):
    path = _jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=message):
        training_rows([str(path)], byte_tokenizer(), seq_len=12, format="completion")


def test_completion_format_needs_jsonl_and_a_known_format(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(DataError, match="is not a .jsonl file"):
        training_rows([str(tmp_path / "a.txt")], byte_tokenizer(), seq_len=12, format="completion")
    with pytest.raises(TrainingError, match="format 'xml' is unknown; use text, completion, chat"):
        TrainConfig(data=["x"], output="o", format="xml").check()


def test_completion_training_loss_is_the_completion_loss(model_dir, tmp_path):
    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(5)]
    path = _jsonl(tmp_path / "add.jsonl", records)
    cfg = TrainConfig(
        data=[str(path)],
        output=str(tmp_path / "run"),
        tokens=16 * 4,
        seq_len=16,
        batch=4,
        lr=1e-9,
        warmup=0.0,
        format="completion",
        budgets=[2],
    )
    trainer = Trainer(model_dir, cfg)
    ids, labels = trainer.data.labeled_batch(0, 4, cfg.seed)
    with torch.no_grad():
        logits = trainer.model(ids, budget=2).logits
    targets = labels[:, 1:]
    keep = targets != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep])  # completion tokens only
    trainer.run()
    assert trainer.records[0]["loss"][0] == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.slow
def test_two_process_ddp(model_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29517",
        "-m",
        "looptool",
        "train",
        str(model_dir),
        "--data",
        str(SOTU / "179*.txt"),
        "-o",
        str(out),
        "--tokens",
        "4k",
        "--seq-len",
        "64",
        "--batch",
        "2",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--new-lr",
        "1e-2",
        "--override",
        "0.5",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    a, b = summary["param_checksums"]
    assert a == b  # ranks stayed in sync
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(records) == summary["steps"] == 4000 // (64 * 2 * 2 * 2)
    for rec in records:
        per_rank = rec["budgets"]  # [rank][micro]
        for micro in range(2):
            col = [per_rank[r][micro] for r in range(2)]
            assert col.count(0) >= 1  # round(0.5 * 2) = 1 rank forced to the shallowest budget
    looptool.load(out)


def test_exit_loss_is_the_weighted_mean_of_exit_losses(tmp_path):
    model = looptool.convert(
        looptool.testing.tiny_model("llama"),
        looptool.RecurrentLoop(recurrent=(1, 2), max_loops=3, init="paper"),
        tokenizer=byte_tokenizer(),
    )
    ids = torch.randint(0, 200, (2, 9))
    labels = ids.clone()
    labels[:, :4] = IGNORE
    out = model(ids, labels=labels, budget=3, output_exit_logits=True)
    ce = [
        torch.nn.functional.cross_entropy(lg[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)
        for lg in (*out.exit_logits, out.logits)
    ]
    from looptool.train.trainer import exit_weighted_loss

    torch.testing.assert_close(exit_weighted_loss(out, labels, 0.5), (0.5 * ce[0] + 0.5 * ce[1] + ce[2]) / 2)
    model.save_pretrained(tmp_path / "elr")
    cfg = dict(
        data=[str(SOTU / "1790*.txt")],
        tokens=32 * 2 * 3,
        seq_len=32,
        batch=2,
        lr=1e-3,
        new_lr=1e-2,
        warmup=0.0,
        budgets=[3],
    )
    plain = Trainer(tmp_path / "elr", TrainConfig(**cfg, output=str(tmp_path / "a")))
    plain.run()
    deep = Trainer(tmp_path / "elr", TrainConfig(**cfg, output=str(tmp_path / "b"), exit_loss=1.0))
    deep.run()
    assert plain.records[0]["loss"] == deep.records[0]["loss"]  # the logged loss is the budget's own
    a, b = plain.model.get_parameter("loop.recurrent.beta_gamma"), deep.model.get_parameter("loop.recurrent.beta_gamma")
    assert not torch.equal(a, b)  # the exits changed the gradients
    with pytest.raises(TrainingError, match="applies to ELR"):
        Trainer(
            _prefix_dir(tmp_path), TrainConfig(**{**cfg, "budgets": None}, output=str(tmp_path / "c"), exit_loss=1.0)
        )


def _prefix_dir(tmp_path: Path) -> Path:
    path = tmp_path / "prefix"
    looptool.convert(
        looptool.testing.tiny_model("llama"),
        looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)),
        tokenizer=byte_tokenizer(),
    ).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------- chat format
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIALOGUE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4, of course."},
]


def _chat_tokenizer(markers: bool = False):
    """The byte tokenizer with a ChatML template; ``markers``: ``<|im_start|>``/``<|im_end|>``
    as single added special tokens (ids 256, 257) instead of their bytes."""
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    if markers:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


@pytest.mark.parametrize("markers", [False, True], ids=["bytes", "marker-tokens"])
def test_chat_sft_masks_match_the_chat_template_token_by_token(tmp_path, markers):
    """SFT loss masks verified token by token against the chat template on a tiny tokenizer."""
    from looptool.train.data import ChatExamples

    tok = _chat_tokenizer(markers)
    path = _jsonl(tmp_path / "chat.jsonl", [{"id": 7, "messages": DIALOGUE}])  # extra fields are ignored
    rows = training_rows([str(path)], tok, seq_len=256, format="chat")
    assert isinstance(rows, ChatExamples) and len(rows) == 1
    text = tok.apply_chat_template(DIALOGUE, tokenize=False)
    expected_ids = tok(text, add_special_tokens=False).input_ids
    n = len(expected_ids)
    ids, labels = rows.ids[0].tolist(), rows.labels[0].tolist()
    assert ids[:n] == expected_ids and set(ids[n:]) == {tok.pad_token_id}  # one conversation, right-padded
    pieces = [tok.decode([t]) for t in ids[:n]]
    assert "".join(pieces) == text  # every token decodes to its own piece of the rendered text
    if markers:
        assert pieces.count("<|im_end|>") == 5 and tok.convert_tokens_to_ids("<|im_end|>") in ids
    runs, run, before = [], "", []
    for pos, (token, label) in enumerate(zip(ids, labels)):
        if label == IGNORE:
            if run:
                runs.append(run)
                run = ""
            continue
        assert label == token  # a target's label is its own input id
        if not run:
            before.append("".join(pieces[:pos]))
        run += pieces[pos]
    assert not run  # the padding after the last turn is not a target
    # exactly the text the template writes for each assistant turn after its header: the content
    # and the end-of-turn marker (so the model learns to stop), nothing of the system/user turns
    assert runs == ["Hello!<|im_end|>\n", "4, of course.<|im_end|>\n"]
    assert all(b.endswith("<|im_start|>assistant\n") for b in before)  # the header is not a target
    assert sum(label != IGNORE for label in labels) == len(tok("".join(runs), add_special_tokens=False).input_ids)
    batch_ids, batch_labels = rows.labeled_batch(0, 3, seed=0)  # wraps into later epochs
    assert batch_ids.shape == batch_labels.shape == (3, 256) and torch.equal(batch_labels[0], rows.labels[0])


@pytest.mark.parametrize(
    "records,message",
    [
        ([{"text": "no messages"}], r"line 1 needs a 'messages' list of objects with string 'role' and 'content'"),
        ([{"messages": DIALOGUE}, {"messages": [{"role": "user", "content": 3}]}], r"line 2 needs a 'messages' list"),
        ([{"messages": []}], r"needs a 'messages' list"),
        ([{"messages": DIALOGUE[:2]}], r"line 1 has no assistant message; there would be nothing to learn"),
        ([{"messages": DIALOGUE}], r"line 1 has \d+ tokens, more than seq_len 40; raise seq_len"),
    ],
)
def test_chat_data_errors(tmp_path, records, message):
    path = _jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=message):
        training_rows([str(path)], _chat_tokenizer(), seq_len=40, format="chat")


def test_chat_format_needs_jsonl_a_chat_template_and_a_fast_tokenizer(tmp_path):
    from looptool.train.data import ChatExamples

    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(DataError, match=r"is not a \.jsonl file; format 'chat' reads JSONL lines with a 'messages'"):
        training_rows([str(tmp_path / "a.txt")], _chat_tokenizer(), seq_len=64, format="chat")
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": DIALOGUE}])
    with pytest.raises(DataError, match="has no chat template; .*or use format='completion'"):
        training_rows([str(path)], byte_tokenizer(), seq_len=256, format="chat")

    class SlowTokenizer:
        chat_template = CHATML
        is_fast = False

    with pytest.raises(DataError, match="needs a fast tokenizer"):
        ChatExamples([DIALOGUE], SlowTokenizer(), seq_len=256)
    tok = _chat_tokenizer()
    tok.chat_template = "{{ messages | length }}" + CHATML  # the count changes as turns are added
    with pytest.raises(DataError, match="does not render .* turn by turn"):
        training_rows([str(path)], tok, seq_len=256, format="chat")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="cannot render .*roles must alternate"):
        training_rows([str(path)], tok, seq_len=256, format="chat")


def test_chat_training_loss_is_the_assistant_loss(model_dir, tmp_path):
    tok = _chat_tokenizer()
    records = [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(4)
        for b in range(4)
    ]
    path = _jsonl(tmp_path / "chat.jsonl", records)
    cfg = TrainConfig(
        data=[str(path)],
        output=str(tmp_path / "run"),
        tokens=80 * 4 * 2,
        seq_len=80,
        batch=4,
        lr=1e-9,
        warmup=0.0,
        format="chat",
        budgets=[2],
    )
    trainer = Trainer(model_dir, cfg, tokenizer=tok)
    ids, labels = trainer.data.labeled_batch(0, 4, cfg.seed)
    with torch.no_grad():
        logits = trainer.model(ids, budget=2).logits
    targets = labels[:, 1:]
    keep = targets != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep])  # assistant tokens only
    trainer.run()
    assert len(trainer.records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])).all() for r in trainer.records)
    assert trainer.records[0]["loss"][0] == pytest.approx(expected.item(), rel=1e-5)
