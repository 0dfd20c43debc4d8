"""Hugging Face Hub model ids as sources, tested offline against a prepared cache (and a fake
Hub on localhost for the ways the Hub refuses)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import TINY_PLAN
from typer.testing import CliRunner

import looptool
from looptool.capture.sources import load_source, parse_hub_id
from looptool.cli import app
from looptool.core.errors import SourceError
from looptool.testing import save_to_hub_cache, tiny_model

MAIN = "a" * 40  # the commit refs/main points at
V1 = "b" * 40  # the commit of tag v1: another model

runner = CliRunner()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache in a temporary ``HF_HOME``, offline. huggingface_hub reads
    ``HF_HOME`` and ``HF_HUB_OFFLINE`` once, at import, so the constants it derives from them
    (read again at every call) are set as well as the environment."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"


@pytest.fixture
def cached_repo(hub_cache, tmp_path) -> Path:
    """``org/tiny`` in the cache: main → a tiny Llama (also saved as the local directory this
    returns), tag v1 → the same architecture with other weights."""
    save_to_hub_cache(tiny_model("llama"), "org/tiny", hub_cache, commit=MAIN)
    save_to_hub_cache(tiny_model("llama", seed=1), "org/tiny", hub_cache, commit=V1, refs=("v1",))
    local = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(local)
    return local


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_parse_hub_id():
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M@refs/pr/1") == ("HuggingFaceTB/SmolLM2-135M", "refs/pr/1")
    for not_an_id in ("name", "./org/name", "/abs/path", "a/b/c", "org/name@", "~/x", "C:/models"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_convert_by_hub_id_equals_local_directory(cached_repo, input_ids):
    by_id = looptool.convert("org/tiny", TINY_PLAN)
    local = looptool.convert(cached_repo, TINY_PLAN)
    assert _same_weights(by_id, local)
    with torch.no_grad():
        for k in TINY_PLAN.budgets:
            assert torch.equal(by_id(input_ids, budget=k).logits, local(input_ids, budget=k).logits)


def test_hub_revision_tag_and_commit(cached_repo):
    v1 = load_source("org/tiny@v1")
    assert v1.origin == f"org/tiny@{V1}"
    assert _same_weights(v1.model, tiny_model("llama", seed=1))
    pinned = load_source(f"org/tiny@{MAIN}")
    assert pinned.origin == f"org/tiny@{MAIN}" and _same_weights(pinned.model, tiny_model("llama"))


def test_local_path_wins_over_hub_id(cached_repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_model("llama", seed=2).save_pretrained(tmp_path / "org" / "tiny")
    src = load_source("org/tiny")
    assert src.origin == "org/tiny" and _same_weights(src.model, tiny_model("llama", seed=2))


def test_cli_convert_by_hub_id(cached_repo, tmp_path, input_ids):
    out = tmp_path / "looped"
    res = runner.invoke(app, ["convert", "org/tiny", "-o", str(out), "--window", "1:3", "--budgets", "0,1,2"])
    assert res.exit_code == 0, res.output
    looped, source = looptool.load(out), tiny_model("llama")  # a fresh conversion computes what its source computes
    with torch.no_grad():
        assert all(torch.equal(looped(input_ids, budget=k).logits, source(input_ids).logits) for k in looped.budgets)


def test_hub_home_from_the_environment(cached_repo, hub_cache):
    """A fresh process finds the cache through HF_HOME alone, as transformers would."""
    env = {**os.environ, "HF_HOME": str(hub_cache.parent), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from looptool.capture.sources import load_source; print(load_source('org/tiny@v1').origin)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == f"org/tiny@{V1}"


@pytest.mark.parametrize("spec", ["org/nope", "org/tiny@v9"])
def test_offline_not_cached_is_one_sentence(cached_repo, hub_cache, tmp_path, spec):
    with pytest.raises(
        SourceError, match=f"Hub model '{spec}' is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"
    ):
        load_source(spec)
    res = runner.invoke(app, ["convert", spec, "-o", str(tmp_path / "out")])
    assert res.exit_code == 1
    text = " ".join(res.output.split())  # rich wraps long lines
    assert text.count("error:") == 1 and "Traceback" not in text and "HF_HUB_OFFLINE is set" in text
    assert not (tmp_path / "out").exists()


def test_missing_source_mentions_hub_ids(tmp_path):
    with pytest.raises(SourceError, match="does not exist; pass a Hugging Face model directory, a Hub model id"):
        load_source(tmp_path / "nope")


class _FakeHub(BaseHTTPRequestHandler):
    """Answers every request the way the Hub refuses: by repository (and revision v9)."""

    REFUSALS = {
        "org/gated": (401, "GatedRepo"),
        "org/missing": (401, "RepoNotFound"),
        "org/gguf-only": (404, "EntryNotFound"),
    }

    def do_HEAD(self) -> None:
        repo = "/".join(self.path.split("/")[1:3])
        status, code = (404, "RevisionNotFound") if "/resolve/v9/" in self.path else self.REFUSALS[repo]
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_hub(hub_cache, monkeypatch):
    """The Hub endpoint pointed at a local server, online mode."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "spec, sentence",
    [
        ("org/gated", "Hub repository 'org/gated' is gated and no token with access to it was given; accept its terms"),
        ("org/missing", "Hub repository 'org/missing' does not exist \\(or is private"),
        ("org/missing@v9", "revision 'v9' does not exist in Hub repository 'org/missing'"),
        ("org/gguf-only", "Hub repository 'org/gguf-only' has no config.json, so it is not a transformers model"),
    ],
    ids=["gated", "missing", "revision", "no-config"],
)
def test_hub_refusals_are_one_sentence(fake_hub, spec, sentence):
    with pytest.raises(SourceError, match=sentence) as info:
        load_source(spec)
    assert info.value.__cause__ is None and "\n" not in str(info.value)


def test_no_network_is_one_sentence(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*args, **kwargs):  # what hf_hub_download raises after its retries when the Hub cannot be reached
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub ...")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(SourceError, match="could not be reached to fetch 'org/tiny' and it is not in the cache"):
        load_source("org/tiny")
