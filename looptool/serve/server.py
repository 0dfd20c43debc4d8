"""One server process (a replica): the served model, its budget resolver, the engine thread and
the FastAPI app under uvicorn.

Every option is checked before the model loads: the port is bound first (a port in use is one
sentence, not a traceback after loading), and the budget options and capacity are checked
against the saved plan and config. SIGTERM (or Ctrl-C) drains, as vLLM's ``--shutdown-timeout``
does: the socket stays open and new requests get 503 (``/health`` too, so a readiness probe
takes the replica out of its load balancer) while the queued and running requests finish; then
the server exits 0. A second signal closes the socket at once (still letting open responses
finish); a third Ctrl-C forces the exit.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine import EngineFacts
from looptool.engine.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache
from looptool.engine.speculation import DEFAULT_DRAFT_TOKENS, LAST_LOOP_VERIFY, MAX_DRAFT_TOKENS
from looptool.passes.adaptive_depth import check_exit_rule
from looptool.serve.budgets import BudgetResolver
from looptool.serve.metrics import Metrics
from looptool.serve.models import ServedModel, open_model, read_facts
from looptool.serve.scheduler import Scheduler

DEFAULT_CAPACITY = 1024  # tokens per slot unless the model's context is shorter
BACKLOG = 2048  # pending connections the listening socket holds (uvicorn's default backlog)

log = logging.getLogger(__name__)


def free_memory(device: str) -> int:
    """Bytes free on ``device`` now: the GPU's free memory on CUDA, else the system's available
    memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class ServeOptions:
    """How the server runs (the ``looptool serve`` options)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    capacity: int | None = None  # default: DEFAULT_CAPACITY, or the model's context if shorter
    max_queue: int = 64
    default_budget: int | None = None
    effort: str | None = None
    api_key: str | None = None
    log_level: str = "warning"
    speculative: bool = False  # requests deeper than the shallowest budget draft there by default
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # tokens drafted per verify step by default
    prefix_cache: bool = True  # requests that share a prompt prefix reuse its keys and values
    prefix_cache_mb: int = DEFAULT_MAX_BYTES >> 20  # what the prefix cache may hold
    kv_memory_mb: int | None = None  # what the slot cache may hold; None: half the memory free at start
    tool_call_parser: str = "hermes"  # how tool calls are read from (and forced into) the output
    jump_forward: bool = True  # tokens a grammar forces are taken without a step

    def check(self) -> None:
        """One sentence per out-of-range option."""
        for what, name, option in (
            ("prefix cache", "prefix_cache_mb", "prefix_cache_mb"),
            ("KV memory", "kv_memory_mb", "kv_memory"),
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise LooptoolError(f"the {what} must be a positive number of MiB, got {value!r}.", parameter=option)
        if isinstance(self.draft_tokens, bool) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise LooptoolError(
                f"draft_tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}.",
                parameter="draft_tokens",
            )
        for name in ("max_batch", "capacity"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LooptoolError(f"{name} must be at least 1, got {value}.", parameter=name)
        if self.max_queue < 0:
            raise LooptoolError(f"max_queue must be at least 0, got {self.max_queue}.", parameter="max_queue")
        if not 0 <= self.port < 65536:
            raise LooptoolError(f"port {self.port} is not a TCP port (0-65535).", parameter="port")
        from looptool.serve.tools import parser_for

        parser_for(self.tool_call_parser)  # one sentence naming the known parsers

    def check_kv(self, kv: str) -> None:
        """One sentence when these options do not go with the KV policy ``kv`` (speculative
        serving needs per-loop KV)."""
        if self.speculative and kv == "last-loop":
            raise LooptoolError(
                f"speculative serving needs kv 'per-loop': {LAST_LOOP_VERIFY}",
                parameter="kv",
            )

    def for_model(self, facts: EngineFacts, name: str, exit_rule: str = "state") -> ResolvedOptions:
        """These options checked (:meth:`check`) and resolved against the model served as
        ``name``: ``default_budget`` and ``effort`` against its budget menu (the budget resolver
        built here, once; a budget "auto" request's threshold means what ``exit_rule`` makes of
        it), ``capacity`` against its context, the default capacity filled in."""
        self.check()
        resolver = BudgetResolver.create(name, facts.budgets, self.default_budget, self.effort, exit_rule)
        if self.speculative and len(resolver.budgets) < 2:
            raise LooptoolError(
                f"speculative serving drafts at the menu's shallowest budget for deeper ones, but the menu "
                f"{list(resolver.budgets)} has one budget.",
                parameter="speculative",
            )
        capacity = self.capacity
        if capacity is None:
            capacity = min(DEFAULT_CAPACITY, facts.context or DEFAULT_CAPACITY)
        elif facts.context is not None and capacity > facts.context:
            raise LooptoolError(
                f"capacity {capacity} exceeds the model's context of {counted(facts.context, 'position')}; "
                f"pass a capacity of at most {facts.context}.",
                parameter="capacity",
            )
        return ResolvedOptions(
            self.host,
            self.port,
            self.max_batch,
            capacity,
            self.max_queue,
            self.api_key,
            self.log_level,
            resolver,
            self.draft_tokens if self.speculative else None,
            self.prefix_cache_mb << 20 if self.prefix_cache else None,
            None if self.kv_memory_mb is None else self.kv_memory_mb << 20,
            self.tool_call_parser,
            self.jump_forward,
        )


@dataclass(frozen=True)
class ResolvedOptions:
    """:class:`ServeOptions` checked and resolved for one model (:meth:`ServeOptions.for_model`):
    what a :class:`Server` takes. ``capacity`` is filled in, and ``resolver`` (the model's name
    and budget menu, the default budget and the effort ladder) answers every request;
    ``draft_tokens`` is the speculative default (None: requests decode plainly unless they
    send a ``draft_budget``); ``prefix_cache_bytes`` is what the prefix cache may hold (None:
    no prefix cache)."""

    host: str
    port: int
    max_batch: int
    capacity: int
    max_queue: int
    api_key: str | None
    log_level: str
    resolver: BudgetResolver
    draft_tokens: int | None = None
    prefix_cache_bytes: int | None = DEFAULT_MAX_BYTES
    kv_memory: int | None = None  # bytes the slot cache may hold (None: half the memory free at start)
    tool_call_parser: str = "hermes"
    jump_forward: bool = True


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, as uvicorn binds one; a port in use or an
    address this machine does not have is one sentence.

    It listens at once, before the model loads: with ``SO_REUSEADDR`` (kept so a restarted server
    can take a port whose old connections linger in TIME_WAIT) Linux lets a second socket bind
    a port that is bound but not listening, so a second server started while the first is still
    loading would pass this check and fail only after its own load. Connections made while the
    model loads wait in the backlog and are answered once the server is up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise LooptoolError(
            f"cannot resolve host {host!r} ({exc.strerror}); pass an address such as 127.0.0.1.", parameter="host"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LooptoolError(
                f"port {port} on {host} is already in use; stop what listens there or pick another port.",
                parameter="port",
            ) from None
        raise LooptoolError(f"cannot listen on {host}:{port} ({exc.strerror}).", parameter="host") from None
    sock.set_inheritable(True)
    return sock


def make_scheduler(served: ServedModel, options: ResolvedOptions) -> Scheduler:
    """The scheduler over ``served``'s engine with ``options``' batch, queue, caches and KV bound,
    warmed up at every budget (and speculative round where ``options`` draft by default); not yet
    started. A server and each Ray Serve replica run one."""
    scheduler = Scheduler(
        served.engine,
        max_batch=options.max_batch,
        capacity=options.capacity,
        max_queue=options.max_queue,
        eos=served.eos,
        metrics=Metrics(served.budgets),
        device=served.device,
        prefix_cache=None if options.prefix_cache_bytes is None else PrefixCache(options.prefix_cache_bytes),
        kv_memory=options.kv_memory or free_memory(served.device) // 2,
        jump_forward=options.jump_forward,
    )
    if options.draft_tokens is not None and (refusal := scheduler.capabilities.verify_refusal) is not None:
        raise LooptoolError(str(refusal), parameter=getattr(refusal, "parameter", None))
    scheduler.warm_up(served.budgets, options.draft_tokens)
    return scheduler


def check_resolved(served: ServedModel, options: ResolvedOptions) -> None:
    """One sentence unless ``options`` were resolved (:meth:`ServeOptions.for_model`) for the model
    ``served`` is: its name and budget menu."""
    if not isinstance(options, ResolvedOptions):
        raise TypeError(
            f"a server takes options resolved for the model (ServeOptions.for_model), got {type(options).__name__}; "
            "prepare() resolves them."
        )
    resolver = options.resolver
    if resolver.name != served.name or resolver.budgets != tuple(sorted(served.budgets)):
        raise LooptoolError(
            f"the options were resolved for {resolver.name!r} with the budget menu {list(resolver.budgets)}, "
            f"but the model served is {served.name!r} with {sorted(served.budgets)}; "
            "resolve them against this model's facts."
        )


class Server:
    """A prepared server: ``model_ids``, ``url``, ``app`` (the FastAPI app) and :meth:`run`
    (blocks until shut down).
    ``options`` are resolved for ``served`` (:meth:`ServeOptions.for_model`, as :func:`prepare`
    does before the load); ``sock`` is the bound socket to serve on (default: one bound here)."""

    def __init__(self, served: ServedModel, options: ResolvedOptions, sock: socket.socket | None = None):
        import uvicorn

        from looptool.serve.app import create_app

        check_resolved(served, options)
        resolver = options.resolver
        self.served = served
        self.options = options
        self.socket = sock if sock is not None else bind(options.host, options.port)
        self.resolver = resolver
        self.scheduler = make_scheduler(served, options)
        self.app = app = create_app(
            served,
            self.scheduler,
            self.resolver,
            api_key=options.api_key,
            draft_tokens=options.draft_tokens,
            tool_call_parser=options.tool_call_parser,
        )
        config = uvicorn.Config(
            app, host=options.host, port=options.port, log_level=options.log_level, access_log=False
        )
        scheduler = self.scheduler

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if not scheduler.draining:  # the first signal drains: 503 to new requests, the socket open
                    log.warning("draining: new requests get 503; exiting when the admitted ones finish")
                    scheduler.drain()
                    return
                super().handle_exit(sig, frame)  # a second closes the socket (a third Ctrl-C forces)

            async def on_tick(self, counter: int) -> bool:
                if scheduler.draining and scheduler.held == 0:
                    self.should_exit = True  # drained: uvicorn closes the socket and ends
                return await super().on_tick(counter)

        self._server = _Uvicorn(config)

    @property
    def model_ids(self) -> list[str]:
        """The model ids clients may ask for."""
        return self.resolver.model_ids()

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (``.../v1``), with the port actually bound."""
        host = self.options.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.socket.getsockname()[1]}/v1"

    def run(self) -> None:
        """Serve until SIGTERM or Ctrl-C, then finish the admitted requests and return."""
        # uvicorn re-raises the signal that stopped it under the handler that was there before
        # it ran; a no-op handler makes a graceful SIGTERM end in a normal return (exit 0)
        previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
        try:
            self._server.run(sockets=[self.socket])
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.scheduler.stop()


