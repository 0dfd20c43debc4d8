"""Saving a looped model: ``config.json`` (the source config), ``looptool.json`` (format
version, plan, recipe of applied passes, capture settings, tensor table, sha256 of every weight
file), ``model.safetensors`` (each shared tensor once; tied names recorded as aliases) and the
tokenizer files, written atomically. Reading them back is :mod:`looptool.storage.load`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from looptool.core.errors import LooptoolError
from looptool.core.version import __version__
from looptool.storage.files import commit_output_dir, prepare_output_dir, sha256_file
from looptool.storage.tensors import graph_tensors

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork


FORMAT_VERSION = 1


LOOPTOOL_JSON = "looptool.json"
WEIGHTS = "model.safetensors"


def _dedupe(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep the first name of each tensor object; map the other names to it."""
    first: dict[int, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = t
    return unique, aliases


def save(model: LoopedNetwork, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model`` to ``directory`` (atomically: temp dir, then rename)."""
    final, temp = prepare_output_dir(directory, overwrite)
    commit_model(model, final, temp)
    return final


def commit_model(model: LoopedNetwork, final: Path, temp: Path, files: dict[str, str] | None = None) -> None:
    """Write ``model`` and the text ``files`` (name → content) into ``temp``, then move it
    to ``final`` atomically; on any failure ``temp`` is removed and nothing is left behind."""
    try:
        write_model(model, temp)
        for name, text in (files or {}).items():
            (temp / name).write_text(text)
        commit_output_dir(final, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def write_model(model: LoopedNetwork, directory: Path | None, *, materialize=None) -> None:
    """Write the files of a saved looped model into an existing (empty) directory.

    ``materialize(tensor) -> tensor`` turns each distinct tensor into the one to store (e.g.
    gathering a sharded parameter; called in the same order on every rank, so it may be a
    collective); ``directory=None`` only materialises (the ranks that do not write).
    """
    unique, aliases = _dedupe(graph_tensors(model))
    if materialize is not None:
        unique = {k: materialize(t) for k, t in unique.items()}
    if directory is None:
        return
    if any(t.device.type == "meta" for t in unique.values()):
        raise LooptoolError("this model's weights are on the meta device (not loaded); bind weights before saving.")
    save_file(
        {k: t.detach().contiguous() for k, t in unique.items()},
        str(directory / WEIGHTS),
        metadata={"format": "pt", "looptool_aliases": json.dumps(aliases)},
    )
    model.config.save_pretrained(directory)
    lg = model.layer_graph
    meta = {
        "format_version": FORMAT_VERSION,
        "looptool_version": __version__,
        "plan": model.plan.to_dict(),
        "recipe": [[name, config] for name, config in model.recipe],
        "source": {
            "model_type": lg.source.model_type,
            "dtype": lg.source.dtype,
            "attn_implementation": lg.source.attn_implementation,
            "num_layers": lg.source.num_layers,
        },
        "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype)} for k, t in unique.items()},
        "aliases": aliases,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "files": {WEIGHTS: {"bytes": (directory / WEIGHTS).stat().st_size, "sha256": sha256_file(directory / WEIGHTS)}},
    }
    (directory / LOOPTOOL_JSON).write_text(json.dumps(meta, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(directory)
