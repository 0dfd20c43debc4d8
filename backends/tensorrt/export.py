"""Lower budget paths to TensorRT: one engine per budget and KV policy, one copy of the
weights on the GPU.

``export_tensorrt`` writes an ONNX engine directory (:mod:`looptool.backends.onnx.export`, the
same serving graphs and ``weights.bin``) and adds, per graph, its *TensorRT variant*
``budget_<k>.<policy>.trt.onnx``:

* layer functions inlined (TensorRT's parser sees plain nodes and plugin nodes only);
* every ``looptool``-domain node carries ``plugin_namespace="looptool"`` and
  ``plugin_version``, so the parser hands it to the plugin of the same name instead of
  inlining its function body (the bodies stay, so onnxruntime still runs the variant), and
  ``aot=1``: each plugin is one Triton kernel whose PTX the engine holds, so no Python runs
  at inference time;
* ``AdaptiveDelta`` split into the gate GEMM (TensorRT's own ``Gemm``) and the
  ``AdaptiveDeltaUpdate`` plugin (one elementwise kernel);
* ``Moe`` split into ``MoeAlign``, ``MoeGateUp``, ``MoeDown`` and ``MoeCombine``
  (:mod:`looptool.backends.tensorrt.moe`: routing, two grouped GEMMs, the weighted sum);
* every weight a named *network input* instead of an initializer: engines hold no weights,
  and :class:`Runtime` uploads ``weights.bin`` once and binds the same device pointers into
  every budget's execution context.

Then, where TensorRT and a GPU exist, :func:`build_engines` builds
``budget_<k>.<policy>.<precision>.engine`` with two optimisation profiles (prefill: any
step length; decode: one token); with ``build_on_target=True`` it writes everything except
the engines plus ``build.py``, which builds them on the target machine.

What has run where is stated in the README: the variants, their onnxruntime equivalence and
the AOT PTX are tested on CPU in CI; engine building and :class:`Runtime` need TensorRT,
which none of the project's machines has.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from looptool.backends.errors import ExportError
from looptool.backends.interface import BUDGETS, INPUTS, CacheLayout
from looptool.backends.manifest import (
    WEIGHTS,
    BuiltOn,
    FileEntry,
    Manifest,
    Plugins,
    Profiles,
    TensorRTSection,
    VariantEntry,
)
from looptool.backends.onnx.format import budget_file
from looptool.backends.tensorrt.kernels import AOT_OPS
from looptool.backends.tensorrt.moe import split_moe
from looptool.core.dtypes import DTYPES, named, raw_numpy
from looptool.core.errors import require_extra
from looptool.core.graph import ROWWISE
from looptool.core.install import install_command
from looptool.storage.files import sha256_file

log = logging.getLogger(__name__)

PLUGIN_NAMESPACE = "looptool"
PLUGIN_VERSION = "1"
PRECISIONS = tuple(d.short for d in DTYPES if d.torch in (torch.float32, torch.float16, torch.bfloat16))
BUILD_SCRIPT = "build.py"


def trt_graph_file(budget: int | str, kv: str) -> str:
    """The TensorRT variant of ``budget_<k>.<policy>.onnx`` (or ``rowwise.<policy>.onnx``)."""
    return budget_file(budget, kv).removesuffix(".onnx") + ".trt.onnx"


def engine_file(budget: int | str, kv: str, precision: str) -> str:
    return budget_file(budget, kv).removesuffix(".onnx") + f".{precision}.engine"


def check_precision(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ExportError(f"TensorRT precision {precision!r} is not supported; choose one of {', '.join(PRECISIONS)}.")
    return named(precision).torch


def require_tensorrt(purpose: str):
    """``import tensorrt``, or one sentence saying how to get it."""
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # the bindings wheel alone fails with OSError on missing libraries
        raise ExportError(
            f"{purpose} needs TensorRT, which is not installed here ({type(exc).__name__}: {exc}); "
            f"{install_command('tensorrt')} on a machine with an NVIDIA GPU, or export with build_on_target=True.",
            parameter="build_on_target",
        ) from exc
    return tensorrt


# ---------------------------------------------------------------------------- the TensorRT variant
def tensorrt_variant(model):
    """The TensorRT-flavoured copy of one serving graph (an ``onnx.ModelProto`` loaded
    without its external data); returns ``(variant, info)`` with the weight inputs, in
    order, and the plugin nodes per op."""
    import onnx
    from onnx import helper, inliner

    from looptool.backends.onnx.functions import DOMAIN, AdaptiveDeltaUpdate

    layer_functions = [(f.domain, f.name) for f in model.functions if f.domain != DOMAIN]
    if layer_functions:
        model = inliner.inline_selected_functions(model, layer_functions, exclude=False)
    else:
        model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    _split_adaptive_delta(graph, DOMAIN)
    split_moe(model, DOMAIN)
    if any(n.domain == DOMAIN and n.op_type == "AdaptiveDeltaUpdate" for n in graph.node):
        model.functions.append(AdaptiveDeltaUpdate.to_function_proto())
    used = {(n.domain, n.op_type) for n in graph.node}
    kept_functions = [f for f in model.functions if (f.domain, f.name) in used]
    del model.functions[:]
    model.functions.extend(kept_functions)
    plugins: Counter = Counter()
    for node in graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type not in AOT_OPS:
            raise ExportError(
                f"the graph has a looptool node {node.op_type!r} with no TensorRT plugin; export with the "
                "onnx backend (export_onnx) instead.",
                parameter="backend",
            )
        node.attribute.extend(
            [
                helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                helper.make_attribute("plugin_version", PLUGIN_VERSION),
            ]
        )
        if node.op_type in AOT_OPS:
            node.attribute.append(helper.make_attribute("aot", 1))
        plugins[node.op_type] += 1
    weights = []
    kept = []
    for init in graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
            weights.append(init.name)
        else:
            kept.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model, {"weight_inputs": weights, "plugins": dict(plugins)}


def _split_adaptive_delta(graph, domain: str) -> None:
    """``AdaptiveDelta(s, r, s~, W, b, γ, e)`` → ``z = Gemm(s~ as 2-D, W, b, transB=1)`` reshaped
    back, then ``AdaptiveDeltaUpdate(s, r, z, γ, e)``; TensorRT runs the GEMM, the plugin the rest."""
    from onnx import helper

    nodes = list(graph.node)
    out = []
    for i, node in enumerate(nodes):
        if not (node.domain == domain and node.op_type == "AdaptiveDelta"):
            out.append(node)
            continue
        s_prev, r, s_tilde, weight, bias, gamma, exit = node.input
        p = f"_trt_ad{i}_"
        out += [
            helper.make_node("Constant", [], [p + "m1"], value=helper.make_tensor(p + "m1v", 7, [1], [-1])),
            helper.make_node("Shape", [weight], [p + "in"], start=1, end=2),
            helper.make_node("Shape", [weight], [p + "out"], start=0, end=1),
            helper.make_node("Shape", [s_tilde], [p + "lead"], start=0, end=-1),
            helper.make_node("Concat", [p + "m1", p + "in"], [p + "flat_shape"], axis=0),
            helper.make_node("Reshape", [s_tilde, p + "flat_shape"], [p + "flat"]),
            helper.make_node("Gemm", [p + "flat", weight, bias], [p + "z2"], transB=1),
            helper.make_node("Concat", [p + "lead", p + "out"], [p + "z_shape"], axis=0),
            helper.make_node("Reshape", [p + "z2", p + "z_shape"], [p + "z"]),
            helper.make_node(
                "AdaptiveDeltaUpdate",
                [s_prev, r, p + "z", gamma, exit],
                list(node.output),
                domain=domain,
                name=(node.name or "AdaptiveDelta") + "_update",
            ),
        ]
    del graph.node[:]
    graph.node.extend(out)


def write_variants(directory: Path, manifest: Manifest) -> dict[int | str, dict[str, VariantEntry]]:
    """Write the TensorRT variant of every graph of ``manifest`` in ``directory``; returns
    their entries ``{budget: {policy: entry}}``, the row-wise graphs' under :data:`ROWWISE`."""
    import onnx

    entries: dict[int | str, dict[str, VariantEntry]] = {}
    for budget, policies in manifest.graphs.items():
        for policy, info in policies.items():
            model = onnx.load(str(directory / info.file), load_external_data=False)
            variant, meta = tensorrt_variant(model)
            name = trt_graph_file(budget, policy)
            onnx.save(variant, str(directory / name))
            entries.setdefault(budget, {})[policy] = VariantEntry(name, sha256_file(directory / name), **meta)
    return entries


