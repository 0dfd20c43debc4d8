"""A cache of ``torch.export`` captures, so a repeated capture skips the export.

``torch.export`` is the slow step of every capture, and ``looptool.load``, ``convert`` and the
cached decode paths repeat the same export for the same architecture. The unlifted exported
module (the rest of the capture pipeline runs unchanged on it) is kept in the stored form of
:mod:`looptool.capture.programs`, keyed by everything that changes it (:func:`key_of`): the
model's config, class, module tree and tensor signature, dtype and devices, attention
implementation, the capture options, the torch / transformers / looptool / Python versions
and the source of the export code.

Two levels serve a key:

* on disk, under ``$LOOPTOOL_CACHE/captures`` (default ``~/.cache/looptool/captures``;
  ``LOOPTOOL_CACHE=off`` disables both levels): ``<sha256 of the key>.json``, a sidecar
  holding the key, the versions and the sha256 of the program file it names,
  ``<sha256 of the key>-<sha256 prefix of the file>.fx`` (:func:`programs.dumps`). Both are
  written to a temporary file and moved into place with ``os.replace``, the sidecar last,
  so concurrent writers (pytest-xdist workers) never expose a partial entry; a process that
  misses an entry another one is exporting waits for it (a ``<digest>.lock`` file) and reads
  it, so the ranks of a distributed run export a model once. Entries are
  pickles: a folder another user can write to is not read (a warning says so);
* in process, an LRU of :data:`MEMORY_ENTRIES` programs.

A stored program holds no tensor of the model it came from, and a hit rebinds every
parameter and buffer by name to the *current* model's own tensor objects, so the returned
GraphModule is what a fresh export gives (same graph code, checked before an entry is kept;
its parameters and buffers are the model's own tensors). Each hit builds a fresh GraphModule
whose nodes and metadata containers are its own; the node values (``FakeTensor``/``SymInt``)
of an entry are shared read-only, and an in-process entry is dropped if its ``ShapeEnv``
changed since it was stored (a caller added a guard).

An entry that cannot be used (unreadable, bad sha256, other key or versions, a load or
rebinding failure) is dropped with a warning and rebuilt: the cache never changes a result
and never raises to the caller. Models with forward hooks or instance-level ``forward``
overrides are not cached (the key cannot see what such code does).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from looptool.capture import programs
from looptool.capture.disk_cache import DiskCache, MemoryLRU, canonical, enabled, file_sha256, sha256
from looptool.core.version import __version__

log = logging.getLogger(__name__)

FORMAT = 2  # of the entries (the key, the sidecar, what a stored program holds)
MEMORY_ENTRIES = 8
SUBDIR = "captures"

STATS: collections.Counter = collections.Counter()  # "memory", "disk", "miss", "dropped", "uncached"
_memory: MemoryLRU[tuple[programs.Program, object]] = MemoryLRU(MEMORY_ENTRIES)
_STORE = DiskCache(SUBDIR, FORMAT, ".fx", "capture cache", log)


def directory() -> Path:
    """Where the exported programs are kept: ``<looptool cache dir>/captures``."""
    return _STORE.directory()


def clear_memory() -> None:
    """Forget the in-process entries (the next capture reads the disk or exports)."""
    _memory.clear()


def versions() -> dict[str, str]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "looptool": __version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def key_of(model: nn.Module, options: dict) -> dict | None:
    """The cache key of exporting ``model`` with capture ``options`` (JSON-serialisable), or
    None when the model cannot be cached (the cache is off, or hooks / a patched ``forward``)."""
    if not enabled():
        return None
    try:
        reason = uncacheable(model)
        key = None if reason else _key(model, options)
    except Exception as exc:  # e.g. a config field JSON cannot hold: the cache never fails a capture
        reason = f"{type(exc).__name__}: {exc}"
    if reason:
        STATS["uncached"] += 1
        log.debug("capture cache: not caching %s (%s)", type(model).__name__, reason)
    return key if not reason else None


def _key(model: nn.Module, options: dict, *, device: bool = True) -> dict:
    config = getattr(model, "config", None)
    tensors = [
        (
            name,
            list(t.shape),
            str(t.dtype),
            str(t.device) if device else None,
            t.requires_grad,
            isinstance(t, nn.Parameter),
        )
        for name, t in own_tensors(model).items()
    ]
    modules = [(name, type(m).__module__ + "." + type(m).__qualname__, m.training) for name, m in model.named_modules()]
    param = next(model.parameters(), None)
    return json.loads(
        _canonical(
            {  # plain JSON (raises here for a value JSON cannot hold)
                "format": FORMAT,
                "model_class": type(model).__module__ + "." + type(model).__qualname__,
                "config": config_json(config),
                "dtype": str(param.dtype) if param is not None else None,
                "device": str(param.device) if param is not None and device else None,
                "attn_implementation": getattr(config, "_attn_implementation", None),
                "options": dict(options),
                "versions": versions(),
                "default_dtype": str(torch.get_default_dtype()),
                "export_code": _export_code_hash(),
                "model_code": _model_code_hash(model),
                "modules": _sha256(json.dumps(modules).encode()),
                "tensors": _sha256(json.dumps(tensors).encode()),
            }
        )
    )


def same_but_device(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` would export the same program but for the device their tensors
    live on: every key field but the device agrees (class and its code, config, dtype,
    attention, module tree and modes, each tensor's name, shape, dtype, kind and
    ``requires_grad``), and neither has hooks or a patched ``forward``."""
    try:
        if uncacheable(a) or uncacheable(b):
            return False
        return _key(a, {}, device=False) == _key(b, {}, device=False)
    except Exception:  # a config JSON cannot hold: not provably the same
        return False


