"""The docs cannot drift: every command line in README.md, examples/README.md and
tests/bench/README.md names a real command and only options that command has, every
Python snippet of README.md and examples/README.md runs on a tiny model, the README stays
short, and the three files name no internal tracker, no path outside the repository and no
source file of the papers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.testing import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    name: (ROOT / name).read_text(encoding="utf-8")
    for name in ("README.md", "examples/README.md", "tests/bench/README.md")
}
SNIPPET_DOCS = ("README.md", "examples/README.md")  # whose ```python blocks run
NEEDS_GPU = ("looptool.backends.tensorrt",)  # snippets that need TensorRT and a GPU
NEEDS_SERVER = ("base_url=",)  # snippets that are clients of a running `looptool serve`
README_MAX_LINES = 300


def _blocks(doc: str, lang: str) -> list[tuple[int, str]]:
    text = DOCS[doc]
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.S)]


def _command_lines(doc: str) -> list[tuple[str, list[str]]]:
    """(command, options) of every `looptool COMMAND ...` line of a doc's shell blocks."""
    out = []
    for _, block in _blocks(doc, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0]
            found = re.search(r"looptool (\w[\w-]*)(.*)", line)
            if found and "pip install" not in line:
                out.append((found.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", found.group(2))))
    return out


def test_doc_commands_exist_with_their_options():
    lines = {doc: _command_lines(doc) for doc in DOCS}
    assert sum(map(len, lines.values())) >= 35, {doc: len(found) for doc, found in lines.items()}
    assert len(lines["README.md"]) >= 5, "the README shows the pipeline in five commands"
    assert len(lines["examples/README.md"]) >= 25, "the guides show every command"
    assert len(lines["tests/bench/README.md"]) >= 6, "the results name the commands that produced them"
    runner = CliRunner()
    helps: dict[str, str] = {}
    for doc, found in lines.items():
        for command, options in found:
            if command not in helps:
                res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
                assert res.exit_code == 0, f"{doc} shows 'looptool {command}', which is not a command: {res.output}"
                helps[command] = res.output
            for option in options:
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[command]), (
                    f"{doc}: 'looptool {command} ... {option}' but {command} has no {option}"
                )
    assert set(helps) >= {
        "convert",
        "inspect",
        "demo",
        "train",
        "eval",
        "plot",
        "analyze",
        "rl",
        "merge",
        "distill",
        "generate",
        "lm-eval",
        "export",
        "run",
    }
    assert {command for command, _ in lines["README.md"]} >= {"convert", "train", "eval", "generate", "export"}


def test_docs_have_snippets():
    assert len(_blocks("README.md", "python")) >= 1
    assert len(_blocks("examples/README.md", "python")) >= 5


def test_every_example_has_its_guide():
    missing = [
        p.name
        for p in sorted((ROOT / "examples").glob("*.py"))
        if f"examples/{p.name}" not in DOCS["examples/README.md"]
    ]
    assert not missing, f"examples/README.md does not describe {missing}"


def test_readme_is_short():
    lines = DOCS["README.md"].count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it ≤ {README_MAX_LINES} (guides go to examples/README.md)"
    )


# Built from parts so that this file does not match tests/test_repository.py's own check.
OUTSIDE = ".." + "/" + "shared"
FORBIDDEN = {
    "an internal issue number": re.compile(r"\bissues?\s+#?\d", re.I),
    "a path outside the repository": re.compile(re.escape(OUTSIDE)),
    "a paper's source file (cite it by title and equation)": re.compile(
        r"\bseeds?/|\.pdf\b|\b\d{3}_[0-9a-f]{16}\b|\bseed \d{3}\b", re.I
    ),
    "first person": re.compile(r"\b(?:I|we|We|our|Our|my|My)\b"),
    "a process note": re.compile(r"this session|lack of time|under load", re.I),
}


def _prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code removed (commands may say `-p "We the People"`)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


@pytest.mark.parametrize("doc", list(DOCS))
def test_doc_has_no_internal_references(doc):
    text = DOCS[doc]
    offenders = []
    for what, pattern in FORBIDDEN.items():
        haystack = _prose(text) if what == "first person" else text
        offenders += [
            f"{what}: {m.group(0)!r} at line {text[: text.find(m.group(0))].count(chr(10)) + 1}"
            for m in pattern.finditer(haystack)
        ]
    assert not offenders, f"{doc}:\n" + "\n".join(offenders)


def _prose_keep_links(text: str) -> str:
    """The text outside fenced code blocks (links in code are not links)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", list(DOCS))
def test_doc_links_resolve(doc):
    """Relative links point at files that exist, and at headings that exist."""
    base = (ROOT / doc).parent
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose_keep_links(DOCS[doc])):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else ROOT / doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(
                r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(encoding="utf-8"), flags=re.S), re.M
            )
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc}: broken links {broken}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """What the snippets assume: a source model directory `path` (24 layers, so the
    docs' windows fit), `src`, a looped `model` with budgets 0..12, `input_ids`, `ids`,
    `mask` and `tok`."""
    root = tmp_path_factory.mktemp("readme")
    tok = byte_tokenizer()
    source = tiny_model("llama", num_layers=24)
    source.save_pretrained(root / "src")
    tok.save_pretrained(root / "src")  # a source directory holds its tokenizer
    ids = torch.tensor([tok("We the People").input_ids])
    model = looptool.convert(source, looptool.PrefixLoop(window=(6, 18), budgets=(0, 3, 6, 9, 12)), tokenizer=tok)
    return root, {
        "looptool": looptool,
        "path": str(root / "src"),
        "src": source,
        "model": model,
        "input_ids": ids,
        "ids": ids,
        "mask": torch.ones_like(ids),
        "tok": tok,
    }


SNIPPETS = [(doc, line, code) for doc in SNIPPET_DOCS for line, code in _blocks(doc, "python")]


@pytest.mark.parametrize("doc,line,code", SNIPPETS, ids=[f"{doc}:{line}" for doc, line, _ in SNIPPETS])
def test_doc_python_snippet_runs(doc, line, code, workspace, tmp_path, monkeypatch):
    if any(module in code for module in NEEDS_GPU):
        pytest.skip("needs TensorRT and an NVIDIA GPU (tests/test_tensorrt.py covers this API with a test double)")
    if any(marker in code for marker in NEEDS_SERVER):
        pytest.skip(
            "a client of a running looptool serve (tests/test_serve.py drives the server with the openai client)"
        )
    root, names = workspace
    monkeypatch.chdir(tmp_path)  # snippets write ./looped, ./engines
    exec(compile(code, f"{doc}:{line}", "exec"), dict(names))
