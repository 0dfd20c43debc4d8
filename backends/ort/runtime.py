"""onnxruntime runtime for engine directories written by :mod:`looptool.backends.onnx.export`.

``Runtime(engine_dir)`` checks the manifest and every file's sha256, maps ``weights.bin``
once (a read-only ``numpy.memmap``) and wraps each stored tensor as an ``OrtValue`` over
that mapping. A graph's ``InferenceSession`` is created on first use and handed those
``OrtValue`` objects with ``SessionOptions.add_initializer``, so every session reads the
same pages: holding all budgets costs little more memory than holding one. Weight
pre-packing is disabled for the same reason (packed copies are per session).

:meth:`Runtime.generate` decodes with the engine's KV caches through IOBinding: each
cache is allocated once at the requested capacity and bound both as ``past`` input and
as ``present`` output, so every step writes its keys and values in place and nothing is
copied per token; the attention mask is bound once too and updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from looptool.backends.engine_files import check_external_data, inside
from looptool.backends.errors import EngineError, ReexportError
from looptool.backends.interface import CacheLayout
from looptool.backends.manifest import MANIFEST, WEIGHTS, GraphEntry, Manifest, check_request
from looptool.backends.onnx.adaptive import ADAPTIVE_KV
from looptool.backends.ort.engine import OrtStepEngine
from looptool.core.dtypes import named
from looptool.core.errors import require_extra
from looptool.core.graph import ROWWISE
from looptool.engine.budgets import PER_LOOP_AUTO, AutoRow, RowBudgets, wants_auto
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.engine.speculation import Speculation

log = logging.getLogger(__name__)

_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


@functools.cache  # once per process: onnxruntime's environment keeps the arena
def _shared_cpu_arena() -> bool:
    """Register one CPU arena with onnxruntime's environment so that every session's
    activations come from the same pool (one set of scratch buffers for all budgets)."""
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator(info, None)
    except Exception as exc:  # noqa: BLE001  (already registered by the host application: use that one)
        log.debug("shared CPU arena not registered (%s)", exc)
    return True


def auto_policy(kv: str | None) -> str:
    """The KV policy of ``budget="auto"`` (None: ``"last-loop"``); one sentence for another."""
    kv = ADAPTIVE_KV[0] if kv is None else kv
    if kv not in ADAPTIVE_KV:
        raise EngineError(f"budget='auto' needs kv='last-loop', not {kv!r}: {PER_LOOP_AUTO}", parameter="kv")
    return kv


def default_providers() -> list[str]:
    """CUDA (and TensorRT) when this onnxruntime build has them, then the CPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    return [p for p in _GPU_PROVIDERS if p in available] + ["CPUExecutionProvider"]


def _numpy_type(onnx_name: str) -> type | None:
    """The numpy type of a manifest tensor dtype (None where numpy has none, or for an unknown name)."""
    try:
        return named(onnx_name).numpy
    except KeyError:
        return None


