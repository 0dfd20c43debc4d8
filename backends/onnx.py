"""Lower budget paths to ONNX: one graph per budget, one shared weight store.

An engine directory holds::

    weights.bin        every tensor the graphs read, once (deduplicated by content, aligned)
    budget_<k>.onnx    one graph per budget; initializers are external data in weights.bin
    manifest.json      budgets, files with sha256, opset, tensor table, source config, version

Each budget path is fused (:mod:`looptool.passes.fuse`), exported with
``torch.onnx.export(..., dynamo=True)`` and a custom translation table, and its fused ops are
re-expressed as single nodes of the ``looptool`` domain whose function bodies ship in the
model (:mod:`looptool.backends.onnx_functions`). The exporter's opset conversion inlines
every function, so after export the nodes of each fused op (grouped by the FX node they
came from) are outlined again into one function call; the body is checked node by node.

The exporter's own optimizer is off (``optimize=False``): it folds ``Transpose``/``Tanh``
of weights into second copies. Instead the onnxscript optimizer runs with a folding rule
that never touches a node reading a weight (:func:`simplify`), and every externalised
initializer is checked to be a model tensor, byte for byte, or a small constant. Every export is validated with onnxruntime against the
PyTorch path before the directory is committed; a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from looptool.errors import LooptoolError

log = logging.getLogger(__name__)

FORMAT = "looptool-onnx-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "logits"
ALIGN = 64  # bytes; every tensor starts on a cache-line (and SIMD) boundary
ALIGN_LARGE = 4096  # tensors of 1 MiB or more start on a page, so they can be mapped as is
LARGE = 1 << 20
INLINE_LIMIT = 1024  # exporter constants smaller than this stay inside the .onnx file
DEFAULT_ATOL = 1e-4
VALIDATION_TEXT = "The quick brown fox jumps over the lazy dog, then counts: one, two, three, four."
_SUPPORTED_DTYPES = (torch.float32, torch.float16)


class ExportError(LooptoolError):
    """An export failed (unsupported model, exporter failure, or validation mismatch)."""


class EngineError(LooptoolError):
    """An engine directory is incomplete, tampered with or points outside itself."""


def budget_file(budget: int) -> str:
    """File name of one budget's graph."""
    return f"budget_{budget}.onnx"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------- weight store
class WeightStore:
    """Appends tensors to one file, once per distinct content, at aligned offsets."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115  (closed by close(), one file for all budgets)
        self._by_digest: dict[str, dict] = {}
        self.tensors: dict[str, dict] = {}  # initializer name → entry (shared with its digest)
        self.size = 0

    def add(self, name: str, array: np.ndarray, dtype: str) -> dict:
        """Store ``array`` (or find identical bytes already stored); returns its entry."""
        data = np.ascontiguousarray(array).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        entry = self._by_digest.get(digest)
        if entry is None:
            align = ALIGN_LARGE if len(data) >= LARGE else ALIGN
            offset = -(-self.size // align) * align
            self._file.write(b"\0" * (offset - self.size))
            self._file.write(data)
            self.size = offset + len(data)
            entry = {"offset": offset, "length": len(data), "sha256": digest}
            self._by_digest[digest] = entry
        if name in self.tensors and self.tensors[name]["sha256"] != digest:
            raise ExportError(f"two different tensors are both named '{name}' in the exported graphs; please report this as a bug.")
        self.tensors[name] = {**entry, "dtype": dtype, "shape": list(array.shape)}
        return self.tensors[name]

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


# ---------------------------------------------------------------------------- reports
@dataclass
class BudgetExport:
    """What exporting one budget produced."""

    budget: int
    file: str
    bytes: int
    seconds: float
    fused: dict[str, int]
    max_abs_diff: dict[str, float] = field(default_factory=dict)


@dataclass
class ExportReport:
    """Summary of an engine export (sizes in bytes; ``graph_bytes`` is every file but
    weights.bin: graphs, manifest and tokenizer)."""

    directory: str
    budgets: list[BudgetExport]
    weights_bytes: int
    graph_bytes: int
    parameter_bytes: int
    seconds: float

    @property
    def total_bytes(self) -> int:
        """Everything on disk: weights.bin, the graphs and the manifest."""
        return self.weights_bytes + self.graph_bytes

    @property
    def disk_ratio(self) -> float:
        """Disk bytes ÷ the model's parameter bytes (≤ 1.02 is the target)."""
        return self.total_bytes / self.parameter_bytes

    @property
    def max_abs_diff(self) -> float:
        """Worst ORT-vs-PyTorch difference over every budget and input."""
        return max((d for b in self.budgets for d in b.max_abs_diff.values()), default=float("nan"))

    def as_dict(self) -> dict:
        """JSON-ready summary."""
        out = asdict(self)
        out.update(total_bytes=self.total_bytes, disk_ratio=self.disk_ratio, max_abs_diff=self.max_abs_diff)
        return out


