"""``looptool serve --replicas 2`` as a user runs it: a process that starts its own local Ray
cluster, serves a tiny fixed-prefix model from two replicas on 127.0.0.1, and on SIGTERM
drains (new requests get 503, ``/health`` says draining, a stream under way finishes whole)
and exits 0. Marked ``ray`` (CI's own step; the ``ray`` extra)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from serve_process import free_port, tiny_looped

import looptool
from looptool.runtime.generation import generate

pytestmark = pytest.mark.ray
pytest.importorskip("ray", reason="the Ray tests need the ray extra (pip install 'looptool[ray]')")


def test_sigterm_drains_every_replica_and_exits_zero(tmp_path):
    model_dir = tiny_looped(tmp_path / "tiny", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)))
    model = looptool.load(model_dir)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONUNBUFFERED": "1", "RAY_TMPDIR": "/tmp"}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "looptool", "serve", str(model_dir), "--port", str(port), "--replicas", "2",
         "--replica-cpus", "0.5", "--max-batch", "2", "--capacity", "96", "--runtime", "pytorch", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "serving at" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        ids = torch.randint(3, 250, (7,), generator=torch.Generator().manual_seed(0)).tolist()
        new = 40
        pieces: list[str] = []
        first = threading.Event()

        def stream():
            body = {
                "model": "tiny@2",
                "prompt": [ids],
                "max_tokens": new,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        item = json.loads(line[6:])
                        assert "error" not in item, item
                        if item["choices"]:
                            pieces.append(item["choices"][0]["text"])
                            first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the drain starts within a moment of the signal
            refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            if refused.status_code == 503:
                break
            assert time.monotonic() < deadline, refused.text
            time.sleep(0.1)
        assert "shutting down" in refused.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        reader.join(120)
        out = generate(model, torch.tensor([ids]), budget=2, max_new_tokens=new, eos_token_id=None)
        assert "".join(pieces) == model.tokenizer.decode(
            out.sequences[0, len(ids) :].tolist(), skip_special_tokens=True
        )
        assert proc.wait(120) == 0
        assert "server stopped" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
