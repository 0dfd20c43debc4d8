"""The manifest of an engine directory, typed, in one place.

An engine directory (:func:`looptool.backends.onnx.export.export_onnx`, extended by
:func:`looptool.backends.tensorrt.export.export_tensorrt`) holds ``weights.bin``, its graphs and ``manifest.json``:
the format and its version, the graphs per budget and KV policy (file, sha256, cache layout, ...), the row-wise
graphs per policy, speculative decoding's verify graphs and the adaptive-depth graphs (``budget="auto"``) where
they were exported, the weight table (every tensor's offset, length, dtype and shape in ``weights.bin``), the
cost table, the source config and, for TensorRT, the variants, profiles and built engines.

:class:`Manifest` is that JSON as dataclasses. Budgets are ints and the row-wise graphs sit
under :data:`~looptool.core.graph.ROWWISE` beside them; JSON's string keys exist only inside
:meth:`Manifest.read` (which checks the format and refuses a malformed entry in one sentence)
and :meth:`Manifest.write`. :meth:`Manifest.verify` checks a file against its entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from looptool.backends.errors import EngineError
from looptool.backends.interface import BUDGETS, INPUTS, LOGITS, CacheLayout
from looptool.core.graph import ROWWISE
from looptool.core.plan import BudgetCost
from looptool.core.version import __version__
from looptool.core.words import counted
from looptool.storage.files import sha256_file

FORMAT = "looptool-onnx-engine"
FORMAT_VERSION = 2  # 2: serving graphs with KV caches, one per budget and policy
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"

Budget = int | str  # a budget, or ROWWISE for the row-wise graph
Problem = Literal["missing", "modified", "resized"]


@dataclass
class FileEntry:
    """A file of the engine directory and what it must be."""

    file: str
    sha256: str | None = None
    bytes: int | None = None


@dataclass
class GraphEntry:
    """One ONNX serving graph (``menu``: the budgets a row of the row-wise graph may take;
    ``max_abs_diff``: per validation prompt, once validated)."""

    file: str
    cache: CacheLayout
    sha256: str | None = None
    bytes: int | None = None
    menu: tuple[int, ...] | None = None
    initializers: list[str] = field(default_factory=list)
    fused: dict[str, int] = field(default_factory=dict)
    composed: bool = False
    layer_calls: dict[str, int] = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    max_abs_diff: dict[str, float] | None = None
    loops: dict[int, int] = field(
        default_factory=dict
    )  # looped window layer -> smallest budget running its second pass

    @property
    def form(self) -> str:
        """``"loop"``: the window runs as ONNX ``Loop`` nodes whose trip counts come from the
        ``budgets`` input (:mod:`looptool.backends.onnx.looped`), so the graph costs its batch's
        deepest row; ``"unrolled"``: every pass is its own node."""
        return "loop" if self.loops else "unrolled"


@dataclass
class TensorEntry:
    """Where one tensor lies in ``weights.bin`` (``dtype``: its ONNX name, e.g. ``FLOAT16``)."""

    offset: int
    length: int
    sha256: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class WeightsEntry:
    """``weights.bin``: its size, sha256 and tensor table."""

    file: str
    sha256: str | None
    bytes: int
    tensors: dict[str, TensorEntry] = field(default_factory=dict)


@dataclass
class VariantEntry:
    """The TensorRT variant of one graph: its weights as named inputs, its plugin nodes."""

    file: str
    sha256: str | None
    weight_inputs: list[str] = field(default_factory=list)
    plugins: dict[str, int] = field(default_factory=dict)


@dataclass
class Plugins:
    """The plugin set the TensorRT variants call."""

    namespace: str
    version: str
    aot: list[str]
    # Python plugins (run through tensorrt.plugin.impl): engines written by looptool before
    # every plugin was AOT had ``["Moe"]`` here; an empty list is not written
    jit: list[str] = field(default_factory=list)


@dataclass
class Profiles:
    """The largest shapes the TensorRT engines take."""

    max_batch: int
    max_prefill: int
    max_capacity: int


@dataclass
class BuiltOn:
    """Where the TensorRT engines were built."""

    gpu: str
    compute_capability: tuple[int, int]
    tensorrt: str


@dataclass
class TensorRTSection:
    """The TensorRT part of an engine directory: variants, and once built, the engines."""

    precision: str
    plugins: Plugins
    profiles: Profiles
    graphs: dict[Budget, dict[str, VariantEntry]] = field(default_factory=dict)
    engines: dict[Budget, dict[str, FileEntry]] | None = None
    built_on: BuiltOn | None = None


@dataclass
class Manifest:
    """What ``manifest.json`` holds: ``graphs[budget][policy]`` (``budget`` an int, or
    :data:`~looptool.core.graph.ROWWISE` for the row-wise graphs), the weight table, the
    model's facts, and the TensorRT section where there is one."""

    graphs: dict[Budget, dict[str, GraphEntry]]
    kv_policies: tuple[str, ...]
    weights: WeightsEntry
    mask_dtype: str = "int64"
    dtype: str | None = None  # the graphs' float dtype
    source_config: dict[str, Any] = field(default_factory=dict)
    costs: tuple[BudgetCost, ...] = ()
    plan: dict[str, Any] | None = None
    opset: dict[str, int] = field(default_factory=dict)
    ort_fusions: bool = False
    fused_per_body: dict[str, dict[str, int]] = field(default_factory=dict)
    parameter_bytes: int | None = None
    tokenizer: bool = False  # a tokenizer was saved beside the graphs
    # weight-only quantization of the linears (looptool.backends.onnx.quantize), None: float weights
    quantization: dict[str, Any] | None = None
    # speculative decoding's verify graphs (logits at every position), ``verify_graphs[budget][policy]``
    verify_graphs: dict[int, dict[str, GraphEntry]] = field(default_factory=dict)
    # the adaptive-depth graphs (budget="auto"), ``adaptive_graphs[exit rule][policy]``
    adaptive_graphs: dict[str, dict[str, GraphEntry]] = field(default_factory=dict)
    looptool_version: str = __version__
    tensorrt: TensorRTSection | None = None

    # ------------------------------------------------------------------ reading
    @property
    def budgets(self) -> tuple[int, ...]:
        """The budgets with graphs of their own, sorted."""
        return tuple(sorted(b for b in self.graphs if b != ROWWISE))

    def graph(self, budget: Budget, kv: str) -> GraphEntry | None:
        """The graph of ``budget`` (or :data:`~looptool.core.graph.ROWWISE`) under policy ``kv``."""
        return self.graphs.get(budget, {}).get(kv)

    def verify_graph(self, budget: int, kv: str) -> GraphEntry | None:
        """The verify graph of ``budget`` under policy ``kv`` (None where none was exported)."""
        return self.verify_graphs.get(budget, {}).get(kv)

    def adaptive_graph(self, rule: str, kv: str) -> GraphEntry | None:
        """The adaptive-depth graph of exit rule ``rule`` under policy ``kv`` (None where none was exported)."""
        return self.adaptive_graphs.get(rule, {}).get(kv)

    @property
    def menu(self) -> tuple[int, ...]:
        """The model's whole budget menu as the cost table lists it (else the engine's budgets)."""
        return tuple(sorted(c.budget for c in self.costs)) or self.budgets

    def row_costs(self, budgets: tuple[int, ...]) -> tuple[BudgetCost, ...]:
        """Each row's per-token cost from the cost table; empty for an engine exported before it was recorded."""
        table = {c.budget: c for c in self.costs}
        return tuple(table[k] for k in budgets) if all(k in table for k in budgets) else ()

    @property
    def vocab_size(self) -> int | None:
        return self.source_config.get("vocab_size")

    @property
    def max_positions(self) -> int | None:
        return self.source_config.get("max_position_embeddings")

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self.source_config.get("eos_token_id")

    def facts(self):
        """The budgets a step engine serves and the source config's context (:class:`looptool.engine.EngineFacts`)."""
        import transformers

        from looptool.capture.facts import context_length_of
        from looptool.engine.interface import EngineFacts

        source = self.source_config
        config = transformers.CONFIG_MAPPING[source["model_type"]].from_dict(source) if "model_type" in source else None
        menus = [e.menu for e in self.graphs.get(ROWWISE, {}).values() if e.menu is not None]
        served = tuple(sorted(menus[0])) if menus else self.budgets  # a step engine serves the row-wise menu
        return EngineFacts(served, context_length_of(config) if config is not None else None)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        """Parse and check ``manifest.json`` of the engine directory ``directory``."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not directory.is_dir():
            raise EngineError(f"'{directory}' is not a directory; pass the folder written by looptool export.")
        if not path.exists():
            raise EngineError(f"'{directory}' has no {MANIFEST}; it is not an engine written by looptool export.")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineError(f"{path} is not valid JSON ({exc}); export the engine again.") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise EngineError(f"{path} is not a looptool engine manifest; export the engine again.")
        if data.get("format_version") != FORMAT_VERSION:
            raise EngineError(
                f"{path} has format version {data.get('format_version')}, this looptool reads "
                f"version {FORMAT_VERSION}; export the engine again with this looptool."
            )
        for key in ("budgets", "weights"):
            if key not in data:
                raise EngineError(f"{path} lacks the '{key}' entry; export the engine again.")
        return _parse(data, directory, path)

    # ------------------------------------------------------------------ writing
    def to_json(self) -> dict[str, Any]:
        """The JSON form :meth:`write` writes (budgets as strings, the row-wise graphs in their own section)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "looptool_version": self.looptool_version,
            "opset": dict(self.opset),
            "interface": _interface(self.mask_dtype),
            "kv_policies": list(self.kv_policies),
            "functions": {"ort_fusions": self.ort_fusions, "fused_per_body": self.fused_per_body},
            "mask_dtype": self.mask_dtype,
            "dtype": self.dtype,
            "plan": self.plan,
            "costs": [c.as_dict() for c in self.costs],
            "budgets": {str(b): {p: _graph_json(e) for p, e in self.graphs[b].items()} for b in self.budgets},
            ROWWISE: {p: _graph_json(e) for p, e in self.graphs.get(ROWWISE, {}).items()},
            **({"verify": _by_budget(self.verify_graphs, _graph_json)} if self.verify_graphs else {}),
            **({"adaptive": _nested(self.adaptive_graphs, _graph_json)} if self.adaptive_graphs else {}),
            "weights": {
                "file": self.weights.file,
                "sha256": self.weights.sha256,
                "bytes": self.weights.bytes,
                "tensors": {name: _tensor_json(t) for name, t in self.weights.tensors.items()},
            },
            "parameter_bytes": self.parameter_bytes,
            "source_config": self.source_config,
            "tokenizer": self.tokenizer,
            **({"quantization": self.quantization} if self.quantization is not None else {}),
            **({"tensorrt": _tensorrt_json(self.tensorrt)} if self.tensorrt is not None else {}),
        }

    def write(self, directory: str | os.PathLike) -> None:
        """Write ``manifest.json`` into ``directory``."""
        (Path(directory) / MANIFEST).write_text(json.dumps(self.to_json(), indent=1, default=str))

    # ------------------------------------------------------------------ files
    def verify(
        self, directory: str | os.PathLike, entry: FileEntry | GraphEntry | WeightsEntry | None = None, *, sha256=True
    ) -> Problem | None:
        """What is wrong with the file of ``entry`` (default: ``weights.bin``) in ``directory``:
        ``"missing"``, ``"modified"`` (its sha256 differs; checked with ``sha256``), ``"resized"``
        (its size differs from a recorded one), or None."""
        entry = self.weights if entry is None else entry
        path = Path(directory) / entry.file
        if not entry.file or not path.is_file():
            return "missing"
        if sha256 and sha256_file(path) != entry.sha256:
            return "modified"
        if entry.bytes is not None and path.stat().st_size != entry.bytes:
            return "resized"
        return None