# ---------------------------------------------------------------------------- export
def resolve_budgets(model, budgets: int | str | Iterable[int] | None) -> tuple[int, ...]:
    """``"all"``/None → every budget; an int or ints → checked against the menu."""
    if budgets is None or budgets == "all":
        return model.budgets
    if isinstance(budgets, str):
        try:
            budgets = [int(b) for b in budgets.split(",")]
        except ValueError:
            raise ExportError(f"budget {budgets!r} is not a number; pass e.g. 6, 0,6 or all.") from None
    if isinstance(budgets, int):
        budgets = [budgets]
    return tuple(sorted({model.check_budget(int(b)) for b in budgets}))


def export_onnx(
    model,
    output: str | os.PathLike,
    budgets: int | str | Iterable[int] | None = "all",
    *,
    overwrite: bool = False,
    validate: bool = True,
    atol: float = DEFAULT_ATOL,
    on_progress: Callable[[str], None] | None = None,
) -> ExportReport:
    """Export budget paths of ``model`` (a :class:`looptool.LoopedModel`) to an engine
    directory ``output`` sharing one ``weights.bin``; validates each graph with
    onnxruntime against the PyTorch path (max abs diff ≤ ``atol × max(1, max |logits|)``)
    unless ``validate=False``.
    """
    from looptool.serialization import commit_output_dir, prepare_output_dir

    say = on_progress or (lambda text: None)
    chosen = resolve_budgets(model, budgets)
    _check_exportable(model)
    final, temp = prepare_output_dir(output, overwrite)
    t0 = time.perf_counter()
    try:
        store = WeightStore(temp / WEIGHTS)
        known = _model_tensor_digests(model)
        results: list[BudgetExport] = []
        graphs: dict[int, dict] = {}
        try:
            for budget in chosen:
                say(f"exporting budget {budget}")
                result, names = _export_budget(model, budget, temp, store, known)
                results.append(result)
                graphs[budget] = {"file": result.file, "initializers": names, "fused": result.fused}
        finally:
            store.close()
        if model.tokenizer is not None:  # so `looptool run` can encode prompts from the engine alone
            model.tokenizer.save_pretrained(temp)
        _write_manifest(model, temp, store, graphs)
        if validate:
            say("validating with onnxruntime")
            diffs = validate_engine(model, temp, atol=atol)
            for r in results:
                r.max_abs_diff = diffs[r.budget]
            _write_manifest(model, temp, store, graphs, diffs)
        graph_bytes = sum(p.stat().st_size for p in temp.iterdir() if p.name != WEIGHTS)
        report = ExportReport(
            directory=str(final), budgets=results, weights_bytes=(temp / WEIGHTS).stat().st_size,
            graph_bytes=graph_bytes, parameter_bytes=model.dims().param_bytes, seconds=time.perf_counter() - t0,
        )
        commit_output_dir(final, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    log.info("exported %d budgets to %s (%.3f x parameter bytes)", len(results), final, report.disk_ratio)
    return report


def _check_exportable(model) -> None:
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ExportError(f"the model is on {param.device}; load it on the CPU (looptool.load(dir)) before exporting.")
    if param.dtype not in _SUPPORTED_DTYPES:
        raise ExportError(f"ONNX export supports float32 and float16 models, this one is {param.dtype}; convert with --dtype float32.")


def _model_tensor_digests(model) -> dict[str, str]:
    """sha256 of every tensor the budget paths read, by name (to tell weights from
    exporter-made constants)."""
    from looptool.serialization import graph_tensors

    out: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, t in graph_tensors(model).items():
        if id(t) not in seen:
            seen[id(t)] = hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
        out[name] = seen[id(t)]
    return out


def fused_path(model, budget: int) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """The budget path with looptool's fused ops swapped in, over the model's tensors."""
    from looptool.passes.fuse import fuse_graph

    from looptool.graph import shared_graph_module

    graph, counts = fuse_graph(model.layer_graph.paths[budget])
    return shared_graph_module(model, graph), dict(counts)


def export_program(gm: torch.fx.GraphModule, vocab_size: int, mask_dtype: torch.dtype):
    """``torch.onnx.export`` (dynamo) of one path with dynamic batch and sequence."""
    from torch.export import Dim

    ids = torch.arange(16).reshape(2, 8) % vocab_size
    mask = torch.ones_like(ids, dtype=mask_dtype)
    batch, seq = Dim("batch"), Dim("sequence")
    with warnings.catch_warnings():  # the exporter warns that both inputs share the axis names
        warnings.filterwarnings("ignore", message=".*axis name.*", category=UserWarning)
        return _onnx_export(gm, ids, mask, batch, seq)


def _onnx_export(gm, ids, mask, batch, seq):
    from looptool.backends.onnx_functions import OPSET, translation_table

    return torch.onnx.export(
        gm, (ids, mask), dynamo=True, external_data=True, optimize=False, opset_version=OPSET,
        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
        input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
        custom_translation_table=translation_table(), verbose=False,
    )


def _export_budget(model, budget: int, directory: Path, store: WeightStore, known: dict[str, str]):
    import onnx_ir as ir

    t0 = time.perf_counter()
    gm, counts = fused_path(model, budget)
    try:
        program = export_program(gm, model.config.vocab_size, model._mask_dtype)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed on budget {budget} ({type(exc).__name__}: {first}).") from exc
    onnx_model = program.model
    outline_looptool_functions(onnx_model)
    simplify(onnx_model)
    names = _externalize(onnx_model, directory, store, known, budget)
    _strip_metadata(onnx_model)
    path = directory / budget_file(budget)
    ir.save(onnx_model, path)
    return BudgetExport(budget=budget, file=path.name, bytes=path.stat().st_size,
                        seconds=time.perf_counter() - t0, fused=counts), names


def _reads_weights(node) -> bool | None:
    """Folding rule: never fold a node that reads a weight-sized initializer (the result
    would be a second copy of the weight); otherwise the optimizer's default rules."""
    for value in node.inputs:
        if value is not None and value.is_initializer() and value.const_value is not None and value.const_value.size > 64:
            return False
    return None


def simplify(onnx_model) -> None:
    """Fold the exporter's shape arithmetic, simplify and drop dead nodes (about 3x fewer
    nodes), keeping the looptool functions as calls and every weight as it is stored."""
    import onnxscript

    # one pass, no ONNX shape inference: on SmolLM2 this halves the graph (877 → 429 KB) and
    # makes onnxruntime ~7% faster for ~20 s of export time per budget
    onnxscript.optimizer.optimize_ir(onnx_model, num_iterations=1, onnx_shape_inference=False, inline=False,
                                     should_fold=_reads_weights)


def _strip_metadata(onnx_model) -> None:
    """Drop the exporter's per-node provenance (FX node text, stack traces): it is most of
    a graph file's bytes and nothing reads it."""
    for node in onnx_model.graph.all_nodes():
        node.metadata_props.clear()
    for fn in onnx_model.functions.values():
        for node in fn:
            node.metadata_props.clear()


def _externalize(onnx_model, directory: Path, store: WeightStore, known: dict[str, str], budget: int) -> list[str]:
    """Point every large or model-owned initializer at ``weights.bin``; refuse folded
    copies of weights (an initializer that is big but no model tensor)."""
    import onnx_ir as ir

    known_digests = set(known.values())
    names: list[str] = []
    for name, value in list(onnx_model.graph.initializers.items()):
        tensor = value.const_value
        if tensor is None:
            continue
        array = tensor.numpy()
        nbytes = array.nbytes
        is_model_tensor = name in known
        if not is_model_tensor and nbytes < INLINE_LIMIT:
            continue  # a small exporter constant: stays in the graph file
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        if is_model_tensor and known[name] != digest:
            raise ExportError(f"initializer '{name}' of budget {budget} differs from the model tensor of that name; please report this as a bug.")
        if not is_model_tensor and digest not in known_digests:
            raise ExportError(
                f"budget {budget} has a {nbytes}-byte initializer '{name}' that is no model tensor "
                "(a constant-folded copy would duplicate weights); please report this as a bug."
            )
        entry = store.add(name, array, str(tensor.dtype))
        value.const_value = ir.ExternalTensor(
            WEIGHTS, entry["offset"], entry["length"], tensor.dtype,
            shape=tensor.shape, name=name, base_dir=directory,
        )
        names.append(name)
    return names


def outline_looptool_functions(onnx_model) -> dict[str, int]:
    """Replace the inlined body of every fused op by one ``looptool``-domain node and add
    the function definitions (bodies) to the model; returns the count per function."""
    import onnx_ir as ir
    from looptool.backends.onnx_functions import DOMAIN, DOMAIN_VERSION, FUNCTIONS

    groups: dict[str, list] = {}
    kinds: dict[str, str] = {}
    for node in onnx_model.graph:
        scope = node.metadata_props.get("namespace", "")
        target = scope.rsplit(": ", 1)[-1]
        if target.startswith(f"{DOMAIN}.") and target.endswith(".default"):
            key = node.metadata_props.get("pkg.torch.onnx.name_scopes", scope)
            groups.setdefault(key, []).append(node)
            kinds[key] = target[len(DOMAIN) + 1:-len(".default")]
    counts: dict[str, int] = {}
    used: set[str] = set()
    for key, nodes in groups.items():
        function = FUNCTIONS[kinds[key]]
        body = ir.serde.deserialize_function(function.to_function_proto())
        _outline(onnx_model.graph, nodes, body)
        used.add(kinds[key])
        counts[body.name] = counts.get(body.name, 0) + 1
    for kind in sorted(used):
        body = ir.serde.deserialize_function(FUNCTIONS[kind].to_function_proto())
        onnx_model.functions[body.identifier()] = body
    if used:
        onnx_model.opset_imports[DOMAIN] = DOMAIN_VERSION
    return counts


def _outline(graph, nodes: list, function) -> None:
    """Swap the inlined copy of ``function`` (the last nodes of ``nodes``) for one call."""
    import onnx_ir as ir

    body = list(function)
    inlined = nodes[-len(body):]
    if len(nodes) < len(body) or [n.op_type for n in inlined] != [n.op_type for n in body]:
        raise ExportError(
            f"the exported nodes of looptool.{function.name} do not match its function body; "
            "please report this as a bug."
        )
    params: dict[int, ir.Value] = {}
    position = {id(v): i for i, v in enumerate(function.inputs)}
    produced = {id(out): out for n in inlined for out in n.outputs}
    for fn_node, node in zip(body, inlined):
        for fn_in, actual in zip(fn_node.inputs, node.inputs):
            if fn_in is not None and id(fn_in) in position:
                params[position[id(fn_in)]] = actual
    if len(params) != len(function.inputs):
        raise ExportError(f"could not recover the inputs of looptool.{function.name}; please report this as a bug.")
    out_index = {id(v): i for i, v in enumerate(function.outputs)}
    old_outputs = [None] * len(function.outputs)
    for fn_node, node in zip(body, inlined):
        for fn_out, actual in zip(fn_node.outputs, node.outputs):
            if id(fn_out) in out_index:
                old_outputs[out_index[id(fn_out)]] = actual
    call = ir.Node(function.domain, function.name, [params[i] for i in range(len(params))],
                   num_outputs=len(old_outputs), name=inlined[-1].name)
    call.metadata_props.update(inlined[-1].metadata_props)
    graph.insert_before(inlined[0], call)
    for old, new in zip(old_outputs, call.outputs):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        old.name = None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    for node in reversed(inlined):
        leaked = [o for o in node.outputs if o.uses() and id(o) in produced and not all(u.node in inlined for u in o.uses())]
        if leaked:
            raise ExportError(f"an intermediate of looptool.{function.name} is read outside it; please report this as a bug.")
    graph.remove(inlined, safe=True)


def _write_manifest(model, directory: Path, store: WeightStore, graphs: dict[int, dict], diffs: dict | None = None) -> None:
    from looptool.backends.onnx_functions import DOMAIN, DOMAIN_VERSION, OPSET

    from looptool import __version__

    budgets = {}
    for budget, info in sorted(graphs.items()):
        path = directory / info["file"]
        budgets[str(budget)] = {
            "file": info["file"], "sha256": sha256_file(path), "bytes": path.stat().st_size,
            "initializers": info["initializers"], "fused": info["fused"],
            **({"max_abs_diff": diffs[budget]} if diffs else {}),
        }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "looptool_version": __version__,
        "opset": {"": OPSET, DOMAIN: DOMAIN_VERSION},
        "inputs": {"input_ids": "int64 [batch, sequence]", "attention_mask": f"{str(model._mask_dtype).removeprefix('torch.')} [batch, sequence]"},
        "output": f"{OUTPUT_NAME} [batch, sequence, vocab]",
        "mask_dtype": str(model._mask_dtype).removeprefix("torch."),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "plan": model.plan.to_dict(),
        "budgets": budgets,
        "weights": {"file": WEIGHTS, "sha256": sha256_file(directory / WEIGHTS), "bytes": store.size, "tensors": store.tensors},
        "parameter_bytes": model.dims().param_bytes,
        "source_config": model.config.to_dict(),
        "tokenizer": model.tokenizer is not None,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))


