"""The HTTP side (FastAPI): OpenAI-compatible routes that turn requests into scheduler jobs and
scheduler events into responses or server-sent events.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends SSE chunks
ending in ``data: [DONE]``), ``GET /v1/models`` (``NAME`` and ``NAME@k`` per budget),
``GET /health`` and ``GET /metrics`` (Prometheus). With an API key, the ``/v1`` routes need
``Authorization: Bearer KEY``. Every refusal is an OpenAI-shaped JSON error. While the server
drains (after SIGTERM) it still listens: ``/v1`` requests get 503 and ``/health`` answers 503
``{"status": "draining"}``, so a load balancer's readiness probe takes the replica out.
A request field the server does not know is ignored, and logged as a warning the first time a
request sends it (once per field name per app, as vLLM warns).

``budget: "auto"`` (adaptive depth per token) is served where the engine runs it (PyTorch under
last-loop KV); elsewhere it is one 400. Its response's ``cost`` gives the mean realised depth.
``draft_budget`` and ``draft_tokens`` (self-speculative decoding, the server's default with
``--speculative``) are served under per-loop KV by the PyTorch engine and by onnxruntime engines
exported with verify graphs; the ``cost`` of a request
that drafted counts its drafted and accepted tokens.

A client that goes away frees its slot: a stream's generator is closed by the framework, and a
non-streamed request has one watcher task that checks its connection every
:data:`DISCONNECT_POLL` seconds while it waits for tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow
from looptool.engine.sampling import SamplingParams
from looptool.engine.speculation import Speculation
from looptool.serve.budgets import BudgetChoiceError, BudgetResolver
from looptool.serve.choices import Choice
from looptool.serve.cost import request_cost
from looptool.serve.drafting import choose_speculation, speculation_cost
from looptool.serve.metrics import CONTENT_TYPE
from looptool.serve.models import ServedModel
from looptool.serve.prompts import chat_prompt, check_room, completion_prompts
from looptool.serve.protocol import (
    APIError,
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    chunk,
    error_body,
    invalid_field,
    request_id,
    response,
    usage,
)
from looptool.serve.scheduler import Draining, Event, Job, QueueFull, Scheduler

log = logging.getLogger(__name__)

DISCONNECT_POLL = 0.1  # seconds between checks that a non-streamed request's client is still there


def create_app(
    served: ServedModel,
    scheduler: Scheduler,
    resolver: BudgetResolver,
    *,
    api_key: str | None = None,
    draft_tokens: int | None = None,
):
    """The FastAPI app serving ``served`` through ``scheduler`` (started and stopped with the app);
    with ``draft_tokens``, requests at a fixed budget deeper than the menu's shallowest decode
    speculatively by default, drafting that many tokens at the shallowest
    (:func:`~looptool.serve.drafting.choose_speculation`)."""

    def cost_of(budget: int | AutoRow, jobs: list[Job], depths: list[int]) -> dict:
        """A response's ``cost``: :func:`request_cost`, and what speculation did where it ran."""
        cost = request_cost(served.costs, budget, depths)
        if jobs[0].speculation is not None:
            cost = {**cost, "speculation": speculation_cost(jobs[0].speculation, [job.speculated for job in jobs])}
        return cost

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="looptool serve", lifespan=lifespan)
    app.state.served, app.state.scheduler, app.state.resolver = served, scheduler, resolver
    app.state.ignored_fields = set()  # the unknown request fields already logged (see _parse)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_middleware(_Gate, scheduler=scheduler, api_key=api_key)

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse({"status": "draining", "running": scheduler.running}, status_code=503)
        return {"status": "ok", "running": scheduler.running}

    @app.get("/metrics")
    async def metrics():
        return Response(scheduler.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        data = []
        for model_id in resolver.model_ids():
            k = resolver.resolve(model_id)
            data.append(
                {"id": model_id, "object": "model", "created": 0, "owned_by": "looptool", "cost": served.costs[k]}
            )
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        budget, sampling, speculation = _common(req, resolver, scheduler, served.runtime, draft_tokens)
        prompts, echoes = completion_prompts(req.prompt, served.tokenizer, served.vocab_size)
        if req.max_tokens is not None and req.max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens")
        if req.stream and (len(prompts) > 1 or req.echo or req.logprobs is not None):
            raise APIError("stream takes one prompt, without echo or logprobs.", param="stream")
        for prompt in prompts:
            check_room(len(prompt), req.max_tokens, scheduler.capacity)
        scoring = req.logprobs if req.echo and req.logprobs is not None else None
        if scoring is not None and isinstance(budget, AutoRow):
            raise APIError('echo with logprobs scores the prompt at a fixed budget, not budget "auto".', param="echo")
        jobs = [
            _job(
                p,
                budget,
                req.max_tokens or scheduler.capacity - len(p),
                sampling,
                req.logprobs,
                scoring,
                req.ignore_eos,
                speculation=speculation,
            )
            for p in prompts
        ]
        rid = request_id("cmpl")
        stops = req.stops()
        if req.stream:
            queue = _submit(scheduler, jobs[0])
            return _sse(_stream_completion(rid, req, jobs[0], queue, stops, budget))
        queues = [_submit(scheduler, job) for job in jobs]
        choices = [Choice(i, served.tokenizer, stops, logprobs=req.logprobs) for i in range(len(jobs))]
        for job, choice in zip(jobs, choices):
            if scoring is not None:
                choice.echo_prompt(job.prompt)
        await _collect(scheduler, jobs, queues, choices, request)
        out = [
            {
                "index": c.index,
                "text": (echoes[c.index] if req.echo else "") + c.text.text,
                "logprobs": c.logprobs(),
                "finish_reason": c.reason,
            }
            for c in choices
        ]
        use = usage(sum(len(p) for p in prompts), sum(len(c.tokens) for c in choices))
        cost = cost_of(budget, jobs, [d for c in choices for d in c.depths])
        return response(rid, "text_completion", req.model, out, use, cost)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        budget, sampling, speculation = _common(req, resolver, scheduler, served.runtime, draft_tokens)
        if req.logprobs:
            raise APIError("logprobs are served on /v1/completions only.", param="logprobs")
        prompt = chat_prompt(req.messages, served.tokenizer)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None and limit < 1:
            raise APIError(f"max_tokens must be at least 1, got {limit}.", param="max_tokens")
        check_room(len(prompt), limit, scheduler.capacity)
        job = _job(
            prompt,
            budget,
            limit or scheduler.capacity - len(prompt),
            sampling,
            ignore_eos=req.ignore_eos,
            speculation=speculation,
        )
        rid = request_id("chatcmpl")
        queue = _submit(scheduler, job)
        if req.stream:
            return _sse(_stream_chat(rid, req, job, queue, budget))
        choice = Choice(0, served.tokenizer, req.stops())
        await _collect(scheduler, [job], [queue], [choice], request)
        message = {"role": "assistant", "content": choice.text.text}
        out = [{"index": 0, "message": message, "logprobs": None, "finish_reason": choice.reason}]
        cost = cost_of(budget, [job], choice.depths)
        return response(rid, "chat.completion", req.model, out, usage(len(prompt), len(choice.tokens)), cost)

    async def _stream_completion(rid, req, job, queue, stops, budget) -> AsyncIterator[dict]:
        choice = Choice(0, served.tokenizer, stops)
        async for piece in _pieces(scheduler, job, queue, choice):
            yield chunk(
                rid,
                "text_completion",
                req.model,
                [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}],
            )
        last = [{"index": 0, "text": "", "logprobs": None, "finish_reason": choice.reason}]
        async for item in _ending(
            rid,
            "text_completion",
            req,
            last,
            len(job.prompt),
            choice,
            cost_of(budget, [job], choice.depths),
        ):
            yield item

    async def _stream_chat(rid, req, job, queue, budget) -> AsyncIterator[dict]:
        kind = "chat.completion.chunk"
        yield chunk(
            rid, kind, req.model, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
        choice = Choice(0, served.tokenizer, req.stops())
        async for piece in _pieces(scheduler, job, queue, choice):
            yield chunk(rid, kind, req.model, [{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
        last = [{"index": 0, "delta": {}, "finish_reason": choice.reason}]
        async for item in _ending(rid, kind, req, last, len(job.prompt), choice, cost_of(budget, [job], choice.depths)):
            yield item

    return app


class _Gate:
    """Refuses ``/v1`` requests before they reach a route: 503 while the server drains, 401
    without the API key. A plain ASGI middleware, not ``@app.middleware("http")``: Starlette's
    ``BaseHTTPMiddleware`` hides the client's disconnect from the route, which a non-streamed
    request needs to free its slot."""

    def __init__(self, app: ASGIApp, *, scheduler: Scheduler, api_key: str | None):
        self.app, self.scheduler, self.api_key = app, scheduler, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if not scope["path"].startswith("/v1"):
            return None
        if self.scheduler.draining and scope["method"] == "POST":
            self.scheduler.metrics.rejected.inc()
            body = error_body("the server is shutting down and admits no new request.", "server_error")
            return JSONResponse(body, status_code=503)
        if self.api_key:
            given = Headers(scope=scope).get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                body = error_body(
                    "missing or wrong API key; send 'Authorization: Bearer KEY'.",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                return JSONResponse(body, status_code=401)
        return None


async def _parse(request: Request, model: type[Body]):
    """The body as ``model``; malformed JSON or a wrong field is one 400 naming the field
    (:func:`invalid_field`). Fields ``model`` does not declare are ignored and logged, each name
    once per app (``app.state.ignored_fields``)."""
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}).") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object.")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise invalid_field(exc.errors()[0]) from None
    warned: set[str] = request.app.state.ignored_fields
    if new := req.ignored_fields() - warned:
        warned |= new
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(sorted(new)))
    return req


def _common(
    req, resolver: BudgetResolver, scheduler: Scheduler, runtime: str, draft_tokens: int | None
) -> tuple[int | AutoRow, SamplingParams, Speculation | None]:
    """The request's budget (or adaptive-depth settings, where the engine runs them), sampling
    settings and speculation (:func:`choose_speculation`; ``draft_tokens``: the server's
    speculative default, None when off), checked."""
    if req.n != 1:
        raise APIError(f"n={req.n}: this server returns one choice per prompt; send n=1.", param="n")
    try:
        budget = resolver.choose(
            req.model, req.budget, req.reasoning_effort, req.min_budget, req.max_budget, req.exit_threshold
        )
    except BudgetChoiceError as exc:
        raise APIError(str(exc), status=exc.status, param=exc.parameter, code=exc.code) from None
    speculation = choose_speculation(req, budget, resolver.budgets, scheduler.capabilities, runtime, draft_tokens)
    if isinstance(budget, AutoRow) and (refusal := scheduler.capabilities.adaptive_refusal) is not None:
        if getattr(refusal, "parameter", None) == "kv":
            message = (
                'budget "auto" needs last-loop KV and this server keeps per-loop KV; start it with --kv last-loop.'
            )
        else:
            message = (
                f'budget "auto" is not served by the {runtime} engine (it has no adaptive-depth graph); serve an '
                "onnxruntime engine exported with it (looptool export --adaptive --kv last-loop) or the looped model "
                "directory on PyTorch, with --kv last-loop."
            )
        raise APIError(message, param="budget")
    try:
        sampling = SamplingParams(req.temperature, req.checked_top_k(), req.top_p if req.top_p < 1 else None, req.seed)
    except LooptoolError as exc:
        raise APIError(str(exc), param=exc.parameter) from None
    return budget, sampling, speculation


def _job(prompt: list[int], budget: int | AutoRow, max_tokens: int, *args, **kwargs) -> Job:
    """The scheduler job of one prompt at a fixed ``budget`` or adaptive depth (run up to its
    ``max_budget``). The HTTP side counts its finish (see :func:`_pieces`)."""
    kwargs["consumer_counts"] = True
    if isinstance(budget, AutoRow):
        return Job(prompt, budget.max_budget, max_tokens, *args, auto=budget, **kwargs)
    return Job(prompt, budget, max_tokens, *args, **kwargs)


def _submit(scheduler: Scheduler, job: Job) -> asyncio.Queue:
    """Queue ``job`` with the engine; its events arrive on the returned asyncio queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | None] = asyncio.Queue()  # None: the client went away (see _collect)
    job.emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
    try:
        scheduler.submit(job)
    except QueueFull:
        scheduler.metrics.rejected.inc()
        raise APIError("the server is at capacity (every slot busy, queue full); retry later.", status=503) from None
    except Draining:
        scheduler.metrics.rejected.inc()
        raise APIError("the server is shutting down and admits no new request.", status=503) from None
    return queue


async def _pieces(scheduler: Scheduler, job: Job, queue: asyncio.Queue, choice: Choice) -> AsyncIterator[str]:
    """The text piece of each token of ``job`` (and any text left at the end) until it finishes.

    The job leaves the engine early (its slot freed at the next step) when a stop string ends
    it (counted as ``stop``), when the consumer stops early (a stream whose client went away),
    or when ``queue`` yields ``None`` (a non-streamed request's client disconnected, see
    :func:`_collect`; counted as ``cancelled``). A job the engine finished is counted with the
    reason its client got: ``stop`` when a stop string ended the text first.
    """
    reason = "cancelled"
    try:
        while not choice.done:
            event = await queue.get()
            if event is None:
                return  # nobody reads the answer: the finally frees the slot
            piece = choice.push(event)
            if event.kind == "token" or piece:
                yield piece  # one chunk per token (empty while text is held back), so clients can time tokens
        reason = choice.reason or reason  # stop (EOS or a stop string) or length
        if choice.failed:
            raise APIError(f"generation failed: {choice.failed}", status=500)
    finally:
        scheduler.cancel(job, reason)


async def _collect(
    scheduler: Scheduler, jobs: list[Job], queues: list[asyncio.Queue], choices: list[Choice], request: Request
) -> None:
    """Run the jobs of one non-streamed request to their end. One watcher task checks every
    :data:`DISCONNECT_POLL` seconds that ``request``'s client is still there; once it left,
    every job gives up (its slot freed, counted as ``cancelled``). The watcher ends with the
    request, and a job still running then (a sibling failed) gives up too."""

    async def drain(job: Job, queue: asyncio.Queue, choice: Choice) -> None:
        async for _ in _pieces(scheduler, job, queue, choice):
            pass

    watcher = asyncio.create_task(_watch(request, queues))
    try:
        await asyncio.gather(*(drain(j, q, c) for j, q, c in zip(jobs, queues, choices)))
    finally:
        watcher.cancel()
        for queue in queues:
            queue.put_nowait(None)  # unread by a job that finished


async def _watch(request: Request, queues: list[asyncio.Queue]) -> None:
    """Every :data:`DISCONNECT_POLL` seconds, whether ``request``'s client disconnected; once it
    did, a ``None`` on every queue tells its reader to give up."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL)
        if await request.is_disconnected():
            break
    for queue in queues:
        queue.put_nowait(None)


async def _ending(rid, kind, req, last_choices, prompt_tokens: int, choice: Choice, cost: dict) -> AsyncIterator[dict]:
    """The finishing chunk (with ``cost``) and, with ``stream_options.include_usage``, the usage chunk."""
    yield chunk(rid, kind, req.model, last_choices, cost=cost)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk(rid, kind, req.model, [], usage=usage(prompt_tokens, len(choice.tokens)), cost=cost)


def _sse(items: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` per item, then ``data: [DONE]``."""

    async def body():
        try:
            async for item in items:
                yield f"data: {json.dumps(item)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
