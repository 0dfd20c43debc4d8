"""``looptool demo`` on a tiny source (window 1:3, budgets 0,1,2; every other option at its
default): by default it checks, tabulates and generates but runs no timing rounds; ``--timing``
runs them (5 rounds of 128 tokens); the table fits 100 columns and says what its ``ideal``
column is. (The defaults on the real SmolLM2, window and budgets included, run in
tests/test_defaults.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import looptool.eval.demo
import looptool.eval.timing
from looptool.cli import app
from looptool.core.plan import PrefixLoop
from looptool.eval.timing import Timing
from looptool.report import tables
from looptool.testing import byte_tokenizer, tiny_model

TABLE_MAX_COLUMNS = 100
PLAN = ("--window", "1:3", "--budgets", "0,1,2")  # the tiny source's plan (the defaults need 20 layers)
BUDGETS = (0, 1, 2)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny 4-layer Llama with a byte tokenizer."""
    path = tmp_path_factory.mktemp("demo") / "source"
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _demo(*args: str):
    res = CliRunner().invoke(app, ["demo", *args])
    assert res.exit_code == 0, res.output
    return res.output


def table_width(output: str) -> int:
    """The widest line of the box-drawn table in ``output``."""
    lines = [line for line in output.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(lines) >= 4 + len(BUDGETS), output
    return max(len(line) for line in lines)


def _check_generations(output: str) -> None:
    """One greedy continuation per budget, all the same at conversion."""
    rows = [line for line in output.splitlines() if line.lstrip().startswith("budget ") and ": '" in line]
    assert [int(line.split()[1].rstrip(":")) for line in rows] == list(BUDGETS), output
    assert len({line.split(": ", 1)[1] for line in rows}) == 1, rows
    assert "the same at every budget" in output


def test_demo_runs_no_timing_rounds_by_default(source, monkeypatch):
    def no_rounds(*args, **kwargs):
        raise AssertionError("the default demo ran timing rounds")

    monkeypatch.setattr(looptool.eval.timing, "interleaved", no_rounds)
    output = _demo("--source", str(source), *PLAN)
    assert "every budget is bit-identical to the source model" in output
    assert "interleaved rounds" not in output and "×time" not in output
    assert "MFLOP/tok" in output and "×KV" in output  # the cost table
    assert "run looptool demo --timing" in output
    _check_generations(output)
    assert table_width(output) <= TABLE_MAX_COLUMNS, output


def test_demo_timing_runs_the_rounds_and_explains_ideal(source, monkeypatch):
    results = []
    run_demo = looptool.eval.demo.run_demo
    monkeypatch.setattr(looptool.eval.demo, "run_demo", lambda *a, **k: results.append(run_demo(*a, **k)) or results[0])
    output = _demo("--source", str(source), *PLAN, "--timing")
    (result,) = results
    assert result.repeats == 5 and all(len(result.timings[k].samples) == 5 for k in ("source", *BUDGETS))
    assert "batch 1, 128 tokens, 5 interleaved rounds" in output
    assert "×time" in output and "ideal" in output
    assert (
        "ideal: the ×time if time grew in proportion to the layers run: each budget's layers ÷ budget 0's, " in output
    )
    assert "(4 + budget) ÷ 4" in output
    _check_generations(output)
    assert table_width(output) <= TABLE_MAX_COLUMNS, output

    # The widest table a timed SmolLM2 demo prints: its longest execution paths (30 layers,
    # window 8:20), five-digit milliseconds and 'noisy ±NNNN.N%'.
    smollm2 = PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12))
    summary = tables.summary

    def smollm2_paths(model) -> dict:
        info = summary(model)
        for row, k in zip(info["budgets"], (0, 6, 12)):
            row["path"] = tables.execution_path(smollm2, k, 30)
        return info

    slow = {"source": Timing((1.0,) * 5), 0: Timing((1.0,) * 5), 1: Timing((99.0,) * 5)}
    slow[2] = Timing((0.1, 0.1, 0.1, 20.0, 20.0))  # rounds 200× apart
    wide = looptool.eval.demo.DemoResult(result.model, result.exact, slow, 128, 5, result.continuations)
    assert wide.time_ratio(2).cell() == "noisy ±9950.0%"
    monkeypatch.setattr(looptool.eval.demo, "run_demo", lambda *a, **k: wide)
    monkeypatch.setattr(tables, "summary", smollm2_paths)
    output = _demo("--timing")
    assert "0-7, 8-19×2, 20-29" in output and "99000" in output
    assert table_width(output) <= TABLE_MAX_COLUMNS, output


def test_demo_repeats_needs_timing(tmp_path):
    res = CliRunner().invoke(app, ["demo", "--source", str(tmp_path / "missing"), "--repeats", "3"])
    assert res.exit_code == 1, res.output
    assert "--repeats sets the timing rounds, which run only with --timing; add --timing." in res.output


def test_ideal_is_relative_to_the_shallowest_budget():
    """``ideal`` compares with ×time, which divides by the shallowest budget's time."""
    model = SimpleNamespace(budgets=(3, 12), dims=lambda: SimpleNamespace(num_layers=30))
    result = looptool.eval.demo.DemoResult(model, {}, {}, 128, 0)
    assert result.ideal_ratio(3) == 1.0 and result.ideal_ratio(12) == 42 / 33
    assert result.ideal_caption().endswith("each budget's layers ÷ budget 3's, (30 + budget) ÷ 33")