# ---------------------------------------------------------------------- JSON
def _graph_json(e: GraphEntry) -> dict[str, Any]:
    return {
        "file": e.file,
        **({"menu": list(e.menu)} if e.menu is not None else {}),
        "initializers": e.initializers,
        "fused": e.fused,
        "composed": e.composed,
        "layer_calls": e.layer_calls,
        **({"loops": {str(k): v for k, v in e.loops.items()}} if e.loops else {}),
        "cache": e.cache.to_dict(),
        "kv_bytes_per_token": e.kv_bytes_per_token,
        **({"max_abs_diff": e.max_abs_diff} if e.max_abs_diff is not None else {}),
        "sha256": e.sha256,
        "bytes": e.bytes,
    }


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    return {"offset": t.offset, "length": t.length, "sha256": t.sha256, "dtype": t.dtype, "shape": list(t.shape)}


def _file_json(e: FileEntry) -> dict[str, Any]:
    return {"file": e.file, "sha256": e.sha256, **({"bytes": e.bytes} if e.bytes is not None else {})}


def _by_budget(section: dict, convert) -> dict[str, dict]:
    """``{budget: {policy: entry}}`` with JSON's string keys, the budgets in order, the row-wise entries last."""
    keys = sorted((b for b in section if b != ROWWISE), key=int) + ([ROWWISE] if ROWWISE in section else [])
    return {str(b): {p: convert(e) for p, e in section[b].items()} for b in keys}


