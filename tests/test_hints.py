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


# ---------------------------------------------------------------------------- fixes spelled as flags


def _under(command: str, exc: BaseException) -> str:
    """``cli_message(exc)`` as ``looptool COMMAND`` prints it."""
    from looptool.cli.hints import cli_message

    group = typer.main.get_command(app)
    with group.make_context("looptool", [command], resilient_parsing=True) as root:
        with group.commands[command].make_context(command, [], parent=root, resilient_parsing=True):
            return cli_message(exc)


@pytest.mark.parametrize(
    "command, message, kw, printed",
    [
        ("convert", "pass overwrite=True to replace it.", {}, "pass --overwrite to replace it."),
        ("convert", "post-norm; convert with conditioning=False.", dict(rerun="convert"), "with --no-conditioning."),
        (
            "export",
            "no KV policy; pass kv='per-loop', 'last-loop' or 'all'.",
            {},
            "pass --kv per-loop, last-loop or all.",
        ),
        ("export", "overflows (precision='bf16' or 'fp32').", {}, "(--precision bf16 or fp32)."),
        (
            "export",
            "add kv='last-loop' (or kv='all'), or drop adaptive.",
            {},
            "add --kv last-loop (or --kv all), or drop --adaptive.",
        ),
        ("merge", "e.g. lambdas=0.5 or lambdas=['looped=1'];", {}, "e.g. --lambda 0.5 or --lambda looped=1;"),
        ("generate", "pass budget='auto' or drop it.", {}, "pass --budget auto or drop it."),
        ("run", "pass tokenizer=PATH (a folder).", {}, "pass --tokenizer PATH (a folder)."),
        # a fix of another command: that command's whole line
        (
            "run",
            "no adaptive-depth graph; export the engine again with adaptive='state' and kv='last-loop'.",
            dict(rerun="export"),
            "export the engine again with looptool export MODEL_DIR --output OUTPUT --adaptive --kv last-loop.",
        ),
        (
            "train",
            "convert the source with dtype=torch.bfloat16 or torch.float32 (and set bf16=True for autocast).",
            dict(rerun="convert"),
            "convert the source with looptool convert SOURCE --output OUTPUT --dtype bfloat16 or float32 "
            "(and set --bf16 for autocast).",
        ),
        # left as they are: a fix no flag spells (the run stays whole), a quoted Python call, a non-option
        (
            "run",
            "export the engine again with adaptive='kl' and kv='last-loop'.",
            dict(rerun="export"),
            "export the engine again with adaptive='kl' and kv='last-loop'.",
        ),
        (
            "generate",
            "or looptool.load(directory, dtype=torch.float16).",
            {},
            "or looptool.load(directory, dtype=torch.float16).",
        ),
        ("serve", "write e.g. low=0,medium=6,high=12.", {}, "write e.g. low=0,medium=6,high=12."),
    ],
)
def test_cli_message_spells_python_fixes_as_flags(command, message, kw, printed):
    from looptool.cli.hints import cli_message

    assert _under(command, LooptoolError(message, **kw)).endswith(printed)
    assert cli_message(LooptoolError(message, **kw)) == message  # outside a command: the library's words


def test_the_hint_is_left_out_when_the_message_names_the_flag_or_its_negation():
    assert (
        _under("convert", LooptoolError("use conditioning=False.", parameter="conditioning"))
        == "use --no-conditioning."
    )
    assert _under("convert", LooptoolError("bad rank.", parameter="rank")) == "bad rank. (option --rank)"


def _engine_without_adaptive_graph(tmp_path):
    import looptool
    from looptool.backends.onnx.export import export_onnx
    from looptool.testing import byte_tokenizer, tiny_model

    model = looptool.convert(
        tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), tokenizer=byte_tokenizer()
    )
    export_onnx(model, tmp_path / "engine", budgets=[1], kv="last-loop", rowwise=False, validate=False)
    return tmp_path / "engine"


def test_cli_output_exists_error_names_the_overwrite_flag(tiny_dir, tmp_path):
    from looptool.storage.files import check_output_dir

    (tmp_path / "out").mkdir()
    res = _run("convert", tiny_dir, "-o", tmp_path / "out")
    assert res.exit_code == 1, res.output
    assert "already exists; pass --overwrite to replace it." in res.output and "overwrite=True" not in res.output
    with pytest.raises(LooptoolError, match=r"pass overwrite=True to replace it\.$"):  # the library's words
        check_output_dir(tmp_path / "out", overwrite=False)


