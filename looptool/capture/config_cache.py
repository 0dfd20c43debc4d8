"""Captures of a config's architecture, served without building the architecture.

``looptool.load`` (and ``cast``) and the cached decode paths capture the source architecture
of a config on ``meta``: :func:`~looptool.capture.export.build_skeleton`, then
:func:`~looptool.capture.capture`. The capture cache (:mod:`looptool.capture.cache`) serves
the export, but building the skeleton imports the architecture's modeling module and with it
transformers' modeling utilities, ``torch._dynamo`` and scipy: 0.8 s of a 1.9 s warm load
of SmolLM2 in a fresh process. What else the capture reads from the skeleton is small, and
is recorded here when a skeleton is captured (:func:`record`), under a key made of the
config alone (:func:`key_of`):

* the capture-cache key of its export;
* its tensors: names, shapes, dtypes, kinds, ``requires_grad`` and which names share one;
* the paths of its decoder-layer list and output head;
* the attributes building it set on the config (the attention and experts implementations
  transformers chose), applied again when the record serves;
* the sha256 of the source files of its module classes.

:func:`served` then rebuilds the export from the capture cache's program on fresh ``meta``
tensors, and the caller runs the rest of the capture as it always does.

The key holds the config as the capture cache keys it and every attribute it holds (private
ones too: implementations an earlier build chose), its class, the dtype and attention implementation asked
for, whether it is the decode step, the default dtype, the torch / transformers / looptool /
Python versions and the source of looptool's capture package. A record whose module source
files changed since, or whose program the capture cache no longer holds, does not serve (the
skeleton is built and the record written again). Configs holding other configs and global
forward hooks are not cached. Records are small JSON files stored like every cache entry
(:data:`looptool.cache.CONFIGS`, ``$LOOPTOOL_CACHE/configs``; off with ``LOOPTOOL_CACHE=off``),
kept in process too.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from looptool.cache import CONFIGS, Store, caches, canonical, digest, enabled, file_sha256, sha256
from looptool.capture import cache as capture_cache
from looptool.capture.facts import layer_and_head_paths
from looptool.core.graph import dtype_from_str

log = logging.getLogger(__name__)


def _store() -> Store:
    """This process's record store (counts: "memory", "disk", "miss", "stale", "uncached", "dropped")."""
    return caches().configs


def key_of(config, dtype: torch.dtype, attn_implementation: str | None, decode: bool) -> dict | None:
    """The key of capturing ``config``'s architecture built in ``dtype`` with
    ``attn_implementation`` (None when it is not cached: the cache is off, global forward
    hooks are registered, or the config holds another config or a value JSON cannot hold)."""
    from torch.nn.modules import module as M

    if not enabled() or getattr(M, "_global_forward_hooks", None) or getattr(M, "_global_forward_pre_hooks", None):
        return None
    try:
        return json.loads(
            canonical(
                {
                    "format": CONFIGS.format,
                    "config_class": type(config).__module__ + "." + type(config).__qualname__,
                    "config": capture_cache.config_json(config),
                    "state": {k: v for k, v in config_state(config).items() if k not in capture_cache.VOLATILE},
                    "dtype": str(dtype),
                    "attn_implementation": attn_implementation,
                    "decode": bool(decode),
                    "default_dtype": str(torch.get_default_dtype()),
                    "versions": capture_cache.versions(),
                    "code": _capture_code_hash(),
                }
            )
        )
    except Exception as exc:  # the cache never fails a capture
        _store().count("uncached")
        log.debug("config capture cache: not caching %s (%s: %s)", type(config).__name__, type(exc).__name__, exc)
        return None


def config_state(config) -> dict:
    """Every attribute of the config (``vars``, private ones included: transformers keeps the
    attention and experts implementations it chose there) as JSON for the key (a value JSON
    cannot hold by its ``repr``); raises for a config holding another config."""
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            raise TypeError(f"it holds another config ({name})")
    return json.loads(json.dumps(vars(config), default=repr))


def snapshot(config) -> dict:
    """A copy of the config's attributes, to tell what building its model set (:func:`record`)."""
    return copy.deepcopy(vars(config))


