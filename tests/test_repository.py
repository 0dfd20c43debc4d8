"""The repository is self-contained: nothing in it points outside it, and the data the
tests and benchmarks read ships with it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Built from parts so that this file does not match itself.
OUTSIDE = ("../" + "shared", "DESIGN" + ".md", "DESIGN" + " §")
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", "gpu-results"}


def _repository_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (``git ls-files``), or, outside a git
    checkout, every file below the root except build and environment folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    files = [
        p for p in files if p.is_file() and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    ]
    assert len(files) > 20, files
    return files


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in _repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (plots)
        for needle in OUTSIDE:
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle!r}")
    assert not offenders, "files refer to things a user who clones the repository does not have:\n" + "\n".join(
        offenders
    )


def test_test_corpus_ships_with_the_repository():
    sotu = ROOT / "tests" / "data" / "sotu"
    train = sorted(sotu.glob("1*.txt"))
    val = sorted(sotu.glob("2*.txt"))
    assert len(train) >= 10 and len(val) >= 2
    assert (sotu / "LICENSE").is_file() and (sotu / "README.md").is_file()
    total = sum(p.stat().st_size for p in sotu.iterdir())
    assert total < 512 * 1024, f"the in-repo corpus should stay small, is {total} bytes"


def test_only_capture_reads_architecture_fields_of_the_hf_config():
    """Per-architecture facts are recorded by capture (SourceInfo, annotations); passes, the
    runtime and the trainer read those, never the Hugging Face config's architecture fields."""
    fields = "rms_norm_eps|layer_norm_eps|num_experts|num_local_experts|num_experts_per_tok|num_key_value_heads|head_dim|use_parallel_residual"
    reads = re.compile(rf"(?:config|text)(?:\(\))?\.(?:{fields})\b|getattr\(\s*[\w.()]+,\s*[\"'](?:{fields})[\"']")
    allowed = {"looptool/testing.py"}
    offenders = []
    for path in _repository_files():
        rel = path.relative_to(ROOT).as_posix()
        if (
            path.suffix != ".py"
            or not rel.startswith(("looptool/", "passes/", "backends/"))
            or rel in allowed
            or rel.startswith("looptool/capture/")
        ):
            continue
        offenders += [f"{rel}: {m.group(0)}" for m in reads.finditer(path.read_text(encoding="utf-8"))]
    assert not offenders, "architecture facts read outside capture:\n" + "\n".join(offenders)
