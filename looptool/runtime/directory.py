"""The ``pytorch`` runtime of :func:`looptool.engine.open_engine`: a looped model directory
(written by looptool convert or save_pretrained), loaded and driven by its step engine."""

from __future__ import annotations

import os
from pathlib import Path

from looptool.engine.interface import EngineFacts
from looptool.engine.opened import OpenedEngine, costs_by_budget, eos_ids
from looptool.runtime.step_engine import TorchStepEngine

WANTS = "give a looped model directory (written by looptool convert or save_pretrained)"


def detect(path: Path) -> bool:
    """Whether ``path`` is a looped model directory."""
    from looptool.storage.save import LOOPTOOL_JSON

    return (path / LOOPTOOL_JSON).is_file()


def describe(path: Path) -> EngineFacts:
    """The saved plan's budget menu and the source config's context, from JSON alone."""
    import transformers

    from looptool.capture.facts import context_length_of
    from looptool.core.plan import plan_from_dict
    from looptool.storage.load import read_looptool_json

    budgets = tuple(sorted(plan_from_dict(read_looptool_json(path)["plan"]).budgets))
    return EngineFacts(budgets, context_length_of(transformers.AutoConfig.from_pretrained(path)))


def open_dir(
    path: Path,
    *,
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    exit_rule: str = "state",
    **_,
) -> OpenedEngine:
    """Load the looped model at ``path`` on ``device`` and its step engine for ``kv`` (rows of
    adaptive depth stop by ``exit_rule``)."""
    from looptool.runtime import text
    from looptool.runtime.convert import load
    from looptool.runtime.devices import resolve_device

    dev = resolve_device(device)
    model = load(path, device=str(dev))
    tok = text.model_tokenizer(model, tokenizer)
    engine = TorchStepEngine(model, kv=kv, exit_rule=exit_rule)
    costs = costs_by_budget([c.as_dict() for c in model.cost_table()], engine.budgets, kv)
    eos = eos_ids(tok, getattr(model.config, "eos_token_id", None))
    return OpenedEngine(engine, tok, costs, eos, str(dev), "pytorch")
