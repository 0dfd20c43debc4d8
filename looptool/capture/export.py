"""``torch.export`` of a source model: the full forward (dynamic batch and sequence) and one
cached decode step over a caller-owned static KV cache."""

from __future__ import annotations

import copy
import inspect

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from looptool.capture import cache as capture_cache
from looptool.capture import programs
from looptool.capture.facts import kv_shape_of, num_layers_of
from looptool.core.errors import CaptureError
from looptool.core.graph import copy_graph, device_swap, retarget_bodies, shared_graph_module
from looptool.core.tracing import fast_tracing

INPUT_NAMES = ("input_ids", "attention_mask")
# A forward export of fewer layers than this traces faster without FakeTensor's dispatch cache;
# a decode step always does (measured: :func:`looptool.core.tracing.fast_tracing`).
FAKE_CACHE_MIN_LAYERS = 8
# the example sizes each export traces with (a field of its capture-cache key, :func:`export_options`)
SOURCE_SIZES = {"seq_len": 8, "batch": 2}
DECODE_SIZES = {"seq_len": 3, "cache_len": 8, "batch": 2}


def export_options(decode: bool = False, **sizes: int) -> dict:
    """The capture options an export is keyed by in the capture cache: ``decode`` and its
    example ``sizes`` (default: :data:`SOURCE_SIZES` or :data:`DECODE_SIZES`)."""
    return {"decode": decode, **(DECODE_SIZES if decode else SOURCE_SIZES), **sizes}


def export_key(model: nn.Module, *, decode: bool = False) -> dict | None:
    """The capture-cache key ``capture(model, decode=decode)`` exports under (None: not cached)."""
    return capture_cache.key_of(model, export_options(decode))


def export_source(
    model: nn.Module, seq_len: int = SOURCE_SIZES["seq_len"], batch: int = SOURCE_SIZES["batch"]
) -> fx.GraphModule:
    """``torch.export`` the model's full-sequence forward (dynamic batch/sequence), unlifted.

    The returned GraphModule's parameters and buffers are the model's own tensor objects.

    A model on a real device is exported through its weightless twin on ``meta`` (the same
    architecture, config, dtype and tensors, built as ``looptool.load`` builds one) when the
    twin provably matches it (:func:`looptool.capture.cache.same_but_device`): the program is
    the one a load of the saved model captures, so converting a model and later loading it
    share one capture-cache entry, and the graph does not depend on the device it was captured
    on. The twin's program is rebuilt with the model's own tensors and its device constants
    retargeted to the model's device. Any other model (hooks, a patched ``forward``, a class or
    tensors the twin does not reproduce) is exported as it is.
    """
    options = export_options(False, seq_len=seq_len, batch=batch)
    twin = _meta_twin(model)
    target = model if twin is None else twin
    device = next(target.parameters()).device
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    dims = {0: Dim.AUTO, 1: Dim.AUTO}
    gm = _export(
        target,
        {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False},
        {"input_ids": dims, "attention_mask": dims, "use_cache": None},
        capture_cache.key_of(target, options),
        fake_tensor_cache=_layers(target) >= FAKE_CACHE_MIN_LAYERS,
    )
    return gm if twin is None else _bound_to(gm, twin, model)


def _layers(model: nn.Module) -> int:
    """The model's decoder layer count (0 when its config does not say)."""
    try:
        return num_layers_of(model.config)
    except (AttributeError, CaptureError):  # no config, or one without a layer count
        return 0


def _meta_twin(model: nn.Module) -> nn.Module | None:
    """The model's weightless twin on ``meta``, or None (on ``meta`` already, or no twin
    provably the same but for the device)."""
    param = next(model.parameters(), None)
    config = getattr(model, "config", None)
    if param is None or config is None or param.device.type == "meta" or capture_cache.uncacheable(model):
        return None  # (hooks or a patched forward: no twin could match it, so none is built)
    try:
        twin = build_skeleton(copy.deepcopy(config), param.dtype, getattr(config, "_attn_implementation", None)).train(
            model.training
        )
    except Exception:  # noqa: BLE001  (an architecture from_config cannot build: export the model itself)
        return None
    return twin if type(twin) is type(model) and capture_cache.same_but_device(twin, model) else None


def _bound_to(gm: fx.GraphModule, twin: nn.Module, model: nn.Module) -> fx.GraphModule:
    """``gm`` (exported from ``twin``) rebuilt with ``model``'s own tensors, its ``meta``
    device constants (and its higher-order ops' bodies') retargeted to ``model``'s device."""
    own = capture_cache.own_tensors(model)
    bound = programs.build(programs.program_of(gm, capture_cache.own_tensors(twin)), own)
    transform = device_swap(torch.device("meta"), next(model.parameters()).device)
    graph = copy_graph(bound.graph, transform)
    graph._codegen = bound.graph._codegen  # the unlifted module's calling convention
    out = shared_graph_module(bound, graph, lazy=True)
    retarget_bodies(out, transform)
    return out


