"""onnxruntime runtime for engine directories written by :mod:`looptool.backends.onnx`.

``Runtime(engine_dir)`` checks the manifest and every file's sha256, maps ``weights.bin``
once (a read-only ``numpy.memmap``) and wraps each stored tensor as an ``OrtValue`` over
that mapping. A budget's ``InferenceSession`` is created on first use and handed those
``OrtValue`` objects with ``SessionOptions.add_initializer``, so every session reads the
same pages: holding all budgets costs little more memory than holding one. Weight
pre-packing is disabled for the same reason (packed copies are per session).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
from looptool.backends.onnx import (
    FORMAT,
    FORMAT_VERSION,
    INPUT_NAMES,
    MANIFEST,
    WEIGHTS,
    EngineError,
    sha256_file,
)

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"FLOAT": np.float32, "FLOAT16": np.float16, "DOUBLE": np.float64, "INT64": np.int64,
                 "INT32": np.int32, "BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8}
_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
_SHARED_ARENA: list[bool] = []  # set once the process-wide CPU arena is registered


def _shared_cpu_arena() -> bool:
    """Register one CPU arena with onnxruntime's environment so that every session's
    activations come from the same pool (one set of scratch buffers for all budgets)."""
    import onnxruntime as ort

    if not _SHARED_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        try:
            ort.create_and_register_allocator(info, None)
        except Exception as exc:  # noqa: BLE001  (already registered by the host application: use that one)
            log.debug("shared CPU arena not registered (%s)", exc)
        _SHARED_ARENA.append(True)
    return True


def default_providers() -> list[str]:
    """CUDA (and TensorRT) when this onnxruntime build has them, then the CPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    return [p for p in _GPU_PROVIDERS if p in available] + ["CPUExecutionProvider"]


def read_manifest(directory: Path) -> dict:
    """Parse and check ``manifest.json`` of an engine directory."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise EngineError(f"'{directory}' is not a directory; pass the folder written by looptool export.")
    if not path.exists():
        raise EngineError(f"'{directory}' has no {MANIFEST}; it is not an engine written by looptool export.")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} is not valid JSON ({exc}); export the engine again.") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{path} is not a looptool engine manifest; export the engine again.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EngineError(
            f"{path} has format version {manifest.get('format_version')}, this looptool reads "
            f"version {FORMAT_VERSION}; export the engine again with this looptool."
        )
    for key in ("budgets", "weights"):
        if key not in manifest:
            raise EngineError(f"{path} lacks the '{key}' entry; export the engine again.")
    return manifest


def _inside(directory: Path, location: str) -> Path:
    """The file a relative ``location`` names, refused unless it lies inside ``directory``."""
    if os.path.isabs(location) or location.startswith(("/", "\\")):
        raise EngineError(f"external data location '{location}' is an absolute path; engines may only reference files inside their own directory.")
    target = (directory / location).resolve()
    if directory.resolve() not in target.parents:
        raise EngineError(f"external data location '{location}' points outside the engine directory '{directory}'; refusing to load it.")
    return target


def check_external_data(directory: Path, graph_path: Path) -> list[str]:
    """Names of the external initializers of one graph, each checked to live in this
    engine's ``weights.bin``."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    names = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        target = _inside(directory, info.get("location", ""))
        if target != (directory / WEIGHTS).resolve():
            raise EngineError(f"initializer '{init.name}' of {graph_path.name} reads '{info.get('location')}', not {WEIGHTS}; export the engine again.")
        names.append(init.name)
    return names


