"""Every way a looped model is made: :func:`convert` (from a source model, in one call),
:func:`load` (from a saved directory), :func:`cast` (another dtype) and :func:`rebuild` (the
structure from a config and a recipe, which both of those bind weights into).

Loading rebuilds the source architecture on ``meta``, captures it, replays the recipe,
retargets the device and binds the stored tensors (:mod:`looptool.storage.load` reads and
checks the files): no network, no weight materialised twice, bit-identical outputs. A weight
file whose sha256 differs from the one recorded is refused as corrupt (models saved before
checksums were recorded load unchecked; ``device="meta"`` reads no tensor data and skips the
check).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from pathlib import Path

import torch
from torch import nn

from looptool.capture import capture, capture_config, num_layers_of
from looptool.capture.sources import load_source
from looptool.capture.tokenizer_cache import load_tokenizer
from looptool.core.errors import CheckpointError, LooptoolError
from looptool.core.graph import dtype_from_str, float_dtype
from looptool.core.plan import LoopPlan, PrefixLoop, RecurrentLoop, plan_from_dict
from looptool.passes import PassManager
from looptool.passes.exit_gate import EXIT_GATE
from looptool.runtime.devices import check_dtype, resolve_device
from looptool.runtime.model import LoopedModel
from looptool.storage.load import (
    bind_weights,
    check_file_sizes,
    check_weights,
    read_looptool_json,
    read_weights,
    verify_files,
)
from looptool.storage.save import WEIGHTS
from looptool.storage.tensors import bind_tensors, graph_tensors
from looptool.storage.weights import WeightReader

log = logging.getLogger(__name__)

_PASS_OF_PLAN = {PrefixLoop: "prefix_loop", RecurrentLoop: "recurrent_loop"}


def plan_steps(plan: LoopPlan) -> list[tuple[str, dict]]:
    """The pass recipe that applies ``plan``."""
    try:
        return [(_PASS_OF_PLAN[type(plan)], plan.to_dict())]
    except KeyError:
        raise LooptoolError(f"{type(plan).__name__} is not a loop plan looptool can apply.") from None


def convert(
    source: nn.Module | str | os.PathLike,
    plan: LoopPlan | None = None,
    *,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    exit_gate: bool = False,
) -> LoopedModel:
    """Capture ``source`` and loop it according to ``plan`` (default: ``PrefixLoop()``);
    ``exit_gate=True`` also adds the learned exits ``budget="auto"`` reads under
    ``exit_rule="gate"`` (:mod:`looptool.passes.exit_gate`; no budget path reads them).

    ``source`` is a Hugging Face causal LM object (used as is: its parameters become the
    looped model's, nothing is copied), a model directory, a Hub model id (``org/name`` or
    ``org/name@revision``, through the Hugging Face cache), a ``.gguf`` file or ``"smollm2"``;
    ``dtype``/``device`` apply when looptool loads the source itself. Right after conversion
    every budget computes exactly what the source computes.
    """
    if isinstance(source, nn.Module):
        model = source
    else:
        loaded = load_source(source, dtype=dtype, device=device)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
    plan = plan or PrefixLoop()
    if hasattr(model, "config"):  # validate the plan before the (slower) capture
        plan = plan.resolve(num_layers_of(model.config))
    lg = capture(model)
    lg = PassManager(plan_steps(plan) + ([(EXIT_GATE, {})] if exit_gate else []))(lg)
    return LoopedModel(lg, tokenizer=tokenizer)


def add_exit_gates(model: LoopedModel) -> LoopedModel:
    """``model`` with learned exit heads added (the ``exit_gate`` pass, recorded in its recipe):
    a new LoopedModel over the same source tensors and the same ``loop.*`` parameter objects,
    plus the heads at their initial values; every budget computes what it did."""
    if model.exit_gates:
        return model
    lg = PassManager([(EXIT_GATE, {})])(model.layer_graph)
    new = LoopedModel(lg, tokenizer=model.tokenizer)
    for name, p in model.new_parameters():  # the existing loop.* parameters, shared, not copied
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner), leaf, p)
    return new.train(model.training)


def rebuild(
    config, recipe, *, dtype: torch.dtype, device: str, attn_implementation: str | None = None, tokenizer=None
) -> LoopedModel:
    """The structure of a looped model with weights on ``meta``: the source architecture of
    ``config`` built on ``meta`` in ``dtype``, captured, its graph retargeted to ``device`` and
    the ``recipe`` of passes replayed. Binding the weights is the caller's (load, cast)."""
    lg = capture_config(config, dtype, attn_implementation)  # served without building it after the first time
    # retargeted before the recipe: the captured graph is copied once, not every budget path
    # the recipe builds (the passes read the device from ``lg.source``)
    lg = PassManager([("retarget_device", {"to": str(device)})])(lg)
    lg = PassManager([(name, cfg) for name, cfg in recipe])(lg)
    return LoopedModel(lg, tokenizer=tokenizer)


