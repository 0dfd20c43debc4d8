"""A cache of ``torch.export`` captures, so a repeated capture skips the export.

``torch.export`` is the slow step of every capture, and ``looptool.load``, ``convert`` and the
cached decode paths repeat the same export for the same architecture. The unlifted exported
module (the rest of the capture pipeline runs unchanged on it) is kept in the stored form of
:mod:`looptool.capture.programs`, keyed by everything that changes it (:func:`key_of`): the
model's config, class, module tree and tensor signature, dtype and devices, attention
implementation, the capture options, the torch / transformers / looptool / Python versions
and the source of the export code.

Two levels of the store :data:`looptool.cache.CAPTURES` (``caches().captures``) serve a key:

* on disk, under ``$LOOPTOOL_CACHE/captures`` (default ``~/.cache/looptool/captures``;
  ``LOOPTOOL_CACHE=off`` disables both levels): a sidecar holding the key, the versions and
  the sha256 of the ``.fx`` program file it names (:func:`programs.dumps`), written
  atomically (:class:`looptool.cache.Store`); a process that misses an entry another one is
  exporting waits for it and reads it, so the ranks of a distributed run export a model once.
  Entries are pickles: a folder another user can write to is not read (a warning says so);
* in process, the last ``CAPTURES.memory`` programs used.

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

import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

from looptool.cache import CAPTURES, Store, caches, canonical, digest, enabled, file_sha256, sha256
from looptool.capture import programs
from looptool.core.version import __version__

log = logging.getLogger(__name__)


def _store() -> Store:
    """This process's capture store (counts: "memory", "disk", "miss", "dropped", "uncached")."""
    return caches().captures


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
        _store().count("uncached")
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
                "format": CAPTURES.format,
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
                "modules": sha256(json.dumps(modules).encode()),
                "tensors": sha256(json.dumps(tensors).encode()),
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
    own, name, store = own_tensors(model), digest(key), _store()

    def keep(gm: fx.GraphModule) -> None:
        data = programs.dumps(programs.program_of(gm, own))
        stored = programs.loads(data)  # what every later hit builds: checked once, here
        if programs.build(stored, own).code != gm.code:
            raise ValueError("the stored program does not rebuild the exported module")
        store.remember(name, (stored, _shape_env_state(stored)))
        store.write(name, key, versions(), data)

    # errors of the export itself reach the caller unchanged
    gm = store.get_or_build(
        name, lambda: _found(name, key, own), lambda: export().module(), keep, "the exported program"
    )
    return _own_meta(gm)


def cached_module(key: dict, own: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    """The module an export under ``key`` gave, built on the tensors ``own`` (name → tensor)
    from the in-process or the disk entry; None when neither holds it (nothing is exported)."""
    gm = _found(digest(key), key, own)
    return None if gm is None else _own_meta(gm)


def _found(name: str, key: dict, own: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    """The module of the in-process entry ``name`` (unless its ``ShapeEnv`` changed since it
    was stored: a caller added a guard), else of the disk entry; None when neither serves."""

    def use(entry: tuple[programs.Program, object]) -> fx.GraphModule | None:
        program, state = entry
        return programs.build(program, own) if _shape_env_state(program) == state else None

    def decode(data: bytes) -> tuple[fx.GraphModule, tuple[programs.Program, object]]:
        stored = programs.loads(data)
        return programs.build(stored, own), (stored, _shape_env_state(stored))

    store = _store()
    gm = store.recall(name, use)
    return gm if gm is not None else store.load(name, key, versions(), decode)


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
    return sha256(b"".join(parts) + here.read_bytes())[:16]


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
    return sha256("\n".join(parts).encode())[:16]
