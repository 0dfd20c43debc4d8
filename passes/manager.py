"""Pass registry and manager (modelled on ``torch.fx.passes.infra.pass_manager``)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable

from looptool.core.errors import InternalError, LooptoolError, PassError
from looptool.core.graph import LayerGraph, verify_layer_graph

log = logging.getLogger(__name__)

PassFn = Callable[[LayerGraph, dict], LayerGraph]


@functools.cache  # one per process: passes register when their modules are imported
def _registry() -> dict[str, PassFn]:
    """Every registered pass by name."""
    return {}


LOOPING_PASSES = ("prefix_loop", "recurrent_loop")  # what a pass rewriting budget paths requires


def register_pass(
    name: str,
    *,
    replayable: bool = True,
    requires: Iterable[str] = (),
    before: Iterable[str] = (),
    after: Iterable[str] = (),
) -> Callable[[PassFn], PassFn]:
    """Register ``fn`` under ``name``. Non-replayable passes (device retargeting) are not
    recorded in the recipe: they depend on where a model is loaded, not on what it is.

    Ordering is declared, never implied by call order: ``requires`` names passes of which at
    least one must have run on the graph first (the looping passes, for a pass that rewrites
    budget paths); ``before`` names passes this one must precede and ``after`` passes it must
    follow whenever both run on one graph. :class:`PassManager` refuses a violating order
    (within its steps, or against the passes already applied, :attr:`LayerGraph.applied`).
    """

    def deco(fn: PassFn) -> PassFn:
        if name in _registry():
            raise ValueError(f"a pass named {name!r} is already registered")
        fn.replayable = replayable  # type: ignore[attr-defined]
        fn.requires = tuple(requires)  # type: ignore[attr-defined]
        fn.before = tuple(before)  # type: ignore[attr-defined]
        fn.after = tuple(after)  # type: ignore[attr-defined]
        _registry()[name] = fn
        return fn

    return deco


def get_pass(name: str) -> PassFn:
    """The registered pass called ``name``."""
    try:
        return _registry()[name]
    except KeyError:
        raise PassError(f"no pass named {name!r}; registered passes: {sorted(_registry())}.") from None


def unregister_pass(name: str) -> None:
    """Remove a registered pass (tests and plugins that register passes temporarily)."""
    _registry().pop(name, None)


def registered_passes() -> tuple[str, ...]:
    """Names of all registered passes."""
    return tuple(sorted(_registry()))


def must_precede(first: str, second: str) -> bool:
    """Whether a registered pass declares that ``first`` runs before ``second`` (``first``'s
    ``before`` or ``second``'s ``after``)."""
    a, b = _registry().get(first), _registry().get(second)
    return second in getattr(a, "before", ()) or first in getattr(b, "after", ())


def check_order(names: Iterable[str], applied: Iterable[str] = (), *, check_requires: bool = True) -> None:
    """Refuse, in one sentence naming both passes, running ``names`` in this order on a graph
    that the passes ``applied`` already rewrote: a pass declared to precede one that already
    ran (in ``applied`` or earlier in ``names``), or (``check_requires``) a pass none of whose
    ``requires`` ran."""
    history = list(applied)
    steps: list[str] = []
    for name in names:
        for done, where in [
            *((d, "already ran on this graph") for d in history),
            *((d, "comes earlier in the steps") for d in steps),
        ]:
            if must_precede(name, done):
                raise PassError(f"pass {name!r} must run before pass {done!r}, which {where}.")
        needs, ran = getattr(get_pass(name), "requires", ()), history + steps
        if check_requires and needs and not any(n in ran for n in needs):
            raise PassError(
                f"pass {name!r} needs pass {' or '.join(map(repr, needs))} to run first; passes that "
                f"ran before it: {', '.join(map(repr, ran)) or 'none'}."
            )
        steps.append(name)


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
        check_order([name for name, _ in self.steps], check_requires=False)  # what needs no graph, early

    def __call__(self, lg: LayerGraph) -> LayerGraph:
        """Apply every step to ``lg``; returns the final LayerGraph (``lg`` is untouched).
        Refuses, before any step runs, an order its passes' declarations forbid."""
        check_order([name for name, _ in self.steps], lg.applied)
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
            out = out.replace(applied=out.applied + (name,))
            if fn.replayable:  # type: ignore[attr-defined]
                out = out.replace(recipe=out.recipe + ((name, config),))
            log.info("pass %s done", name)
            done.append(name)
            lg = out
        return lg