def load(directory: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | str | None = None) -> LoopedModel:
    """Rebuild a saved looped model on ``device`` (bit-identical to the one saved); the
    weights are read straight onto the device (``"auto"``: cuda when available).

    Called inside ``torch.inference_mode()`` it still returns ordinary tensors (a model that
    can be trained later; the weights are read on a worker thread, outside that mode).

    ``dtype`` (default: the saved dtype) rebuilds the graphs in another floating-point dtype
    and casts each weight to it as it is read, e.g. an fp16 copy of an fp32 model for
    deployment (captured graphs are dtype-specialised, so this is a rebuild, not ``.to``).

    ``device="meta"`` rebuilds the structure only (plan, graphs, shapes) without reading
    weights, which is what ``looptool inspect`` needs.
    """
    with torch.inference_mode(False):
        return _load(directory, device, dtype)


def _load(directory: str | os.PathLike, device: str, dtype: torch.dtype | str | None) -> LoopedModel:
    """:func:`load`'s work, outside inference mode."""
    import transformers

    device = str(resolve_device(device))
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"'{directory}' is not a directory; pass the folder written by save_pretrained or looptool convert."
        )
    meta = read_looptool_json(directory)
    weights = directory / WEIGHTS
    if not weights.exists():
        raise CheckpointError(f"'{directory}' has no {WEIGHTS}; the save was incomplete, re-save the model.")
    reader = None
    if torch.device(device).type == "cpu":  # read and hashed in one pass, beside the tokenizer
        check_file_sizes(directory, meta)
        verify_files(directory, meta, skip=(WEIGHTS,))
        reader = WeightReader(weights)
    elif torch.device(device).type != "meta":  # meta (inspect) reads only headers: stays cheap
        verify_files(directory, meta)  # before the slow rebuild: a corrupt file fails fast
    plan_from_dict(meta["plan"])  # refuses unknown kinds / versions with a clear message
    src = meta["source"]
    saved = dtype_from_str(src["dtype"])
    dtype = saved if dtype is None else float_dtype(dtype)
    check_dtype(torch.device(device), dtype)  # e.g. a bf16 checkpoint on a GPU without bf16
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(f"config.json in '{directory}' could not be read ({exc}).") from exc
    tokenizer = None
    if any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = load_tokenizer(directory)  # served from the tokenizer cache after the first load
    with _no_gc():
        model = rebuild(
            config,
            meta["recipe"],
            dtype=dtype,
            device=device,
            attn_implementation=src.get("attn_implementation"),
            tokenizer=tokenizer,
        )
    if torch.device(device).type == "meta":  # structure only (looptool inspect): header checked, no data read
        check_weights(model, weights, cast=dtype != saved)
        return model.eval()
    # joined only now, so the read and the hash overlap the rebuild (file reads and hashlib
    # release the GIL): warm SmolLM2 loads, 8 alternating fresh processes each, median 3.73 s
    # when joined before the rebuild, 3.34 s now. A file of the recorded size whose bytes
    # differ is therefore refused after the rebuild; one of another size, before it.
    loaded = None if reader is None else read_weights(reader, meta)
    bind_weights(model, weights, device=device, trainable=meta.get("trainable"), cast=dtype != saved, loaded=loaded)
    return model.eval()


@contextlib.contextmanager
def _no_gc():
    """The cyclic garbage collector paused: a rebuild creates some 10^5 graph objects, and the
    full collections they trigger cost about a quarter of a warm SmolLM2 load (the rebuild
    frees no cycles worth collecting; collection resumes, and catches up, right after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cast(model: LoopedModel, dtype: torch.dtype | str) -> LoopedModel:
    """A copy of ``model`` whose graphs and weights are in ``dtype``; ``model`` is untouched.

    A captured graph is specialised to its dtype, so an in-place ``model.to(dtype)`` is
    refused; this recaptures the source architecture in ``dtype`` on ``meta``, replays the
    model's recipe and binds cast copies of its tensors (each tied tensor cast once; tensors
    the new graphs keep in another dtype, such as fp32 rotary frequencies, keep it, and a
    tensor whose dtype does not change is shared, not copied). Trainability is kept.
    Returns ``model`` itself when it is already in ``dtype``.
    """
    source = model.layer_graph.source
    dtype = float_dtype(dtype)
    if dtype_from_str(source.dtype) == dtype:
        return model
    device = source.device
    new = rebuild(
        model.config,
        model.recipe,
        dtype=dtype,
        device=device,
        attn_implementation=source.attn_implementation,
        tokenizer=model.tokenizer,
    )
    old = graph_tensors(model)
    missing = sorted(set(graph_tensors(new)) - set(old))
    if missing:  # the replayed recipe must give the same tensors; anything else is a looptool bug
        raise LooptoolError(
            f"the {dtype} rebuild of this model has tensors the model lacks ({missing[:3]}); "
            "please report this as a bug."
        )
    cast_of: dict[int, torch.Tensor] = {}

    def tensor_for(name: str, placeholder: torch.Tensor) -> torch.Tensor:
        t = old[name]
        if id(t) not in cast_of:
            value = t.detach()
            cast_of[id(t)] = value if value.dtype == placeholder.dtype else value.to(placeholder.dtype)
        return cast_of[id(t)]

    trainable = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    bind_tensors(new, tensor_for, trainable=trainable)
    new.activation_checkpointing = model.activation_checkpointing
    new.train(model.training)
    return new
