"""The looptool CLI through typer's CliRunner: happy paths and every bad-input case."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_convert_then_inspect(tiny_dir, tmp_path):
    out = tmp_path / "looped"
    res = _run("convert", tiny_dir, "-o", out, "--window", "1:3", "--budgets", "0,1,2")
    assert res.exit_code == 0, res.output
    assert {"config.json", "looptool.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    res = _run("inspect", out)
    assert res.exit_code == 0, res.output
    assert "0-1×2" not in res.output and "1×2" in res.output and "1-2×2" in res.output
    res = _run("inspect", out, "--json")
    info = json.loads(res.stdout)
    assert [r["layer_executions"] for r in info["budgets"]] == [4, 5, 6]
    assert info["params_added"] == 2 * 64 * 2
    model = looptool.load(out)
    source = looptool.testing.tiny_model("llama")
    ids = torch.randint(0, 256, (1, 6))
    assert torch.equal(source(input_ids=ids).logits, model(ids, budget=2).logits)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--window", "3:9"], "window 3:9 is not a non-empty range"),
        (["--window", "2:2"], "window 2:2 is not a non-empty range"),
        (["--window", "abc"], "must look like START:STOP"),
        (["--window", "1:3", "--budgets", "0,5"], "budget 5 is outside 0..2"),
        (["--window", "1:3", "--budgets", "0,1.5"], "not a whole number"),
        (["--mode", "spiral"], "--mode 'spiral' is not available"),
        (["--dtype", "int8"], "--dtype 'int8' is not supported"),
    ],
)
def test_convert_bad_options(tiny_dir, tmp_path, extra, message):
    out = tmp_path / "looped"
    res = _run("convert", tiny_dir, "-o", out, *extra)
    assert res.exit_code == 1
    assert message in res.output
    assert res.output.count("error:") == 1
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]  # no temp dirs either


def test_convert_missing_source(tmp_path):
    res = _run("convert", tmp_path / "nope", "-o", tmp_path / "out")
    assert res.exit_code == 1 and "does not exist" in res.output
    assert not (tmp_path / "out").exists()


def test_convert_unsupported_architecture(tmp_path):
    import transformers

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    res = _run("convert", tmp_path / "bert", "-o", tmp_path / "out")
    # transformers loads BERT as BertLMHeadModel; its post-LN layers have no clean residual stream
    assert res.exit_code == 1 and "layer structure is not supported" in res.output
    assert not (tmp_path / "out").exists()


def test_convert_refuses_existing_output(tiny_dir, tmp_path):
    out = tmp_path / "looped"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = _run("convert", tiny_dir, "-o", out)
    assert res.exit_code == 1 and "already exists; pass --overwrite" in res.output
    assert (out / "keep.txt").read_text() == "mine"
    res = _run("convert", tiny_dir, "-o", out, "--overwrite", "--window", "0:2")
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists()


def test_inspect_corrupted(tiny_dir, tmp_path):
    out = tmp_path / "looped"
    assert _run("convert", tiny_dir, "-o", out).exit_code == 0
    (out / "looptool.json").write_text("{")
    res = _run("inspect", out)
    assert res.exit_code == 1 and "not valid JSON" in res.output
    res = _run("inspect", tmp_path / "missing")
    assert res.exit_code == 1 and "not a directory" in res.output


def test_inspect_refuses_corrupted_weights(tiny_dir, tmp_path):
    out = tmp_path / "looped"
    assert _run("convert", tiny_dir, "-o", out).exit_code == 0
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:100])
    res = _run("inspect", out)
    assert res.exit_code == 1 and "the file is corrupt" in res.output


def test_convert_recurrent_and_inspect(tmp_path):
    from looptool.testing import tiny_model

    tiny_model("qwen3_moe", num_layers=6).save_pretrained(tmp_path / "moe")
    out = tmp_path / "elr"
    res = _run("convert", tmp_path / "moe", "-o", out, "--mode", "recurrent", "--recurrent", "1:5",
               "--max-loops", "3", "--update", "delta", "--no-reinject", "--route-replay")
    assert res.exit_code == 0, res.output
    res = _run("inspect", out, "--json")
    info = json.loads(res.stdout)
    expected = looptool.RecurrentLoop(recurrent=(1, 5), max_loops=3, update="delta", reinject=False,
                                      route_replay=True).to_dict()
    assert info["plan"] == expected  # every option reached the plan, nothing else changed
    assert info["plan"]["reinject"] is False and info["plan"]["route_replay"] is True
    assert [r["layer_executions"] for r in info["budgets"]] == [6, 10, 14]  # D_eff(k)
    assert {r["kv_bytes_per_token_last_loop"] for r in info["budgets"]} == {info["budgets"][0]["kv_bytes_per_token"]}
    text = _run("inspect", out).output
    assert "D_eff" in text and "1-4×3" in text


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mode", "recurrent", "--window", "1:2"], "--window and --budgets apply to --mode prefix"),
        (["--max-loops", "3"], "--max-loops only apply to --mode recurrent"),
        (["--mode", "recurrent", "--max-loops", "0"], "max_loops must be a whole number >= 1"),
        (["--mode", "recurrent", "--recurrent", "2:2"], "recurrent block 2:2 is not a non-empty range"),
        (["--mode", "recurrent", "--route-replay"], "route replay needs MoE layers"),
        (["--mode", "recurrent", "--update", "momentum"], "update rule 'momentum' is unknown"),
    ],
)
def test_convert_recurrent_bad_options(tiny_dir, tmp_path, extra, message):
    out = tmp_path / "elr"
    res = _run("convert", tiny_dir, "-o", out, *extra)
    assert res.exit_code == 1 and message in res.output, res.output
    assert not out.exists()


@pytest.fixture(scope="module")
def looped_with_tokenizer(tmp_path_factory):
    from looptool.testing import byte_tokenizer, tiny_model

    path = tmp_path_factory.mktemp("gen") / "looped"
    model = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), tokenizer=byte_tokenizer())
    model.save_pretrained(path)
    return path


def test_generate_cli(looped_with_tokenizer):
    res = _run("generate", looped_with_tokenizer, "--budget", "2", "-p", "The Constitution", "-p", "We", "--max-new-tokens", "5")
    assert res.exit_code == 0, res.output
    model = looptool.load(looped_with_tokenizer)
    tok = model.tokenizer
    tok.padding_side = "left"
    enc = tok(["The Constitution", "We"], return_tensors="pt", padding=True)
    seqs = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], budget=2, max_new_tokens=5,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for row in seqs[:, enc["input_ids"].shape[1]:]:
        assert tok.decode(row, skip_special_tokens=True) in res.stdout
    assert "KV/tok" in res.output and "tok/s" in res.output
    streamed = _run("generate", looped_with_tokenizer, "--budget", "1", "-p", "We", "--max-new-tokens", "4", "--stream",
                    "--kv", "last-loop", "--temperature", "0.8", "--seed", "3")
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout.startswith("We")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--budget", "7", "-p", "x"], "not in this model's budget menu"),
        (["-p", "  "], "empty"),
        (["-p", "x", "--max-new-tokens", "-1"], "non-negative"),
        (["-p", "x", "--kv", "sometimes"], "unknown KV cache policy"),
        (["-p", "x", "-p", "y", "--stream"], "single --prompt"),
    ],
)
def test_generate_cli_bad_input(looped_with_tokenizer, extra, message):
    res = _run("generate", looped_with_tokenizer, *extra)
    assert res.exit_code == 1
    assert message in res.output


def test_internal_errors_say_bug_and_debug_shows_the_traceback(tiny_dir, tmp_path, monkeypatch):
    """A user error exits 1 with one line; a crash inside looptool exits 2 with one line that
    says it is a bug, and ``--debug`` lets the exception through with its traceback."""
    import looptool.sources

    def crash(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(looptool.sources, "load_source", crash)
    res = runner.invoke(app, ["convert", str(tiny_dir), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "internal error: ZeroDivisionError: boom" in res.output and "looptool bug" in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    res = runner.invoke(app, ["--debug", "convert", str(tiny_dir), "-o", str(tmp_path / "out")])
    assert isinstance(res.exception, ZeroDivisionError)  # propagated: the traceback is printed
    monkeypatch.undo()
    res = runner.invoke(app, ["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "out")])
    assert res.exit_code == 1 and "error:" in res.output and "internal error" not in res.output
