"""FSDP2 training (--strategy fsdp) with two processes on the CPU (gloo)."""

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

SOTU = Path(__file__).resolve().parent / "data" / "sotu"
pytestmark = pytest.mark.slow
ARGS = [
    "--data",
    str(SOTU / "179*.txt"),
    "--tokens",
    "4k",
    "--seq-len",
    "64",
    "--grad-accum",
    "2",
    "--lr",
    "1e-3",
    "--new-lr",
    "1e-2",
    "--override",
    "0.5",
    "--seed",
    "3",
    "--device",
    "cpu",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fsdp(model_dir, out, port, *extra):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        "-m",
        "looptool",
        "train",
        str(model_dir),
        "-o",
        str(out),
        "--batch",
        "2",
        "--strategy",
        "fsdp",
        *ARGS,
        *extra,
    ]


_TEARDOWN_ABORT = "terminate called without an active exception"


def _run_fsdp(model_dir, out: Path, port: int, *extra) -> tuple[subprocess.CompletedProcess, Path]:
    """torchrun the trainer; rerun once into a fresh folder if a rank aborted in gloo's
    process teardown after finishing its work (a rare upstream exit-time race seen on this
    2-core machine: training and saving had completed, the C++ runtime aborted at exit)."""
    res = subprocess.run(_fsdp(model_dir, out, port, *extra), capture_output=True, text=True, timeout=600, env=ENV)
    if res.returncode != 0 and _TEARDOWN_ABORT in res.stderr and (out / "model.safetensors").exists():
        out = out.with_name(out.name + "-rerun")
        res = subprocess.run(
            _fsdp(model_dir, out, port + 100, *extra), capture_output=True, text=True, timeout=600, env=ENV
        )
    return res, out


def _weights(path: Path) -> dict:
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def fsdp_run(model_dir, tmp_path_factory) -> Path:
    """One uninterrupted two-rank FSDP run, checkpointing every step: the reference of both
    the one-process comparison and the kill-and-resume test (one torchrun launch, not two)."""
    res, out = _run_fsdp(model_dir, tmp_path_factory.mktemp("fsdp") / "ref", 29541, "--save-every", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_fsdp_equals_one_process_on_the_same_rows(model_dir, fsdp_run, tmp_path):
    """Two FSDP ranks with 2 rows each compute what one process computes with the same 4
    rows per micro-batch and the same budgets: weights agree to fp32 reduction order (the
    FSDP run checkpoints every step, so this also shows that checkpointing changes nothing)."""
    fsdp = fsdp_run
    single = tmp_path / "single"
    res = subprocess.run(
        [sys.executable, "-m", "looptool", "train", str(model_dir), "-o", str(single), "--batch", "4", *ARGS],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    logs = [[json.loads(x) for x in (p / "train_log.jsonl").read_text().splitlines()] for p in (fsdp, single)]
    assert [r["budgets"][0] for r in logs[0]] == [r["budgets"] for r in logs[1]]  # same draw on every rank
    assert all(r["budgets"][0] == r["budgets"][1] for r in logs[0])
    assert any(2 in r["budgets"] for r in logs[1])  # the looped layers were trained
    a, b = _weights(fsdp), _weights(single)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-6, msg=k)
    assert any(a[k].abs().sum() > 0 for k in a if k.startswith("loop."))
    model = looptool.load(fsdp)  # an ordinary looped model
    assert type(model).__name__ == "LoopedModel"


def test_fsdp_resume_after_kill_is_exact(model_dir, fsdp_run, tmp_path):
    ref = fsdp_run
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _fsdp(model_dir, killed, 29545, "--save-every", "1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        log = killed / "train_log.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    res = subprocess.run(
        _fsdp(model_dir, killed, 29547, "--save-every", "1", "--resume"),
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [[json.loads(x)["loss"] for x in (p / "train_log.jsonl").read_text().splitlines()] for p in (ref, killed)]
    assert losses[0] == losses[1]
    a, b = _weights(ref), _weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_needs_torchrun(model_dir, tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "looptool",
            "train",
            str(model_dir),
            "-o",
            str(tmp_path / "x"),
            "--strategy",
            "fsdp",
            *ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert res.returncode == 1
    assert "strategy 'fsdp' shards the model across processes; launch with torchrun" in res.stderr
    assert "(option --strategy)" in res.stderr
    assert not (tmp_path / "x").exists()