def _nested(section: dict, convert) -> dict[str, dict]:
    """``{key: {policy: convert(entry)}}``."""
    return {str(k): {p: convert(e) for p, e in section[k].items()} for k in section}


def _tensorrt_json(t: TensorRTSection) -> dict[str, Any]:
    out = {
        "precision": t.precision,
        "plugins": {k: v for k, v in asdict(t.plugins).items() if k != "jit" or v},
        "profiles": asdict(t.profiles),
        "graphs": _by_budget(
            t.graphs,
            lambda v: {"file": v.file, "sha256": v.sha256, "weight_inputs": v.weight_inputs, "plugins": v.plugins},
        ),
    }
    if t.engines is not None:
        out["engines"] = _by_budget(t.engines, _file_json)
    if t.built_on is not None:
        out["built_on"] = {**asdict(t.built_on), "compute_capability": list(t.built_on.compute_capability)}
    return out


def _interface(mask_dtype: str) -> dict[str, Any]:
    """The decode interface the graphs implement, in words."""
    shapes = ("int64 [batch, step]", f"{mask_dtype} [batch, capacity]", "int64 [batch, step]", "int64 [step]")
    return {
        "inputs": dict(zip(INPUTS, shapes)),
        "caches": "past_key_values.{j}.key / .value [batch, kv_heads, capacity, head_dim] in, present.{j}.key / "
        ".value out (same buffers may be bound to both)",
        "outputs": {LOGITS: "[batch, 1, vocab] (last position)"},
        "rowwise": f"the {ROWWISE} graphs take {BUDGETS} int64 [batch] (each row's budget) after "
        f"{INPUTS[-1]}; their caches are the deepest budget's",
    }