def export_decode_step(
    model: nn.Module,
    seq_len: int = DECODE_SIZES["seq_len"],
    cache_len: int = DECODE_SIZES["cache_len"],
    batch: int = DECODE_SIZES["batch"],
) -> fx.GraphModule:
    """``torch.export`` one cached step of the model (prefill or decode), unlifted.

    The step is the way transformers' export-with-static-cache wrappers run a model: a
    ``StaticCache`` whose layers hold caller-owned tensors, written in place with
    ``index_copy_`` at ``cache_position`` (``T`` consecutive slots), and attention over
    all ``cache_len`` slots masked by a ``[batch, cache_len]`` attention mask. Inputs:
    ``input_ids [B, T]``, ``attention_mask [B, S]``, ``position_ids [B, T]``,
    ``cache_position [T]`` and ``2 * layers`` caches ``[B, kv_heads, S, head_dim]``
    (layer ``i``: keys ``caches_{2i}``, values ``caches_{2i+1}``); output: logits.
    """
    key = capture_cache.key_of(model, export_options(True, seq_len=seq_len, cache_len=cache_len, batch=batch))
    config = model.config.get_text_config()
    n_layers = num_layers_of(config)
    kv_heads, head_dim = kv_shape_of(config)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    caches = [
        torch.zeros(batch, kv_heads, cache_len, head_dim, dtype=dtype, device=device) for _ in range(2 * n_layers)
    ]
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, cache_len, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq_len, device=device).expand(batch, seq_len),
        "cache_position": torch.arange(seq_len, device=device),
        "caches": caches,
    }
    # Named dims shared by all inputs: one batch, one step length, one cache length (per-input
    # AUTO dims would give every cache its own symbols, and export time grows with them).
    b, t, s = Dim("batch"), Dim("step"), Dim("cache_len")
    shapes = {
        "input_ids": {0: b, 1: t},
        "attention_mask": {0: b, 1: s},
        "position_ids": {0: b, 1: t},
        "cache_position": {0: t},
        "caches": [{0: b, 2: s}] * len(caches),
    }
    forward = type(model).forward
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

    def step(input_ids, attention_mask, position_ids, cache_position, caches):
        cache = _bind_static_cache(config, caches, cache_position)
        out = forward(
            model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_kw: cache},
        )
        return out.logits

    model.forward = step  # export traces the step with the model's own parameter names
    try:
        return _export(model, inputs, shapes, key, fake_tensor_cache=False)
    finally:
        del model.forward


class _CallerOwnedLayer(StaticLayer):
    """A static cache layer over caller-owned tensors that writes the step's keys/values
    at ``cache_position`` (no in-place position counter, so a layer copied by a looping
    pass writes the same slots as the original)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor):
        super().__init__(keys.shape[2])
        self.keys, self.values, self.positions = keys, values, cache_position
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = cache_position[0]  # the mask's query offset
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values


def _bind_static_cache(config, caches: list[torch.Tensor], cache_position: torch.Tensor) -> StaticCache:
    """A transformers ``StaticCache`` whose layers write into ``caches`` (full-length layers
    throughout: sliding windows are applied by the mask, as the export wrappers do)."""
    cache = StaticCache(config=config, max_cache_len=caches[0].shape[2])
    for i in range(len(cache.layers)):
        cache.layers[i] = _CallerOwnedLayer(caches[2 * i], caches[2 * i + 1], cache_position)
    return cache


def _export(
    model: nn.Module, kwargs: dict, dynamic_shapes: dict, key: dict | None = None, *, fake_tensor_cache: bool = True
) -> fx.GraphModule:
    """The unlifted export of ``model`` (served by the capture cache under ``key``, if any),
    traced under :func:`looptool.core.tracing.fast_tracing`."""

    def export() -> torch.export.ExportedProgram:
        try:
            with fast_tracing(fake_tensor_cache=fake_tensor_cache):
                try:
                    return torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
                except torch._dynamo.exc.UserError as exc:
                    if exc.error_type is not torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
                        raise
                    # Some torch versions cannot prove guards that hold for every size (torch
                    # 2.11 on CUDA: ``min(64*s, 192*s) == 64*s`` from the caches' strides), and
                    # named dims turn such a guard into an error. Automatic dims accept it.
                    shapes = _automatic_dims(dynamic_shapes)
                    return torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False)
        except Exception as exc:  # torch.export raises many types; say which model failed
            raise CaptureError(
                f"torch.export could not capture {type(model).__name__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})."
            ) from exc

    return capture_cache.exported_module(model, key, export)


def _automatic_dims(shapes):
    """``shapes`` (export's ``dynamic_shapes``) with every named dim replaced by ``Dim.AUTO``."""
    if isinstance(shapes, dict):
        return {k: _automatic_dims(v) for k, v in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        return type(shapes)(_automatic_dims(v) for v in shapes)
    return shapes if shapes is None or shapes is Dim.AUTO or shapes is Dim.STATIC else Dim.AUTO


def build_skeleton(config, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """The source architecture of ``config`` on ``meta`` (no weights), in eval mode."""
    import transformers

    kwargs: dict = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()
