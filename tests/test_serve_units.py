"""The server's parts without a server: the budget resolver and its effort ladder, stop
strings across token boundaries, the capacity check, the options checked before a load, the
scheduler's bookkeeping over a step engine that needs no model, and the app in process over
such an engine (request bodies' JSON types, unknown fields logged)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="looptool serve needs the serve extra (pip install 'looptool[serve]')")

from looptool.core.errors import LooptoolError  # noqa: E402
from looptool.engine import EngineFacts, StepEngine, StepResult, TensorSlotCache  # noqa: E402
from looptool.engine.interface import Capabilities, StepBatch  # noqa: E402
from looptool.serve.budgets import BudgetChoiceError, BudgetResolver, default_ladder, parse_effort  # noqa: E402
from looptool.serve.models import read_facts  # noqa: E402
from looptool.serve.prompts import check_room  # noqa: E402
from looptool.serve.protocol import APIError  # noqa: E402
from looptool.serve.scheduler import Job, QueueFull, Scheduler  # noqa: E402
from looptool.serve.server import ServeOptions  # noqa: E402
from looptool.serve.text import TextStream  # noqa: E402
from looptool.testing import byte_tokenizer  # noqa: E402

MENU = (0, 3, 6, 9, 12)


def test_default_ladder_spreads_the_levels_over_the_menu():
    assert default_ladder(MENU) == {
        "none": 0,
        "minimal": 0,
        "low": 3,
        "medium": 6,
        "high": 9,
        "xhigh": 12,
        "max": 12,
    }
    assert default_ladder((1, 2)) == {"none": 1, "minimal": 1, "low": 1, "medium": 2, "high": 2, "xhigh": 2, "max": 2}
    assert set(default_ladder((4,)).values()) == {4}


def test_effort_override_maps_named_levels_and_rounds_the_rest_to_the_nearest():
    ladder = parse_effort("low=0,high=12", MENU)
    assert ladder["low"] == 0 and ladder["high"] == 12
    assert ladder["minimal"] == 0 and ladder["none"] == 0  # nearest: low
    assert ladder["xhigh"] == 12 and ladder["max"] == 12  # nearest: high
    assert ladder["medium"] == 0  # equally near low and high: the cheaper
    assert parse_effort("medium=6", MENU) == dict.fromkeys(default_ladder(MENU), 6)


@pytest.mark.parametrize("text", ["low", "huge=3", "low=x", "low=4", ""])
def test_bad_effort_is_one_sentence(text):
    with pytest.raises(LooptoolError) as err:
        parse_effort(text, MENU)
    assert err.value.parameter == "effort" and str(err.value).endswith(".")


def test_resolver_takes_one_of_model_budget_and_effort():
    r = BudgetResolver.create("m", MENU, default=6)
    assert r.model_ids() == ["m", "m@0", "m@3", "m@6", "m@9", "m@12"]
    assert r.resolve("m") == 6 and r.resolve("m@9") == 9
    assert r.resolve("m", budget=3) == 3 and r.resolve("m", effort="xhigh") == 12
    assert r.resolve("m@3", budget=3, effort="low") == 3  # agreeing choices are fine
    with pytest.raises(BudgetChoiceError) as err:
        r.resolve("m@3", budget=6)
    assert err.value.status == 400 and err.value.parameter == "budget"
    for model in ("other", "m@5", "m@x", "m@"):
        with pytest.raises(BudgetChoiceError) as err:
            r.resolve(model)
        assert err.value.status == 404 and err.value.code == "model_not_found"
    assert BudgetResolver.create("m", MENU).default == 12  # default: the deepest
    with pytest.raises(LooptoolError, match="default_budget 5"):
        BudgetResolver.create("m", MENU, default=5)


def test_stop_strings_are_found_across_token_boundaries_and_held_back_until_sure():
    tok = byte_tokenizer()
    stream = TextStream(tok, ["END", "!!"])
    sent = [stream.push(t) for t in tok("abcEN")["input_ids"]]
    assert "".join(sent) == "abc"  # "EN" might start "END": held back
    assert stream.push(tok("D")["input_ids"][0]) == "" and stream.stopped and stream.text == "abc"
    plain = TextStream(tok)
    assert "".join(plain.push(t) for t in tok("no stops")["input_ids"]) + plain.finish() == "no stops"
    held = TextStream(tok, ["xyz"])
    assert "".join(held.push(t) for t in tok("abxy")["input_ids"]) + held.finish() == "abxy"  # the end releases it


def test_room_check_names_prompt_or_max_tokens():
    check_room(10, 54, 64)
    with pytest.raises(APIError) as err:
        check_room(64, None, 64)
    assert err.value.parameter == "prompt" and err.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as err:
        check_room(10, 55, 64)
    assert err.value.parameter == "max_tokens" and "at most 54" in str(err.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/dir"], "is not a directory"),
        (["/no/such/dir", "--max-batch", "0"], "--max-batch must be at least 1"),
        (["/no/such/dir", "--kv", "bogus"], "unknown KV cache policy"),
        (["/no/such/dir", "--max-queue", "-1"], "max_queue must be at least 0"),
        (
            ["/no/such/dir", "--tool-call-parser", "mistral"],
            "tool_call_parser 'mistral' is not known; use one of hermes",
        ),
    ],
)
def test_cli_bad_input_is_one_sentence_before_any_load(args, message):
    from typer.testing import CliRunner

    from looptool.cli import app

    res = CliRunner().invoke(app, ["serve", *args])
    assert res.exit_code == 1 and message in res.output, res.output


def test_the_budget_field_takes_integers_and_effort_levels_only():
    r = BudgetResolver.create("m", MENU)
    assert r.resolve("m", budget=9) == 9 and r.resolve("m", budget="low") == 3 and r.resolve("m", budget=0) == 0
    for bad, shown in (("6", '"6"'), (6.0, "6.0"), (True, "true"), ([6], "[6]"), ("huge", '"huge"')):
        with pytest.raises(BudgetChoiceError) as err:
            r.resolve("m", budget=bad)
        assert err.value.parameter == "budget" and f"got {shown}." in str(err.value), str(err.value)


# ------------------------------------------------------------------ the scheduler, no model
class _GatedEngine(StepEngine):
    """A step engine whose every row picks token 3; a prefill (more than one token) waits for
    ``gate`` after setting ``entered``, so a test can act while a request is being prefilled."""

    budgets = (0, 1)
    vocab_size = 8
    mask_dtype = torch.long
    capabilities = Capabilities("per-loop", "float32", LooptoolError("fixed budgets only"), LooptoolError("no verify"))

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()

    def allocate(self, slots: int, length: int) -> TensorSlotCache:
        return TensorSlotCache([torch.zeros(slots, 1, length, 1)])

    def run(self, cache, batch: StepBatch) -> StepResult:
        if batch.input_ids.shape[1] > 1:
            self.entered.set()
            assert self.gate.wait(30)
        logits = torch.zeros(batch.input_ids.shape[0], self.vocab_size)
        logits[:, 3] = 1.0
        return StepResult(logits, batch.budgets.tensor())


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _finished(batch: Scheduler, reason: str, budget: int = 0) -> float:
    return (
        batch.metrics.registry.get_sample_value(
            "looptool_requests_finished_total", {"budget": str(budget), "reason": reason}
        )
        or 0.0
    )


def test_a_request_being_prefilled_counts_against_the_queue_bound():
    """max_batch 2 + max_queue 1 holds three requests, whether they wait, are being prefilled
    or decode: with one request stuck in its prefill, two more are accepted, the next refused."""
    engine = _GatedEngine()
    batch = Scheduler(engine, max_batch=2, capacity=64, max_queue=1)
    batch.start()
    try:
        batch.submit(Job([1, 2], 0, 40))
        assert engine.entered.wait(10)  # taken off the queue, inside its prefill
        accepted = 0
        with pytest.raises(QueueFull):
            for _ in range(5):
                batch.submit(Job([1, 2], 0, 40))
                accepted += 1
        assert accepted == 2 and batch.held == 3
    finally:
        engine.gate.set()
        batch.stop(10)
    assert batch.held == 0


def test_a_request_ended_by_the_http_side_counts_under_its_reason():
    """A stop string ends a request as ``stop``, a client that left as ``cancelled``: both free
    the slot at the next step and count once, under that reason. The request's first token
    holds the scheduler until the test has ended it, so it cannot reach its length first
    however fast the scheduler runs or however late the test thread wakes."""
    engine = _GatedEngine()
    engine.gate.set()
    batch = Scheduler(engine, max_batch=2, capacity=64, max_queue=0)
    batch.start()
    try:
        for reason in ("stop", "cancelled"):
            token, ended = threading.Event(), threading.Event()

            def emit(event, token=token, ended=ended):
                token.set()
                assert ended.wait(30)  # no further step until the HTTP side ended the job

            job = Job([1, 2], 0, 10_000, emit=emit)
            batch.submit(job)
            assert token.wait(10)
            batch.cancel(job, reason)
            ended.set()
            _wait_for(lambda: batch.held == 0 and batch.running == 0)
        assert _finished(batch, "stop") == 1 and _finished(batch, "cancelled") == 1 and _finished(batch, "length") == 0
        batch.cancel(job, "stop")  # a job that already left is left alone
        assert _finished(batch, "stop") == 1
    finally:
        batch.stop(10)


def test_a_request_the_engine_finished_counts_under_the_reason_its_client_got():
    """The HTTP side may find a stop string only after the engine ran the job to its length:
    such a job is counted once, as ``stop``, when its consumer names the reason; a job nobody
    consumes that way is counted by the engine as before."""
    engine = _GatedEngine()
    engine.gate.set()
    batch = Scheduler(engine, max_batch=2, capacity=64, max_queue=0)
    batch.start()
    try:
        finished = threading.Event()
        job = Job([1, 2], 0, 3, emit=lambda event: event.kind == "finished" and finished.set(), consumer_counts=True)
        batch.submit(job)
        assert finished.wait(10)
        assert _finished(batch, "length") == 0 and _finished(batch, "stop") == 0  # held for the consumer
        batch.cancel(job, "stop")
        batch.cancel(job, "stop")  # counted once
        assert _finished(batch, "stop") == 1 and _finished(batch, "length") == 0
        plain = Job([1, 2], 0, 3)
        batch.submit(plain)
        _wait_for(lambda: _finished(batch, "length") == 1)
    finally:
        batch.stop(10)


class _SummingEngine(StepEngine):
    """A step engine whose cache holds the tokens fed (one position each) and whose next token
    is the sum of every token its row attends to, modulo the vocabulary: any position a row
    loses, gains or shares with another row changes its tokens. It records each decode step's
    mask width and cache length."""

    budgets = (0,)
    vocab_size = 97
    mask_dtype = torch.long
    capabilities = Capabilities("per-loop", "int64", LooptoolError("fixed budgets only"), LooptoolError("no verify"))

    def __init__(self) -> None:
        self.widths: list[tuple[int, int, int]] = []  # (mask width, cache length, positions of the longest row)

    def allocate(self, slots: int, length: int) -> TensorSlotCache:
        self.moves: list[str] = []
        cache = TensorSlotCache([torch.zeros(slots, 1, length, 1, dtype=torch.long)])
        for name in ("shift_left", "shift_right", "resize"):
            method = getattr(cache, name)
            setattr(cache, name, lambda n, method=method, name=name: (self.moves.append(name), method(n)))
        return cache

    def run(self, cache, batch: StepBatch) -> StepResult:
        rows, input_ids, attention_mask, position_ids, cache_position = batch.rows, *batch.inputs
        width = attention_mask.shape[1]
        buffer = cache.buffers[0][rows, 0, :width, 0]  # a view: written in place
        buffer[:, cache_position] = input_ids
        if rows.start == 0 and input_ids.shape[1] == 1:  # a decode step (every running row) or a first prefill
            self.widths.append((width, cache.length, int(position_ids.max()) + 1))
        total = (buffer * attention_mask).sum(dim=1) % self.vocab_size
        return StepResult(torch.nn.functional.one_hot(total, self.vocab_size).float(), batch.budgets.tensor())


def _sums_alone(prompt: list[int], new: int, vocab: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(sum(ids) % vocab)
    return ids[len(prompt) :]


def test_the_slot_cache_holds_what_the_rows_need_and_every_row_keeps_its_tokens():
    """Requests of mixed prompt and answer lengths, arriving while others run: every answer is
    what its request gives alone (no row loses, gains or shares a position while the cache
    grows, drops old positions, moves right for a long prompt and shrinks again), and no step
    attends over more than twice the positions the rows hold (64 at the least) although the
    capacity is 1024. Each request arrives as the one before it gets its first token (submitted
    from the scheduler thread), so the schedule is the same at any machine speed."""
    engine = _SummingEngine()
    batch = Scheduler(engine, max_batch=3, capacity=1024, max_queue=16)
    rng = torch.Generator().manual_seed(0)
    shapes = [(3, 40), (150, 30), (5, 200), (90, 5), (2, 3), (400, 20), (7, 60), (1, 1), (30, 100), (12, 12)]
    jobs, answers = [], {}

    def emit(i):
        def put(event):
            answers.setdefault(i, []).append(event)
            if len(answers[i]) == 1 and i + 1 < len(jobs):  # its first token: the next request arrives
                batch.submit(jobs[i + 1][0])

        return put

    for i, (n, new) in enumerate(shapes):
        prompt = torch.randint(0, 97, (n,), generator=rng).tolist()
        jobs.append((Job(prompt, 0, new, emit=emit(i)), prompt, new))
    batch.start()
    try:
        batch.submit(jobs[0][0])
        _wait_for(lambda: len(answers) == len(jobs) and batch.held == 0, timeout=60)
    finally:
        batch.stop(10)
    for i, (_, prompt, new) in enumerate(jobs):
        tokens = [e.token for e in answers[i] if e.kind == "token"]
        assert tokens == _sums_alone(prompt, new, 97), f"request {i}"
    assert {"shift_left", "shift_right", "resize"} <= set(engine.moves)
    lengths = {length for _, length, _ in engine.widths}
    assert max(lengths) > 400 and min(lengths) == 64  # grew for the long prompt; the first request's steps: 64
    for width, length, longest in engine.widths:
        assert width <= max(64, 2 * longest) and length <= max(64, 4 * (width + 1))


# ------------------------------------------------------------------ options checked before a load
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from serve_process import tiny_looped

    import looptool

    return tiny_looped(tmp_path_factory.mktemp("facts") / "tiny", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))


def test_facts_and_the_default_capacity_come_from_the_saved_plan_and_config(saved):
    facts = read_facts(saved)
    assert facts == EngineFacts((0, 2), 2048)  # the tiny Llama's max_position_embeddings
    assert ServeOptions().for_model(facts, "m").capacity == 1024
    assert ServeOptions().for_model(EngineFacts((0, 2), 128), "m").capacity == 128  # a short context caps the default
    assert ServeOptions(capacity=300).for_model(EngineFacts((0, 2), None), "m").capacity == 300
    resolved = ServeOptions().for_model(facts, "m")  # the defaults: a prefix cache of 1 GiB, KV memory by free memory
    assert (resolved.prefix_cache_bytes, resolved.kv_memory) == (1 << 30, None)
    resolved = ServeOptions(prefix_cache=False, kv_memory_mb=64).for_model(facts, "m")
    assert (resolved.prefix_cache_bytes, resolved.kv_memory) == (None, 64 << 20)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--default-budget", "5"], "default_budget 5 is not in the budget menu [0, 2]"),
        (["--effort", "low=1"], "effort low=1: 1 is not in the budget menu [0, 2]"),
        (["--capacity", "4096"], "capacity 4096 exceeds the model's context of 2048 positions"),
        (["--served-model-name", "a@b"], "may not contain '@'"),
        (["--kv-memory", "0"], "the KV memory must be a positive number of MiB, got 0. (option --kv-memory)"),
        (["--replicas", "0"], "replicas must be at least 1, got 0. (option --replicas)"),
        (
            ["--replicas", "2", "--router", "random"],
            "unknown router 'random'; use one of depth, ray. (option --router)",
        ),
        (["--replicas", "2", "--min-replicas", "3"], "autoscaling needs 0 <= min_replicas <= replicas <= max_replicas"),
        (
            ["--prefix-cache-mb", "-1"],
            "the prefix cache must be a positive number of MiB, got -1. (option --prefix-cache-mb)",
        ),
    ],
)
def test_options_are_checked_against_the_model_before_it_loads(saved, monkeypatch, args, message):
    from typer.testing import CliRunner

    from looptool.cli import app

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before its options were checked")

    monkeypatch.setattr("looptool.serve.server.open_model", no_load)
    res = CliRunner().invoke(app, ["serve", str(saved), "--port", "0", *args])
    assert res.exit_code == 1 and message in res.output and "serving" not in res.output, res.output


def test_replicas_without_the_ray_extra_is_one_sentence_naming_it(saved, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from looptool.cli import app

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray.serve" else find_spec(name, *a)
    )
    res = CliRunner().invoke(app, ["serve", str(saved), "--port", "0", "--replicas", "2"])
    assert res.exit_code == 1 and "serving on Ray needs the 'ray' extra (ray.serve not installed)" in res.output, (
        res.output
    )
    assert "looptool[ray]" in res.output or "[ray]" in res.output


def test_a_port_in_use_is_one_sentence_before_the_load(saved, monkeypatch):
    from typer.testing import CliRunner

    from looptool.cli import app

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr("looptool.serve.server.open_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", str(saved), "--port", str(port)])
    assert res.exit_code == 1, res.output
    assert f"port {port} on 127.0.0.1 is already in use" in res.output and "serving" not in res.output
    assert "Errno" not in res.output and "Traceback" not in res.output


def test_a_port_a_loading_server_holds_is_refused_before_the_load(saved, monkeypatch):
    """A second server on the port of one that has bound it but is still loading (so uvicorn
    does not listen yet) is refused in one sentence, exit 1, before its own load; and it is
    refused again while the first waits on its ``--engine onnx`` export."""
    from typer.testing import CliRunner

    from looptool.cli import app
    from looptool.serve.server import bind

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    def no_export(*args, **kwargs):
        raise AssertionError("the engine was exported before the port was checked")

    monkeypatch.setattr("looptool.serve.server.open_model", no_load)
    monkeypatch.setattr("looptool.cli.serve.onnx_engine_of", no_export)
    first = bind("127.0.0.1", 0)  # what a loading `looptool serve` holds
    try:
        port = first.getsockname()[1]
        for engine in ("as-is", "onnx"):
            res = CliRunner().invoke(app, ["serve", str(saved), "--port", str(port), "--engine", engine])
            assert res.exit_code == 1, res.output
            assert f"port {port} on 127.0.0.1 is already in use" in res.output and "serving" not in res.output
            assert "Errno" not in res.output and "Traceback" not in res.output
        with pytest.raises(LooptoolError, match="already in use"):
            bind("127.0.0.1", port).close()
    finally:
        first.close()
    bind("127.0.0.1", port).close()  # free again once the first server is gone


# ------------------------------------------------------------------ the disconnect watcher
class _Client:
    """A request whose client goes away when ``gone`` is set; counts the connection checks."""

    def __init__(self) -> None:
        self.checks, self.gone = 0, False

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.gone


class _Cancels:
    """A scheduler that records what the HTTP side cancels."""

    def __init__(self) -> None:
        self.cancelled: list[tuple[Job, str]] = []

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        self.cancelled.append((job, reason))


def test_a_non_streamed_request_checks_its_connection_once_per_poll_with_one_watcher():
    """The jobs of one non-streamed request (two prompts) share one watcher: however many tokens
    arrive, the connection is checked once every DISCONNECT_POLL seconds, and a client that
    leaves ends every job within a poll (each cancelled once, as ``cancelled``): at the first
    check after it left, counted in checks rather than timed, so a slow machine passes too."""
    from looptool.serve.app import DISCONNECT_POLL, _collect
    from looptool.serve.choices import Choice
    from looptool.serve.scheduler import Event

    async def scenario():
        client, scheduler = _Client(), _Cancels()
        jobs = [Job([1], 0, 10_000), Job([1], 0, 10_000)]
        queues = [asyncio.Queue(), asyncio.Queue()]
        choices = [Choice(i, byte_tokenizer(), []) for i in range(2)]
        collect = asyncio.create_task(_collect(scheduler, jobs, queues, choices, client))
        start = time.monotonic()
        while client.checks < 3 or len(choices[0].tokens) <= 20:  # a token every millisecond or so
            assert time.monotonic() - start < 60, "the watcher did not check the connection"
            for queue in queues:
                queue.put_nowait(Event("token", token=ord("a")))
            await asyncio.sleep(0.001)
        tokens, checks, polled = len(choices[0].tokens), client.checks, time.monotonic() - start
        client.gone = True
        await asyncio.wait_for(collect, 60)
        return client, scheduler, jobs, tokens, checks, polled

    client, scheduler, jobs, tokens, checks, polled = asyncio.run(scenario())
    assert tokens > 20  # many more tokens than checks
    assert checks <= polled / DISCONNECT_POLL + 2, (checks, polled)  # by the clock, not per token
    assert client.checks == checks + 1  # the first check after the client left ended the request
    assert sorted((id(j), r) for j, r in scheduler.cancelled) == sorted((id(j), "cancelled") for j in jobs)


def test_a_finished_request_stops_its_watcher():
    """A request whose jobs finish leaves no watcher behind: the connection is not checked after."""
    from looptool.serve.app import DISCONNECT_POLL, _collect
    from looptool.serve.choices import Choice
    from looptool.serve.scheduler import Event

    async def scenario():
        client, scheduler = _Client(), _Cancels()
        job, queue = Job([1], 0, 1), asyncio.Queue()
        choice = Choice(0, byte_tokenizer(), [])
        queue.put_nowait(Event("token", token=ord("a")))
        queue.put_nowait(Event("finished", reason="length"))
        await _collect(scheduler, [job], [queue], [choice], client)
        await asyncio.sleep(3 * DISCONNECT_POLL)
        return client, scheduler, choice, asyncio.all_tasks()

    client, scheduler, choice, tasks = asyncio.run(scenario())
    assert choice.reason == "length" and choice.tokens == [ord("a")]
    assert client.checks == 0 and len(tasks) == 1  # only the scenario itself runs
    assert [r for _, r in scheduler.cancelled] == ["length"]  # the reason its client got, counted if held back


# ------------------------------------------------------------------ options resolved once
def test_options_are_resolved_once_before_the_load_and_the_server_takes_only_resolved_ones(saved, monkeypatch):
    """``prepare`` resolves the options against the model's facts once, before anything loads
    (the resolver it builds is the one the server answers with); a server given options not
    resolved for its model refuses them."""
    import looptool.serve.server as server_module
    from looptool.serve.models import ServedModel

    created = []
    real_create = BudgetResolver.create.__func__

    def counting(cls, *args, **kwargs):
        created.append(args)
        return real_create(cls, *args, **kwargs)

    monkeypatch.setattr(BudgetResolver, "create", classmethod(counting))
    engine = _GatedEngine()
    engine.gate.set()
    engine.budgets = (0, 2)
    opened = []

    def fake_open(path, *, name, **kwargs):
        assert len(created) == 1  # resolved before the load
        opened.append(ServedModel.of(name, engine, byte_tokenizer(), {}, (), "cpu", "pytorch"))
        return opened[-1]

    monkeypatch.setattr(server_module, "open_model", fake_open)
    server = server_module.prepare(saved, ServeOptions(port=0, max_batch=2, default_budget=0))
    try:
        assert len(created) == 1 and isinstance(server.options, server_module.ResolvedOptions)
        assert server.options.capacity == 1024 and server.resolver is server.options.resolver
        assert server.resolver.default == 0 and server.model_ids == ["tiny", "tiny@0", "tiny@2"]
    finally:
        server.socket.close()
        server.scheduler.stop(10)
    with pytest.raises(TypeError, match="resolved for the model"):
        server_module.Server(opened[0], ServeOptions(port=0))
    other = ServeOptions(port=0).for_model(EngineFacts((0, 1), None), "tiny")
    with pytest.raises(LooptoolError, match=r"budget menu \[0, 1\]"):
        server_module.Server(opened[0], other)


def test_a_cpu_server_over_a_looped_model_points_at_the_onnx_engine():
    """The start-up hint names the export and serve commands for a looped model served by
    PyTorch on a CPU, and says nothing for an engine directory or a GPU."""
    from pathlib import Path

    from looptool.cli.serve import default_engine_dir, faster_engine_hint

    assert default_engine_dir(Path("models/looped")) == Path("models/looped-onnx")  # --engine-dir's default
    hint = faster_engine_hint(Path("looped"), "pytorch", "cpu")
    assert "looptool serve looped --engine onnx" in hint
    assert "looptool export looped -o looped-engine" in hint and "looptool serve looped-engine" in hint
    assert faster_engine_hint(Path("engines"), "onnxruntime", "cpu") == ""
    assert faster_engine_hint(Path("looped"), "pytorch", "cuda:0") == ""


@pytest.fixture(scope="module")
def per_loop_engine(saved, tmp_path_factory):
    """The engine ``looptool serve SAVED --engine onnx`` keeps for its default options, exported
    once here (not validated: export_onnx's own tests validate), read-only for the tests."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    from looptool.backends.engines import exported_engine

    return exported_engine(saved, tmp_path_factory.mktemp("engines"), validate=False)


def _files(directory):
    """Every file under ``directory`` with its bytes: what an overwrite would change."""
    return {f.relative_to(directory): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def test_the_onnx_engine_of_a_looped_model_is_kept_per_option_set_with_its_source(
    saved, per_loop_engine, tmp_path, monkeypatch
):
    """``exported_engine`` (what ``looptool serve --engine onnx`` runs) exports into the subfolder
    of its folder named by the options, recording the model files' sha256; it reuses that engine
    while they are unchanged, exports it again when they change or it lacks a graph its options
    need, keeps every other option set (KV policy, verify graphs, exit rule, quantization) in a
    folder of its own without touching this one, and never writes into a directory it did not
    write; the engine (one looped graph) opens with onnxruntime's packing on by default and its
    spinning on as ``looptool serve`` opens it, and off when asked (``--no-prepack``, ``--no-spin``)."""
    import json
    import shutil
    from pathlib import Path

    from looptool.backends import engines
    from looptool.backends.errors import ExportError
    from looptool.backends.manifest import Manifest
    from looptool.core.graph import ROWWISE

    kept = per_loop_engine
    assert kept.path.name == "per-loop" and kept.exported == "no engine there yet"
    assert kept.bytes == sum(len(data) for data in _files(kept.path).values()) > 0
    stamp = json.loads((kept.path / engines.SOURCE_STAMP).read_text())
    assert (kept.path / "manifest.json").is_file() and set(stamp) == {"looptool.json", "model.safetensors"}
    root = tmp_path / "engines"
    out = shutil.copytree(kept.path, root / "per-loop")
    exports = []

    def export(model, output, backend, budgets, *, options, **kwargs):
        exports.append((Path(output).name, options))
        Path(output).mkdir(exist_ok=True)

    monkeypatch.setattr(engines, "export_engines", export)
    assert engines.exported_engine(saved, root) == engines.KeptEngine(out, kept.bytes, None)  # unchanged: reused
    assert engines.exported_engine(saved, root, precision="fp32").path == out  # a float precision: the same engine
    assert exports == []
    from looptool.engine import open_engine

    # the default engine is one looped graph: one session, so it packs its weights once, and it spins
    # as looptool serve opens it (spin None: the runtime's choice for one session)
    for session, want in (({"spin": None}, ("1", True)), ({"prepack": False}, ("0", False))):
        runtime = open_engine(kept.path, runtime="onnxruntime", threads=1, **session).engine.runtime
        assert runtime.one_graph and runtime.budgets == ()
        options = runtime.session(ROWWISE).get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == want[0]
        assert runtime.prepack is want[1]
    older = Manifest.read(kept.path)  # as an engine of a graph per budget (before one looped graph)
    older.graphs[0] = {"per-loop": older.graphs[ROWWISE]["per-loop"]}
    assert engines.EngineOptions.of().missing_from(older) == (
        "it runs a graph per budget; one looped graph now serves every budget"
    )
    mine = _files(out)
    for options, folder, wanted in (
        ({"speculative": True}, "per-loop-speculative", {"speculative": True}),
        ({"kv": "last-loop", "adaptive": True}, "last-loop-adaptive-state", {"kv": "last-loop", "adaptive": True}),
        ({"kv": "last-loop", "adaptive": "kl"}, "last-loop-adaptive-kl", {"kv": "last-loop", "adaptive": "kl"}),
        ({"precision": "int8"}, "per-loop-int8", {"quantize": "int8"}),
    ):
        got = engines.exported_engine(saved, root, **options)
        assert got.path == root / folder and got.exported == "no engine there yet"
        assert exports[-1][0] == folder and exports[-1][1].items() >= wanted.items()
    assert _files(out) == mine and len(exports) == 4  # the per-loop engine: neither mistaken nor overwritten
    shutil.rmtree(root / "per-loop-speculative")
    shutil.copytree(out, root / "per-loop-speculative")  # as if an older looptool had left it there
    got = engines.exported_engine(saved, root, speculative=True)
    assert got.exported == "this engine lacks the verify graphs speculative decoding needs"
    assert exports[-1][0] == "per-loop-speculative"
    auto = shutil.copytree(out, root / "per-loop-adaptive-state")
    manifest = json.loads((auto / "manifest.json").read_text())
    manifest["adaptive"] = {"state": {"per-loop": manifest["rowwise"]["per-loop"]}}  # as if exported with it
    (auto / "manifest.json").write_text(json.dumps(manifest))
    assert engines.exported_engine(saved, root, adaptive=True).exported is None  # True is the state rule: held
    (out / engines.SOURCE_STAMP).write_text(json.dumps({**stamp, "model.safetensors": "0" * 64}))
    assert engines.exported_engine(saved, root).exported == "model files changed"
    assert exports[-1][0] == "per-loop" and len(exports) == 6  # another model's engine: exported again
    with pytest.raises(ExportError, match="is an engine directory, not a folder of engines"):
        engines.exported_engine(saved, kept.path)  # looptool export -o wrote it: not a folder of engines
    (tmp_path / "mine" / "per-loop").mkdir(parents=True)
    (tmp_path / "mine" / "per-loop" / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="was not written by exported_engine"):
        engines.exported_engine(saved, tmp_path / "mine")
    assert (tmp_path / "mine" / "per-loop" / "notes.txt").read_text() == "keep" and len(exports) == 6


def test_serve_engine_onnx_keeps_an_engine_per_kv_policy_and_says_which_and_why(
    saved, per_loop_engine, tmp_path, monkeypatch
):
    """``looptool serve MODEL --engine onnx`` after ``--kv last-loop`` (and back) serves two
    engines, each exported once into its own folder and then reused, neither mistaken for nor
    overwritten by the other; a start-up line names the folder, its size and why it was
    exported (or that it was reused)."""
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from looptool.backends import engines
    from looptool.backends.manifest import Manifest
    from looptool.cli import app
    from looptool.report.tables import human_bytes

    root = tmp_path / "engines"
    shutil.copytree(per_loop_engine.path, root / "per-loop")  # a plain serve --engine onnx exported it before
    exports, served = [], []
    export_engines = engines.export_engines

    def export(model, output, *args, **kwargs):
        exports.append(Path(output).name)
        return export_engines(model, output, *args, **{**kwargs, "validate": False})  # export_onnx's tests validate

    def prepare(model_dir, options, *, kv, sock, **kwargs):  # what the server would serve, without serving it
        sock.close()
        served.append((Path(model_dir), kv, Manifest.read(model_dir).kv_policies))
        return SimpleNamespace(
            served=SimpleNamespace(runtime="onnxruntime", device="cpu"), model_ids=["tiny"], url="", run=lambda: None
        )

    monkeypatch.setattr(engines, "export_engines", export)
    monkeypatch.setattr("looptool.serve.prepare", prepare)

    def serve(*args):
        res = CliRunner().invoke(
            app, ["serve", str(saved), "--port", "0", "--engine", "onnx", "--engine-dir", str(root), *args]
        )
        assert res.exit_code == 0, res.output
        return res.output

    last_loop = root / "last-loop-adaptive-state"
    logs = [serve("--kv", "last-loop")]
    exported = _files(last_loop)
    logs += [serve(), serve("--kv", "last-loop"), serve()]
    assert exports == [last_loop.name]  # once, then reused
    assert served == [(last_loop, "last-loop", ("last-loop",)), (root / "per-loop", "per-loop", ("per-loop",))] * 2
    assert _files(last_loop) == exported and _files(root / "per-loop") == _files(per_loop_engine.path)  # kept as is
    size = human_bytes(sum(len(data) for data in exported.values()))
    assert f"exported the engine to {last_loop} ({size}): no engine there yet" in logs[0]
    assert f"reused the engine in {last_loop} ({size})" in logs[2]
    assert f"reused the engine in {root / 'per-loop'} ({human_bytes(per_loop_engine.bytes)})" in logs[1]
    # --engine-dir's default: MODEL-onnx beside the model (here holding the same per-loop engine)
    model = shutil.copytree(saved, tmp_path / "beside" / "tiny")
    shutil.copytree(per_loop_engine.path, tmp_path / "beside" / "tiny-onnx" / "per-loop")
    res = CliRunner().invoke(app, ["serve", str(model), "--port", "0", "--engine", "onnx"])
    assert res.exit_code == 0, res.output
    assert f"reused the engine in {tmp_path / 'beside' / 'tiny-onnx' / 'per-loop'}" in res.output
    assert exports == [last_loop.name] and served[-1][0] == tmp_path / "beside" / "tiny-onnx" / "per-loop"


# ------------------------------------------------------------------ request bodies, in process
class _Ungated(_GatedEngine):
    """A :class:`_GatedEngine` over the byte vocabulary whose prefills never wait."""

    vocab_size = 256

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()


@contextlib.contextmanager
def _app_client():
    """A test client of a fresh app (create_app) over :class:`_Ungated`, in this process."""
    from fastapi.testclient import TestClient

    from looptool.serve.app import create_app
    from looptool.serve.models import ServedModel

    engine = _Ungated()
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    costs = {k: {"budget": k, "layer_executions": k + 1, "kv_bytes_per_token": 8} for k in engine.budgets}
    served = ServedModel.of("m", engine, tok, costs, (), "cpu", "pytorch")
    scheduler = Scheduler(engine, max_batch=2, capacity=64, max_queue=4)
    with TestClient(create_app(served, scheduler, BudgetResolver.create("m", engine.budgets))) as client:
        yield client


@pytest.fixture(scope="module")
def api():
    with _app_client() as client:
        yield client


COMPLETION, CHAT = {"model": "m", "prompt": "a"}, {"model": "m", "messages": [{"role": "user", "content": "a"}]}
WRONG_TYPES = [  # (endpoint, fields sent, the field the 400 names)
    *(("completions", {"max_tokens": v}, "max_tokens") for v in ("4", 4.0, True, "many")),
    *(("completions", {"temperature": v}, "temperature") for v in ("0.5", True, "hot")),
    *(("completions", {"top_p": v}, "top_p") for v in ("1", False)),
    *(("completions", {"top_k": v}, "top_k") for v in ("5", 5.0, True)),
    *(("completions", {"seed": v}, "seed") for v in ("1", 1.5, True)),
    *(("completions", {"n": v}, "n") for v in ("1", 1.0, True)),
    *(("completions", {"logprobs": v}, "logprobs") for v in ("1", 1.0, True)),
    *(("completions", {"echo": v}, "echo") for v in ("true", 1)),
    *(("completions", {"stream": v}, "stream") for v in ("true", 0)),
    ("completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ("completions", {"stream_options": 1}, "stream_options"),
    *(("completions", {"draft_tokens": v}, "draft_tokens") for v in ("4", 4.0, True)),
    ("completions", {"budget": "1"}, "budget"),
    ("completions", {"model": 1}, "model"),
    ("completions", {"reasoning_effort": 1}, "reasoning_effort"),
    *(("completions", {"prompt": v}, "prompt") for v in (5, [1.0], [True], [["a"]])),
    ("completions", {"stop": 3}, "stop"),
    *(("chat/completions", {"max_tokens": v}, "max_tokens") for v in ("4", 4.0, True)),
    *(("chat/completions", {"max_completion_tokens": v}, "max_completion_tokens") for v in ("4", 4.0, True)),
    *(("chat/completions", {"logprobs": v}, "logprobs") for v in (1, "true")),
    ("chat/completions", {"temperature": "0.5"}, "temperature"),
    ("chat/completions", {"seed": "1"}, "seed"),
    ("chat/completions", {"stream": "true"}, "stream"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": 1, "content": "a"}]}, "messages.0.role"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), WRONG_TYPES, ids=[str(i) for i in range(len(WRONG_TYPES))])
def test_a_field_of_the_wrong_json_type_is_one_400_naming_it(api, endpoint, fields, param):
    """Every declared field takes its JSON type only: integers a JSON integer (not "4", 4.0 or
    true), numbers a JSON number (not "0.5" or true), booleans true or false, as ``budget`` does;
    anything else is one sentence naming the field and what it got."""
    body = {**(COMPLETION if endpoint == "completions" else CHAT), **fields}
    r = api.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert message.startswith(f"{param} must be ") and ", got " in message, message
    assert message.endswith(".") and ". " not in message, message


def test_well_typed_requests_are_served_with_integers_for_number_fields(api):
    """JSON integers are numbers: temperature 0, top_p 1 and so on are served, on both
    endpoints, streamed or not."""
    sampling = {"temperature": 0, "top_p": 1, "top_k": 5, "seed": 1, "n": 1, "ignore_eos": False}
    r = api.post("/v1/completions", json={**COMPLETION, **sampling, "max_tokens": 2, "echo": False, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and r.json()["choices"][0]["logprobs"] is not None
    r = api.post("/v1/chat/completions", json={**CHAT, **sampling, "max_completion_tokens": 3, "logprobs": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    stream = {
        **COMPLETION,
        "temperature": 1,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = api.post("/v1/completions", json=stream)
    assert r.status_code == 200 and '"usage": {"prompt_tokens": 1, "completion_tokens": 2' in r.text, r.text


def test_an_unknown_field_is_served_and_logged_once_per_name_per_app(caplog):
    """Fields no model declares are ignored, and the app warns of each name the first time a
    request sends it (top level, or in a part: ``stream_options.NAME``, ``messages.NAME``)."""
    import logging

    def warnings() -> list[str]:
        return [rec.getMessage() for rec in caplog.records if "present in the request but ignored" in rec.getMessage()]

    extra = {"best_effort": 0.5, "tenant": "u", "stream_options": {"continuous_usage_stats": True}}
    first = (
        "The following fields were present in the request but ignored: "
        "best_effort, stream_options.continuous_usage_stats, tenant"
    )
    with caplog.at_level(logging.WARNING, logger="looptool.serve.app"):
        with _app_client() as api:
            for _ in range(2):
                assert api.post("/v1/completions", json={**COMPLETION, **extra, "max_tokens": 1}).status_code == 200
            assert warnings() == [first]
            body = {**CHAT, "messages": [{"role": "user", "content": "a", "mood": "x"}], "tenant": "u", "max_tokens": 1}
            assert api.post("/v1/chat/completions", json=body).status_code == 200
            assert warnings()[1:] == ["The following fields were present in the request but ignored: messages.mood"]
        with _app_client() as api:  # another app (another server) warns again
            assert api.post("/v1/completions", json={**COMPLETION, "tenant": "u", "max_tokens": 1}).status_code == 200
            assert warnings()[2:] == ["The following fields were present in the request but ignored: tenant"]


def test_the_single_process_server_and_the_cli_do_not_import_ray():
    import subprocess
    import sys

    code = (
        "import sys, looptool.serve, looptool.serve.routing, looptool.cli, looptool.cli.serve; "
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
