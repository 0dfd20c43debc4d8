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

    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
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
    assert res.exit_code == 1 and "already exists; pass --overwrite to replace it." in res.output
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
    res = _run(
        "convert",
        tmp_path / "moe",
        "-o",
        out,
        "--mode",
        "recurrent",
        "--recurrent",
        "1:5",
        "--max-loops",
        "3",
        "--update",
        "delta",
        "--no-reinject",
        "--route-replay",
    )
    assert res.exit_code == 0, res.output
    res = _run("inspect", out, "--json")
    info = json.loads(res.stdout)
    expected = looptool.RecurrentLoop(
        recurrent=(1, 5), max_loops=3, update="delta", reinject=False, route_replay=True
    ).to_dict()
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
    model = looptool.convert(
        tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), tokenizer=byte_tokenizer()
    )
    model.save_pretrained(path)
    return path


def test_generate_cli(looped_with_tokenizer):
    res = _run(
        "generate",
        looped_with_tokenizer,
        "--budget",
        "2",
        "-p",
        "The Constitution",
        "-p",
        "We",
        "--max-new-tokens",
        "5",
    )
    assert res.exit_code == 0, res.output
    model = looptool.load(looped_with_tokenizer)
    tok = model.tokenizer
    tok.padding_side = "left"
    enc = tok(["The Constitution", "We"], return_tensors="pt", padding=True)
    seqs = model.generate(
        enc["input_ids"],
        attention_mask=enc["attention_mask"],
        budget=2,
        max_new_tokens=5,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    for row in seqs[:, enc["input_ids"].shape[1] :]:
        assert tok.decode(row, skip_special_tokens=True) in res.stdout
    assert "KV/tok" in res.output and "tok/s" in res.output
    # --draft-budget with its default --draft-tokens: budget 2's own continuations, drafted at 0
    drafted = _run(
        "generate", looped_with_tokenizer, "--budget", "2", "-p", "The Constitution", "-p", "We",
        "--max-new-tokens", "5", "--draft-budget", "0",
    )  # fmt: skip
    assert drafted.exit_code == 0, drafted.output
    assert drafted.stdout == res.stdout  # the continuations, and nothing else, go to stdout
    assert "drafted at 0" in drafted.output and "drafts kept" in drafted.output


def test_generate_cli_budget_auto(looped_with_tokenizer):
    """--budget auto with its defaults (last-loop KV, the menu's ends, threshold 0.05): a fresh
    conversion's second passes write nothing, so every token stops at the shallowest budget;
    --exit-threshold 0 runs every token at the deepest."""
    args = ["generate", looped_with_tokenizer, "-p", "The Constitution", "-p", "We", "--max-new-tokens", "5"]
    auto = _run(*args, "--budget", "auto")
    assert auto.exit_code == 0, auto.output
    assert "budget auto 0..2" in auto.output and "realised depth per token" in auto.output
    assert auto.stdout == _run(*args, "--budget", "0", "--kv", "last-loop").stdout
    deepest = _run(*args, "--budget", "auto", "--exit-threshold", "0", "--min-budget", "1")
    assert deepest.exit_code == 0, deepest.output
    assert deepest.stdout == _run(*args, "--budget", "2", "--kv", "last-loop").stdout
    for extra, message in [
        (["--budget", "auto", "--kv", "per-loop"], "needs --kv last-loop"),
        (["--budget", "auto", "--draft-budget", "0"], "needs a fixed --budget"),
        (["--budget", "1", "--exit-threshold", "0.1"], "applies to --budget auto only"),
        (["--budget", "auto", "--max-budget", "5"], "max_budget 5 is not in"),
    ]:
        res = _run(*args, *extra)
        assert res.exit_code != 0 and message in res.output, res.output
    streamed = _run(
        "generate",
        looped_with_tokenizer,
        "--budget",
        "1",
        "-p",
        "We",
        "--max-new-tokens",
        "4",
        "--stream",
        "--kv",
        "last-loop",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    )
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout.startswith("We")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--budget", "7", "-p", "x"], "budget 7 is not in the budget menu"),
        (["-p", "  "], "empty"),
        (["-p", "x", "--max-new-tokens", "-1"], "non-negative"),
        (["-p", "x", "--kv", "sometimes"], "unknown KV cache policy"),
        (["-p", "x", "-p", "y", "--stream"], "single --prompt"),
        (["-p", "x", "--budget", "1", "--draft-budget", "2"], "must be shallower"),
        (["-p", "x", "--draft-budget", "0", "--draft-tokens", "0"], "draft_tokens must be an integer >= 1"),
        (["-p", "x", "--draft-budget", "0", "--kv", "last-loop"], "needs --kv per-loop"),
    ],
)
def test_generate_cli_bad_input(looped_with_tokenizer, extra, message):
    res = _run("generate", looped_with_tokenizer, *extra)
    assert res.exit_code == 1
    assert message in res.output


