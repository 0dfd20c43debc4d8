"""What a server serves: a step engine over a looped model directory (PyTorch,
:class:`looptool.runtime.step_engine.TorchStepEngine`) or an exported ONNX engine directory
(onnxruntime, :class:`looptool.backends.ort_engine.OrtStepEngine`), with its tokenizer, EOS
ids and each budget's cost from the cost table (Accordion Eq. 6). Everything after this
module sees only the step-engine surface."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from looptool.core.errors import LooptoolError


@dataclass
class ServedModel:
    """A step engine and what the HTTP side needs to know about the model behind it."""

    name: str
    engine: object  # the step-engine surface: budgets, vocab_size, mask_dtype, allocate, step, prompt_logprobs
    tokenizer: object
    budgets: tuple[int, ...]
    costs: dict[int, dict]  # budget -> {"budget", "layer_executions", "kv_bytes_per_token"}
    eos: tuple[int, ...]
    device: str
    runtime: str  # "pytorch" or "onnxruntime"


@dataclass(frozen=True)
class ModelFacts:
    """What the server's options are checked against before anything loads: the budget menu of
    the saved plan and the positions the source model was built for (None if unknown)."""

    budgets: tuple[int, ...]
    context: int | None


def read_facts(path: str | os.PathLike) -> ModelFacts:
    """The :class:`ModelFacts` of a looped model directory (``looptool.json`` and
    ``config.json``) or an engine directory (its manifest), read from JSON alone."""
    import transformers

    from looptool.capture.facts import context_length_of
    from looptool.core.plan import plan_from_dict

    path = Path(path)
    if not path.is_dir():
        raise LooptoolError(
            f"'{path}' is not a directory; give a looped model directory or an exported engine directory.",
            parameter="model_dir",
        )
    if is_engine_dir(path):
        from looptool.backends.ort import read_manifest

        manifest = read_manifest(path)
        budgets = tuple(sorted(int(b) for b in manifest["budgets"]))
        source = manifest.get("source_config") or {}
        config = transformers.CONFIG_MAPPING[source["model_type"]].from_dict(source) if "model_type" in source else None
    else:
        from looptool.storage.load import read_looptool_json

        budgets = tuple(sorted(plan_from_dict(read_looptool_json(path)["plan"]).budgets))
        config = transformers.AutoConfig.from_pretrained(path)
    return ModelFacts(budgets, context_length_of(config) if config is not None else None)


def is_engine_dir(path: Path) -> bool:
    """Whether ``path`` is an exported engine directory (it holds the engine manifest)."""
    from looptool.backends.onnx_format import MANIFEST

    return (path / MANIFEST).is_file()


def open_model(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
) -> ServedModel:
    """The served model at ``path``: an engine directory runs on onnxruntime (``threads``
    intra-op threads), a looped model directory on PyTorch (``device``). ``name`` (default: the
    directory's name) is the model id clients ask for."""
    path = Path(path)
    if not path.is_dir():
        raise LooptoolError(
            f"'{path}' is not a directory; give a looped model directory or an exported engine directory.",
            parameter="model_dir",
        )
    name = name or path.resolve().name
    if is_engine_dir(path):
        return _open_engine_dir(path, name, kv, tokenizer, threads)
    return _open_model_dir(path, name, device, kv, tokenizer)


def _open_model_dir(path: Path, name: str, device: str, kv: str, tokenizer) -> ServedModel:
    from looptool.runtime import text
    from looptool.runtime.devices import resolve_device
    from looptool.runtime.step_engine import TorchStepEngine
    from looptool.storage.load import load

    dev = resolve_device(device)
    model = load(path, device=str(dev))
    tok = text.model_tokenizer(model, tokenizer)
    engine = TorchStepEngine(model, kv=kv)
    costs = _costs([c.as_dict() for c in model.cost_table()], engine.budgets, kv)
    eos = _eos_ids(tok, getattr(model.config, "eos_token_id", None))
    return ServedModel(name, engine, tok, tuple(engine.budgets), costs, eos, str(dev), "pytorch")


def _open_engine_dir(path: Path, name: str, kv: str, tokenizer, threads: int | None) -> ServedModel:
    from looptool.backends.ort import Runtime
    from looptool.backends.ort_engine import OrtStepEngine
    from looptool.runtime import text

    rt = Runtime(path, threads=threads)
    source = tokenizer if tokenizer is not None else (path if rt.manifest.get("tokenizer") else None)
    if source is None:
        raise LooptoolError(
            "this engine was exported without a tokenizer; pass tokenizer=PATH (a Hugging Face tokenizer folder).",
            parameter="tokenizer",
        )
    tok = text.load_tokenizer(source)
    engine = OrtStepEngine(rt, kv=kv)
    costs = _costs(rt.manifest.get("costs", []), engine.budgets, kv)
    missing = sorted(set(engine.budgets) - set(costs))
    if missing:
        raise LooptoolError(
            f"{path} has no cost-table entry for budget {missing[0]}; export the engine again.", parameter="model_dir"
        )
    eos = _eos_ids(tok, rt.manifest.get("source_config", {}).get("eos_token_id"))
    return ServedModel(name, engine, tok, tuple(engine.budgets), costs, eos, "cpu", "onnxruntime")


def _costs(table: list[dict], budgets, kv: str) -> dict[int, dict]:
    """``budget -> {"budget", "layer_executions", "kv_bytes_per_token"}`` from cost-table rows
    (Accordion Eq. 6; last-loop KV where ``kv`` is ``last-loop``)."""
    key = "kv_bytes_per_token_last_loop" if kv == "last-loop" else "kv_bytes_per_token"
    return {
        int(c["budget"]): {
            "budget": int(c["budget"]),
            "layer_executions": int(c["layer_executions"]),
            "kv_bytes_per_token": int(c[key]),
        }
        for c in table
        if int(c["budget"]) in budgets
    }


def _eos_ids(tok, config_eos) -> tuple[int, ...]:
    """The tokenizer's EOS id and the config's (one id or a list)."""
    ids = {int(i) for i in ([config_eos] if isinstance(config_eos, int) else (config_eos or []))}
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))
