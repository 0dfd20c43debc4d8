"""Lower budget paths to ONNX: serving graphs over one weight store.

An engine directory holds::

    weights.bin                 every tensor the graphs read, once (deduplicated by content, aligned)
    rowwise.<policy>.onnx       every row at its own budget; for a fixed-prefix plan (per-loop KV) its
                                window layers are ONNX Loops, so this one graph serves every budget
    budget_<k>.<policy>.onnx    where asked (or the row-wise graph cannot loop): one graph per budget
    adaptive.<rule>.<policy>.onnx   with adaptive=True: the adaptive-depth graph (budget="auto")
    manifest.json               budgets, policies, files with sha256, cache layouts, tensor table

Each graph is a budget path in the decode interface of :mod:`looptool.backends.interface`:
one graph with a dynamic step length serves the prefill and every decode step, reading and
writing a fixed-capacity KV cache. Graphs are composed from layer functions
(:mod:`looptool.backends.onnx.layers`): each distinct layer body is exported once with
``torch.onnx.export(..., dynamo=True)`` and called as an ONNX function, and only the glue
between layers is traced per graph (a graph that cannot be composed is exported flat). Fused
ops become single nodes of the ``looptool`` domain whose function bodies ship in the model
(:mod:`looptool.backends.onnx.functions`); the exporter's opset conversion inlines every
function, so after export the nodes of each fused op (grouped by the FX node they came
from) are outlined again into one call; the body is checked node by node.

The exporter's own optimizer is off (``optimize=False``): it folds ``Transpose``/``Tanh``
of weights into second copies. Instead the onnxscript optimizer runs with a folding rule
that never touches a node reading a weight (:func:`simplify`), and every externalised
initializer is checked to be a model tensor, byte for byte, or a small constant. Every
export is validated with onnxruntime against the PyTorch path (cached generation, step by
step) before the directory is committed; a failure leaves nothing behind.

This module runs the export (under :func:`faster_exporter`); one job per module beside it:
graph file names and the manifest of an export (:mod:`~looptool.backends.onnx.format`; the
manifest's type is :mod:`looptool.backends.manifest`'s), the weight store
(:mod:`~looptool.backends.onnx.store`), optimisation (:mod:`~looptool.backends.onnx.optimize`),
lowering to onnxruntime's fused ops (:mod:`~looptool.backends.onnx.fuse_ort`, on each layer
body after it is simplified, or on a flat graph), outlining of fused ops
(:mod:`~looptool.backends.onnx.outline`), looping the window (:mod:`~looptool.backends.onnx.looped`),
which graphs to write (:mod:`~looptool.backends.onnx.selection`) and validation
(:mod:`~looptool.backends.onnx.validate`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from looptool.backends.errors import ExportError
from looptool.backends.interface import example_extras
from looptool.backends.manifest import WEIGHTS, GraphEntry
from looptool.backends.onnx.adaptive import adaptive_rules, adaptive_targets, export_adaptive_graphs
from looptool.backends.onnx.format import budget_file, export_manifest
from looptool.backends.onnx.fuse_ort import FUSE_PREFIX, fuse_for_ort, rule_counts
from looptool.backends.onnx.optimize import constant_reshapes, simplify, strip_metadata
from looptool.backends.onnx.outline import outline_looptool_functions
from looptool.backends.onnx.quantize import ACCURACY_LEVEL, Quantizer, quantizer_for
from looptool.backends.onnx.report import BudgetExport, ExportReport
from looptool.backends.onnx.selection import looped_by_default, resolve_budgets, resolve_policies
from looptool.backends.onnx.speculative import export_verify_graphs, verify_targets
from looptool.backends.onnx.store import WeightStore, externalize, to_numpy
from looptool.backends.onnx.validate import ADAPTIVE, VERIFY, validate_engine
from looptool.core.compat import decompose_only_what_onnx_lacks, reused_torchlib_registry, without_torchvision_notice
from looptool.core.errors import require_extra
from looptool.core.graph import ROWWISE
from looptool.core.tracing import fast_tracing

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.float16)


# ---------------------------------------------------------------------------- export
def export_onnx(
    model,
    output: str | os.PathLike,
    budgets: int | str | Iterable[int] | None = None,
    *,
    kv: str | Iterable[str] = "per-loop",
    compose: bool = True,
    ort_fusions: bool = False,
    fuse_ort: bool = True,
    rowwise: bool = True,
    loop: bool = True,
    speculative: bool = False,
    adaptive: bool | str = False,
    quantize: str | None = None,
    accuracy_level: int = ACCURACY_LEVEL,
    overwrite: bool = False,
    validate: bool = True,
    atol: float | None = None,
    on_progress: Callable[[str], None] | None = None,
    _allow_bf16: bool = False,
) -> ExportReport:
    """Export budget paths of ``model`` (a :class:`looptool.LoopedModel`) to an engine
    directory ``output`` sharing one ``weights.bin`` (``kv``: ``per-loop``, ``last-loop``, a
    comma-separated list or ``all``).

    ``rowwise=True`` writes, per policy, the row-wise-budget graph ``rowwise.<policy>.onnx``
    (input ``budgets [batch]``: every row runs its own budget of the whole menu, over the
    deepest budget's caches). With ``loop=True`` (default) a fixed-prefix plan's window becomes
    ONNX ``Loop`` nodes in it (:mod:`looptool.backends.onnx.looped`, per-loop KV): each window
    layer runs once or twice as the batch's deepest row asks, so this one graph serves every
    budget at that budget's cost and the engine opens as one session with one packed copy of
    the weights. Otherwise the row-wise graph masks rows and costs the deepest budget.

    ``budgets``: the per-budget graphs ``budget_<k>.<policy>.onnx`` (every pass unrolled; the
    form TensorRT builds), a budget, several or ``"all"``; ``"none"`` for none. A batch whose
    rows share a budget runs that budget's own graph where the engine has one. Default (None):
    none where every row-wise graph is looped and no verify graph needs drafts, else all.

    ``speculative=True`` also writes, per budget but the shallowest (per-loop KV), the verify
    graph speculative decoding scores drafts with (:mod:`looptool.backends.onnx.speculative`).

    ``adaptive=True`` (or an exit rule, ``"state"`` / ``"kl"``, or both comma-separated) also
    writes, under last-loop KV, the adaptive-depth graph ``budget="auto"`` runs
    (:mod:`looptool.backends.onnx.adaptive`): every loop up to the batch's deepest
    ``max_budget`` runs masked, so it saves depth, not time.

    ``compose=True`` builds the graphs from layer functions, each distinct layer body
    exported once (falls back to a flat export per graph where that fails).
    ``ort_fusions=True`` rewrites each body with onnxscript's onnxruntime fusions (RMSNorm,
    skip-RMSNorm, attention as ``com.microsoft`` ops): onnxruntime-only graphs.
    ``fuse_ort=True`` lowers each graph to onnxruntime's fused ops where their patterns match
    (:mod:`looptool.backends.onnx.fuse_ort`: linears as ``FusedMatMul`` over the stored
    weights, RMSNorm, attention over the grouped caches): onnxruntime-only graphs too, so the
    TensorRT export turns it off. Unless
    ``validate=False`` every graph is run with onnxruntime, prefill then step-by-step
    decoding, against the PyTorch cached path (max abs diff ≤ ``atol × max(1, max
    |logits|)``; ``atol`` default: 1e-4 for float32, 1e-2 for float16 graphs).

    ``quantize`` (``"int8"`` or ``"int4"``; default None: float weights) stores every linear's
    weight once as weight-only blocks read by ``com.microsoft.MatMulNBits`` in every graph
    (:mod:`looptool.backends.onnx.quantize`: onnxruntime-only graphs); such graphs cannot
    reproduce PyTorch's logits, so validation bounds their error instead
    (:func:`looptool.backends.onnx.validate.check_quantized`). ``accuracy_level`` is how
    ``MatMulNBits`` computes: 1 (default), float activations, so each row's tokens do not depend
    on the other rows of its batch; 4, int8 activations (onnxruntime-genai's CPU setting): faster,
    and a row's tokens then depend on the batch it runs in.
    """
    require_extra("onnx", "ONNX export", "onnx", "onnxscript", "onnx_ir", *(("onnxruntime",) if validate else ()))
    from looptool.backends.interface import rowwise_serving_graph, serving_graph
    from looptool.backends.onnx.layers import LayerLibrary
    from looptool.storage.files import commit_output_dir, prepare_output_dir

    say = on_progress or (lambda text: None)
    policies = resolve_policies(model, kv)
    loops_all = looped_by_default(
        model.plan, policies, loop=loop, rowwise=rowwise, compose=compose, speculative=speculative
    )
    chosen = resolve_budgets(model, ("none" if loops_all else "all") if budgets is None else budgets)
    if not chosen and not rowwise:
        raise ExportError("no graph to export: pick budgets, or keep rowwise=True.", parameter="budgets")
    targets = verify_targets(chosen, policies) if speculative else []
    auto_targets = adaptive_targets(adaptive_rules(adaptive), policies)
    _check_exportable(model, _SUPPORTED_DTYPES + ((torch.bfloat16,) if _allow_bf16 else ()))
    quantizer = quantizer_for(quantize, accuracy_level)
    final, temp = prepare_output_dir(output, overwrite)
    t0 = time.perf_counter()
    library = LayerLibrary(ort_fusions=ort_fusions, fuse_ort=fuse_ort) if compose else None
    try:
        store = WeightStore(temp / WEIGHTS)
        known = _model_tensor_digests(model)
        results: list[BudgetExport] = []
        rowwise_results: list[BudgetExport] = []
        graphs: dict[tuple[int | str, str], GraphEntry] = {}
        try:
            for policy in policies:
                if rowwise:
                    say(f"exporting the row-wise graph ({policy})")
                    sg = rowwise_serving_graph(model, policy, unflatten=compose)  # composing: crossings unflattened
                    result, entry = _export_graph(
                        sg, ROWWISE, policy, temp, store, known, library, quantizer, fuse_ort, loop=loop
                    )
                    rowwise_results.append(result)
                    graphs[ROWWISE, policy] = entry
                    if budgets is None and loops_all and not entry.loops:
                        chosen = model.budgets  # it could not be looped: each budget keeps a graph of its own
                for budget in chosen:
                    say(f"exporting budget {budget} ({policy})")
                    sg = serving_graph(model, budget, policy, unflatten=compose)
                    result, entry = _export_graph(
                        sg, budget, policy, temp, store, known, library, quantizer=quantizer, fuse_ort=fuse_ort
                    )
                    results.append(result)
                    graphs[budget, policy] = entry
            one_graph = functools.partial(
                _export_graph,
                directory=temp,
                store=store,
                known=known,
                library=library,
                quantizer=quantizer,
                fuse_ort=fuse_ort,
            )
            verify_results, verify = export_verify_graphs(model, targets, one_graph, compose=compose, say=say)
            auto_results, auto = export_adaptive_graphs(model, auto_targets, one_graph, compose=compose, say=say)
        finally:
            store.close()
        if model.tokenizer is not None:  # so `looptool run` can encode prompts from the engine alone
            model.tokenizer.save_pretrained(temp)
        functions = library.fusions() if library else {}
        manifest = export_manifest(model, temp, store, graphs, functions, ort_fusions, verify, auto)
        manifest.quantization = quantizer.describe() if quantizer is not None else None
        manifest.write(temp)
        t_validate = time.perf_counter()
        if validate:
            say("validating with onnxruntime")
            diffs = validate_engine(model, temp, atol=atol, quantized=quantize)
            for r in [*results, *rowwise_results]:
                r.max_abs_diff = diffs[r.budget, r.kv]
                graphs[r.budget, r.kv].max_abs_diff = r.max_abs_diff
            for r in verify_results:
                r.max_abs_diff = verify[r.budget, r.kv].max_abs_diff = diffs[r.budget, r.kv, VERIFY]
            for r, (rule, policy) in zip(auto_results, auto_targets):
                r.max_abs_diff = auto[rule, policy].max_abs_diff = diffs[ADAPTIVE, policy, rule]
            manifest.write(temp)
        t_validate = time.perf_counter() - t_validate
        graph_bytes = sum(p.stat().st_size for p in temp.iterdir() if p.name != WEIGHTS)
        bodies = list(library.bodies.values()) if library else []
        report = ExportReport(
            directory=str(final),
            budgets=results,
            weights_bytes=(temp / WEIGHTS).stat().st_size,
            graph_bytes=graph_bytes,
            parameter_bytes=model.dims().param_bytes,
            seconds=time.perf_counter() - t0,
            layer_functions=sum(b.function is not None for b in bodies),
            layer_seconds=sum(b.seconds for b in bodies),
            validation_seconds=t_validate,
            fusions=functions,
            rowwise=rowwise_results,
            verify=verify_results,
            adaptive=auto_results,
        )
        commit_output_dir(final, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    n = len(results) + len(rowwise_results) + len(verify_results) + len(auto_results)
    log.info("exported %d graphs to %s (%.3f x parameter bytes)", n, final, report.disk_ratio)
    return report


def _check_exportable(model, dtypes: tuple[torch.dtype, ...] = _SUPPORTED_DTYPES) -> None:
    """On the CPU and in a dtype the target runs (bf16 only for TensorRT: onnxruntime's CPU
    kernels lack it)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ExportError(f"the model is on {param.device}; load it on the CPU (looptool.load(dir)) before exporting.")
    if param.dtype not in dtypes:
        raise ExportError(
            f"ONNX export supports float32 and float16 models, this one is {param.dtype}; convert with "
            "dtype=torch.float32.",
            parameter="dtype",
            rerun="convert",
        )


def _model_tensor_digests(model) -> dict[str, str]:
    """sha256 of every tensor the budget paths read, by name (to tell weights from
    exporter-made constants)."""
    from looptool.storage.tensors import graph_tensors

    out: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, t in graph_tensors(model).items():
        if id(t) not in seen:
            seen[id(t)] = hashlib.sha256(to_numpy(t).tobytes()).hexdigest()
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
    extras = example_extras(sg, batch)
    args = [ids, torch.ones(batch, capacity, dtype=mask_dtype), steps.expand(batch, step), steps, *extras, *caches]
    b, t, s = Dim("batch"), Dim("step"), Dim("capacity")
    shapes = ({0: b, 1: t}, {0: b, 1: s}, {0: b, 1: t}, {0: t}, *[{0: b}] * len(extras), *[{0: b, 2: s}] * len(caches))
    return args, shapes


@contextlib.contextmanager
def faster_exporter() -> Iterator[None]:
    """``torch.onnx.export`` under two of :mod:`looptool.core.compat`'s patches of its internals
    (each behind its version check): :func:`~looptool.core.compat.reused_torchlib_registry` and
    :func:`~looptool.core.compat.decompose_only_what_onnx_lacks`, and the exporter's torchvision
    notice dropped (:func:`~looptool.core.compat.without_torchvision_notice`)."""
    with reused_torchlib_registry(), decompose_only_what_onnx_lacks(), without_torchvision_notice():
        yield


def export_program(
    gm: torch.fx.GraphModule,
    args,
    dynamic_shapes,
    *,
    input_names=None,
    output_names=None,
    extra_translations: dict | None = None,
    fake_tensor_cache: bool = True,
):
    """``torch.onnx.export`` (dynamo, no exporter optimisation, looptool's translations), in
    eval mode (serving graphs are inference graphs; ``gm``'s mode is restored after), under
    :func:`looptool.core.tracing.fast_tracing` (``fake_tensor_cache=False`` for a small graph
    such as one layer body, which traces faster without it)."""
    from looptool.backends.onnx.functions import OPSET, translation_table

    training = gm.training
    gm.eval()
    try:
        with warnings.catch_warnings(), fast_tracing(fake_tensor_cache=fake_tensor_cache), faster_exporter():
            # the exporter warns that inputs share axis names
            warnings.filterwarnings("ignore", message=".*axis name.*", category=UserWarning)
            # and torch.export's own pytree deprecation notice (torch's code, not the user's)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            return torch.onnx.export(
                gm,
                tuple(args),
                dynamo=True,
                external_data=True,
                optimize=False,
                opset_version=OPSET,
                dynamic_shapes=tuple(dynamic_shapes),
                input_names=input_names,
                output_names=output_names,
                custom_translation_table={**translation_table(), **(extra_translations or {})},
                verbose=False,
            )
    finally:
        gm.train(training)