# ---------------------------------------------------------------------------- validation
def validation_inputs(model) -> dict[str, torch.Tensor]:
    """A random batch and a real sentence (tokenised when the model has a tokenizer)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = {"random": torch.randint(0, vocab, (2, 13), generator=g)}
    if model.tokenizer is not None:
        ids = model.tokenizer(VALIDATION_TEXT, return_tensors="pt").input_ids
    else:
        ids = torch.tensor([list(VALIDATION_TEXT.encode())]) % vocab
    out["real"] = ids
    return out


def validate_engine(model, directory: str | os.PathLike, *, atol: float = DEFAULT_ATOL) -> dict[int, dict[str, float]]:
    """Run every graph of an engine with onnxruntime (through :class:`Runtime`) and the
    PyTorch path on the same inputs; returns max abs diff per budget and input, raising
    :class:`ExportError` above ``atol × max(1, max |logits|)``."""
    from looptool.backends.ort import Runtime

    rt = Runtime(directory)
    diffs: dict[int, dict[str, float]] = {}
    for budget in rt.budgets:
        diffs[budget] = {}
        for label, ids in validation_inputs(model).items():
            with torch.inference_mode():
                ref = model(ids, budget=budget).logits.float().numpy()
            got = rt(ids.numpy(), budget=budget).astype(np.float32)
            diff = float(np.abs(got - ref).max()) if got.shape == ref.shape else float("inf")
            # fp32 kernels accumulate in different orders, so the limit scales with the
            # logits once they exceed 1 (SmolLM2: |logits| ~ 36, diff ~ 2e-4 even with ORT
            # optimisations off)
            limit = atol * max(1.0, float(np.abs(ref).max()))
            if not np.isfinite(diff) or diff > limit:
                raise ExportError(
                    f"budget {budget}: onnxruntime and PyTorch differ by {diff:.3g} on the {label} input "
                    f"(limit {limit:.3g}); the export was discarded, please report this as a bug."
                )
            diffs[budget][label] = diff
        log.info("budget %d validated: %s", budget, diffs[budget])
    rt.close()
    return diffs