class Runtime:
    """Run an exported engine: ``rt.generate(input_ids, budget=k, kv=...)`` decodes with a KV
    cache; ``rt(input_ids, budget=k)`` returns the next-token logits ``[batch, vocab]``.

    ``verify=True`` (default) refuses files whose sha256 differs from the manifest:
    ``weights.bin`` at construction, each graph when its session is first created (so a
    missing or damaged graph of one budget is named when that budget is run, and does not
    stop the others).
    ``prepack=True`` lets onnxruntime pre-pack weights for its GEMM kernels: faster
    (measured ~15% on SmolLM2's prefill and decode), but every session then holds its own
    packed copy of the weights it reads, so memory is no longer one copy for all budgets
    (onnxruntime shares packed weights across sessions only through its C API).
    ``prepack=None`` (default) pre-packs an engine of one looped graph (:attr:`one_graph`: one
    session, so one packed copy, which replaces the mapped one in memory) and the engines whose
    linears are weight-only quantized (``MatMulNBits``, :mod:`looptool.backends.onnx.quantize`),
    not an engine of a graph per budget: MatMulNBits runs its
    fast int4/int8 kernels only over its packed form (SmolLM2-135M int4, 2 threads, batch 1:
    ~1.1 s per decode step unpacked, ~30 ms packed), so there each session holds a packed copy
    of the quantized weights (about their stored size) beside the one shared mapping.
    ``spin=True`` lets onnxruntime's idle intra-op threads spin between ops (its own default):
    they pick up the next op without being woken, which on SmolLM2 makes a decode step ~20%
    faster at one row and a served batch ~12% faster (tests/bench/README.md), but a spinning
    thread takes a core from other sessions and from PyTorch work in the same process.
    ``spin=None`` spins for an engine of one looped graph (one session: nothing else of this
    runtime's competes; ``looptool serve`` with 8 streams measured faster that way) and not for
    an engine of a graph per budget: what ``looptool run`` and ``looptool serve`` do, processes
    that run nothing but the engine. The default here, False, suits a process that also runs
    PyTorch or other sessions. Inputs may be numpy arrays or torch tensors.
    """

    def __init__(
        self,
        engine_dir: str | os.PathLike,
        *,
        providers: list[str] | None = None,
        verify: bool = True,
        threads: int | None = None,
        prepack: bool | None = None,
        spin: bool | None = False,
    ):
        require_extra("onnx", "running ONNX engines", "onnxruntime", "onnx")
        self.directory = Path(engine_dir)
        self.manifest = Manifest.read(self.directory)
        self.budgets: tuple[int, ...] = self.manifest.budgets
        self.kv_policies: tuple[str, ...] = self.manifest.kv_policies
        self._layouts = {
            (b, p): entry.cache
            for b in (*self.budgets, ROWWISE)
            for p in self.kv_policies
            if (entry := self.manifest.graph(b, p)) is not None
        }
        self.providers = providers or default_providers()
        self.threads = threads
        self.spin = self.one_graph if spin is None else spin
        self.prepack = (bool(self.manifest.quantization) or self.one_graph) if prepack is None else prepack
        weights = self.directory / WEIGHTS
        self.verify = verify
        problem = self.manifest.verify(self.directory, sha256=verify)
        if problem == "missing":
            raise EngineError(f"'{self.directory}' has no {WEIGHTS}; export the engine again.")
        if problem == "modified":
            raise EngineError(
                f"{weights} does not match the sha256 in {MANIFEST} (the file was modified or corrupted); export the engine again."
            )
        if problem == "resized":
            raise EngineError(
                f"{weights} has {weights.stat().st_size} bytes, the manifest says {self.manifest.weights.bytes}; export the engine again."
            )
        self._graph_inits: dict[tuple, list[str]] = {}  # per graph, checked when its session is made
        self._mmap = np.memmap(weights, dtype=np.uint8, mode="r") if weights.stat().st_size else np.zeros(0, np.uint8)
        self._values: dict[str, object] = {}
        self._sessions: dict[tuple, object] = {}
        self._engines: dict[tuple[str, str], OrtStepEngine] = {}  # step_engine()'s, per (kv, exit rule)
        self._lock = threading.Lock()
        self.mask_dtype = np.dtype(self.manifest.mask_dtype)
        self.vocab_size = self.manifest.vocab_size

    @property
    def one_graph(self) -> bool:
        """Whether every budget and every mix of budgets runs one graph per policy: no per-budget
        graphs beside a looped row-wise graph (:mod:`looptool.backends.onnx.looped`)."""
        entries = [self.manifest.graph(ROWWISE, p) for p in self.kv_policies]
        return not self.budgets and all(e is not None and e.loops for e in entries)

    # ------------------------------------------------------------------ files
    def _entry(self, budget: int | str, kv: str) -> GraphEntry:
        entry = self.manifest.graph(budget, kv)
        if entry is None and budget == ROWWISE:
            raise EngineError(
                f"'{self.directory}' was exported without the row-wise graph for kv {kv}, so its rows cannot "
                "take different budgets; export it again with this looptool (it writes that graph by default).",
                parameter="budget",
            )
        if entry is None:
            raise EngineError(
                f"{MANIFEST} lists budget {budget} and policy {kv} but has no graph entry for them; export the engine again."
            )
        return entry

    def layout(self, budget: int | str | None = None, kv: str = "per-loop") -> CacheLayout:
        """The cache layout of one graph (pairs, dtype) as the manifest records it (``budget``
        :data:`~looptool.core.graph.ROWWISE`: the row-wise graph's)."""
        return self._layouts[self._key(budget, kv)]

    def has_rowwise(self, kv: str = "per-loop") -> bool:
        """Whether the engine holds the row-wise graph for policy ``kv``."""
        return (ROWWISE, kv) in self._layouts

    def has_verify(self, budget: int, kv: str = "per-loop") -> bool:
        """Whether the engine holds budget ``budget``'s verify graph for policy ``kv`` (speculative decoding)."""
        return self.manifest.verify_graph(budget, kv) is not None

    def verify_layout(self, budget: int, kv: str = "per-loop") -> CacheLayout:
        """The cache layout of budget ``budget``'s verify graph (refused where there is none)."""
        return self._verify_entry(budget, kv).cache

    def _verify_entry(self, budget: int, kv: str) -> GraphEntry:
        budget, kv = self._check_budget(budget), self._check_policy(kv)
        entry = self.manifest.verify_graph(budget, kv)
        if entry is None:
            raise ReexportError(
                f"'{self.directory}' has no verify graph for budget {budget} ({kv}), which speculative decoding "
                f"scores drafts with; export the engine again with speculative=True (it then writes one per budget "
                f"but the shallowest, per-loop KV).",
                parameter="speculative",
            )
        return entry

    def adaptive_session(self, rule: str = "state", kv: str = "last-loop"):
        """The InferenceSession of the adaptive-depth graph of exit rule ``rule`` under ``kv``
        (created on first use, refused in one sentence where the engine has none)."""
        entry = self.manifest.adaptive_graph(rule, kv)
        if entry is None:
            raise ReexportError(
                f"'{self.directory}' has no adaptive-depth graph ({rule} rule, {kv}), which budget 'auto' runs; export "
                f"the engine again with adaptive={rule!r} and kv='last-loop'.",
                parameter="budget",
            )
        return self._session((f"adaptive.{rule}", kv), lambda: entry)

    def rowwise_menu(self, kv: str = "per-loop") -> tuple[int, ...]:
        """The budgets a row of the row-wise graph may take (refused where it was not exported)."""
        menu = self._entry(ROWWISE, self._check_policy(kv)).menu
        return self.budgets if menu is None else menu

    def resolve_budget(self, budget, batch: int, kv: str = "per-loop") -> tuple[int | str, RowBudgets]:
        """``budget`` as the caller gave it (None, one budget for all ``batch`` rows, one per row,
        or :class:`~looptool.engine.budgets.RowBudgets` resolved before, taken as it is) resolved
        once into each row's budget, and the graph that runs them: rows that agree run their
        budget's own graph where the engine has it, other rows the row-wise graph. One sentence
        for a bad budget or an engine without the row-wise graph."""
        kv = self._check_policy(kv)
        rowwise = self.has_rowwise(kv)
        one = not isinstance(budget, (RowBudgets, list, tuple)) and getattr(budget, "ndim", 0) == 0
        # without the row-wise graph one budget must have a graph of its own; a list is checked
        # against the model's menu (the cost table), so a mixed list is refused for that reason
        menu = self.rowwise_menu(kv) if rowwise else (self.budgets if one else self.manifest.menu)
        if not menu:
            self._check_budget(None)  # one sentence: an engine of row-wise graphs only
        default = self.budgets[-1] if self.budgets else menu[-1]
        rows = RowBudgets.resolve(budget, menu, batch, default=default, error=EngineError)
        graph = rows.graph(self.budgets)
        if graph == ROWWISE and not rowwise:
            if rows.uniform:
                self._check_budget(rows.rows[0])  # a budget this engine has no graph of
            self._entry(ROWWISE, kv)  # one sentence: no row-wise graph
        return graph, rows

    def _key(self, budget, kv: str) -> tuple[int | str, str]:
        """``(budget or ROWWISE, policy)``, both checked."""
        kv = self._check_policy(kv)
        if isinstance(budget, str) and budget == ROWWISE:
            self._entry(ROWWISE, kv)  # one sentence where the engine has none
            return ROWWISE, kv
        return self._check_budget(budget), kv

    def _checked_graph(self, key: tuple, entry: GraphEntry) -> Path:
        """The graph file of ``entry`` (the graph of ``key``: budget, policy, maybe ``"verify"``):
        present, matching its sha256 (``verify``) and reading its weights only from this
        engine's ``weights.bin``."""
        path = inside(self.directory, entry.file)
        if not path.exists():
            what = "the verify graph of " if len(key) > 2 else ""
            raise EngineError(
                f"'{self.directory}' has no {entry.file} for {what}budget {key[0]} ({key[1]}); export the engine again."
            )
        if self.verify and self.manifest.verify(self.directory, entry) == "modified":
            raise EngineError(
                f"{path} does not match the sha256 in {MANIFEST} (the file was modified or corrupted); export the engine again."
            )
        self._graph_inits[key] = check_external_data(self.directory, path)
        return path

    # ------------------------------------------------------------------ sessions
    def _ort_value(self, name: str):
        import onnxruntime as ort

        value = self._values.get(name)
        if value is None:
            entry = self.manifest.weights.tensors.get(name)
            if entry is None:
                raise EngineError(f"tensor '{name}' is not in the manifest's tensor table; export the engine again.")
            start, length = entry.offset, entry.length
            if start < 0 or start + length > self._mmap.size:
                raise EngineError(f"tensor '{name}' lies outside {WEIGHTS}; export the engine again.")
            np_dtype = _numpy_type(entry.dtype)
            if np_dtype is None:
                raise EngineError(
                    f"tensor '{name}' has dtype {entry.dtype}, which this runtime cannot map; export in float32 or float16."
                )
            array = self._mmap[start : start + length].view(np_dtype).reshape(entry.shape)
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self._values[name] = value
        return value

    def session(self, budget: int | None = None, kv: str = "per-loop"):
        """The InferenceSession of one budget and KV policy (created on first use)."""
        key = self._key(budget, kv)
        return self._session(key, lambda: self._entry(*key))

    def verify_session(self, budget: int, kv: str = "per-loop"):
        """The InferenceSession of budget ``budget``'s verify graph (speculative decoding; created
        on first use, refused in one sentence where the engine has none)."""
        entry = self._verify_entry(budget, kv)
        return self._session((int(budget), kv, "verify"), lambda: entry)

    def _session(self, key: tuple, entry):
        """The session of the graph ``entry()`` describes, kept under ``key``."""
        import onnxruntime as ort

        with self._lock:
            sess = self._sessions.get(key)
            if sess is None:
                options = ort.SessionOptions()
                # errors only: its warnings (e.g. "can't constant fold" an fp16 node it has no
                # CPU kernel to fold with) are about its own optimiser and not actionable
                options.log_severity_level = 3
                if not self.prepack:  # packed copies are per session: one copy of the weights needs them off
                    options.add_session_config_entry("session.disable_prepacking", "1")
                # idle threads spin only where asked or for one session (they would starve the others)
                options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
                if _shared_cpu_arena():
                    options.add_session_config_entry("session.use_env_allocators", "1")
                if self.threads:
                    options.intra_op_num_threads = self.threads
                path = self._checked_graph(key, entry())
                for name in self._graph_inits[key]:
                    options.add_initializer(name, self._ort_value(name))
                sess = ort.InferenceSession(str(path), options, providers=self.providers)
                self._sessions[key] = sess
                log.info("created session for budget %s (%s, %s)", key[0], key[1], sess.get_providers()[0])
                if self.prepack:
                    self._release_mapped_pages()
        return sess

    def _release_mapped_pages(self) -> None:
        """Drop this process's pages of ``weights.bin`` once a session has packed its weights:
        the packed copies are what its matrix products read from then on, so the mapped
        originals would count twice in resident memory. The pages are clean and file-backed:
        a tensor still read as stored (an embedding row, a norm's weight) is paged in again
        from the page cache when it is next read."""
        import mmap

        mapped = getattr(self._mmap, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def _check_budget(self, budget: int | None) -> int:
        if budget is None and not self.budgets:
            raise EngineError(
                f"'{self.directory}' holds only the row-wise graph; name a budget, or use '{ROWWISE}' for its layout."
            )
        if budget is None:
            return self.budgets[-1]
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or int(budget) not in self.budgets:
            raise EngineError(
                f"budget {budget!r} is not in this engine's budgets {list(self.budgets)}; pick one of those."
            )
        return int(budget)

    def _check_policy(self, kv: str) -> str:
        if kv not in self.kv_policies:
            raise ReexportError(
                f"this engine was exported with KV policies {list(self.kv_policies)}, not {kv!r}; pick one of "
                f"those or export again with kv={kv!r}.",
                parameter="kv",
            )
        return kv

    # ------------------------------------------------------------------ compute
    def __call__(self, input_ids, budget: int | None = None, attention_mask=None, kv: str = "per-loop"):
        """Next-token logits ``[batch, vocab]`` after the prompt (a prefill into a fresh
        cache); numpy in → numpy out, torch in → torch out."""
        is_torch = type(input_ids).__module__.startswith("torch")
        out = self.generate(
            input_ids, budget=budget, attention_mask=attention_mask, kv=kv, max_new_tokens=1, output_logits=True
        )
        logits = out.logits[0]
        return logits if is_torch else logits.numpy()

    def generate(
        self,
        input_ids,
        *,
        budget=None,
        max_new_tokens: int = 32,
        kv: str | None = None,
        attention_mask=None,
        capacity: int | None = None,
        sampling: SamplingParams = GREEDY,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        on_step=None,
        output_logits: bool = False,
        draft_budget: int | None = None,
        draft_tokens: int = 4,
        min_budget: int | None = None,
        max_budget: int | None = None,
        exit_threshold: float | None = None,
        exit_rule: str | None = None,
    ):
        """Generate with the engine's KV cache, like :func:`looptool.runtime.generation.generate`
        (same sampling, EOS handling and :class:`~looptool.runtime.generation.GenerationOutput`).

        ``input_ids [batch, prompt]`` may be left-padded (``attention_mask`` 0 on
        padding). The caches hold ``capacity`` tokens (default: prompt + new tokens) and
        are bound in place for the whole call. ``budget`` is one budget for every row, or one
        per row (a list, tensor or array of ``batch`` budgets, or
        :class:`~looptool.engine.budgets.RowBudgets` resolved before): rows of different budgets
        run through the row-wise graph, each exactly at its own budget.

        ``draft_budget=j`` decodes speculatively (:mod:`looptool.backends.ort.speculative`):
        budget ``j``'s graph drafts ``draft_tokens`` tokens, ``budget``'s verify graph (an engine
        exported with ``speculative=True``) keeps what it agrees with: budget ``budget``'s own
        output (token for token when greedy); one budget for every row, per-loop KV; the result's
        ``speculation`` counts the drafts kept. The caches grow when the rows' rejected drafts
        pass ``capacity``.

        ``budget="auto"`` decides each row's depth per token, as the PyTorch ``generate`` does
        (same ``min_budget``, ``max_budget``, ``exit_threshold``, ``exit_rule``; ``depths`` in the
        result), with the engine's adaptive-depth graph (:mod:`looptool.backends.ort.adaptive`;
        ``kv`` None: ``"per-loop"``, or ``"last-loop"`` for ``"auto"``).
        """
        from looptool.engine.offline import generate_batch
        from looptool.runtime.adaptive import AutoDepth

        ids, mask, capacity = check_request(self.manifest, input_ids, attention_mask, max_new_tokens, capacity)
        spec, rows = None, None
        if wants_auto(budget, min_budget, max_budget, exit_threshold, exit_rule):
            if draft_budget is not None:
                raise EngineError("speculative decoding needs a fixed budget, not 'auto'.", parameter="draft_budget")
            kv = auto_policy(kv)
            auto = dict(
                min_budget=min_budget, max_budget=max_budget, exit_threshold=exit_threshold, exit_rule=exit_rule
            )
            settings = AutoDepth.resolve(SimpleNamespace(budgets=self.manifest.menu), **auto)  # the model's menu
            self.adaptive_session(settings.exit_rule, kv)  # one sentence where the engine has no such graph
            engine = self.step_engine(kv, settings.exit_rule)
            if engine.capabilities.adaptive_refusal is not None:
                raise engine.capabilities.adaptive_refusal
            budgets = [AutoRow(settings.min_budget, settings.max_budget, settings.exit_threshold)] * ids.shape[0]
        else:
            kv = self._check_policy("per-loop" if kv is None else kv)
            if draft_budget is not None and len(set(np.asarray(getattr(budget, "rows", budget)).ravel().tolist())) > 1:
                raise EngineError("speculative decoding takes one budget for every row.", parameter="draft_budget")
            _, rows = self.resolve_budget(budget, ids.shape[0], kv)
            engine = self.step_engine(kv)
            if draft_budget is not None:
                spec = Speculation(draft_budget, draft_tokens).check(rows.rows[0], self.manifest.menu, kv)
                self.verify_session(rows.rows[0], kv)  # one sentence where the engine has no verify graph for it
            budgets = list(rows.rows)
        out = generate_batch(
            engine,
            ids,
            mask,
            budgets,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            on_step=on_step,
            output_logits=output_logits,
            speculation=spec,
            capacity=capacity,
        )
        if rows is None:
            return out
        return dataclasses.replace(out, budgets=rows.rows, row_costs=self.manifest.row_costs(rows.rows))

    def step_engine(self, kv: str = "per-loop", exit_rule: str = "state") -> OrtStepEngine:
        """The step engine :meth:`generate` drives for ``kv`` (rows of adaptive depth stopping by
        ``exit_rule``), made once per pair; it serves an engine without the row-wise graph too,
        rows that share a budget only."""
        key = (kv, exit_rule)
        if key not in self._engines:
            self._engines[key] = OrtStepEngine(self, kv=kv, exit_rule=exit_rule, mixed=False)
        return self._engines[key]

    def kv_bytes(self, budget: int | None = None, kv: str = "per-loop", *, batch: int = 1, capacity: int = 1) -> int:
        """Bytes :meth:`generate` allocates for the caches of ``batch`` rows of ``capacity`` tokens."""
        return batch * capacity * self.layout(budget, kv).bytes_per_token()

    def close(self) -> None:
        """Drop the sessions and the weight mapping."""
        self._sessions.clear()
        self._values.clear()
        self._mmap = None

    def __repr__(self) -> str:
        return (
            f"Runtime('{self.directory}', budgets={list(self.budgets)}, kv={list(self.kv_policies)}, "
            f"sessions={sorted(self._sessions)})"
        )
