"""A ``looptool serve`` subprocess for the server tests: a free port on 127.0.0.1, started,
waited for (``/health``), its log kept for failure messages, terminated in a finaliser."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

import looptool
from looptool.testing import byte_tokenizer, tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_looped(directory: Path, plan, seed: int = 0) -> Path:
    """A tiny 3-layer Llama converted with ``plan``, its new parameters set to seeded non-zero
    values (so budgets differ), saved with the byte tokenizer and a chat template."""
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = looptool.convert(tiny_model("llama", num_layers=3, eos_token_id=10), plan, tokenizer=tok)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.save_pretrained(directory)


class ServerProcess:
    """``looptool serve DIR --port P ARGS...``; ``base`` is its /v1 URL. ``launcher`` replaces
    ``-m looptool`` (e.g. a script that installs a test double first)."""

    def __init__(
        self, model_dir: Path, *args: str, log: Path, timeout: float = 180.0, launcher: list[str] | None = None
    ):
        self.port = free_port()
        self.log = log
        self.base = f"http://127.0.0.1:{self.port}/v1"
        entry = launcher or ["-m", "looptool"]
        argv = [sys.executable, *entry, "serve", str(model_dir), "--port", str(self.port), *args]
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        """What the server printed so far."""
        self._log.flush()
        return self.log.read_text()

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name{labels}`` in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0