def test_cli_missing_graph_error_is_the_export_command_line(tmp_path):
    from looptool.backends.ort.runtime import Runtime

    engine = _engine_without_adaptive_graph(tmp_path)
    res = _run("run", engine, "-p", "hi", "--budget", "auto")
    assert res.exit_code == 1, res.output
    line = "export the engine again with looptool export MODEL_DIR --output OUTPUT --adaptive --kv last-loop."
    assert line in res.output and "adaptive='state'" not in res.output and "kv='last-loop'" not in res.output
    with pytest.raises(LooptoolError, match=r"again with adaptive='state' and kv='last-loop'\.$"):  # the library's
        Runtime(engine).adaptive_session("state", "last-loop")


def test_cli_missing_extra_names_the_install_command_of_this_copy(monkeypatch):
    import sys

    from looptool.core import install
    from looptool.core.errors import MissingExtraError, require_extra

    monkeypatch.setattr(install, "_source", lambda: ("editable", "/src/my looptool"))
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the serve extra were not installed
    monkeypatch.delitem(sys.modules, "looptool.serve", raising=False)
    res = _run("serve", "somewhere")
    assert res.exit_code == 1, res.output
    assert "pip install -e '/src/my looptool[serve]'." in res.output and "'looptool[serve]'" not in res.output
    with pytest.raises(MissingExtraError, match=r"pip install -e '/src/my looptool\[serve\]'\.$"):
        require_extra("serve", "looptool serve", "fastapi")


@pytest.mark.parametrize(
    "record, checkout, command",
    [
        ({"url": "file:///src/lt", "dir_info": {"editable": True}}, None, "pip install -e '/src/lt[serve]'"),
        ({"url": "file:///src/lt", "dir_info": {}}, None, "pip install '/src/lt[serve]'"),
        (
            {"url": "https://github.com/o/lt", "vcs_info": {"vcs": "git", "commit_id": "abc1"}},
            None,
            "pip install 'looptool[serve] @ git+https://github.com/o/lt@abc1'",
        ),
        (None, Path("/work/lt"), "pip install -e '/work/lt[serve]'"),  # imported from an unrecorded checkout
        (None, None, "pip install 'looptool[serve]'"),  # from an index
    ],
)
def test_install_command_follows_how_looptool_was_installed(monkeypatch, record, checkout, command):
    from looptool.core import install

    monkeypatch.setattr(install, "_direct_url", lambda: record)
    monkeypatch.setattr(install, "_checkout", lambda: checkout)
    assert install.install_command("serve") == command


def _spelled_fixes() -> dict[str, set[str]]:
    """Every ``name=value`` fix a library error spells (outside quoted calls): name -> where."""
    from looptool.cli.hints import _runs

    found: dict[str, set[str]] = {}
    for root in LIBRARY:
        for path in sorted((ROOT / root).rglob("*.py")):
            if CLI in path.parents:
                continue
            for line, text in _raised_messages(path):
                for run in _runs(text):
                    for m in run:
                        found.setdefault(m["name"], set()).add(f"{path.relative_to(ROOT)}:{line}")
    return found


# fixes library errors spell that no command has an option for, and why the command line never shows them
NOT_ON_THE_COMMAND_LINE = {
    "n": "an HTTP request field: the server's API errors go to the client",
    "best_of": "an HTTP request field: the server's API errors go to the client",
    "use_cache": "says how looptool calls transformers; not a fix",
    "low": "a level inside serve --effort's own value",
    "medium": "a level inside serve --effort's own value",
    "high": "a level inside serve --effort's own value",
    "x": "LoopedModel.forward's and serve --effort's {name}={value} (f-string fields read as x)",
}


def test_every_fix_a_library_error_spells_has_a_flag():
    """A new ``name=value`` fix in a library error is spelled as a flag on the command line: some
    command has an option for it (ALIASES where the names differ), or it is listed above."""
    options = _cli_options()
    found = _spelled_fixes()
    assert {"overwrite", "kv", "adaptive", "dtype"} <= set(found)
    missing = {
        name: sorted(where)
        for name, where in found.items()
        if name not in NOT_ON_THE_COMMAND_LINE
        and not any({name, ALIASES.get(name, name)} & names for names in options.values())
    }
    assert not missing, f"fixes no command spells (add the option, an ALIASES entry or a reason): {missing}"


def test_every_rerun_names_a_command():
    commands = set(typer.main.get_command(app).commands)
    named = set()
    for root in LIBRARY:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "rerun" and isinstance(node.value, ast.Constant):
                    named.add(node.value.value)
    assert named and named <= commands, named - commands