def exported_module(
    model: nn.Module, key: dict | None, export: Callable[[], torch.export.ExportedProgram]
) -> fx.GraphModule:
    """``export().module()``, served from the cache under ``key`` when it can be (None:
    always export). Its parameters and buffers are ``model``'s own tensor objects."""
    if key is None:
        return export().module()
    own = own_tensors(model)
    gm = cached_module(key, own)
    if gm is not None:
        return gm
    digest = _sha256(_canonical(key).encode())
    with _STORE.one_builder(digest):  # a process exporting the same key: wait, then read its entry
        gm = _from_disk(digest, key, own)
        if gm is not None:
            return _own_meta(gm)
        STATS["miss"] += 1
        gm = export().module()  # errors of the export itself reach the caller unchanged
        try:
            data = programs.dumps(programs.program_of(gm, own))
            stored = programs.loads(data)  # what every later hit builds: checked once, here
            if programs.build(stored, own).code != gm.code:
                raise ValueError("the stored program does not rebuild the exported module")
            _remember(digest, stored)
            _write(digest, key, data)
        except Exception as exc:  # the cache never fails a capture
            _STORE.could_not_store(exc, "the exported program")
    return _own_meta(gm)


def cached_module(key: dict, own: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    """The module an export under ``key`` gave, built on the tensors ``own`` (name → tensor)
    from the in-process or the disk entry; None when neither holds it (nothing is exported)."""
    digest = _sha256(_canonical(key).encode())
    gm = _from_memory(digest, own)
    if gm is None:
        gm = _from_disk(digest, key, own)
    return None if gm is None else _own_meta(gm)


# -- in process -------------------------------------------------------------------------


def _from_memory(digest: str, own: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    entry = _memory.get(digest)
    if entry is None:
        return None
    program, state = entry
    if _shape_env_state(program) != state:  # someone added guards to the shared ShapeEnv: not pristine
        log.debug("capture cache: in-process entry %s changed; reading it again", digest[:12])
        _memory.pop(digest)
        return None
    try:
        gm = programs.build(program, own)
    except Exception as exc:  # never raises to the caller: export afresh
        log.warning(
            "capture cache: could not use the in-process entry %s (%s: %s); exporting afresh.",
            digest[:12],
            type(exc).__name__,
            exc,
        )
        _memory.pop(digest)
        return None
    STATS["memory"] += 1
    return gm


def _remember(digest: str, program: programs.Program) -> None:
    _memory.put(digest, (program, _shape_env_state(program)))


# -- on disk ------------------------------------------------------------------------------


def _from_disk(digest: str, key: dict, own: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    def decode(data: bytes) -> tuple[programs.Program, fx.GraphModule]:
        stored = programs.loads(data)
        return stored, programs.build(stored, own)

    found = _STORE.read(digest, key, versions(), decode, on_drop=lambda: STATS.update(["dropped"]))
    if found is None:
        return None
    stored, gm = found
    _remember(digest, stored)
    STATS["disk"] += 1
    return gm


def _write(digest: str, key: dict, data: bytes) -> None:
    _STORE.write(digest, key, versions(), data)


# -- programs -----------------------------------------------------------------------------


def own_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by every name they have (tied ones twice)."""
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}


def _own_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every node its own copies of the metadata containers (``nn_module_stack``,
    ``from_node``, ...), which a build shares with the stored program."""
    for node in gm.graph.nodes:
        for k, v in node.meta.items():
            if type(v) is dict:
                node.meta[k] = dict(v)
            elif type(v) is list:
                node.meta[k] = list(v)
    return gm


def _shape_env_state(program: programs.Program):
    """A fingerprint of the program's ShapeEnv (guards, replacements, ranges)."""
    env = program.shape_env()
    if env is None:
        return None
    deferred = getattr(env, "deferred_runtime_asserts", {}) or {}
    return (
        len(getattr(env, "guards", ())),
        repr(sorted((str(k), str(v)) for k, v in getattr(env, "replacements", {}).items())),
        repr(sorted((str(k), str(v)) for k, v in getattr(env, "var_to_range", {}).items())),
        sum(len(v) for v in deferred.values()),
        len(getattr(env, "divisible", ())),
    )


# -- keys ---------------------------------------------------------------------------------


def uncacheable(model: nn.Module) -> str | None:
    """Why exporting ``model`` cannot be cached (global or module forward hooks, a module with
    its own ``forward``), or None: what it runs is not what its class and config say."""
    from torch.nn.modules import module as M

    for hooks in ("_global_forward_hooks", "_global_forward_pre_hooks"):
        if getattr(M, hooks, None):
            return "global forward hooks are registered"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"module '{name}' has forward hooks"
        if "forward" in vars(m):
            return f"module '{name}' has its own forward"
    return None


VOLATILE = ("_name_or_path", "architectures", "transformers_version")  # config fields that do not change the program


def config_json(config) -> dict | None:
    """The config as its keys hold it: ``to_dict()`` without the fields that do not change
    the program (its folder, ``architectures``, the version that wrote it)."""
    if config is None:
        return None
    d = config.to_dict()
    for k in VOLATILE:
        d.pop(k, None)
    return json.loads(_canonical(d))


def _canonical(obj) -> str:
    return canonical(obj, default=_json_default)


def _json_default(obj):
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


@functools.lru_cache(maxsize=1)
def _export_code_hash() -> str:
    """What looptool's own export code looks like (a change of it must miss)."""
    here = Path(__file__)  # export.py sits beside this module (read, not imported: it imports this one)
    parts = [here.with_name(name).read_bytes() for name in ("export.py", "programs.py")]
    parts.append((here.parents[1] / "core" / "tracing.py").read_bytes())  # the settings it traces under
    return _sha256(b"".join(parts) + here.read_bytes())[:16]


def model_code_files(model: nn.Module) -> list[str]:
    """The source files of the model's module classes but torch's (whose code its version covers)."""
    files = set()
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        path = getattr(mod, "__file__", None)
        if path and not type(m).__module__.startswith("torch."):
            files.add(path)
    return sorted(files)


def _model_code_hash(model: nn.Module) -> str:
    """What the source files of the model's module classes hold (an edited or newer
    remote-code ``modeling_*.py`` must miss; torch's own modules are covered by its version)."""
    parts = []
    for path in model_code_files(model):
        try:
            parts.append(f"{path}:{file_sha256(path)}")
        except OSError:
            parts.append(f"{path}:?")
    return _sha256("\n".join(parts).encode())[:16]


_sha256 = sha256
