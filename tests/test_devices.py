"""Devices, dtypes, compile and checkpointing options of the model, trainer and CLI (CPU
parts; tests/gpu/ holds the CUDA checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.core.errors import LooptoolError
from looptool.runtime.devices import DeviceError, resolve_device
from looptool.testing import byte_tokenizer, tiny_model
from looptool.train.trainer import TrainConfig, Trainer, TrainingError

SOTU = Path(__file__).resolve().parent / "data" / "sotu"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_device_is_cuda_only_when_available():
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="not a device name"):
        resolve_device("gpu0")


@NO_CUDA
def test_cuda_without_cuda_is_refused(model_dir):
    with pytest.raises(DeviceError, match="no usable CUDA device.*use device='cpu'"):
        resolve_device("cuda:1")
    with pytest.raises(DeviceError, match="no usable CUDA device"):
        looptool.load(model_dir, device="cuda")


def test_to_moves_or_refuses_in_one_sentence(model_dir):
    model = looptool.load(model_dir)
    assert model.to("cpu") is model and model.cpu() is model
    assert model.to(torch.float32) is model  # same dtype: nothing to do
    for change in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float16)):
        with pytest.raises(LooptoolError, match="cannot change dtype in place.*looptool.cast"):
            change(model)
    ids = torch.randint(0, 256, (1, 8))
    ref = model(ids, budget=2).logits
    model.to("meta")  # a real device move: parameters and graphs follow
    assert model.layer_graph.source.device == "meta" and next(model.parameters()).device.type == "meta"
    assert model(ids.to("meta"), budget=2).logits.device.type == "meta"
    assert ref.shape == (1, 8, 256)


def _run(model_dir, out, **extra) -> Trainer:
    cfg = TrainConfig(
        data=[str(SOTU / "1790*.txt")],
        output=str(out),
        tokens=64 * 4 * 3,
        seq_len=64,
        batch=4,
        lr=3e-3,
        new_lr=3e-2,
        warmup=0.0,
        **extra,
    )
    trainer = Trainer(model_dir, cfg)
    trainer.run()
    return trainer


def test_checkpointed_training_is_exact(model_dir, tmp_path):
    """--checkpoint trains to the same per-step losses and the same weights bit for bit."""
    plain = _run(model_dir, tmp_path / "plain")
    ckpt = _run(model_dir, tmp_path / "ckpt", checkpoint=True)
    assert ckpt.model.activation_checkpointing
    assert [r["loss"] for r in ckpt.records] == [r["loss"] for r in plain.records]
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "ckpt" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if k.startswith("loop."))


@pytest.mark.slow
def test_compiled_training_matches_eager(model_dir, tmp_path, caplog):
    """--compile: per-step losses within fp32 tolerance of eager (one budget, so one compile),
    and they come from the compiled path: dynamo captured it, AOTAutograd made its backward,
    Inductor built it, and no step fell back to eager (which would match eager trivially)."""
    from torch._dynamo.utils import counters

    eager = _run(model_dir, tmp_path / "eager", budgets=[2])
    counters.clear()
    with caplog.at_level("WARNING"):
        compiled = _run(model_dir, tmp_path / "compiled", budgets=[2], compile=True)
    assert "torch.compile failed" not in caplog.text
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1
    assert sum(counters["inductor"].values()) >= 1
    for a, b in zip(eager.records, compiled.records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


def test_compile_failure_falls_back_to_eager_with_a_warning(model_dir, monkeypatch, caplog):
    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("backend exploded")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    model = looptool.load(model_dir)
    ids = torch.randint(0, 256, (1, 8))
    ref = model(ids, budget=1).logits
    model.compile()
    with caplog.at_level("WARNING"):
        got = model(ids, budget=1).logits
    assert torch.equal(ref, got)
    assert "torch.compile failed for budget 1 (RuntimeError: backend exploded); running it eagerly" in caplog.text


def test_fp16_training_is_refused(tmp_path):
    path = tmp_path / "fp16"
    src = tiny_model("llama").to(torch.float16)
    looptool.convert(
        src, looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)), tokenizer=byte_tokenizer()
    ).save_pretrained(path)
    with pytest.raises(TrainingError, match="float16 weights needs loss scaling.*dtype=torch.bfloat16"):
        Trainer(path, TrainConfig(data=[str(SOTU / "1790*.txt")], output=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


@NO_CUDA
@pytest.mark.parametrize("command", ["train", "eval", "generate", "demo", "convert"])
def test_cli_device_cuda_without_cuda(command, model_dir, tmp_path):
    args = {
        "train": ["train", str(model_dir), "--data", str(SOTU / "1790*.txt"), "-o", str(tmp_path / "t")],
        "eval": ["eval", str(model_dir), "--data", str(SOTU / "1790*.txt")],
        "generate": ["generate", str(model_dir), "-p", "We the People"],
        "demo": ["demo", "--source", str(model_dir)],
        "convert": ["convert", str(model_dir), "-o", str(tmp_path / "c")],
    }[command]
    res = CliRunner().invoke(app, [*args, "--device", "cuda"])
    assert res.exit_code == 1, res.output
    assert "no usable CUDA device" in res.output and "Traceback" not in res.output
    assert "use --device cpu." in res.output  # the library's device='cpu' as the command line spells it
    assert not (tmp_path / "t").exists() and not (tmp_path / "c").exists()


def test_export_refuses_a_gpu_device(model_dir, tmp_path):
    res = CliRunner().invoke(app, ["export", str(model_dir), "-o", str(tmp_path / "e"), "--device", "cuda:0"])
    assert res.exit_code == 1 and not (tmp_path / "e").exists()


def test_train_cli_takes_checkpoint(model_dir, tmp_path):
    out = tmp_path / "cli"
    res = CliRunner().invoke(
        app,
        [
            "train",
            str(model_dir),
            "--data",
            str(SOTU / "1790*.txt"),
            "-o",
            str(out),
            "--tokens",
            "512",
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--checkpoint",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads((out / "train_args.json").read_text())["checkpoint"] is True


def test_gpu_check_script_is_valid_bash():
    """tests/gpu/run.sh is the one command for a GPU machine; keep it parseable (its CPU
    dry run, GPU_CHECK_DRY=1, exercises the rest: ~100 s, not part of this suite)."""
    import subprocess

    script = Path(__file__).resolve().parent / "gpu" / "run.sh"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
