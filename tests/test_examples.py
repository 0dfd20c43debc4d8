"""Every script in examples/ runs to completion as a user would run it: ``python
examples/NAME.py OUT_DIR`` (its ``__main__``, its arguments, its working directory), run in
this process with :mod:`runpy` so it reuses the imports and the captured programs of the
suite instead of starting a Python of its own; an exception or a non-zero ``sys.exit``
fails the test, as a non-zero exit status would."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
SLOW = {"smollm2_convert.py"}
ARGS = {"posttrain.py": ["--smoke"]}  # the full run trains SmolLM2 for minutes; the suite checks the pipeline


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, id=p.name, marks=[pytest.mark.slow, pytest.mark.smollm2] if p.name in SLOW else [])
        for p in EXAMPLES
    ],
)
def test_example_runs(script, tmp_path, request, monkeypatch, capsys):
    if script.name in SLOW:
        request.getfixturevalue("smollm2_gguf")  # fetched (or skipped offline) before the script runs
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "out"), *ARGS.get(script.name, [])])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (None, 0), f"{script.name} exited with {exc.code!r}"
    assert capsys.readouterr().out.strip(), "an example should tell the user what it did"


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