class Runtime:
    """Run an exported engine: ``rt(input_ids, budget=k, attention_mask=None)`` → logits.

    ``verify=True`` (default) refuses files whose sha256 differs from the manifest.
    Inputs may be numpy arrays or torch tensors; the logits come back as the same kind.
    """

    def __init__(self, engine_dir: str | os.PathLike, *, providers: list[str] | None = None, verify: bool = True,
                 threads: int | None = None):
        self.directory = Path(engine_dir)
        self.manifest = read_manifest(self.directory)
        self.budgets: tuple[int, ...] = tuple(sorted(int(b) for b in self.manifest["budgets"]))
        self.providers = providers or default_providers()
        self.threads = threads
        weights = self.directory / self.manifest["weights"]["file"]
        if self.manifest["weights"]["file"] != WEIGHTS or not weights.exists():
            raise EngineError(f"'{self.directory}' has no {WEIGHTS}; export the engine again.")
        if verify:
            self._verify(weights)
        if weights.stat().st_size != self.manifest["weights"]["bytes"]:
            raise EngineError(f"{weights} has {weights.stat().st_size} bytes, the manifest says {self.manifest['weights']['bytes']}; export the engine again.")
        self._graph_inits = {b: check_external_data(self.directory, self._graph_path(b)) for b in self.budgets}
        self._mmap = np.memmap(weights, dtype=np.uint8, mode="r") if weights.stat().st_size else np.zeros(0, np.uint8)
        self._values: dict[str, object] = {}
        self._sessions: dict[int, object] = {}
        self._lock = threading.Lock()
        self.mask_dtype = np.dtype(self.manifest.get("mask_dtype", "int64"))

    # ------------------------------------------------------------------ files
    def _graph_path(self, budget: int) -> Path:
        name = self.manifest["budgets"][str(budget)]["file"]
        path = _inside(self.directory, name)
        if not path.exists():
            raise EngineError(f"'{self.directory}' has no {name} for budget {budget}; export the engine again.")
        return path

    def _verify(self, weights: Path) -> None:
        expected = self.manifest["weights"].get("sha256")
        if sha256_file(weights) != expected:
            raise EngineError(f"{weights} does not match the sha256 in {MANIFEST} (the file was modified or corrupted); export the engine again.")
        for budget in self.budgets:
            path = self._graph_path(budget)
            if sha256_file(path) != self.manifest["budgets"][str(budget)].get("sha256"):
                raise EngineError(f"{path} does not match the sha256 in {MANIFEST} (the file was modified or corrupted); export the engine again.")

    # ------------------------------------------------------------------ sessions
    def _ort_value(self, name: str):
        import onnxruntime as ort

        value = self._values.get(name)
        if value is None:
            entry = self.manifest["weights"]["tensors"].get(name)
            if entry is None:
                raise EngineError(f"tensor '{name}' is not in the manifest's tensor table; export the engine again.")
            start, length = entry["offset"], entry["length"]
            if start < 0 or start + length > self._mmap.size:
                raise EngineError(f"tensor '{name}' lies outside {WEIGHTS}; export the engine again.")
            dtype = entry["dtype"]
            np_dtype = _NUMPY_DTYPES.get(dtype)
            if np_dtype is None:
                raise EngineError(f"tensor '{name}' has dtype {dtype}, which this runtime cannot map; export in float32 or float16.")
            array = self._mmap[start:start + length].view(np_dtype).reshape(entry["shape"])
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self._values[name] = value
        return value

    def session(self, budget: int):
        """The InferenceSession of one budget (created on first use)."""
        import onnxruntime as ort

        budget = self._check_budget(budget)
        with self._lock:
            sess = self._sessions.get(budget)
            if sess is None:
                options = ort.SessionOptions()
                options.add_session_config_entry("session.disable_prepacking", "1")
                # idle ORT threads must not spin: they would starve PyTorch or other sessions
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                if _shared_cpu_arena():
                    options.add_session_config_entry("session.use_env_allocators", "1")
                if self.threads:
                    options.intra_op_num_threads = self.threads
                for name in self._graph_inits[budget]:
                    options.add_initializer(name, self._ort_value(name))
                sess = ort.InferenceSession(str(self._graph_path(budget)), options, providers=self.providers)
                self._sessions[budget] = sess
                log.info("created session for budget %d (%s)", budget, sess.get_providers()[0])
        return sess

    def _check_budget(self, budget: int | None) -> int:
        if budget is None:
            return self.budgets[-1]
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or int(budget) not in self.budgets:
            raise EngineError(f"budget {budget!r} is not in this engine's budgets {list(self.budgets)}; pick one of those.")
        return int(budget)

    # ------------------------------------------------------------------ compute
    def __call__(self, input_ids, budget: int | None = None, attention_mask=None):
        """Logits ``[batch, sequence, vocab]`` of the budget-``budget`` graph."""
        is_torch = type(input_ids).__module__.startswith("torch")
        ids = input_ids.detach().cpu().numpy() if is_torch else np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise EngineError(f"input_ids must be [batch, sequence] with at least one token, got shape {ids.shape}.")
        if not np.issubdtype(ids.dtype, np.integer):
            raise EngineError(f"input_ids must be integer token ids, got {ids.dtype}.")
        vocab = self.manifest.get("source_config", {}).get("vocab_size")
        if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise EngineError(f"input_ids must lie in [0, {vocab}), got values from {ids.min()} to {ids.max()}.")
        if attention_mask is None:
            mask = np.ones(ids.shape, dtype=self.mask_dtype)
        else:
            mask = attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else np.asarray(attention_mask)
            if mask.shape != ids.shape:
                raise EngineError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}; they must match.")
            mask = mask.astype(self.mask_dtype)
        feeds = dict(zip(INPUT_NAMES, (ids.astype(np.int64), mask)))
        logits = self.session(budget).run(None, feeds)[0]
        if is_torch:
            import torch

            return torch.from_numpy(logits)
        return logits

    def greedy(self, input_ids, budget: int | None = None, max_new_tokens: int = 16,
               eos_token_id: int | None = None) -> np.ndarray:
        """Greedy continuation of one or more equal-length prompts: each step reruns the
        whole sequence (no KV cache) and appends the arg-max token; rows that produced
        ``eos_token_id`` keep emitting it. Returns ``[batch, prompt + new]`` token ids."""
        if max_new_tokens < 0:
            raise EngineError(f"max_new_tokens must be 0 or more, got {max_new_tokens}.")
        ids = np.asarray(input_ids.detach().cpu().numpy() if hasattr(input_ids, "detach") else input_ids, dtype=np.int64)
        done = np.zeros(ids.shape[0], dtype=bool)
        for _ in range(max_new_tokens):
            nxt = self(ids, budget=budget)[:, -1].argmax(-1)
            if eos_token_id is not None:
                nxt = np.where(done, eos_token_id, nxt)
                done |= nxt == eos_token_id
            ids = np.concatenate([ids, nxt[:, None].astype(np.int64)], axis=1)
            if done.all():
                break
        return ids

    def close(self) -> None:
        """Drop the sessions and the weight mapping."""
        self._sessions.clear()
        self._values.clear()
        self._mmap = None

    def __repr__(self) -> str:
        return f"Runtime('{self.directory}', budgets={list(self.budgets)}, sessions={sorted(self._sessions)})"
