"""Lower budget paths to ONNX: one serving graph per budget and KV policy, one weight store.

An engine directory holds::

    weights.bin                 every tensor the graphs read, once (deduplicated by content, aligned)
    budget_<k>.<policy>.onnx    one graph per budget and KV policy; initializers live in weights.bin
    manifest.json               budgets, policies, files with sha256, cache layouts, tensor table

Each graph is a budget path in the decode interface of :mod:`looptool.backends.serving`:
one graph with a dynamic step length serves the prefill and every decode step, reading and
writing a fixed-capacity KV cache. Graphs are composed from layer functions
(:mod:`looptool.backends.onnx_layers`): each distinct layer body is exported once with
``torch.onnx.export(..., dynamo=True)`` and called as an ONNX function, and only the glue
between layers is traced per graph (a graph that cannot be composed is exported flat). Fused
ops become single nodes of the ``looptool`` domain whose function bodies ship in the model
(:mod:`looptool.backends.onnx_functions`); the exporter's opset conversion inlines every
function, so after export the nodes of each fused op (grouped by the FX node they came
from) are outlined again into one call; the body is checked node by node.

The exporter's own optimizer is off (``optimize=False``): it folds ``Transpose``/``Tanh``
of weights into second copies. Instead the onnxscript optimizer runs with a folding rule
that never touches a node reading a weight (:func:`simplify`), and every externalised
initializer is checked to be a model tensor, byte for byte, or a small constant. Every
export is validated with onnxruntime against the PyTorch path (cached generation, step by
step) before the directory is committed; a failure leaves nothing behind.
"""

from __future__ import annotations

import functools
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

from looptool.errors import LooptoolError, require_extra

log = logging.getLogger(__name__)

FORMAT = "looptool-onnx-engine"
FORMAT_VERSION = 2  # 2: serving graphs with KV caches, one per budget and policy
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
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


def budget_file(budget: int, kv: str = "per-loop") -> str:
    """File name of one budget's graph under KV policy ``kv``."""
    return f"budget_{budget}.{kv}.onnx"


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
    """What exporting one budget's graph under one KV policy produced."""

    budget: int
    kv: str
    file: str
    bytes: int
    seconds: float
    fused: dict[str, int]
    composed: bool = False  # built from layer functions (else traced flat)
    layer_calls: dict[str, int] = field(default_factory=dict)
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
    layer_functions: int = 0  # distinct layer bodies exported
    layer_seconds: float = 0.0  # time spent exporting them
    validation_seconds: float = 0.0
    fusions: dict[str, dict[str, int]] = field(default_factory=dict)  # onnxruntime fusions per body

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
        """Worst ORT-vs-PyTorch difference over every graph and input."""
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


def resolve_policies(model, kv: str | Iterable[str]) -> tuple[str, ...]:
    """KV policies to export: one, a comma-separated list, or ``all`` (every policy the
    model supports: last-loop only where some budget repeats a layer)."""
    from looptool.generation import check_policy, repeats_layers
    from looptool.passes.kv_cache import KV_POLICIES

    if kv == "all":
        chosen = [p for p in KV_POLICIES if p == "per-loop" or repeats_layers(model)]
    else:
        chosen = [p.strip() for p in kv.split(",")] if isinstance(kv, str) else list(kv)
    if not chosen:
        raise ExportError("no KV policy given; pass --kv per-loop, last-loop or all.")
    return tuple(check_policy(model, p) for p in dict.fromkeys(chosen))


