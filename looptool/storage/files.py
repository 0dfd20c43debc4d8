"""Output directories written atomically (temp dir, then rename), with the user's umask, and
file checksums. Every command that writes a folder goes through these helpers, so a failure
never leaves half-written output."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from looptool.core.errors import LooptoolError


def check_output_dir(directory: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite`` (and never a non-directory); callers
    run this before slow work so a bad target fails fast."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise LooptoolError(
            f"output directory '{final}' already exists; pass overwrite=True to replace it.", parameter="overwrite"
        )
    if final.exists() and not final.is_dir():
        raise LooptoolError(
            f"output path '{final}' exists and is not a directory; choose another path.", parameter="directory"
        )
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
    staging = (
        prepare_output_dir(folder, overwrite=False)[1]
        if fresh
        else Path(tempfile.mkdtemp(prefix=".results.", suffix=".tmp", dir=folder))
    )
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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed in ``chunk``-byte blocks (1 MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
