"""Pass registry and manager (modelled on ``torch.fx.passes.infra.pass_manager``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from looptool.core.errors import InternalError, LooptoolError, PassError
from looptool.core.graph import LayerGraph, verify_layer_graph

log = logging.getLogger(__name__)

PassFn = Callable[[LayerGraph, dict], LayerGraph]
_REGISTRY: dict[str, PassFn] = {}


def register_pass(name: str, *, replayable: bool = True) -> Callable[[PassFn], PassFn]:
    """Register ``fn`` under ``name``. Non-replayable passes (device retargeting) are not
    recorded in the recipe: they depend on where a model is loaded, not on what it is."""

    def deco(fn: PassFn) -> PassFn:
        if name in _REGISTRY:
            raise ValueError(f"a pass named {name!r} is already registered")
        fn.replayable = replayable  # type: ignore[attr-defined]
        _REGISTRY[name] = fn
        return fn

    return deco


def get_pass(name: str) -> PassFn:
    """The registered pass called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PassError(f"no pass named {name!r}; registered passes: {sorted(_REGISTRY)}.") from None


def unregister_pass(name: str) -> None:
    """Remove a registered pass (tests and plugins that register passes temporarily)."""
    _REGISTRY.pop(name, None)


def registered_passes() -> tuple[str, ...]:
    """Names of all registered passes."""
    return tuple(sorted(_REGISTRY))


class PassManager:
    """Runs named passes in order, verifying after each and recording the recipe."""

    def __init__(self, steps: Iterable[tuple[str, dict]]):
        self.steps = [(name, dict(config)) for name, config in steps]
        for name, config in self.steps:
            get_pass(name)
            try:
                json.dumps(config)
            except TypeError as exc:
                raise PassError(f"the config of pass {name!r} is not JSON-serialisable ({exc}).") from exc

    def __call__(self, lg: LayerGraph) -> LayerGraph:
        """Apply every step to ``lg``; returns the final LayerGraph (``lg`` is untouched)."""
        done: list[str] = []
        for name, config in self.steps:
            fn = get_pass(name)
            try:
                out = fn(lg, config)
            except LooptoolError:
                raise
            except Exception as exc:  # not a user error: a bug in the pass, traceback kept
                ran = ", ".join(done) or "none"
                raise InternalError(
                    f"pass {name!r} crashed ({type(exc).__name__}: {exc}); passes that ran before it: {ran}."
                ) from exc
            if out is lg:
                raise PassError(f"pass {name!r} returned its input; passes must return a new LayerGraph.")
            verify_layer_graph(out, f"after pass {name!r}")
            if fn.replayable:  # type: ignore[attr-defined]
                out = out.replace(recipe=out.recipe + ((name, config),))
            log.info("pass %s done", name)
            done.append(name)
            lg = out
        return lg
