"""Save and load looped models.

A saved model is a directory with ``config.json`` (the source config), ``looptool.json``
(format version, plan, recipe of applied passes, capture settings, tensor table, sha256
of every weight file), ``model.safetensors`` (each shared tensor once; tied names recorded as aliases) and the
tokenizer files. Loading rebuilds the source architecture on ``meta``, captures it,
replays the recipe, retargets the device and binds the stored tensors: no network, no
weight materialised twice, bit-identical outputs. A weight file whose sha256 differs from
the one recorded is refused as corrupt (models saved before checksums were recorded load
unchecked; ``device="meta"`` reads no tensor data and skips the check).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from looptool.errors import CheckpointError, LooptoolError
from looptool.graph import FLOAT_DTYPES, dtype_from_str, float_dtype
from looptool.model import LoopedModel, bind_tensors, graph_tensors
from looptool.plan import plan_from_dict

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
LOOPTOOL_JSON = "looptool.json"
WEIGHTS = "model.safetensors"


def _version() -> str:
    from looptool import __version__

    return __version__


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


def check_output_dir(directory: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite`` (and never a non-directory); callers
    run this before slow work so a bad target fails fast."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise LooptoolError(f"output directory '{final}' already exists; pass --overwrite (overwrite=True) to replace it.")
    if final.exists() and not final.is_dir():
        raise LooptoolError(f"output path '{final}' exists and is not a directory; choose another path.")
    return final


def prepare_output_dir(directory: str | os.PathLike, overwrite: bool) -> tuple[Path, Path]:
    """Validate the target and return ``(final, temp)`` directories; write into temp and
    call :func:`commit_output_dir` so a failure never leaves a half-written output."""
    final = check_output_dir(directory, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    return final, temp


def commit_output_dir(final: Path, temp: Path) -> None:
    """Atomically move a finished temp directory into place (replacing an old one), with
    the permissions of the user's umask (see :func:`apply_umask`)."""
    apply_umask(temp)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        temp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        temp.rename(final)


def current_umask() -> int:
    """The process umask (read by setting it and putting it straight back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give ``root`` and everything below it the modes a plain ``mkdir``/``open`` would:
    directories ``0o777 & ~umask``, files ``0o666 & ~umask`` (``0o777`` for executables).
    ``mkdtemp`` makes 0700 and safetensors writes 0600, which would survive the rename and
    keep colleagues on a shared machine from reading the output."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            Path(parent, name).chmod(0o777 & ~mask)
        for name in files:
            path = Path(parent, name)
            if not path.is_symlink():
                full = 0o777 if path.stat().st_mode & 0o111 else 0o666
                path.chmod(full & ~mask)


@contextlib.contextmanager
def result_files(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging folder for a command's result files; when the block ends they all
    appear in ``folder`` together, on a failure none does. ``folder`` is often a model
    directory (the default of eval and lm-eval), so the unit is the set of files, not the
    folder: a new folder is staged whole and renamed in (:func:`commit_output_dir`); in an
    existing one the files are staged in a hidden folder inside it (same file system) and
    each moved over its old version with ``os.replace``, leaving the model's files alone."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise LooptoolError(f"output path '{folder}' exists and is not a directory; choose another path.")
    fresh = not folder.exists()
    staging = prepare_output_dir(folder, overwrite=False)[1] if fresh else Path(
        tempfile.mkdtemp(prefix=".results.", suffix=".tmp", dir=folder))
    try:
        yield staging
        if fresh:
            commit_output_dir(folder, staging)
        else:
            apply_umask(staging)  # the files get the modes a plain write would give them
            for path in sorted(staging.iterdir()):
                os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def recover_interrupted_commit(final: Path) -> None:
    """Undo a :func:`commit_output_dir` killed between its two renames: only ``.NAME.old``
    is left, so it is moved back (the previous complete output)."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        old.rename(final)