def _budget_key(key: str) -> Budget:
    return key if key == ROWWISE else int(key)


def _parse(data: dict, directory: Path, path: Path) -> Manifest:
    """The checked JSON ``data`` as a :class:`Manifest`; one sentence for a malformed entry."""
    try:
        budgets = {int(b): policies for b, policies in data["budgets"].items()}
        kv_policies = tuple(str(p) for p in data["kv_policies"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"{path} does not list its budgets and KV policies; export the engine again.") from exc
    graphs: dict[Budget, dict[str, GraphEntry]] = {}
    for budget in sorted(budgets):
        policies = budgets[budget] if isinstance(budgets[budget], dict) else {}
        for kv in kv_policies:
            if not isinstance(policies.get(kv), dict):
                raise EngineError(
                    f"{MANIFEST} lists budget {budget} and policy {kv} but has no graph entry for them; "
                    "export the engine again."
                )
        graphs[budget] = {kv: _graph(e, budget, kv) for kv, e in policies.items() if isinstance(e, dict)}
    rowwise = data.get(ROWWISE) or {}
    if isinstance(rowwise, dict) and (entries := {kv: e for kv, e in rowwise.items() if isinstance(e, dict)}):
        graphs[ROWWISE] = {kv: _graph(e, ROWWISE, kv) for kv, e in entries.items()}
    section = "verify"
    try:
        verify = {
            int(b): {kv: _graph(e, int(b), kv) for kv, e in policies.items()}
            for b, policies in (data.get("verify") or {}).items()
        }
        section = "adaptive"
        adaptive = {
            str(r): {kv: _graph(e, f"adaptive.{r}", kv) for kv, e in policies.items()}
            for r, policies in (data.get("adaptive") or {}).items()
        }
        section = "weights"
        w = data["weights"]
        weights = WeightsEntry(
            str(w["file"]),
            w.get("sha256"),
            int(w["bytes"]),
            {
                str(name): TensorEntry(
                    int(t["offset"]), int(t["length"]), t.get("sha256"), str(t["dtype"]), tuple(map(int, t["shape"]))
                )
                for name, t in w["tensors"].items()
            },
        )
        section = "costs"
        costs = tuple(BudgetCost(**c) for c in data.get("costs") or [])
        section = "tensorrt"
        tensorrt = _tensorrt(data["tensorrt"]) if data.get("tensorrt") else None
        functions = data.get("functions") or {}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"{path} has a malformed '{section}' entry ({exc!r}); export the engine again.") from exc
    if weights.file != WEIGHTS:
        raise EngineError(f"'{directory}' has no {WEIGHTS}; export the engine again.")
    return Manifest(
        graphs=graphs,
        kv_policies=kv_policies,
        weights=weights,
        mask_dtype=str(data.get("mask_dtype", "int64")),
        dtype=data.get("dtype"),
        source_config=data.get("source_config") or {},
        costs=costs,
        plan=data.get("plan"),
        opset=data.get("opset") or {},
        ort_fusions=bool(functions.get("ort_fusions", False)),
        fused_per_body=functions.get("fused_per_body") or {},
        parameter_bytes=data.get("parameter_bytes"),
        tokenizer=bool(data.get("tokenizer")),
        quantization=data.get("quantization"),
        verify_graphs=verify,
        adaptive_graphs=adaptive,
        looptool_version=str(data.get("looptool_version", "")),
        tensorrt=tensorrt,
    )