def export_onnx(
    model,
    output: str | os.PathLike,
    budgets: int | str | Iterable[int] | None = "all",
    *,
    kv: str | Iterable[str] = "per-loop",
    compose: bool = True,
    ort_fusions: bool = False,
    overwrite: bool = False,
    validate: bool = True,
    atol: float = DEFAULT_ATOL,
    on_progress: Callable[[str], None] | None = None,
    _allow_bf16: bool = False,
) -> ExportReport:
    """Export budget paths of ``model`` (a :class:`looptool.LoopedModel`) to an engine
    directory ``output`` sharing one ``weights.bin``: one serving graph per budget and KV
    policy (``kv``: ``per-loop``, ``last-loop``, a comma-separated list or ``all``).

    ``compose=True`` builds the graphs from layer functions, each distinct layer body
    exported once (falls back to a flat export per graph where that fails).
    ``ort_fusions=True`` rewrites each body with onnxscript's onnxruntime fusions (RMSNorm,
    skip-RMSNorm, attention as ``com.microsoft`` ops): onnxruntime-only graphs. Unless
    ``validate=False`` every graph is run with onnxruntime, prefill then step-by-step
    decoding, against the PyTorch cached path (max abs diff ≤ ``atol × max(1, max
    |logits|)``).
    """
    require_extra("onnx", "ONNX export", "onnx", "onnxscript", "onnx_ir", *(("onnxruntime",) if validate else ()))
    from looptool.backends.onnx_layers import LayerLibrary
    from looptool.backends.serving import serving_graph
    from looptool.serialization import commit_output_dir, prepare_output_dir

    say = on_progress or (lambda text: None)
    chosen = resolve_budgets(model, budgets)
    policies = resolve_policies(model, kv)
    _check_exportable(model, _SUPPORTED_DTYPES + ((torch.bfloat16,) if _allow_bf16 else ()))
    final, temp = prepare_output_dir(output, overwrite)
    t0 = time.perf_counter()
    library = LayerLibrary(ort_fusions=ort_fusions) if compose else None
    try:
        store = WeightStore(temp / WEIGHTS)
        known = _model_tensor_digests(model)
        results: list[BudgetExport] = []
        graphs: dict[tuple[int, str], dict] = {}
        try:
            for policy in policies:
                for budget in chosen:
                    say(f"exporting budget {budget} ({policy})")
                    result, entry = _export_graph(serving_graph(model, budget, policy), budget, policy, temp, store,
                                                  known, library)
                    results.append(result)
                    graphs[budget, policy] = entry
        finally:
            store.close()
        if model.tokenizer is not None:  # so `looptool run` can encode prompts from the engine alone
            model.tokenizer.save_pretrained(temp)
        functions = library.fusions() if library else {}
        _write_manifest(model, temp, store, graphs, functions, ort_fusions)
        t_validate = time.perf_counter()
        if validate:
            say("validating with onnxruntime")
            diffs = validate_engine(model, temp, atol=atol)
            for r in results:
                r.max_abs_diff = diffs[r.budget, r.kv]
                graphs[r.budget, r.kv]["max_abs_diff"] = r.max_abs_diff
            _write_manifest(model, temp, store, graphs, functions, ort_fusions)
        t_validate = time.perf_counter() - t_validate
        graph_bytes = sum(p.stat().st_size for p in temp.iterdir() if p.name != WEIGHTS)
        bodies = list(library.bodies.values()) if library else []
        report = ExportReport(
            directory=str(final), budgets=results, weights_bytes=(temp / WEIGHTS).stat().st_size,
            graph_bytes=graph_bytes, parameter_bytes=model.dims().param_bytes, seconds=time.perf_counter() - t0,
            layer_functions=sum(b.function is not None for b in bodies), layer_seconds=sum(b.seconds for b in bodies),
            validation_seconds=t_validate, fusions=functions,
        )
        commit_output_dir(final, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    log.info("exported %d graphs to %s (%.3f x parameter bytes)", len(results), final, report.disk_ratio)
    return report


def _check_exportable(model, dtypes: tuple[torch.dtype, ...] = _SUPPORTED_DTYPES) -> None:
    """On the CPU and in a dtype the target runs (bf16 only for TensorRT: onnxruntime's CPU
    kernels lack it)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ExportError(f"the model is on {param.device}; load it on the CPU (looptool.load(dir)) before exporting.")
    if param.dtype not in dtypes:
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


def serving_example(sg) -> tuple[list[torch.Tensor], tuple]:
    """Example inputs (batch 2, step 3, capacity 8) and dynamic shapes (named ``batch``,
    ``step``, ``capacity``) for exporting a serving graph."""
    from torch.export import Dim

    placeholders = [n for n in sg.module.graph.nodes if n.op == "placeholder"]
    mask_dtype = placeholders[1].meta["val"].dtype
    batch, step, capacity = 2, 3, 8
    dtype = getattr(torch, sg.layout.dtype)
    ids = torch.zeros(batch, step, dtype=torch.long)
    steps = torch.arange(step)
    caches = [torch.zeros(batch, p.kv_heads, capacity, p.head_dim, dtype=dtype) for p in sg.layout.pairs for _ in "kv"]
    args = [ids, torch.ones(batch, capacity, dtype=mask_dtype), steps.expand(batch, step), steps, *caches]
    b, t, s = Dim("batch"), Dim("step"), Dim("capacity")
    shapes = ({0: b, 1: t}, {0: b, 1: s}, {0: b, 1: t}, {0: t}, *[{0: b, 2: s}] * len(caches))
    return args, shapes


def export_program(gm: torch.fx.GraphModule, args, dynamic_shapes, *, input_names=None, output_names=None,
                   extra_translations: dict | None = None):
    """``torch.onnx.export`` (dynamo, no exporter optimisation, looptool's translations)."""
    from looptool.backends.onnx_functions import OPSET, translation_table

    with warnings.catch_warnings():  # the exporter warns that inputs share axis names
        warnings.filterwarnings("ignore", message=".*axis name.*", category=UserWarning)
        return torch.onnx.export(
            gm, tuple(args), dynamo=True, external_data=True, optimize=False, opset_version=OPSET,
            dynamic_shapes=tuple(dynamic_shapes), input_names=input_names, output_names=output_names,
            custom_translation_table={**translation_table(), **(extra_translations or {})}, verbose=False,
        )


def _export_graph(sg, budget: int, policy: str, directory: Path, store: WeightStore, known: dict[str, str], library):
    """Export one serving graph (composed from layer functions when ``library`` is given),
    externalise its weights and save it; returns its report and manifest entry."""
    import onnx_ir as ir

    t0 = time.perf_counter()
    onnx_model, calls = None, {}
    if library is not None:
        try:
            onnx_model, calls = _compose(sg, library)
        except Exception as exc:  # noqa: BLE001  (any failure of the composed route: trace flat instead)
            log.warning("budget %d (%s): composing from layer functions failed (%s: %s); exporting it flat",
                        budget, policy, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
    if onnx_model is None:
        args, shapes = serving_example(sg)
        onnx_model = _run_exporter(lambda: export_program(sg.module, args, shapes, input_names=sg.input_names,
                                                          output_names=sg.output_names), budget).model
    outline_looptool_functions(onnx_model)
    simplify(onnx_model)
    names = _externalize(onnx_model, directory, store, known, budget)
    _strip_metadata(onnx_model)
    path = directory / budget_file(budget, policy)
    ir.save(onnx_model, path)
    result = BudgetExport(budget=budget, kv=policy, file=path.name, bytes=path.stat().st_size,
                          seconds=time.perf_counter() - t0, fused=sg.fused, composed=bool(calls), layer_calls=calls)
    entry = {"file": path.name, "initializers": names, "fused": sg.fused, "composed": bool(calls),
             "layer_calls": calls, "cache": sg.layout.to_dict(), "kv_bytes_per_token": sg.layout.bytes_per_token()}
    return result, entry


def _compose(sg, library) -> tuple[object, dict[str, int]]:
    """The serving graph as calls of functions, each distinct body exported once."""
    from looptool.backends.onnx_functions import OPSET

    comp = library.partition(sg)
    library.record_examples(comp, sg.layout)
    library.export_functions(comp, functools.partial(_body_model, ort_fusions=library.ort_fusions))
    onnx_model = library.assemble(comp, sg, {"": OPSET})
    calls: dict[str, int] = {}
    for unit in comp.units:
        calls[unit.body.name] = calls.get(unit.body.name, 0) + 1
    return onnx_model, calls


def _body_model(module, example, shapes, *, ort_fusions: bool = False):
    """One body exported and tidied (fused ops outlined, shape arithmetic folded), with
    onnxruntime's transformer fusions when ``ort_fusions``; returns ``(model, fusion counts)``."""
    program = export_program(module, example, shapes)
    model = program.model
    outline_looptool_functions(model)
    simplify(model)
    counts: dict[str, int] = {}
    if ort_fusions:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model, counts = optimize_for_ort(model)
    _strip_metadata(model)
    return model, {k: v for k, v in counts.items() if v}


def _run_exporter(call, budget: int):
    try:
        return call()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed on budget {budget} ({type(exc).__name__}: {first}).") from exc


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
        kind = target[len(DOMAIN) + 1:-len(".default")] if target.endswith(".default") else None
        if target.startswith(f"{DOMAIN}.") and kind in FUNCTIONS:
            key = node.metadata_props.get("pkg.torch.onnx.name_scopes", scope)
            groups.setdefault(key, []).append(node)
            kinds[key] = kind
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


def _write_manifest(model, directory: Path, store: WeightStore, graphs: dict[tuple[int, str], dict],
                    functions: dict[str, dict[str, int]], ort_fusions: bool) -> None:
    from looptool.backends.onnx_functions import DOMAIN, DOMAIN_VERSION, OPSET
    from looptool.backends.serving import INPUTS, LOGITS

    from looptool import __version__

    budgets: dict[str, dict] = {}
    for (budget, policy), info in sorted(graphs.items()):
        path = directory / info["file"]
        budgets.setdefault(str(budget), {})[policy] = {**info, "sha256": sha256_file(path), "bytes": path.stat().st_size}
    mask_dtype = str(model.mask_dtype).removeprefix("torch.")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "looptool_version": __version__,
        "opset": {"": OPSET, DOMAIN: DOMAIN_VERSION},
        "interface": {
            "inputs": dict(zip(INPUTS, ("int64 [batch, step]", f"{mask_dtype} [batch, capacity]", "int64 [batch, step]",
                                        "int64 [step]"))),
            "caches": "past_key_values.{j}.key / .value [batch, kv_heads, capacity, head_dim] in, present.{j}.key / "
                      ".value out (same buffers may be bound to both)",
            "outputs": {LOGITS: "[batch, 1, vocab] (last position)"},
        },
        "kv_policies": sorted({policy for _, policy in graphs}),
        "functions": {"ort_fusions": ort_fusions, "fused_per_body": functions},
        "mask_dtype": mask_dtype,
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
def validation_prompts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, attention_mask)`` per label: two random rows, the second left-padded,
    and a real sentence (tokenised when the model has a tokenizer)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {"random": (ids, mask)}
    if model.tokenizer is not None:
        real = model.tokenizer(VALIDATION_TEXT, return_tensors="pt").input_ids
    else:
        real = torch.tensor([list(VALIDATION_TEXT.encode())]) % vocab
    out["real"] = (real, torch.ones_like(real))
    return out


def validate_engine(model, directory: str | os.PathLike, *, atol: float = DEFAULT_ATOL,
                    new_tokens: int = 6) -> dict[tuple[int, str], dict[str, float]]:
    """Generate greedily with every graph of an engine (onnxruntime, :class:`Runtime`) and
    with the PyTorch cached path on the same prompts; returns the max abs difference of the
    next-token logits over the prefill and every decode step, per ``(budget, policy)`` and
    prompt, raising :class:`ExportError` above ``atol × max(1, max |logits|)`` or when the
    greedy tokens differ."""
    from looptool.backends.ort import Runtime
    from looptool.generation import generate

    rt = Runtime(directory)
    diffs: dict[tuple[int, str], dict[str, float]] = {}
    for policy in rt.kv_policies:
        for budget in rt.budgets:
            diffs[budget, policy] = {}
            for label, (ids, mask) in validation_prompts(model).items():
                ref = generate(model, ids, attention_mask=mask, budget=budget, kv=policy, max_new_tokens=new_tokens,
                               output_logits=True)
                got = rt.generate(ids, attention_mask=mask, budget=budget, kv=policy, max_new_tokens=new_tokens,
                                  output_logits=True)
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.logits, got.logits))
                # fp32 kernels accumulate in different orders, so the limit scales with the logits
                # once they exceed 1 (SmolLM2: |logits| ~ 36, diff ~ 2e-4 even with ORT optimisations off)
                limit = atol * max(1.0, max(float(t.abs().max()) for t in ref.logits))
                if not np.isfinite(diff) or diff > limit or not torch.equal(ref.sequences, got.sequences):
                    raise ExportError(
                        f"budget {budget} ({policy}): onnxruntime and PyTorch differ by {diff:.3g} on the {label} prompt "
                        f"(limit {limit:.3g}){'' if torch.equal(ref.sequences, got.sequences) else ' and generate different tokens'}; "
                        "the export was discarded, please report this as a bug."
                    )
                diffs[budget, policy][label] = diff
            log.info("budget %d (%s) validated: %s", budget, policy, diffs[budget, policy])
    rt.close()
    return diffs
