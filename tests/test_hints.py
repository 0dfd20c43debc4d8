"""Library errors name Python parameters, never command-line flags; the command line points at
its own option for the parameter an error names (looptool.cli.hints.option_hint)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest
import torch
import typer
from typer.testing import CliRunner

from looptool.cli import app
from looptool.cli.hints import ALIASES, option_hint
from looptool.core.errors import LooptoolError

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("looptool", "passes", "backends")
# The command line is where flags belong.
CLI = ROOT / "looptool" / "cli"
# Modules whose messages are being reworded in a change of their own; drop each from this set
# once its raised messages name parameters too.
PENDING = {"looptool/eval/harness.py"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------------------- option_hint


def _command() -> click.Command:
    return click.Command(
        "cmd",
        params=[
            click.Argument(["model_dir"]),
            click.Option(["--output", "-o"]),
            click.Option(["--seq-len"], type=int),
            click.Option(["--teacher"], multiple=True),
            click.Option(["--overwrite/--no-overwrite"]),
        ],
    )


def test_option_hint_names_the_commands_option_for_the_parameter():
    with click.Context(_command()):
        assert option_hint(LooptoolError("seq_len must be at least 1.", parameter="seq_len")) == " (option --seq-len)"
        assert option_hint(LooptoolError("pass overwrite=True.", parameter="overwrite")) == " (option --overwrite)"
        # a library name that differs from the command line's: through ALIASES
        assert option_hint(LooptoolError("not a directory.", parameter="directory")) == " (option --output)"
        assert option_hint(LooptoolError("no teacher covers it.", parameter="teachers")) == " (option --teacher)"


def test_option_hint_is_empty_without_a_matching_option():
    with click.Context(_command()):
        assert option_hint(LooptoolError("no parameter named")) == ""
        assert option_hint(LooptoolError("not on this command", parameter="temperature")) == ""
        assert option_hint(LooptoolError("an argument, not an option", parameter="model_dir")) == ""
        assert option_hint(LooptoolError("already says --seq-len", parameter="seq_len")) == ""  # no repeat
        assert option_hint(ValueError("not a LooptoolError")) == ""
    assert option_hint(LooptoolError("outside a command", parameter="seq_len")) == ""  # a library caller


def _cli_options() -> dict[str, set[str]]:
    """Python parameter names of every command's options, by command."""
    group = typer.main.get_command(app)
    return {name: {p.name for p in cmd.params if p.param_type_name == "option"} for name, cmd in group.commands.items()}


def test_aliases_point_at_real_cli_parameters():
    options = _cli_options()
    for library, cli in ALIASES.items():
        assert library != cli
        assert any(cli in names for names in options.values()), (
            f"no command has a parameter {cli!r} (ALIASES[{library!r}])"
        )
        both = [command for command, names in options.items() if {library, cli} <= names]
        assert not both, f"{both} have both {library!r} and {cli!r}: the alias would be ambiguous there"


# ---------------------------------------------------------------------------- through the CLI


def test_cli_error_gains_the_option(tmp_path):
    res = _run("train", tmp_path / "nowhere", "--data", "x", "-o", tmp_path / "out", "--seq-len", "0")
    assert res.exit_code == 1, res.output
    assert "seq_len must be at least 1. (option --seq-len)" in res.output


def test_cli_error_gains_an_aliased_option(tmp_path):
    res = _run("distill", tmp_path / "nowhere", "--teacher", "bad", "--data", "x", "-o", tmp_path / "out")
    assert res.exit_code == 1, res.output
    assert "teacher spec 'bad' is not DOMAIN=PATH. (option --teacher)" in res.output
    target = tmp_path / "file"
    target.write_text("not a folder")
    res = _run("convert", tmp_path / "nowhere", "-o", target, "--overwrite")
    assert res.exit_code == 1, res.output
    assert "is not a directory; choose another path. (option --output)" in res.output


# ---------------------------------------------------------------------------- the library


def _library_errors(tmp_path):
    from looptool.core.plan import parse_budgets
    from looptool.posttrain.distill import DistillConfig, parse_teachers
    from looptool.posttrain.rl import RLConfig
    from looptool.runtime.devices import resolve_device
    from looptool.storage.files import check_output_dir
    from looptool.train.data import PackedTokens, training_rows
    from looptool.train.trainer import TrainConfig

    train = dict(data=["x"], output="o")
    return [
        ("seq_len", lambda: TrainConfig(**train, seq_len=0).check()),
        ("override", lambda: TrainConfig(**train, override=2.0).check()),
        ("warmup", lambda: TrainConfig(**train, warmup=1.0).check()),
        ("gate_floor_until", lambda: TrainConfig(**train, gate_floor_until=2.0).check()),
        ("strategy", lambda: TrainConfig(**train, strategy="zero").check()),
        ("rollouts", lambda: RLConfig(data=["x"], output="o", rollouts=1).check()),
        ("is_clip", lambda: RLConfig(data=["x"], output="o", is_clip=(2.0, 5.0)).check()),
        ("teachers", lambda: DistillConfig(data=["x"], teachers={}, output="o").check()),
        ("teachers", lambda: parse_teachers(["no-equals-sign"])),
        ("budgets", lambda: parse_budgets("0,x")),
        ("device", lambda: resolve_device("gpu0")),
        ("overwrite", lambda: check_output_dir(tmp_path, overwrite=False)),
        ("seq_len", lambda: PackedTokens(torch.arange(10), seq_len=1)),
        ("format", lambda: training_rows(["x"], None, 8, format="xml")),
    ]


def test_library_errors_name_the_parameter_not_a_flag(tmp_path):
    for parameter, call in _library_errors(tmp_path):
        with pytest.raises(LooptoolError) as info:
            call()
        assert "--" not in str(info.value), str(info.value)
        assert info.value.parameter == parameter, (parameter, str(info.value))


def _raised_messages(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every string in a ``raise`` statement of ``path`` (f-string fields read as ``x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        for sub in ast.walk(node.exc):
            if isinstance(sub, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in sub.values)
                found.append((sub.lineno, text))
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.append((sub.lineno, sub.value))
    return found


def test_no_library_error_names_a_command_line_flag():
    files = [
        p
        for root in LIBRARY
        for p in sorted((ROOT / root).rglob("*.py"))
        if CLI not in p.parents and p.relative_to(ROOT).as_posix() not in PENDING
    ]
    assert len(files) > 30, files
    offenders = sorted(
        {
            f"{p.relative_to(ROOT)}:{line}: {FLAG.findall(text)} in {text!r}"
            for p in files
            for line, text in _raised_messages(p)
            if FLAG.search(text)
        }
    )
    assert not offenders, (
        "raised messages name command-line flags; name the Python parameter instead "
        "(LooptoolError(message, parameter=...)):\n" + "\n".join(offenders)
    )
