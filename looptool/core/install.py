"""The pip command that adds an optional extra to looptool as it is installed here.

looptool is not on the package index: ``pip install 'looptool[serve]'`` fails for anyone who
installed it from a checkout. :func:`install_command` reads how this copy was installed (the
``direct_url.json`` pip records, PEP 610) and names the same source: the checkout (``-e`` when
the install is editable), the wheel or archive, or the VCS URL and revision; a copy imported
straight from a checkout that pip did not record names that checkout; only an install from an
index falls back to the project name.
"""

from __future__ import annotations

import json
import shlex
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

PROJECT = "looptool"


def install_command(extra: str) -> str:
    """``pip install ...`` that adds the optional dependencies ``extra`` to this looptool."""
    kind, source = _source()
    if kind == "editable":
        return f"pip install -e {shlex.quote(f'{source}[{extra}]')}"
    if kind == "path":  # a folder, wheel or archive on this machine
        return f"pip install {shlex.quote(f'{source}[{extra}]')}"
    if kind == "url":
        return f"pip install {shlex.quote(f'{PROJECT}[{extra}] @ {source}')}"
    return f"pip install {shlex.quote(f'{PROJECT}[{extra}]')}"


def _source() -> tuple[str, str]:
    """``(kind, source)`` of this copy: ``("editable" | "path", local path)``, ``("url", a URL
    pip takes after '@')`` or ``("index", "")``."""
    recorded = _direct_url()
    if recorded is not None:
        url = recorded.get("url", "")
        if "vcs_info" in recorded:
            vcs = recorded["vcs_info"]
            revision = vcs.get("requested_revision") or vcs.get("commit_id")
            return "url", f"{vcs.get('vcs', 'git')}+{url}" + (f"@{revision}" if revision else "")
        if url.startswith("file:"):
            editable = bool(recorded.get("dir_info", {}).get("editable"))
            return ("editable" if editable else "path"), url2pathname(unquote(urlparse(url).path))
        if url:
            return "url", url
    checkout = _checkout()
    return ("editable", str(checkout)) if checkout is not None else ("index", "")


def _direct_url() -> dict | None:
    """The installed distribution's ``direct_url.json`` (absent for an install from an index)."""
    try:
        text = metadata.distribution(PROJECT).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _checkout() -> Path | None:
    """The source checkout this package is imported from (its ``pyproject.toml`` names the
    project), or None."""
    root = Path(__file__).resolve().parents[2]
    project = root / "pyproject.toml"
    try:
        text = project.read_text(encoding="utf-8")
    except OSError:
        return None
    return root if f'name = "{PROJECT}"' in text else None
