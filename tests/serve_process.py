"""A ``looptool serve`` subprocess for the server tests: a free port on 127.0.0.1, started,
waited for (``/health``), its log kept for failure messages, terminated in a finaliser; and
:func:`served_on`, what the same server tests serve on each runtime (a looped model directory
on PyTorch, its exported engine directory on onnxruntime, its TensorRT engine directory under
the TensorRT test double) with the reference each answer is compared with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import looptool
from looptool.engine import OpenedEngine, open_engine
from looptool.engine.budgets import RowBudgets
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.runtime.generation import generate
from looptool.testing import byte_tokenizer, decode_loop, tiny_model

RUNTIMES = ("pytorch", "onnxruntime", "tensorrt")
FAKE_TRT_PROCESS = str(Path(__file__).with_name("fake_trt_process.py"))
HELD_PROCESS = str(Path(__file__).with_name("held_process.py"))

# What the structured-output and tool tests ask for: a small answer schema (every string and
# number bounded, so a tiny random model finishes it) and a tool whose arguments follow one.
PLACE_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["city", "n", "ok", "tags"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_looped(directory: Path, plan, seed: int = 0, eos: int = 10, model_type: str = "llama") -> Path:
    """A tiny 3-layer model (default Llama) converted with ``plan``, its new parameters set to
    seeded non-zero values (so budgets differ), saved with the byte tokenizer (EOS the byte
    ``eos``) and a chat template."""
    tok = byte_tokenizer(eos)
    tok.chat_template = CHAT_TEMPLATE
    model = looptool.convert(tiny_model(model_type, num_layers=3, eos_token_id=eos), plan, tokenizer=tok)
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
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
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


# ---------------------------------------------------------------------- one test, three runtimes
Alone = Callable[..., list[int]]  # (prompt ids, budget, max_tokens, sampling=GREEDY) -> the tokens, EOS included


@dataclass
class Served:
    """What the server tests serve on one runtime: the directory, the ``looptool serve``
    options and launcher that serve it there, and :attr:`alone`, the tokens a prompt gets
    generated alone at a budget on that runtime (what every batched answer must equal)."""

    runtime: str
    directory: Path
    args: tuple[str, ...]
    launcher: list[str] | None
    alone: Alone

    def start(self, *args: str, log: Path, hold: Path | None = None) -> ServerProcess:
        """A server of this directory on this runtime with ``args`` (checked to run there); with
        ``hold``, its running rows do not advance while that file exists (``held_process.py``)."""
        launcher = self.launcher
        if hold is not None:
            launcher = [HELD_PROCESS, str(hold), *(launcher or [])]
        proc = ServerProcess(self.directory, *self.args, *args, log=log, launcher=launcher)
        try:
            _wait_for_text(proc, f"runtime {self.runtime},")
        except BaseException:
            proc.stop()
            raise
        return proc


def _wait_for_text(proc: ServerProcess, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in the server's output:\n{proc.output()}")
        time.sleep(0.05)


def export_engine(model_dir: Path, output: Path, *args: str) -> Path:
    """``looptool export MODEL_DIR -o OUTPUT ARGS`` in this process, unvalidated (the export
    tests validate); the engine directory."""
    from typer.testing import CliRunner

    from looptool.cli import app

    res = CliRunner().invoke(app, ["export", str(model_dir), "-o", str(output), "--no-validate", *args])
    assert res.exit_code == 0, res.output
    return output


Shape = Callable[[torch.Tensor, list[int]], torch.Tensor]


def alone_on(
    opened: OpenedEngine,
    ids: list[int],
    budget: int,
    max_tokens: int,
    sampling: SamplingParams = GREEDY,
    shape: Shape | None = None,
):
    """The tokens ``ids`` gets alone at ``budget`` on ``opened``'s step engine (one row, a cache
    of its own, the shared prefill-then-decode loop), EOS included; ``shape(logits [1, vocab],
    tokens so far)`` (a test's own formula) changes each step's logits before the token is picked."""
    engine = opened.engine
    capacity = len(ids) + max_tokens
    cache = engine.allocate(1, capacity)
    history = list(ids)

    def step(input_ids, mask, position_ids, cache_position):
        if int(cache_position[0]) >= len(ids):  # a decode step feeds the token picked last
            history.append(int(input_ids[0, -1]))
        logits = engine.step(cache, slice(0, 1), input_ids, mask, position_ids, cache_position, RowBudgets((budget,)))
        return logits if shape is None else shape(logits.float(), history)

    out = decode_loop(
        step,
        torch.tensor([ids]),
        None,
        capacity=capacity,
        max_new_tokens=max_tokens,
        mask_dtype=engine.mask_dtype,
        sampling=sampling,
        eos_token_id=list(opened.eos),
    )
    return out.sequences[0, len(ids) :].tolist()


def served_on(runtime: str, model_dir: Path, model, workdir: Path) -> Served:
    """``model_dir`` (saved from ``model``) as ``runtime`` serves it: the looped model directory on
    PyTorch (the reference: :func:`looptool.runtime.generation.generate`); on onnxruntime, the
    looped model directory with ``--engine onnx``, its engine exported into ``workdir``; a TensorRT engine directory built there by the
    TensorRT test double (fp32: the tiny models' new parameters, N(0, 0.5²), overflow fp16 in
    PyTorch itself) and served by TensorRT's step engine in a process that has the double.
    An engine directory's reference is onnxruntime's step engine over it, one row alone (the
    double runs the TensorRT variants with onnxruntime, so they compute what its graphs do)."""
    if runtime == "pytorch":

        def alone(ids, budget, max_tokens, sampling=GREEDY, shape=None):
            if shape is not None:  # the test's own logits formula: the reference decode loop
                return alone_on(
                    open_engine(model_dir, runtime="pytorch", device="cpu"), ids, budget, max_tokens, sampling, shape
                )
            out = generate(
                model,
                torch.tensor([ids]),
                budget=budget,
                max_new_tokens=max_tokens,
                eos_token_id=model.tokenizer.eos_token_id,
                sampling=sampling,
            )
            return out.sequences[0, len(ids) :].tolist()

        return Served(runtime, Path(model_dir), ("--runtime", runtime, "--device", "cpu"), None, alone)
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    output = workdir / Path(model_dir).name  # the served model's name, as on PyTorch
    directory = output
    if runtime == "onnxruntime":  # exported as looptool serve MODEL_DIR --engine onnx does, which then reuses it
        from looptool.backends.engines import exported_engine

        engines, output = output, exported_engine(model_dir, output, validate=False).path  # output/per-loop
        directory = Path(model_dir)
        args = ("--runtime", runtime, "--threads", "1", "--engine", "onnx", "--engine-dir", str(engines), "--prepack")
        launcher = None
    else:
        import fake_tensorrt

        with pytest.MonkeyPatch.context() as patch:
            fake_tensorrt.install(patch)
            fake_tensorrt.pretend_gpu(patch)
            export_engine(model_dir, output, "--backend", "tensorrt", "--precision", "fp32")
        args, launcher = ("--runtime", runtime, "--device", "cpu"), [FAKE_TRT_PROCESS]
    opened = open_engine(output, runtime="onnxruntime", threads=1)

    def alone(ids, budget, max_tokens, sampling=GREEDY, shape=None):
        return alone_on(opened, ids, budget, max_tokens, sampling, shape)

    return Served(runtime, directory, args, launcher, alone)


def prompt_ids(i: int, length: int = 6) -> list[int]:
    """A seeded prompt of token ids (``length`` to ``length + 2`` tokens, by ``i``)."""
    return torch.randint(3, 250, (length + i % 3,), generator=torch.Generator().manual_seed(i)).tolist()


def budget_job(prompt: list[int], budget, max_tokens: int):
    """A scheduler job running ``prompt`` for ``max_tokens`` tokens (EOS ignored) at a fixed
    ``budget`` or, for an :class:`~looptool.engine.budgets.AutoRow`, at adaptive depth."""
    from looptool.engine.budgets import AutoRow
    from looptool.serve.scheduler import Job

    auto = budget if isinstance(budget, AutoRow) else None
    return Job(prompt, auto.max_budget if auto else budget, max_tokens, ignore_eos=True, auto=auto)


def alone_answer(run, prompt: list[int], budget, max_tokens: int) -> tuple[list[int], list[int]]:
    """Tokens and per-token depths of ``prompt`` generated alone by ``run`` (``generate`` bound
    to a model, or a runtime's ``generate``; EOS not stopping it where the caller's run says so):
    adaptive for an :class:`~looptool.engine.budgets.AutoRow` (its range and threshold), else
    fixed at ``budget`` under last-loop KV."""
    import torch

    from looptool.engine.budgets import AutoRow

    ids = torch.tensor([prompt])
    if isinstance(budget, AutoRow):
        auto = dict(min_budget=budget.min_budget, max_budget=budget.max_budget, exit_threshold=budget.exit_threshold)
        out = run(ids, budget="auto", **auto, max_new_tokens=max_tokens)
        depths = out.depths[0].tolist()
    else:
        out = run(ids, budget=budget, kv="last-loop", max_new_tokens=max_tokens)
        depths = [budget] * max_tokens
    return out.sequences[0, ids.shape[1] :].tolist(), depths


def run_jobs(engine, jobs: list, *, max_batch: int, start_after: int, shifts: list[int] | None = None):
    """Run scheduler ``jobs`` (:class:`looptool.serve.scheduler.Job` s, their ``emit`` set here)
    in process over ``engine``: the first ``start_after`` queued before the scheduler starts (one
    batch), the rest once a token came out (they arrive while the others run). Returns each
    job's events; ``shifts`` collects the cache shifts."""
    import threading

    from looptool.serve.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=max_batch, capacity=64, max_queue=len(jobs))
    if shifts is not None:
        real = scheduler.core.shift
        scheduler.core.shift = lambda n: shifts.append(n) or real(n)
    events: list[list] = [[] for _ in jobs]
    ended, first = threading.Semaphore(0), threading.Event()

    def emit(i: int):
        def put(event) -> None:
            events[i].append(event)
            first.set() if event.kind == "token" else None
            if event.kind in ("finished", "failed"):
                ended.release()

        return put

    for i, job in enumerate(jobs):
        job.emit = emit(i)
        scheduler.submit(job)
        if i + 1 == start_after:
            scheduler.start()
            assert first.wait(60)
    try:
        for _ in jobs:
            assert ended.acquire(timeout=120)
    finally:
        scheduler.stop(10)
    scheduler.events = events
    return scheduler