def _exact(name: str, value):
    """``value`` as JSON that :func:`set_state` turns back into an equal value of its type
    (a ``torch.dtype`` as ``{"torch.dtype": name}``); raises for any other value."""
    if isinstance(value, torch.dtype):
        return {"torch.dtype": str(value)}
    encoded = json.loads(json.dumps(value))
    if encoded != value or type(encoded) is not type(value):
        raise TypeError(f"building the model set the config's {name} to a value JSON cannot hold")
    return encoded


def set_state(config, changes: dict) -> None:
    """Set the attributes a record holds (:func:`_exact`) on ``config``."""
    for name, value in changes.items():
        if isinstance(value, dict) and value.keys() == {"torch.dtype"}:
            value = dtype_from_str(value["torch.dtype"])
        vars(config)[name] = value


def served(key: dict, config) -> tuple[fx.GraphModule, dict] | None:
    """The exported module of ``key``'s capture, on fresh ``meta`` tensors, and its record,
    when a record and the capture cache's program serve it; the record's config attributes
    are then set on ``config``. None otherwise (the caller builds the skeleton)."""
    store, name = _store(), digest(key)
    entry = store.recall(name, lambda held: held)
    if entry is None:
        entry = store.load(name, key, capture_cache.versions(), lambda data: (json.loads(data),) * 2)
    if entry is None:
        store.count("miss")
        return None
    changed = [path for path, sha in entry["model_files"].items() if _sha_or_none(path) != sha]
    if changed:
        store.count("stale")
        log.debug("config capture cache: %s changed since the record; building the model", changed[0])
        return None
    gm = capture_cache.cached_module(entry["capture_key"], meta_tensors(entry["tensors"]))
    if gm is None:
        store.count("stale")
        return None
    set_state(config, entry["config_set"])  # what building the skeleton set on its config
    return gm, entry


def record(key: dict, model: nn.Module, before: dict, export_key: dict | None) -> None:
    """Record the capture of ``model`` (the skeleton built for ``key``; ``before``: the
    :func:`snapshot` of its config before it was built) for :func:`served`. Nothing is
    recorded when the export was not cached (``export_key`` None)."""
    if export_key is None:
        return
    store = _store()
    try:
        config = model.config
        after = vars(config)
        if before.keys() - after.keys():
            raise ValueError(f"building the model removed config attributes ({sorted(before.keys() - after.keys())})")
        own = capture_cache.own_tensors(model)
        first: dict[int, str] = {}
        tensors = []
        for name, t in own.items():
            alias = first.setdefault(id(t), name)
            spec = [list(t.shape), str(t.dtype), isinstance(t, nn.Parameter), t.requires_grad]
            tensors.append([name, *spec, None if alias == name else alias])
        layers_path, head_path = layer_and_head_paths(model, config)
        entry = {
            "capture_key": export_key,
            "tensors": tensors,
            "layers_path": layers_path,
            "head_path": head_path,
            "config_set": {k: _exact(k, v) for k, v in after.items() if k not in before or before[k] != v},
            "model_files": {path: file_sha256(path) for path in capture_cache.model_code_files(model)},
        }
        data = (json.dumps(entry, sort_keys=True) + "\n").encode()
        store.remember(digest(key), json.loads(data))
        store.write(digest(key), key, capture_cache.versions(), data)
    except Exception as exc:  # the cache never fails a capture
        store.could_not_store(exc, f"the capture record of {type(model).__name__}")


def meta_tensors(specs: list) -> dict[str, torch.Tensor]:
    """Fresh ``meta`` tensors for a record's tensor specs (tied names share one tensor)."""
    own: dict[str, torch.Tensor] = {}
    for name, shape, dtype, parameter, requires_grad, alias in specs:
        if alias is not None:
            own[name] = own[alias]
            continue
        t = torch.empty(shape, dtype=dtype_from_str(dtype), device="meta")
        own[name] = nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)
    return own


def _sha_or_none(path: str) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _capture_code_hash() -> str:
    """What looptool's capture package and the graph core hold (a change of either must miss)."""
    here = Path(__file__).resolve().parent
    files = sorted(here.glob("*.py")) + sorted((here.parent / "core").glob("*.py"))
    return sha256(b"".join(p.name.encode() + p.read_bytes() for p in files))[:16]