def prepare(
    model_dir: str | os.PathLike,
    options: ServeOptions | None = None,
    *,
    name: str | None = None,
    device: str = "auto",
    runtime: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    exit_rule: str = "state",
    sock: socket.socket | None = None,
    **session,
) -> Server:
    """Load ``model_dir`` (a looped model or an exported engine directory) on ``runtime``
    (``auto``, ``pytorch``, ``onnxruntime`` or ``tensorrt``) and prepare a server
    (``session``: onnxruntime's ``prepack`` and ``spin``, see :func:`looptool.engine.open_engine`;
    ``exit_rule``: how the tokens of ``budget: "auto"`` requests stop, ``state`` or ``kl``, on
    PyTorch, or onnxruntime engines exported with that rule's adaptive-depth graph, under
    last-loop KV). Every option is checked and the port bound before the model loads (``sock``: a
    socket :func:`bind` already bound to the options' host and port, which the server then owns, and
    which is closed here if the server cannot be prepared)."""
    options = options or ServeOptions()
    try:
        options.check()  # before the directory is read: a bad option is reported first
        options.check_kv(kv)
        check_exit_rule(exit_rule)
        name = name or Path(model_dir).resolve().name
        resolved = options.for_model(read_facts(model_dir, runtime), name, exit_rule)
        sock = sock or bind(resolved.host, resolved.port)
        served = open_model(
            model_dir,
            name=name,
            runtime=runtime,
            device=device,
            kv=kv,
            tokenizer=tokenizer,
            threads=threads,
            exit_rule=exit_rule,
            **session,
        )
        return Server(served, resolved, sock)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
