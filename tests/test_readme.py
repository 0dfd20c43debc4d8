"""The README cannot drift: every command line it shows names a real command and only
options that command has, and every Python snippet runs on a tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.testing import byte_tokenizer, tiny_model

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
NEEDS_GPU = ("looptool.backends.tensorrt",)  # snippets that need TensorRT and a GPU


def _blocks(lang: str) -> list[tuple[int, str]]:
    return [(README[:m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(rf"```{lang}\n(.*?)```", README, re.S)]


def _command_lines() -> list[tuple[str, list[str]]]:
    """(command, options) of every `looptool COMMAND ...` line of the README's shell blocks."""
    out = []
    for _, block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0]
            found = re.search(r"looptool (\w[\w-]*)(.*)", line)
            if found and "pip install" not in line:
                out.append((found.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", found.group(2))))
    return out


def test_readme_commands_exist_with_their_options():
    lines = _command_lines()
    assert len(lines) >= 25
    runner = CliRunner()
    helps: dict[str, str] = {}
    for command, options in lines:
        if command not in helps:
            res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
            assert res.exit_code == 0, f"README shows 'looptool {command}', which is not a command: {res.output}"
            helps[command] = res.output
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[command]), \
                f"README: 'looptool {command} ... {option}' but {command} has no {option}"
    assert set(helps) >= {"convert", "train", "rl", "merge", "distill", "generate", "export", "run"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """What the snippets assume: a source model directory `path` (24 layers, so the
    README's windows fit), `src`, a looped `model` with budgets 0..12, `input_ids`, `ids`,
    `mask` and `tok`."""
    root = tmp_path_factory.mktemp("readme")
    tok = byte_tokenizer()
    source = tiny_model("llama", num_layers=24)
    source.save_pretrained(root / "src")
    ids = torch.tensor([tok("We the People").input_ids])
    model = looptool.convert(source, looptool.PrefixLoop(window=(6, 18), budgets=(0, 3, 6, 9, 12)), tokenizer=tok)
    return root, {"looptool": looptool, "path": str(root / "src"), "src": source, "model": model, "input_ids": ids, "ids": ids,
                  "mask": torch.ones_like(ids), "tok": tok}


@pytest.mark.parametrize("line,code", _blocks("python"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_readme_python_snippet_runs(line, code, workspace, tmp_path, monkeypatch):
    if any(module in code for module in NEEDS_GPU):
        pytest.skip("needs TensorRT and an NVIDIA GPU (tests/test_tensorrt.py covers this API with a test double)")
    root, names = workspace
    monkeypatch.chdir(tmp_path)  # snippets write ./looped, ./engines
    exec(compile(code, f"README.md:{line}", "exec"), dict(names))
