"""``looptool serve``: an OpenAI-compatible HTTP server in which every request picks its own
budget (model id ``NAME@k``, a ``budget`` field, or ``reasoning_effort``) and requests of
different budgets share one decode batch on one copy of the weights.

Modules, by responsibility: :mod:`~looptool.serve.protocol` (the wire format),
:mod:`~looptool.serve.budgets` (which budget a request runs at),
:mod:`~looptool.serve.prompts` (prompts as token ids), :mod:`~looptool.serve.drafting`
(the speculative-decoding fields), :mod:`~looptool.serve.scheduler` (the engine core on a thread,
with a bounded queue),
:mod:`~looptool.serve.text` and :mod:`~looptool.serve.choices` (events into text and
``logprobs``), :mod:`~looptool.serve.metrics` (Prometheus), :mod:`~looptool.serve.models`
(what is served: a step engine opened by :func:`looptool.engine.open_engine`), :mod:`~looptool.serve.app` (the FastAPI
routes) and :mod:`~looptool.serve.server` (uvicorn, graceful shutdown).
"""

from looptool.core.errors import require_extra

require_extra("serve", "looptool serve", "fastapi", "uvicorn", "prometheus_client")

from looptool.serve.server import ResolvedOptions, ServeOptions, Server, prepare  # noqa: E402

__all__ = ["ResolvedOptions", "ServeOptions", "Server", "prepare"]