def weight_arrays(directory: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """Every tensor of ``weights.bin`` by name, as read-only views into one mapping (bfloat16: its raw bits)."""
    mmap = np.memmap(directory / WEIGHTS, dtype=np.uint8, mode="r")
    return {
        name: mmap[t.offset : t.offset + t.length].view(raw_numpy(named(t.dtype))).reshape(t.shape)
        for name, t in manifest.weights.tensors.items()
    }


# ---------------------------------------------------------------------------- export
def export_tensorrt(
    model,
    output: str | os.PathLike,
    budgets: int | str | Iterable[int] | None = "all",
    *,
    kv: str | Iterable[str] = "per-loop",
    precision: str = "fp16",
    build_on_target: bool = False,
    max_batch: int = 8,
    max_prefill: int = 2048,
    max_capacity: int = 4096,
    compose: bool = True,
    rowwise: bool = True,
    overwrite: bool = False,
    validate: bool = True,
    on_progress: Callable[[str], None] | None = None,
):
    """Export ``model`` for TensorRT into ``output``: the ONNX engine directory plus a
    TensorRT variant of every graph (with ``rowwise``, the row-wise-budget graph's too: one
    engine serves every budget), ``build.py``, and (unless ``build_on_target``) the
    engines. Everything is checked before anything is written; a failure removes the output.

    ``precision`` is the engines' dtype: the model is exported in it (a cast copy where it
    differs). Validation with onnxruntime runs for fp32 and fp16 graphs (onnxruntime's CPU
    kernels lack bf16)."""
    from looptool.backends.onnx.export import export_onnx
    from looptool.storage.files import check_output_dir

    require_extra("tensorrt", "TensorRT export", "onnx", "onnxscript", "onnx_ir")
    dtype = check_precision(precision)
    for name, value in (("max_batch", max_batch), ("max_prefill", max_prefill), ("max_capacity", max_capacity)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{name} must be a positive integer, got {value!r}.")
    if max_prefill > max_capacity:
        raise ExportError(
            f"max_prefill ({max_prefill}) exceeds max_capacity ({max_capacity}); a prompt must fit the cache."
        )
    if not build_on_target:
        require_tensorrt("building TensorRT engines")
        if not torch.cuda.is_available():
            raise ExportError(
                "building TensorRT engines needs an NVIDIA GPU, and torch sees none here; "
                "export with build_on_target=True and run build.py on the GPU machine.",
                parameter="build_on_target",
            )
    final = check_output_dir(output, overwrite)
    say = on_progress or (lambda text: None)
    source = model
    if next(model.parameters()).dtype != dtype:  # graphs are dtype-specialised: rebuild, not .to()
        from looptool.runtime.convert import cast

        say(f"rebuilding a copy of the model in {precision}")
        source = cast(model, dtype)
    report = export_onnx(
        source,
        final,
        budgets,
        kv=kv,
        compose=compose,
        fuse_ort=False,  # onnxruntime's fused ops: TensorRT parses standard ONNX only
        rowwise=rowwise,
        loop=False,  # TensorRT builds each budget's unrolled graph (its loop layer is not used)
        overwrite=overwrite,
        validate=validate and precision != "bf16",
        on_progress=on_progress,
        _allow_bf16=True,
    )
    try:
        say("writing TensorRT variants")
        manifest = Manifest.read(final)
        manifest.tensorrt = TensorRTSection(
            precision,
            Plugins(PLUGIN_NAMESPACE, PLUGIN_VERSION, list(AOT_OPS)),
            Profiles(max_batch, max_prefill, max_capacity),
            write_variants(final, manifest),
        )
        manifest.write(final)
        (final / BUILD_SCRIPT).write_text(_BUILD_PY)
        if not build_on_target:
            build_engines(final, on_progress=say)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    return report


_BUILD_PY = '''"""Build this directory's TensorRT engines on the machine that will run them.

    pip install "looptool[tensorrt]"
    python build.py            # writes budget_<k>.<policy>.<precision>.engine next to this file
"""
from pathlib import Path

from looptool.backends.tensorrt.export import build_engines

if __name__ == "__main__":
    build_engines(Path(__file__).resolve().parent, on_progress=print)
'''


def profile_shapes(
    limits: Profiles, layout: CacheLayout, decode: bool, rowwise: bool = False
) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shapes of every dynamic input for the prefill or the decode profile
    under ``limits`` (``rowwise``: the row-wise graph, which also takes ``budgets [batch]``)."""
    batch, cap = limits.max_batch, limits.max_capacity
    step = (1, 1, 1) if decode else (1, min(128, limits.max_prefill), limits.max_prefill)
    b = (1, 1, batch)
    c = (step[0], max(step[1], min(cap, 512)), cap)
    shapes = {
        INPUTS[0]: tuple((b[i], step[i]) for i in range(3)),
        INPUTS[1]: tuple((b[i], c[i]) for i in range(3)),
        INPUTS[2]: tuple((b[i], step[i]) for i in range(3)),
        INPUTS[3]: tuple((step[i],) for i in range(3)),
        **({BUDGETS: tuple((b[i],) for i in range(3))} if rowwise else {}),
    }
    past, _ = layout.names()
    for pair, (key, value) in zip(layout.pairs, zip(past[0::2], past[1::2])):
        for name in (key, value):
            shapes[name] = tuple((b[i], pair.kv_heads, c[i], pair.head_dim) for i in range(3))
    return shapes


def build_engines(
    directory: str | os.PathLike, *, on_progress: Callable[[str], None] | None = None
) -> dict[int | str, dict[str, FileEntry]]:
    """Build ``budget_<k>.<policy>.<precision>.engine`` for every TensorRT variant in
    ``directory`` (strongly typed networks: the graph's dtype is the engine's), with a
    prefill profile (0) and a decode profile (1); records them in the manifest and returns
    their entries ``{budget: {policy: entry}}``."""
    trt = require_tensorrt("building TensorRT engines")
    from looptool.backends.tensorrt import plugins as trt_plugins

    say = on_progress or (lambda text: None)
    directory = Path(directory)
    manifest = Manifest.read(directory)
    section = manifest.tensorrt
    if section is None:
        raise ExportError(
            f"{directory} has no TensorRT variants; export it with the tensorrt backend (export_tensorrt).",
            parameter="backend",
        )
    trt_plugins.register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    engines: dict[int | str, dict[str, FileEntry]] = {}
    for budget, policies in section.graphs.items():
        for policy, info in policies.items():
            say(f"building {'the row-wise graph' if budget == ROWWISE else f'budget {budget}'} ({policy})")
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
            network = builder.create_network(flags)
            parser = trt.OnnxParser(network, logger)
            if not parser.parse_from_file(str(directory / info.file)):
                errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
                raise ExportError(f"TensorRT could not parse {info.file}: {errors}")
            config = builder.create_builder_config()
            layout = manifest.graphs[budget][policy].cache
            for decode in (False, True):
                profile = builder.create_optimization_profile()
                for name, (lo, opt, hi) in profile_shapes(section.profiles, layout, decode, budget == ROWWISE).items():
                    profile.set_shape(name, lo, opt, hi)
                config.add_optimization_profile(profile)
            plan = builder.build_serialized_network(network, config)
            if plan is None:
                raise ExportError(
                    f"TensorRT failed to build an engine for {info.file}; rerun with TensorRT's verbose log."
                )
            name = engine_file(budget, policy, section.precision)
            (directory / name).write_bytes(bytes(plan))
            engines.setdefault(budget, {})[policy] = FileEntry(
                name, sha256_file(directory / name), (directory / name).stat().st_size
            )
    major, minor = torch.cuda.get_device_capability()
    section.engines = engines
    section.built_on = BuiltOn(torch.cuda.get_device_name(), (major, minor), trt.__version__)
    manifest.write(directory)
    return engines
