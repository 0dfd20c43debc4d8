"""Packaging: passes/ and backends/ import only as looptool.passes / looptool.backends."""

from __future__ import annotations

import subprocess
import sys

import looptool


def test_subpackages_import_under_looptool():
    import looptool.backends
    import looptool.passes

    assert looptool.passes.__name__ == "looptool.passes"
    assert "prefix_loop" in looptool.passes.registered_passes()
    assert looptool.backends.__name__ == "looptool.backends"


def test_no_generic_top_level_packages(tmp_path):
    # run outside the checkout: the repo's own folders are not packages on an installed path
    code = "import importlib.util as u; print(u.find_spec('passes'), u.find_spec('backends'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.stdout.strip() == "None None", res.stdout + res.stderr


def test_console_script_help():
    res = subprocess.run([sys.executable, "-m", "looptool", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    for command in ("convert", "inspect", "demo", "train", "eval", "plot", "export", "run"):
        assert command in res.stdout
    assert looptool.__version__
