"""One server process (a replica): the served model, its budget resolver, the engine thread and
the FastAPI app under uvicorn. SIGTERM (or Ctrl-C) stops admitting (new requests get 503, the
listening socket closes), lets the queued and running requests finish, and exits cleanly."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from looptool.core.errors import LooptoolError
from looptool.serve.budgets import BudgetResolver
from looptool.serve.engine import BatchEngine
from looptool.serve.metrics import Metrics
from looptool.serve.models import ServedModel, open_model

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    """How the server runs (the ``looptool serve`` options)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    capacity: int = 1024
    max_queue: int = 64
    default_budget: int | None = None
    effort: str | None = None
    api_key: str | None = None
    log_level: str = "warning"

    def check(self) -> None:
        """One sentence per out-of-range option."""
        for name in ("max_batch", "capacity"):
            if getattr(self, name) < 1:
                raise LooptoolError(f"{name} must be at least 1, got {getattr(self, name)}.", parameter=name)
        if self.max_queue < 0:
            raise LooptoolError(f"max_queue must be at least 0, got {self.max_queue}.", parameter="max_queue")
        if not 0 <= self.port < 65536:
            raise LooptoolError(f"port {self.port} is not a TCP port (0-65535).", parameter="port")


class Server:
    """A prepared server: ``model_ids``, ``url``, and :meth:`run` (blocks until shut down)."""

    def __init__(self, served: ServedModel, options: ServeOptions):
        import uvicorn

        from looptool.serve.app import create_app

        options.check()
        self.served = served
        self.options = options
        self.resolver = BudgetResolver.create(served.name, served.budgets, options.default_budget, options.effort)
        self.batch = BatchEngine(
            served.engine,
            max_batch=options.max_batch,
            capacity=options.capacity,
            max_queue=options.max_queue,
            eos=served.eos,
            metrics=Metrics(),
            device=served.device,
        )
        self.batch.warm_up(served.budgets)
        app = create_app(served, self.batch, self.resolver, api_key=options.api_key)
        config = uvicorn.Config(
            app, host=options.host, port=options.port, log_level=options.log_level, access_log=False
        )
        batch = self.batch

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame):
                batch.drain()  # refuse new requests at once; uvicorn lets the open ones finish
                super().handle_exit(sig, frame)

        self._server = _Uvicorn(config)

    @property
    def model_ids(self) -> list[str]:
        """The model ids clients may ask for."""
        return self.resolver.model_ids()

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (``.../v1``)."""
        return f"http://{self.options.host}:{self.options.port}/v1"

    def run(self) -> None:
        """Serve until SIGTERM or Ctrl-C, then finish the admitted requests and return."""
        # uvicorn re-raises the signal that stopped it under the handler that was there before
        # it ran; a no-op handler makes a graceful SIGTERM end in a normal return (exit 0)
        previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
        try:
            self._server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.batch.stop()


def prepare(
    model_dir: str | os.PathLike,
    options: ServeOptions | None = None,
    *,
    name: str | None = None,
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
) -> Server:
    """Load ``model_dir`` (a looped model or an exported engine directory) and prepare a server."""
    options = options or ServeOptions()
    options.check()
    served = open_model(model_dir, name=name, device=device, kv=kv, tokenizer=tokenizer, threads=threads)
    return Server(served, options)