def _graph(e: dict, budget: Budget, kv: str) -> GraphEntry:
    try:
        cache = CacheLayout.from_dict(e["cache"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"{MANIFEST} does not describe the cache layout of budget {budget} ({kv}); export the engine again."
        ) from exc
    return GraphEntry(
        file=str(e.get("file", "")),
        cache=cache,
        sha256=e.get("sha256"),
        bytes=e.get("bytes"),
        menu=tuple(int(b) for b in e["menu"]) if e.get("menu") is not None else None,
        initializers=list(e.get("initializers") or []),
        fused=dict(e.get("fused") or {}),
        composed=bool(e.get("composed", False)),
        layer_calls=dict(e.get("layer_calls") or {}),
        kv_bytes_per_token=int(e.get("kv_bytes_per_token") or 0),
        max_abs_diff=e.get("max_abs_diff"),
        loops={int(k): int(v) for k, v in (e.get("loops") or {}).items()},
    )


def _tensorrt(t: dict) -> TensorRTSection:
    def by_budget(section: dict, entry) -> dict:
        return {_budget_key(b): {p: entry(e) for p, e in ps.items()} for b, ps in section.items()}

    built = t.get("built_on")
    return TensorRTSection(
        precision=str(t["precision"]),
        plugins=Plugins(**t["plugins"]),
        profiles=Profiles(**t["profiles"]),
        graphs=by_budget(
            t.get("graphs") or {},
            lambda e: VariantEntry(e["file"], e.get("sha256"), list(e["weight_inputs"]), dict(e.get("plugins") or {})),
        ),
        engines=by_budget(t["engines"], lambda e: FileEntry(e["file"], e.get("sha256"), e.get("bytes")))
        if t.get("engines") is not None
        else None,
        built_on=BuiltOn(str(built["gpu"]), tuple(built["compute_capability"]), str(built["tensorrt"]))
        if built
        else None,
    )


def check_request(
    manifest: Manifest,
    input_ids,
    attention_mask,
    max_new_tokens: int,
    capacity: int | None,
):
    """A generate request checked against an engine's manifest (any runtime): ``(input_ids
    as a LongTensor [batch, prompt], attention_mask or None, cache capacity)``; one
    sentence for each thing that is wrong."""
    import numpy as np
    import torch

    from looptool.runtime.generation import check_generation_args

    vocab_size = manifest.vocab_size
    ids = input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else torch.from_numpy(np.asarray(input_ids))
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise EngineError(f"input_ids must be [batch, sequence] with at least one token, got shape {tuple(ids.shape)}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise EngineError(f"input_ids must be integer token ids, got {ids.dtype}.")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise EngineError(
            f"input_ids must lie in [0, {vocab_size}), got values from {int(ids.min())} to {int(ids.max())}."
        )
    ids = ids.long()
    mask = None
    if attention_mask is not None:
        mask = (
            attention_mask.detach().cpu()
            if isinstance(attention_mask, torch.Tensor)
            else torch.from_numpy(np.asarray(attention_mask))
        )
        if tuple(mask.shape) != tuple(ids.shape):
            raise EngineError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}; they must match."
            )
    check_generation_args(ids, max_new_tokens)
    prompt = ids.shape[1]
    capacity = prompt + max_new_tokens if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < prompt:
        raise EngineError(
            f"the prompt has {counted(prompt, 'token')}, more than the cache capacity {capacity}; raise the capacity."
        )
    limit = manifest.max_positions
    if limit is not None and capacity > limit:
        raise EngineError(
            f"a cache of {counted(capacity, 'token')} exceeds the model's {counted(limit, 'position')}; use a shorter prompt or "
            "fewer new tokens."
        )
    return ids, mask, int(capacity)