def save(model: LoopedModel, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model`` to ``directory`` (atomically: temp dir, then rename)."""
    final, temp = prepare_output_dir(directory, overwrite)
    commit_model(model, final, temp)
    return final


def commit_model(model: LoopedModel, final: Path, temp: Path, files: dict[str, str] | None = None) -> None:
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


def write_model(model: LoopedModel, directory: Path | None, *, materialize=None) -> None:
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
        "looptool_version": _version(),
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


def load(directory: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | str | None = None) -> LoopedModel:
    """Rebuild a saved looped model on ``device`` (bit-identical to the one saved); the
    weights are read straight onto the device (``"auto"``: cuda when available).

    ``dtype`` (default: the saved dtype) rebuilds the graphs in another floating-point dtype
    and casts each weight to it as it is read, e.g. an fp16 copy of an fp32 model for
    deployment (captured graphs are dtype-specialised, so this is a rebuild, not ``.to``).

    ``device="meta"`` rebuilds the structure only (plan, graphs, shapes) without reading
    weights, which is what ``looptool inspect`` needs.
    """
    import transformers

    from looptool.convert import rebuild
    from looptool.devices import check_dtype, resolve_device

    device = str(resolve_device(device))
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"'{directory}' is not a directory; pass the folder written by save_pretrained or looptool convert.")
    meta = read_looptool_json(directory)
    weights = directory / WEIGHTS
    if not weights.exists():
        raise CheckpointError(f"'{directory}' has no {WEIGHTS}; the save was incomplete, re-save the model.")
    if torch.device(device).type != "meta":  # meta (inspect) reads only headers: stays cheap
        verify_files(directory, meta)  # before the slow rebuild: a corrupt file fails fast
    plan_from_dict(meta["plan"])  # refuses unknown kinds / versions with a clear message
    src = meta["source"]
    saved = dtype_from_str(src["dtype"])
    dtype = saved if dtype is None else float_dtype(dtype)
    check_dtype(torch.device(device), dtype)  # e.g. a bf16 checkpoint on a GPU without bf16
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(f"config.json in '{directory}' could not be read ({exc}).") from exc
    tokenizer = None
    if any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = rebuild(config, meta["recipe"], dtype=dtype, device=device,
                    attn_implementation=src.get("attn_implementation"), tokenizer=tokenizer)
    if torch.device(device).type == "meta":  # structure only (looptool inspect): header checked, no data read
        check_weights(model, weights, cast=dtype != saved)
        return model.eval()
    bind_weights(model, weights, device=device, trainable=meta.get("trainable"), cast=dtype != saved)
    return model.eval()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed in 1 MiB blocks."""
    from looptool.backends.onnx_format import sha256_file as streamed

    return streamed(path, chunk=1 << 20)


def verify_files(directory: Path, meta: dict) -> None:
    """Refuse a file of ``directory`` whose size or sha256 differs from the one recorded in
    ``meta["files"]`` (looptool.json); models saved without checksums pass unchecked."""
    for name, want in meta.get("files", {}).items():
        path = directory / name
        if not path.exists() or path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its contents differ from the sha256 recorded in "
                                  f"{LOOPTOOL_JSON} at save; re-save or re-copy the model.")



def check_weights(model: LoopedModel, path: Path, *, cast: bool = False) -> dict[str, str]:
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
        raise CheckpointError(f"{path} could not be read as safetensors ({exc}); the file is corrupt, re-save the model.") from exc
    missing = [n for n in expected if aliases.get(n, n) not in header]
    extra = sorted(set(header) - {aliases.get(n, n) for n in expected})
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise CheckpointError(f"{path} does not match the model rebuilt from looptool.json ({what}); re-save the model.")
    for name, ref in expected.items():
        shape, dtype = header[aliases.get(name, name)]
        want, have = str(ref.dtype).removeprefix("torch."), _ST_DTYPES.get(dtype, dtype)
        if cast and ref.dtype.is_floating_point and have in _ST_FLOATS:
            have = want
        if shape != tuple(ref.shape) or have != want:
            raise CheckpointError(
                f"tensor '{name}' in {path} has shape {shape} {dtype}, the model expects "
                f"{tuple(ref.shape)} {want}; re-save the model."
            )
    return aliases


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32", "BOOL": "bool", "U8": "uint8", "I8": "int8"}
_ST_FLOATS = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)  # the dtypes a cast load accepts


_ALIGN = 64  # bytes: what torch's CPU allocator guarantees


def bind_weights(model: LoopedModel, path: Path, *, device: str, trainable=None, cast: bool = False) -> None:
    """Replace every (meta) tensor of ``model`` with the one stored in ``path`` (with
    ``cast``: converted to the dtype of the model's own tensor as it is read)."""
    aliases = check_weights(model, path, cast=cast)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            loaded = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as exc:
        raise CheckpointError(f"{path} could not be read as safetensors ({exc}); the file is corrupt, re-save the model.") from exc
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
