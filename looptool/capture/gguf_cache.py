"""A cache of dequantised GGUF sources: a ``.gguf`` file is parsed and dequantised once.

transformers reads a GGUF file by parsing every metadata field with gguf's ``GGUFReader``,
mapping its tensor names and dequantising each tensor, then builds the tokenizer from the
same fields again: 24–27 s for SmolLM2-135M's Q4_1 file on the 2-core machine, 9–11 s with
the file parsed once (:func:`looptool.capture.sources._gguf_parsed_once`, which a miss uses),
of which dequantising is about 3 s. ``looptool convert smollm2``, ``looptool demo`` and a
distillation teacher would repeat that on every run. This cache keeps what one load
produced — the state dict (tied tensors once), the config and the tokenizer's files — as one
safetensors entry of the store :data:`looptool.cache.GGUF` under
``$LOOPTOOL_CACHE/gguf``, keyed by the file's sha256, the dtype and the torch / transformers /
gguf / looptool versions. A hit is
rebuilt by transformers' own ``from_pretrained`` of the entry (as ``model.safetensors`` beside
its config) and the tokenizer from its files, then checked against the entry tensor for tensor
and tie for tie; the weights are the dequantised values bit for bit.

The entry is checked like every looptool cache entry (sha256, key, versions); one that cannot
be used is dropped with a warning and the file is loaded afresh. ``LOOPTOOL_CACHE=off``
disables it. Entries are about four bytes per parameter in fp32 (SmolLM2: 540 MB).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from looptool.cache import GGUF, Store, caches, digest, enabled, file_sha256
from looptool.capture.tokenizer_cache import load_tokenizer
from looptool.core.version import __version__

log = logging.getLogger(__name__)

_ALIASES, _CONFIG, _TOKENIZER = "looptool_aliases", "looptool_config", "looptool_tokenizer"

Loaded = tuple[nn.Module, object | None]  # (model, tokenizer or None)


def versions() -> dict[str, str]:
    """What an entry was written by: a dequantisation or a model class may change with any."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        gguf = version("gguf")
    except PackageNotFoundError:  # the load itself says what to install
        gguf = "absent"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "gguf": gguf, "looptool": __version__}


def _store() -> Store:
    """This process's GGUF store (counts: "disk", served from an entry; "miss", dequantised; "dropped")."""
    return caches().gguf


def cached_load(path: Path, dtype: torch.dtype, load: Callable[[], Loaded]) -> Loaded:
    """``load()`` of the GGUF file ``path`` in ``dtype`` (model on the CPU, tokenizer or None),
    served from the cache when an entry for the file's contents holds it."""
    if not enabled():
        return load()
    key = {"format": GGUF.format, "gguf_sha256": file_sha256(path.resolve()), "dtype": str(dtype)}
    store, name = _store(), digest(key)

    def keep(loaded: Loaded) -> None:
        store.write(name, key, versions(), _encode(*loaded))

    # another process dequantising the same file: wait, read its entry
    return store.get_or_build(name, lambda: _read(path, name, key, dtype), load, keep, f"the dequantised {path.name}")


def _read(path: Path, name: str, key: dict, dtype: torch.dtype) -> Loaded | None:
    store = _store()
    found = store.load(name, key, versions(), lambda data: (_decode(data, dtype), None))
    if found is None:
        return None
    model, tokenizer = found
    model.config._name_or_path = model.name_or_path = str(path.parent)  # as a load of the file names them
    if tokenizer is not None:
        tokenizer.name_or_path = str(path.parent)
    log.info("GGUF cache: %s read from %s", path.name, store.directory())
    return found


def _unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state dict with each tied tensor under its first name only, and the other
    names of tied tensors (alias → that first name)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if where in first:
            aliases[name] = first[where]
        else:
            first[where] = name
            tensors[name] = t.detach()
    return tensors, aliases


def _encode(model: nn.Module, tokenizer) -> bytes:
    """The model's state dict (each tied tensor once, its other names as aliases), config and
    tokenizer files as one safetensors blob."""
    from safetensors.torch import save

    tensors, aliases = _unique_tensors(model)
    files: dict[str, str] = {}
    if tokenizer is not None:
        with tempfile.TemporaryDirectory(prefix="looptool-gguf-tok-") as tmp:
            tokenizer.save_pretrained(tmp)
            files = {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}
    meta = {
        "format": "pt",  # what transformers' loader asks of a safetensors file
        _ALIASES: json.dumps(aliases),
        _CONFIG: model.config.to_json_string(use_diff=False),
        _TOKENIZER: json.dumps(files) if tokenizer is not None else "null",
    }
    return save({k: t.contiguous() for k, t in tensors.items()}, metadata=meta)


def _decode(data: bytes, dtype: torch.dtype) -> Loaded:
    """The model (CPU, ``dtype``) and tokenizer an entry holds, built the way transformers
    builds a saved model (``from_pretrained`` of the entry as ``model.safetensors`` beside its
    config: ties and computed buffers as in any load); raises when the rebuilt state dict
    differs from the stored one, in a value or in which names share a tensor."""
    import transformers

    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    aliases = json.loads(meta[_ALIASES])
    files = json.loads(meta[_TOKENIZER])
    with tempfile.TemporaryDirectory(prefix="looptool-gguf-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(meta[_CONFIG])
        (folder / "model.safetensors").write_bytes(data)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=None)
        tokenizer = None
        if files is not None:
            tok = folder / "tokenizer"
            tok.mkdir()
            for name, text in files.items():
                (tok / name).write_text(text)
            tokenizer = load_tokenizer(tok)  # keyed by its files' contents: a hit, after the first time
    stored, got_aliases = _unique_tensors(model)
    if got_aliases != aliases:
        raise ValueError(f"the rebuilt model ties other tensors ({got_aliases}) than the stored one ({aliases})")
    from safetensors.torch import load

    want = load(data)
    if set(stored) != set(want) or any(not torch.equal(stored[k], v) for k, v in want.items()):
        raise ValueError("the model rebuilt from the entry differs from the stored state dict")
    return model, tokenizer
