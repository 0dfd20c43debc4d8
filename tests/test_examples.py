"""Every script in examples/ runs to completion as a user would run it."""

from __future__ import annotations

import subprocess
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
def test_example_runs(script, tmp_path, request):
    if script.name in SLOW:
        request.getfixturevalue("smollm2_gguf")  # fetched (or skipped offline) before the script runs
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), *ARGS.get(script.name, [])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.strip(), "an example should tell the user what it did"


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
