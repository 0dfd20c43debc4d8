"""What a command-line user reads besides errors: counts in the number they take, help that reads
as whole sentences at any terminal width, defaults that --help states, and an export table that
says what its numbers count."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from looptool.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = sorted(typer.main.get_command(app).commands)
runner = CliRunner()


def _help(*args: str, columns: int) -> str:
    res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.output


# ---------------------------------------------------------------------------- counts


def test_counts_take_the_number_of_their_noun():
    from looptool.core.words import counted, plural

    assert counted(1, "token") == "1 token"
    assert counted(0, "token") == "0 tokens"
    assert counted(2, "token") == "2 tokens"
    assert counted(1, "distinct body", "distinct bodies") == "1 distinct body"
    assert counted(5, "distinct body", "distinct bodies") == "5 distinct bodies"
    assert counted(2048, "held-out token", grouped=True) == "2,048 held-out tokens"
    assert plural(1, "row") == "row" and plural(3, "row") == "rows"


def test_a_one_token_prompt_is_one_token():
    from looptool.core.errors import LooptoolError
    from looptool.serve.prompts import check_room

    with pytest.raises(LooptoolError, match=r"the prompt's 1 token exceed the capacity of 4 tokens"):
        check_room(1, 5, 4)
    res = runner.invoke(app, ["generate", "nowhere", "-p", "x", "--budget", "0,1"])
    assert res.exit_code == 1 and "--budget gives 2 budgets for 1 --prompt;" in res.output, res.output


# ---------------------------------------------------------------------------- help


def test_help_texts_are_whole_paragraphs_of_whole_sentences():
    """Every command's help (and the group's) is paragraphs with no line break inside (rich-mode
    typer would print the break where the docstring had it) that end a sentence; so is every
    option's help."""
    group = typer.main.get_command(app)
    for command in (group, *group.commands.values()):
        texts = [command.help, *(getattr(p, "help", None) for p in command.params)]
        for text in filter(None, texts):
            for paragraph in text.split("\n\n"):
                assert "\n" not in paragraph, f"{command.name}: a line break inside {paragraph!r}"
                assert paragraph.rstrip().endswith((".", "!", "?", ")")), f"{command.name}: {paragraph!r} ends mid-way"


def _early_breaks(lines: list[str], width: int) -> list[tuple[str, str]]:
    """Pairs of consecutive lines of one paragraph where the first ended although the second's
    first word fitted after it: a break the text carried, not the terminal's wrapping."""
    return [
        (a, b)
        for a, b in zip(lines, lines[1:])
        if a.strip() and b.strip() and len(a.rstrip()) + 1 + len(b.split()[0]) <= width
    ]


def _command_entries(output: str) -> list[tuple[list[str], int]]:
    """The Commands panel of the group's help: each command's text lines and the column's width."""
    panel = output[output.index("Commands") :].splitlines()[1:]
    entries: list[list[str]] = []
    width = 0
    for line in panel:
        if not line.startswith("│"):
            break
        inner = line[1:-1]  # between the borders
        match = re.match(r" (\S+)?(\s+)", inner)
        offset = match.end()
        width = len(inner) - 1 - offset  # one space of padding on the right
        text = inner[offset:].rstrip()
        if match.group(1):
            entries.append([text])
        else:
            entries[-1].append(text)
    return [(e, width) for e in entries]


def _description(output: str) -> list[list[str]]:
    """The paragraphs of a command's description (above its panels), as printed lines."""
    top = output.split("╭")[0].splitlines()
    usage = next(i for i, line in enumerate(top) if "Usage:" in line)
    paragraphs: list[list[str]] = [[]]
    for line in top[usage + 1 :]:
        if line.strip():
            paragraphs[-1].append(line.strip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


@pytest.mark.parametrize("columns", [80, 120])
def test_help_wraps_only_at_the_terminal_width(columns):
    """``looptool --help`` and every ``looptool COMMAND --help`` at 80 and 120 columns: no
    sentence is broken where the next word would have fitted, and every paragraph ends one."""
    for lines, width in _command_entries(_help(columns=columns)):
        assert not _early_breaks(lines, width), lines
        assert lines[-1].endswith((".", ")")), lines
    for command in COMMANDS:
        paragraphs = _description(_help(command, columns=columns))
        assert paragraphs, command
        for lines in paragraphs:
            assert not _early_breaks(lines, columns - 2), (command, lines)
            assert lines[-1].endswith((".", ")")), (command, lines)


def test_help_shows_bracketed_words_as_written():
    """Rich markup would read ``[recurrent]`` as a style and drop it."""
    assert "[recurrent] Recurrent block START:STOP" in _help("convert", columns=200)


def test_every_threads_option_states_its_default():
    group = typer.main.get_command(app)
    with_threads = [name for name, cmd in group.commands.items() if any(p.name == "threads" for p in cmd.params)]
    assert {"run", "serve"} <= set(with_threads)
    for name in with_threads:
        text = " ".join(_help(name, columns=200).split())
        assert re.search(
            r"--threads .*intra-op threads.*\(default: onnxruntime's own, one per physical core\)", text
        ), name


# ---------------------------------------------------------------------------- the export table


def _graph(budget, calls: dict[str, int], composed: bool = True):
    return SimpleNamespace(
        budget=budget,
        kv="per-loop",
        file=f"budget_{budget}.per-loop.onnx",
        bytes=2048,
        fused={},
        composed=composed,
        layer_calls=calls,
        max_abs_diff={"random": 1e-6},
        seconds=0.5,
    )


def test_export_table_says_what_layer_calls_count():
    from looptool.cli.export import LAYER_CALLS, engine_table

    report = SimpleNamespace(
        budgets=[_graph(0, {"Layer0": 1}), _graph(6, {"Layer0": 1, "Layer1": 30, "Layer2": 1}), _graph(2, {}, False)],
        rowwise=[],
    )
    console = Console(record=True, width=400)
    console.print(engine_table(report, "engines"))
    text = console.export_text()
    assert "1 of 1 body" in text and "32 of 3 bodies" in text and "flat" in text
    assert " ".join(LAYER_CALLS.split()) in " ".join(text.split())  # the caption, under the table
    assert "N calls of ONNX functions" in LAYER_CALLS and "M distinct function bodies" in LAYER_CALLS
    guide = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")
    section = guide[guide.index("## ONNX serving engines") : guide.index("## TensorRT engines")]
    assert "**layer calls** `N of M bodies`" in section