def _export_graph(
    sg,
    budget: int | str,
    policy: str,
    directory: Path,
    store: WeightStore,
    known: dict[str, str],
    library,
    quantizer: Quantizer | None = None,
    fuse_ort: bool = False,
    file: str | None = None,
    loop: bool = False,
):
    """Export one serving graph (composed from layer functions when ``library`` is given),
    quantize its linears' weights (``quantizer``), externalise its weights and save it;
    returns its report and manifest entry (``file``: its file name, default the budget's).
    ``loop``: a composed row-wise graph gets its window as ``Loop`` nodes where the plan has one
    (:mod:`looptool.backends.onnx.looped`)."""
    import onnx_ir as ir

    t0 = time.perf_counter()
    onnx_model, calls, ort_ops, loops = None, {}, {}, {}
    if library is not None:
        try:
            onnx_model, calls, ort_ops, loops = _compose(sg, library, loop=loop and sg.rowwise)
        except Exception as exc:  # noqa: BLE001  (any failure of the composed route: trace flat instead)
            log.warning(
                "budget %s (%s): composing from layer functions failed (%s: %s); exporting it flat",
                budget,
                policy,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
    if onnx_model is None:
        args, shapes = serving_example(sg)
        onnx_model = _run_exporter(
            lambda: export_program(sg.module, args, shapes, input_names=sg.input_names, output_names=sg.output_names),
            budget,
        ).model
    outline_looptool_functions(onnx_model)
    if not calls:  # a composed graph is only calls of bodies, each simplified when it was exported
        simplify(onnx_model)
        if fuse_ort:
            ort_ops = rule_counts(fuse_for_ort(onnx_model))
    fused = dict(sg.fused)
    if quantizer is not None:  # after the fusions: it reads their FusedMatMul linears too
        fused.update({op: n for op, n in quantizer.rewrite(onnx_model).items() if n})
        known = {**known, **quantizer.tensors}  # its tensors are model tensors too (stored however small)
    names = externalize(onnx_model, directory, store, known, budget)
    strip_metadata(onnx_model)
    path = directory / (file or budget_file(budget, policy))
    ir.save(onnx_model, path)
    result = BudgetExport(
        budget=budget,
        kv=policy,
        file=path.name,
        bytes=path.stat().st_size,
        seconds=time.perf_counter() - t0,
        fused=fused,
        composed=bool(calls),
        ort_ops=ort_ops,
        layer_calls=calls,
        form="loop" if loops else "unrolled",
    )
    entry = GraphEntry(
        file=path.name,
        cache=sg.layout,
        menu=tuple(sg.menu) if sg.rowwise or sg.adaptive else None,
        initializers=names,
        fused=fused,
        composed=bool(calls),
        layer_calls=calls,
        kv_bytes_per_token=sg.layout.bytes_per_token(),
        loops=loops,
    )
    return result, entry


def _compose(sg, library, loop: bool = False) -> tuple[object, dict[str, int], dict[str, int], dict[int, int]]:
    """The serving graph as calls of functions, each distinct body exported once; returns
    the model, the calls per body, the onnxruntime fused ops of all calls together and, with
    ``loop``, the window layers it looped (layer -> the smallest budget running its second
    pass; empty where it has none or they could not be looped: the graph stays unrolled)."""
    from looptool.backends.onnx.functions import OPSET
    from looptool.backends.onnx.layers import LAYER_DOMAIN, ComposeError
    from looptool.backends.onnx.looped import loop_window

    comp = library.partition(sg)
    library.record_examples(comp, sg)
    library.export_functions(
        comp, functools.partial(_body_model, ort_fusions=library.ort_fusions, fuse_ort=library.fuse_ort)
    )
    onnx_model = library.assemble(comp, sg, {"": OPSET})
    loops: dict[int, int] = {}
    if loop:
        try:
            loops = loop_window(onnx_model, comp)
        except ComposeError as exc:  # raised before the graph changes: it stays as assembled
            log.warning("the row-wise graph keeps every pass unrolled (%s)", exc)
    calls: dict[str, int] = {}
    ort_ops: dict[str, int] = {}
    bodies = {unit.body.name: unit.body for unit in comp.units}
    for node in onnx_model.graph.all_nodes():  # a looped window layer: one call, in its Loop's body
        if node.domain == LAYER_DOMAIN:
            calls[node.op_type] = calls.get(node.op_type, 0) + 1
            for rule, n in rule_counts(bodies[node.op_type].fusions).items():
                ort_ops[rule] = ort_ops.get(rule, 0) + n
    return onnx_model, calls, ort_ops, loops


def _body_model(module, example, shapes, *, ort_fusions: bool = False, fuse_ort: bool = False):
    """One body exported and tidied (fused ops outlined, shape arithmetic folded, reshape targets
    made constant: :func:`~looptool.backends.onnx.optimize.constant_reshapes`), lowered to
    onnxruntime's fused ops when ``fuse_ort`` (counts keyed ``ort.<rule>``), with onnxscript's
    transformer fusions when ``ort_fusions``; returns ``(model, fusion counts)``."""
    program = export_program(module, example, shapes, fake_tensor_cache=False)  # one body: small
    model = program.model
    outline_looptool_functions(model)
    simplify(model)
    counts: dict[str, int] = {}
    if fuse_ort:
        counts.update({FUSE_PREFIX + k: v for k, v in fuse_for_ort(model).items()})
    if ort_fusions:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model, more = optimize_for_ort(model)
        counts.update(more)
    constant_reshapes(model)  # standard ONNX (every backend reads it), after the pattern rewrites
    strip_metadata(model)
    return model, {k: v for k, v in sorted(counts.items()) if v}  # sorted as a cached entry's are


def _run_exporter(call, budget: int):
    try:
        return call()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed on budget {budget} ({type(exc).__name__}: {first}).") from exc
