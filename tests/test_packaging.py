"""Packaging: passes/ and backends/ import only as looptool.passes / looptool.backends."""

from __future__ import annotations

import subprocess
import sys

import pytest

import looptool
from looptool.core.install import install_command


def test_subpackages_import_under_looptool():
    import looptool.backends
    import looptool.passes

    assert looptool.passes.__name__ == "looptool.passes"
    assert "prefix_loop" in looptool.passes.registered_passes()
    assert looptool.backends.__name__ == "looptool.backends"


def test_every_subpackage_is_in_the_wheel():
    """Every package folder of looptool/, passes/ and backends/ is listed in pyproject's
    ``packages`` under the name its ``package-dir`` gives it (a wheel holds only those; an
    editable install hides the omission)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    root = Path(__file__).resolve().parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(root / folder).parts]))
    assert {"looptool", "looptool.passes", "looptool.backends", "looptool.backends.onnx"} <= found
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_no_generic_top_level_packages(tmp_path):
    # run outside the checkout: the repo's own folders are not packages on an installed path
    code = "import importlib.util as u; print(u.find_spec('passes'), u.find_spec('backends'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.stdout.strip() == "None None", res.stdout + res.stderr


COMMANDS = (
    "convert",
    "inspect",
    "demo",
    "train",
    "rl",
    "merge",
    "distill",
    "eval",
    "analyze",
    "lm-eval",
    "generate",
    "plot",
    "export",
    "run",
    "serve",
)


def test_console_script_help():
    """`looptool --help` lists exactly the commands, each as a row of the commands table."""
    import re

    from looptool.cli import app

    res = subprocess.run(
        [sys.executable, "-m", "looptool", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    assert res.returncode == 0
    listed = re.findall(r"^│ (\w[\w-]*) ", res.stdout, flags=re.M)
    assert sorted(listed) == sorted(COMMANDS), listed
    assert sorted(c.name or c.callback.__name__ for c in app.registered_commands) == sorted(COMMANDS)
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", looptool.__version__)


def test_missing_onnx_extras_name_the_extra(tmp_path):
    """Without onnx/onnxscript/onnx-ir/onnxruntime, export and run end in one sentence naming
    the pip extra (the modules still import)."""
    code = """
import sys
for m in ("onnxscript", "onnx_ir", "onnxruntime", "onnx"):
    sys.modules[m] = None  # as if not installed
import looptool
from looptool.testing import tiny_model
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.backends.tensorrt.export import export_tensorrt
from looptool.core.errors import MissingExtraError
m = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
for f in (lambda: export_onnx(m, sys.argv[1] + "/a"), lambda: Runtime(sys.argv[1]),
          lambda: export_tensorrt(m, sys.argv[1] + "/b", build_on_target=True)):
    try:
        f()
    except MissingExtraError as exc:
        print(exc)
"""
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines == [
        "ONNX export needs the 'onnx' extra (onnx, onnxscript, onnx_ir, onnxruntime not installed): "
        f"{install_command('onnx')}.",
        f"running ONNX engines needs the 'onnx' extra (onnxruntime, onnx not installed): {install_command('onnx')}.",
        "TensorRT export needs the 'tensorrt' extra (onnx, onnxscript, onnx_ir not installed): "
        f"{install_command('tensorrt')}.",
    ]
    assert not any(tmp_path.iterdir())  # nothing written