def test_internal_errors_say_bug_and_debug_shows_the_traceback(tiny_dir, tmp_path, monkeypatch):
    """A user error exits 1 with one line; a crash inside looptool exits 2 with one line that
    says it is a bug, and ``--debug`` lets the exception through with its traceback."""
    from looptool.capture import sources

    def crash(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(sources, "load_source", crash)
    res = runner.invoke(app, ["convert", str(tiny_dir), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "internal error: ZeroDivisionError: boom" in res.output and "looptool bug" in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    res = runner.invoke(app, ["--debug", "convert", str(tiny_dir), "-o", str(tmp_path / "out")])
    assert isinstance(res.exception, ZeroDivisionError)  # propagated: the traceback is printed
    monkeypatch.undo()
    res = runner.invoke(app, ["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "out")])
    assert res.exit_code == 1 and "error:" in res.output and "internal error" not in res.output


SOTU_1790 = str(__import__("pathlib").Path(__file__).resolve().parent / "data" / "sotu" / "1790*.txt")


def test_eval_cli_says_no_gain_and_writes_its_results_together(looped_with_tokenizer, tmp_path, monkeypatch):
    """A fresh conversion: every budget has the same loss, so there is no endpoint gain to
    share ("no gain", never "-0%"); eval.json and frontier.png land in MODEL_DIR together, and
    a failing plot leaves neither behind."""
    import shutil

    import looptool.report.plots

    model = tmp_path / "model"
    shutil.copytree(looped_with_tokenizer, model)
    before = sorted(p.name for p in model.iterdir())
    args = ["eval", model, "--data", SOTU_1790, "--max-tokens", "256", "--seq-len", "32", "--device", "cpu"]
    real_plot = looptool.report.plots.plot_frontier

    def broken_plot(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(looptool.report.plots, "plot_frontier", broken_plot)
    res = _run(*args)
    assert res.exit_code == 2 and "plotting failed" in res.output
    assert sorted(p.name for p in model.iterdir()) == before
    monkeypatch.setattr(looptool.report.plots, "plot_frontier", real_plot)
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in model.iterdir()) == sorted([*before, "eval.json", "frontier.png"])
    result = json.loads((model / "eval.json").read_text())
    assert [r["share_of_endpoint_gain"] for r in result["budgets"]] == [None, None, None]
    assert res.stdout.count("no gain") >= 3 and "-0%" not in res.stdout and "no endpoint gain" in res.stdout


def test_eval_cli_bad_max_tokens_names_its_option(looped_with_tokenizer):
    res = _run("eval", looped_with_tokenizer, "--data", SOTU_1790, "--max-tokens", "lots")
    assert res.exit_code == 1 and "--max-tokens 'lots' is not a number" in res.output and "--tokens" not in res.output


def test_gain_shares_only_when_the_deepest_budget_improves():
    from looptool.eval.evaluate import format_share, gain_shares

    assert gain_shares({0: 2.0, 3: 2.0015, 6: 2.004, 9: 2.0084}) == {
        0: None,
        3: None,
        6: None,
        9: None,
    }  # deeper is worse
    assert gain_shares({0: 2.0, 1: 2.0, 2: 2.0}) == {0: None, 1: None, 2: None}
    assert gain_shares({0: 2.0, 1: 1.9, 2: 1.8}) == pytest.approx({0: 0.0, 1: 0.5, 2: 1.0})
    assert [format_share(x) for x in (None, 0.0, -0.0, -0.003, 0.644, 1.0)] == [
        "no gain",
        "0%",
        "0%",
        "0%",
        "64%",
        "100%",
    ]


def test_frontier_plots_loss_against_the_cost_table(looped_with_tokenizer, tmp_path, monkeypatch):
    """The frontier's x values are the cost table's relative FLOPs (deterministic), not one
    latency measurement per budget; the measured latency sits in its own panel with min–max bars."""
    import matplotlib.figure

    from looptool.eval.evaluate import evaluate
    from looptool.report.plots import plot_frontier

    model = looptool.load(looped_with_tokenizer)
    result = evaluate(model, SOTU_1790, seq_len=32, max_tokens=128, batch=2, timing_rounds=2)
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    plot_frontier(result, tmp_path / "frontier.png")
    loss_ax, latency_ax = drawn[0].axes
    assert list(loss_ax.lines[0].get_xdata()) == [c.relative_flops for c in model.cost_table()]
    assert list(loss_ax.lines[0].get_ydata()) == [r["loss"] for r in result["budgets"]]
    assert "latency" in latency_ax.get_ylabel() and "FLOPs" in loss_ax.get_xlabel()


def _sentencepiece_like_tokenizer():
    """A small BPE with merges over bytes (ByteLevel), trained here: tokens merge several bytes
    and split multi-byte characters at other places than the byte tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, naïve café", "€ and 😀 and 日本語", "the quick brown fox"] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.mark.parametrize("kind", ["bytes", "merges"])
def test_streamed_text_equals_the_decoded_continuation(kind):
    """Token by token, with tokens that split multi-byte characters (and random bytes that
    are not UTF-8 at all), the streamed pieces join to the final decode; no piece shows a
    half character; the work is linear: each step decodes a short window, not the whole text."""
    from looptool.runtime.text import IncrementalDecoder
    from looptool.testing import byte_tokenizer

    tok = byte_tokenizer() if kind == "bytes" else _sentencepiece_like_tokenizer()
    text = "héllo wörld € 😀 日本語, naïve café " * 8
    sequences = [tok(text)["input_ids"], tok("a😀b")["input_ids"] + [tok.eos_token_id] + tok("€")["input_ids"]]
    sequences.append(torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist())
    decoded = []
    original = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or original(ids, **kw)
    for ids in sequences:
        decoded.clear()
        decoder = IncrementalDecoder(tok)
        pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
        assert "".join(pieces) == original(ids, skip_special_tokens=True)
        if ids is sequences[0]:
            assert not any("\ufffd" in p for p in pieces)
            assert sum(decoded) <= 8 * len(ids)  # a window of a few tokens per step
        assert max(decoded) <= 16


def test_encode_leaves_the_tokenizer_alone():
    from looptool.runtime.text import encode_prompts as _encode
    from looptool.testing import byte_tokenizer

    tok = byte_tokenizer()
    tok.pad_token = None
    enc = _encode(tok, ["ab", "abcd"])
    assert enc["input_ids"].tolist() == [[10, 10, 97, 98], [97, 98, 99, 100]]  # left-padded with EOS
    assert enc["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert tok.pad_token is None and tok.padding_side == "right"
    assert _encode(tok, ["abc"])["input_ids"].tolist() == [[97, 98, 99]]


def test_generate_cli_streams_the_continuation_and_keeps_the_tokenizer(looped_with_tokenizer, monkeypatch):
    import looptool.runtime.text

    seen = []
    real = looptool.runtime.text.model_tokenizer
    monkeypatch.setattr(
        looptool.runtime.text, "model_tokenizer", lambda model, path: seen.append(real(model, path)) or seen[-1]
    )
    res = _run("generate", looped_with_tokenizer, "--budget", "2", "-p", "We", "--max-new-tokens", "24", "--stream")
    assert res.exit_code == 0, res.output
    model = looptool.load(looped_with_tokenizer)
    tok = model.tokenizer
    ids = tok(["We"], return_tensors="pt")["input_ids"]
    seqs = model.generate(
        ids, budget=2, max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    assert res.stdout.startswith("We" + tok.decode(seqs[0, ids.shape[1] :], skip_special_tokens=True) + "\n")
    state = (seen[0].padding_side, seen[0].pad_token)
    res = _run("generate", looped_with_tokenizer, "--budget", "1", "-p", "We", "-p", "The", "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    assert (seen[1].padding_side, seen[1].pad_token) == state == (tok.padding_side, tok.pad_token)


def test_generate_writes_the_decoded_text_byte_for_byte_into_a_file(looped_with_tokenizer, tmp_path):
    """Into a file (not a terminal), each prompt and its continuation come out exactly as the
    Python API decodes them: a 200-character line is not wrapped, ``[bold]`` and ``:smile:``
    stay literal, and the random model's control bytes (0x1e, 0x1a, 0x04) are not stripped."""
    import subprocess
    import sys

    from looptool.runtime.generation import generate
    from looptool.runtime.text import encode_prompts

    prompts = [
        "We the People of the United States, in Order to form a more perfect Union, [bold]establish[/bold] "
        "Justice, :smile: insure domestic Tranquility, provide for the common defence, promote the general Welfare",
        ":smile: [red]x[/red]",
    ]
    args = ["generate", str(looped_with_tokenizer), "-p", prompts[0], "-p", prompts[1], "--max-new-tokens", "48"]
    stdout = tmp_path / "stdout.txt"
    with open(stdout, "wb") as f:
        res = subprocess.run([sys.executable, "-m", "looptool", *args], stdout=f, stderr=subprocess.PIPE, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    model = looptool.load(looped_with_tokenizer)
    tok = model.tokenizer
    enc = encode_prompts(tok, prompts)
    result = generate(
        model,
        enc["input_ids"],
        attention_mask=enc["attention_mask"],
        budget=model.budgets[-1],
        max_new_tokens=48,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    width = enc["input_ids"].shape[1]
    continuations = [tok.decode(row[width:], skip_special_tokens=True) for row in result.sequences]
    assert all(len(c) > 40 for c in continuations) and "\x1e" in continuations[0]  # long, with control bytes
    expected = "".join(p + c + "\n" for p, c in zip(prompts, continuations))
    assert len(expected.splitlines()[0]) > 160
    assert stdout.read_bytes() == expected.encode()


def test_export_is_quiet_and_run_names_the_missing_file_of_the_budget_asked(looped_with_tokenizer, tmp_path, capfd):
    """``looptool export`` prints no torch exporter noise (torchvision notices, training-mode
    warnings); with one budget's graph deleted, the other budgets still run and running that
    budget names its file."""
    engine = tmp_path / "engine"
    capfd.readouterr()
    res = _run("export", looped_with_tokenizer, "-o", engine, "--budget", "0,2")
    assert res.exit_code == 0, res.output
    noise = res.output + capfd.readouterr().err
    assert "torchvision is not installed" not in noise and "training mode" not in noise and "LeafSpec" not in noise
    (engine / "budget_2.per-loop.onnx").unlink()
    res = _run("run", engine, "--budget", "0", "-p", "We", "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    res = _run("run", engine, "--budget", "2", "-p", "We", "--max-new-tokens", "2")
    assert res.exit_code == 1 and "budget_2.per-loop.onnx for budget 2" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "{m}", "-p", "x", "--kv", "lastloop"], "unknown KV cache policy --kv 'lastloop'"),
        (["generate", "{m}", "-p", "x", "--temperature", "-1"], "temperature must be a number >= 0, got -1.0"),
        (["generate", "{m}", "-p", "x", "--max-new-tokens", "-2"], "max_new_tokens must be a non-negative integer"),
        (["eval", "{m}", "--data", "{m}/missing.txt"], "data path '{m}/missing.txt' does not exist"),
        (["eval", "{m}", "--data", "{m}", "--seq-len", "1"], "--seq-len must be at least 2"),
        (["analyze", "{m}", "--data", "{m}", "--batch", "0"], "--batch must be at least 1"),
        (["train", "{m}", "--data", "{m}/nope", "-o", "{m}/out"], "data path '{m}/nope' does not exist"),
        (["export", "{m}", "-o", "{m}/e", "--kv", "per-loop,bogus"], "unknown KV cache policy --kv 'per-loop,bogus'"),
        (["export", "{m}", "-o", "{m}/e", "--budget", "1,x"], "budget 'x' is not a whole number"),
        (
            ["convert", "{src}", "-o", "{m}/c", "--window", "1:9"],
            "window 1:9 is not a non-empty range inside the model's 4 layers",
        ),
    ],
)
def test_cheap_checks_come_before_the_slow_load(args, message, tiny_dir, tmp_path, monkeypatch):
    """Settings that need no model fail at once: the load is never reached."""
    import looptool.runtime.convert
    from looptool.capture import sources

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before a cheap check")

    monkeypatch.setattr(looptool.runtime.convert, "load", no_load)
    monkeypatch.setattr(sources, "load_source", no_load)
    fill = {"m": str(tmp_path), "src": str(tiny_dir)}
    res = _run(*[a.format(**fill) for a in args])
    assert res.exit_code == 1, res.output
    assert message.format(**fill) in res.output.replace("\n", "")


def test_usage_errors_raised_inside_a_command_stay_usage_errors():
    """typer >= 0.26 bundles its own click: its BadParameter must pass through the error
    wrapper (click reports it as a usage error, exit 2 with the usage line) instead of being
    called a looptool bug."""
    import typer

    from looptool.cli.application import friendly

    @friendly
    def command():
        raise typer.BadParameter("not like that")

    with pytest.raises(typer.BadParameter):
        command()


def _demo_result(source_ms: list[float], per_round: dict[int, list[float]]):
    """A demo result of the tiny looped Llama (budgets 0, 1, 2) with synthetic timings: the
    source's milliseconds per round, and each budget's ratio to the source in each round."""
    from conftest import converted

    from looptool.eval.demo import DemoResult
    from looptool.eval.timing import Timing

    timings = {"source": Timing(tuple(ms / 1e3 for ms in source_ms))}
    timings.update({k: Timing(tuple(ms / 1e3 * r for ms, r in zip(source_ms, rs))) for k, rs in per_round.items()})
    _, model = converted("llama")
    return DemoResult(model, {0: True, 1: True, 2: True}, timings, tokens=128, repeats=len(source_ms))


def test_demo_timing_gives_ratios_only_when_the_rounds_agree(monkeypatch):
    """A ratio is printed when its interleaved rounds agree (spread ≤ 20% of their median, over 3
    or more rounds); otherwise the demo says the timing is too noisy to give one."""
    import looptool.eval.demo
    from looptool.eval.timing import Ratio

    quiet = _demo_result(
        [80, 90, 85, 82, 84], {0: [1.0, 1.02, 1.01, 1.0, 0.99], 1: [1.25, 1.26, 1.27, 1.24, 1.25], 2: [1.5] * 5}
    )
    assert quiet.time_ratio(1).cell() == "1.250 ±1.1%"  # median ± half the spread of the rounds
    legend = (
        "×time: each budget's time ÷ budget 0's in the same round, median over the rounds ± half their spread; "
        "'noisy' where the rounds spread more than 20% of their median or are fewer than 3"
    )
    assert quiet.timing_notes() == [
        legend,
        "source model: 84 ms median (rounds 80–90 ms); batch 1, 128 tokens, 5 interleaved rounds",
        "budget 0 ÷ source = 1.000 (rounds 0.990–1.020)",
    ]
    # a busy machine: the rounds' ratios range over more than an order of magnitude
    busy = _demo_result(
        [409, 44, 492, 300, 120], {0: [0.318, 3.823, 1.0, 0.5, 2.0], 1: [0.4, 5.0, 1.1, 0.6, 2.2], 2: [1.5] * 5}
    )
    assert busy.time_ratio(1).cell() == "1.200 ±8.7%"  # rounds that moved together still agree
    assert busy.time_ratio(2).cell() == "noisy ±144.2%"
    assert busy.timing_notes() == [
        legend,
        "source model: 300 ms median (rounds 44–492 ms); batch 1, 128 tokens, 5 interleaved rounds",
        "budget 0 ÷ source: the timing is too noisy to give a ratio (its rounds gave 0.318–3.823, a spread of 350.5% "
        "of their median, over the 20% a ratio allows).",
        "×time of budget 2: the timing is too noisy to give a ratio (its rounds gave 0.392–4.717, a spread of 288.3% "
        "of their median, over the 20% a ratio allows).",
        "for ratios, rerun with nothing else running on the machine.",
    ]
    monkeypatch.setattr(looptool.eval.demo, "run_demo", lambda *args, **kwargs: busy)
    res = _run("demo", "--timing")
    assert res.exit_code == 0, res.output
    assert "noisy ±144.2%" in res.output and "1.200 ±8.7%" in res.output  # the ×time column
    assert all(note in res.output for note in busy.timing_notes())
    assert Ratio((1.0, 1.2)).noisy  # two rounds that agree still cannot tell a ratio from noise
    assert not Ratio((1.0, 1.1, 1.2)).noisy and Ratio((1.0, 1.1, 1.25)).noisy  # spread 18%, 23% of the median
    few = _demo_result([80, 82], {0: [1.0, 1.0], 1: [1.2, 1.2], 2: [1.4, 1.4]})
    assert few.time_ratio(1).cell() == "noisy"
    assert few.timing_notes()[2:] == [
        "budget 0 ÷ source: the timing is too noisy to give a ratio (2 rounds; a ratio needs at least 3).",
        "×time of budgets 1, 2: the timing is too noisy to give a ratio (2 rounds; a ratio needs at least 3).",
        "for ratios, rerun with at least 3 rounds.",
    ]
