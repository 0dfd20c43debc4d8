"""Reading the files of a saved looped model (those :mod:`looptool.storage.save` writes):
``looptool.json`` parsed and version-checked, every weight file's size and sha256 checked
against the ones recorded (models saved before checksums were recorded load unchecked), the
safetensors header checked against a rebuilt model and its tensors bound into it.
Rebuilding the model itself is the runtime's (:func:`looptool.runtime.convert.load`), so
storage imports nothing from the runtime.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from looptool.core.dtypes import named
from looptool.core.errors import CheckpointError
from looptool.core.graph import FLOAT_DTYPES
from looptool.storage.files import sha256_file
from looptool.storage.save import FORMAT_VERSION, LOOPTOOL_JSON
from looptool.storage.tensors import bind_tensors, graph_tensors
from looptool.storage.weights import WeightReader

if TYPE_CHECKING:
    from looptool.runtime.network import LoopedNetwork

log = logging.getLogger(__name__)


def read_looptool_json(directory: Path) -> dict:
    """Parse and version-check ``looptool.json``."""
    path = directory / LOOPTOOL_JSON
    if not path.exists():
        raise CheckpointError(f"'{directory}' has no {LOOPTOOL_JSON}; it is not a looped model saved by looptool.")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save the model.") from exc
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise CheckpointError(f"{path} has no format_version; re-save the model with looptool.")
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {meta['format_version']}, this looptool reads "
            f"version {FORMAT_VERSION}; use a matching looptool version."
        )
    for key in ("plan", "recipe", "source", "tensors"):
        if key not in meta:
            raise CheckpointError(f"{path} lacks the '{key}' entry; re-save the model.")
    return meta


def check_file_sizes(directory: Path, meta: dict) -> None:
    """The cheap part of :func:`verify_files`: every recorded file exists with its size."""
    for name, want in meta.get("files", {}).items():
        path = directory / name
        if not path.exists() or path.stat().st_size != want["bytes"]:
            raise _corrupt(path)


def read_weights(reader: WeightReader, meta: dict) -> dict[str, torch.Tensor]:
    """The tensors ``reader`` read, refused like :func:`verify_files` refuses them when their
    file's sha256 differs from the one recorded."""
    path = reader.path
    want = meta.get("files", {}).get(path.name)
    try:
        tensors, _, sha = reader.result()
    except Exception as exc:
        if want is not None:  # what was saved parsed: this file is not what was saved
            raise _corrupt(path) from exc
        raise CheckpointError(
            f"{path} could not be read as safetensors ({exc}); the file is corrupt, re-save the model."
        ) from exc
    if want is not None and sha != want["sha256"]:
        raise _corrupt(path)
    return tensors


def _corrupt(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is corrupt: its contents differ from the sha256 recorded in "
        f"{LOOPTOOL_JSON} at save; re-save or re-copy the model."
    )


def verify_files(directory: Path, meta: dict, skip: tuple[str, ...] = ()) -> None:
    """Refuse a file of ``directory`` (but those in ``skip``) whose size or sha256 differs
    from the one recorded in ``meta["files"]`` (looptool.json); models saved without
    checksums pass unchecked."""
    for name, want in meta.get("files", {}).items():
        if name in skip:
            continue
        path = directory / name
        if not path.exists() or path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
            raise _corrupt(path)


def check_weights(model: LoopedNetwork, path: Path, *, cast: bool = False) -> dict[str, str]:
    """Check the safetensors header (names, shapes, dtypes) against ``model`` without
    reading tensor data; returns the alias map (tied name → stored name). With ``cast``
    (a load in another dtype) a stored floating-point tensor may have any floating dtype."""
    expected = graph_tensors(model)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            aliases = json.loads((f.metadata() or {}).get("looptool_aliases", "{}"))
            slices = {n: f.get_slice(n) for n in f.keys()}
            header = {n: (tuple(sl.get_shape()), sl.get_dtype()) for n, sl in slices.items()}
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        raise CheckpointError(
            f"{path} could not be read as safetensors ({exc}); the file is corrupt, re-save the model."
        ) from exc
    missing = [n for n in expected if aliases.get(n, n) not in header]
    extra = sorted(set(header) - {aliases.get(n, n) for n in expected})
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise CheckpointError(
            f"{path} does not match the model rebuilt from looptool.json ({what}); re-save the model."
        )
    for name, ref in expected.items():
        shape, dtype = header[aliases.get(name, name)]
        want, have = str(ref.dtype).removeprefix("torch."), _torch_name(dtype)
        if cast and ref.dtype.is_floating_point and have in _ST_FLOATS:
            have = want
        if shape != tuple(ref.shape) or have != want:
            raise CheckpointError(
                f"tensor '{name}' in {path} has shape {shape} {dtype}, the model expects "
                f"{tuple(ref.shape)} {want}; re-save the model."
            )
    return aliases


def _torch_name(safetensors_dtype: str) -> str:
    """torch's name of a safetensors dtype (the name itself where the table lacks it)."""
    try:
        return named(safetensors_dtype).name
    except KeyError:
        return safetensors_dtype


_ST_FLOATS = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)  # the dtypes a cast load accepts


_ALIGN = 64  # bytes: what torch's CPU allocator guarantees


def bind_weights(
    model: LoopedNetwork,
    path: Path,
    *,
    device: str,
    trainable=None,
    cast: bool = False,
    loaded: dict[str, torch.Tensor] | None = None,
) -> None:
    """Replace every (meta) tensor of ``model`` with the one stored in ``path`` (with
    ``cast``: converted to the dtype of the model's own tensor as it is read); ``loaded``:
    the file's tensors, already read (:func:`read_weights`)."""
    aliases = check_weights(model, path, cast=cast)
    if loaded is None:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                loaded = {n: f.get_tensor(n) for n in f.keys()}
        except Exception as exc:
            raise CheckpointError(
                f"{path} could not be read as safetensors ({exc}); the file is corrupt, re-save the model."
            ) from exc
    loaded = dict(loaded)
    objects: dict[str, torch.Tensor] = {}

    def tensor_for(name: str, placeholder: torch.Tensor) -> torch.Tensor:
        key = aliases.get(name, name)
        if key not in objects:
            t = loaded.pop(key)
            if t.dtype != placeholder.dtype:
                t = t.to(placeholder.dtype)
            elif t.data_ptr() % _ALIGN:
                # safetensors may hand back views into one read buffer at any 8-byte offset;
                # CPU GEMMs take other code paths (other rounding) on such data, so give each
                # tensor its own aligned storage: outputs then equal the saved model's bit for bit
                t = t.clone()
            objects[key] = t
        return objects[key]

    if trainable is not None:  # a tied name is trainable when its stored name is
        trainable = set(trainable) | {n for n, key in aliases.items() if key in trainable}
    bind_tensors(model, tensor_for, trainable=trainable)
