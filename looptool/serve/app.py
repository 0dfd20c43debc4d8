"""The HTTP side (FastAPI): OpenAI-compatible routes that turn requests into scheduler jobs and
scheduler events into responses or server-sent events.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends SSE chunks
ending in ``data: [DONE]``; ``n`` choices, structured outputs, tool calls: see
:mod:`looptool.serve.requests`, :mod:`looptool.serve.structured`, :mod:`looptool.serve.tools`),
``GET /v1/models`` (``NAME`` and ``NAME@k`` per budget), vLLM's ``POST /tokenize`` and
``POST /detokenize``, ``GET /health`` and ``GET /metrics`` (Prometheus). With an API key, the ``/v1`` routes need
``Authorization: Bearer KEY``. Every refusal is an OpenAI-shaped JSON error. While the server
drains (after SIGTERM) it still listens: ``/v1`` requests get 503 and ``/health`` answers 503
``{"status": "draining"}``, so a load balancer's readiness probe takes the replica out.
A field the OpenAI API defines and the server does not serve is one 400 naming it
(:data:`looptool.serve.protocol.UNSUPPORTED`); a request field the API does not define is
ignored, and logged as a warning the first time a request sends it (once per field name per
app, as vLLM warns).

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
import functools
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

from looptool.engine.budgets import AutoRow
from looptool.serve.budgets import BudgetResolver
from looptool.serve.choices import Choice
from looptool.serve.cost import request_cost
from looptool.serve.drafting import speculation_cost
from looptool.serve.metrics import CONTENT_TYPE
from looptool.serve.models import ServedModel
from looptool.serve.prompts import chat_prompt, check_room, completion_prompts
from looptool.serve.protocol import (
    APIError,
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chunk,
    error_body,
    invalid_field,
    refused_fields,
    request_id,
    response,
    usage,
)
from looptool.serve.requests import check_n, choice_jobs, known_model, plan
from looptool.serve.scheduler import Draining, Event, Job, QueueFull, Scheduler
from looptool.serve.structured import Grammars, GrammarSpec, request_grammar
from looptool.serve.tools import ToolRequest, check_tools, parser_for

log = logging.getLogger(__name__)

DISCONNECT_POLL = 0.1  # seconds between checks that a non-streamed request's client is still there


def create_app(
    served: ServedModel,
    scheduler: Scheduler,
    resolver: BudgetResolver,
    *,
    api_key: str | None = None,
    draft_tokens: int | None = None,
    tool_call_parser: str = "hermes",
):
    """The FastAPI app serving ``served`` through ``scheduler`` (started and stopped with the app);
    with ``draft_tokens``, requests at a fixed budget deeper than the menu's shallowest decode
    speculatively by default, drafting that many tokens at the shallowest
    (:func:`~looptool.serve.drafting.choose_speculation`); ``tool_call_parser`` names the format
    tool calls are read in (:data:`looptool.serve.tools.PARSERS`)."""

    def cost_of(budget: int | AutoRow, jobs: list[Job], choices: list[Choice]) -> dict:
        """A response's ``cost``: :func:`request_cost` over its choices' tokens, what speculation
        did where it ran, and the tokens a grammar forced (taken without a step) where one ran."""
        cost = request_cost(served.costs, budget, [d for c in choices for d in c.depths])
        if jobs[0].speculation is not None:
            cost = {**cost, "speculation": speculation_cost(jobs[0].speculation, [job.speculated for job in jobs])}
        if jobs[0].constraint is not None:
            cost = {**cost, "forced_tokens": sum(c.forced for c in choices)}
        return cost

    tool_parser = parser_for(tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="looptool serve", lifespan=lifespan)
    app.state.served, app.state.scheduler, app.state.resolver = served, scheduler, resolver
    app.state.ignored_fields = set()  # the unknown request fields already logged (see _parse)
    app.state.grammars = None  # the structured-output grammars, compiled on first use (see grammar_rows)

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

    def grammar_rows(spec: GrammarSpec | None):
        """A maker of one choice's grammar state for ``spec`` (None: no grammar); compiled once per
        grammar text (:class:`Grammars`)."""
        if spec is None:
            return None
        if app.state.grammars is None:
            app.state.grammars = Grammars(served.tokenizer, served.vocab_size, served.eos)
        grammars: Grammars = app.state.grammars
        compiled = grammars.compile(spec)
        return lambda: grammars.row(compiled, spec)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, TokenizeRequest)
        known_model(req.model, resolver)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send either prompt or messages.", param="prompt")
        if req.prompt is not None:
            ids = list(served.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        else:
            ids = chat_prompt(req.messages, served.tokenizer, add_generation_prompt=req.add_generation_prompt)
        strs = served.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": scheduler.capacity, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest)
        known_model(req.model, resolver)
        bad = [t for t in req.tokens if not 0 <= t < served.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {served.vocab_size}).", param="tokens")
        return {"prompt": served.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        spec = request_grammar(req)
        p = plan(req, resolver, scheduler, served.runtime, draft_tokens, served.vocab_size, spec is not None)
        prompts, echoes = completion_prompts(req.prompt, served.tokenizer, served.vocab_size)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(
                f"best_of={req.best_of} with n={req.n}: this server returns every choice it generates; send best_of "
                "equal to n (or leave it out).",
                param="best_of",
            )
        check_n(req.n, scheduler)
        if req.max_tokens is not None and req.max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens")
        if req.stream and (len(prompts) > 1 or req.echo):
            raise APIError("stream takes one prompt, without echo.", param="stream")
        for prompt in prompts:
            check_room(len(prompt), req.max_tokens, scheduler.capacity)
        scoring = req.logprobs if req.echo and req.logprobs is not None else None
        if scoring is not None and isinstance(p.budget, AutoRow):
            raise APIError('echo with logprobs scores the prompt at a fixed budget, not budget "auto".', param="echo")
        rows = await asyncio.to_thread(grammar_rows, spec)
        groups = [
            choice_jobs(
                prompt,
                p,
                req.n,
                req.max_tokens or scheduler.capacity - len(prompt),
                rows,
                logprobs=req.logprobs,
                prompt_logprobs=scoring,
                ignore_eos=req.ignore_eos,
            )
            for prompt in prompts
        ]
        jobs = [job for group in groups for job in group]
        rid = request_id("cmpl")
        stops = req.stops()
        choices = [Choice(i, served.tokenizer, stops, logprobs=req.logprobs) for i in range(len(jobs))]
        queues = [q for group in groups for q in _submit(scheduler, group)]
        if req.stream:
            return _sse(_stream_completion(rid, req, jobs, queues, choices, p.budget))
        for job, choice in zip(jobs, choices):
            if scoring is not None:
                choice.echo_prompt(job.prompt)
        await _collect(scheduler, jobs, queues, choices, request)
        out = [
            {
                "index": c.index,
                "text": (echoes[c.index // req.n] if req.echo else "") + c.text.text,
                "logprobs": c.logprobs(),
                "finish_reason": c.reason,
            }
            for c in choices
        ]
        use = usage(sum(len(job.prompt) for job in jobs[:: req.n]), sum(len(c.tokens) for c in choices))
        return response(rid, "text_completion", req.model, out, use, cost_of(p.budget, jobs, choices))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        spec = request_grammar(req)
        calling = tools if tools is not None and tools.choice != "none" else None
        forcing = tool_parser.constraint(calling) if calling is not None else None
        if forcing is not None:
            if spec is not None:
                raise APIError(
                    f"tool_choice forces a tool call, which {spec.field} would constrain too; send one of them.",
                    param=spec.field,
                )
            spec = GrammarSpec("structural_tag", forcing.model_dump_json(), "tool_choice")
        p = plan(req, resolver, scheduler, served.runtime, draft_tokens, served.vocab_size, spec is not None)
        check_n(req.n, scheduler)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true.", param="top_logprobs")
        if calling is not None:
            prompt = tool_parser.render([m.as_dict() for m in req.messages], calling, served.tokenizer)
        else:
            prompt = chat_prompt(req.messages, served.tokenizer)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None and limit < 1:
            raise APIError(f"max_tokens must be at least 1, got {limit}.", param="max_tokens")
        check_room(len(prompt), limit, scheduler.capacity)
        rows = await asyncio.to_thread(grammar_rows, spec)
        top = (req.top_logprobs or 0) if req.logprobs else None
        jobs = choice_jobs(
            prompt, p, req.n, limit or scheduler.capacity - len(prompt), rows, logprobs=top, ignore_eos=req.ignore_eos
        )
        rid = request_id("chatcmpl")
        choices = [Choice(i, served.tokenizer, req.stops(), logprobs=top) for i in range(len(jobs))]
        queues = _submit(scheduler, jobs)
        if req.stream:
            return _sse(_stream_chat(rid, req, jobs, queues, choices, p.budget, calling))
        await _collect(scheduler, jobs, queues, choices, request)
        out = []
        for c in choices:
            message: dict = {"role": "assistant", "content": c.text.text}
            reason = c.reason
            if calling is not None:
                content, calls = tool_parser.parse(c.text.text, calling)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    reason = tool_finish(calling, reason)
            out.append({"index": c.index, "message": message, "logprobs": c.chat_logprobs(), "finish_reason": reason})
        use = usage(len(prompt), sum(len(c.tokens) for c in choices))
        return response(rid, "chat.completion", req.model, out, use, cost_of(p.budget, jobs, choices))

    async def _stream_completion(rid, req, jobs, queues, choices, budget) -> AsyncIterator[dict]:
        offsets = [0] * len(choices)
        async for i, piece, event in _merged(scheduler, jobs, queues, choices):
            c = choices[i]
            logprobs = None
            if c.want_logprobs and event.kind == "token":
                logprobs = c.logprobs(start=len(c.lp_tokens) - 1, offset=offsets[i])
                offsets[i] += len(logprobs["tokens"][0])
            yield chunk(
                rid,
                "text_completion",
                req.model,
                [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}],
            )
        last = [{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.reason} for c in choices]
        async for item in _ending(
            rid, "text_completion", req, last, len(jobs[0].prompt), choices, cost_of(budget, jobs, choices)
        ):
            yield item

    async def _stream_chat(rid, req, jobs, queues, choices, budget, calling) -> AsyncIterator[dict]:
        kind = "chat.completion.chunk"

        def out(i: int, delta: dict, logprobs: dict | None = None) -> dict:
            return chunk(
                rid, kind, req.model, [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
            )

        for c in choices:
            yield out(c.index, {"role": "assistant", "content": ""})
        parsers = [tool_parser.stream(calling) if calling is not None else None for _ in choices]
        async for i, piece, event in _merged(scheduler, jobs, queues, choices):
            c = choices[i]
            logprobs = c.chat_logprobs(start=len(c.tokens) - 1) if c.want_logprobs and event.kind == "token" else None
            deltas = [{"content": piece}] if parsers[i] is None else parsers[i].push(piece)
            for delta in deltas or ([{"content": ""}] if logprobs is not None else []):
                yield out(i, delta, logprobs)
                logprobs = None
        last = []
        for i, c in enumerate(choices):
            reason = c.reason
            if parsers[i] is not None:
                for delta in parsers[i].finish():
                    yield out(i, delta)
                if parsers[i].calls:
                    reason = tool_finish(calling, reason)
            last.append({"index": c.index, "delta": {}, "finish_reason": reason})
        async for item in _ending(rid, kind, req, last, len(jobs[0].prompt), choices, cost_of(budget, jobs, choices)):
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
    refused_fields(data, model.refuses)
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise invalid_field(exc.errors()[0]) from None
    warned: set[str] = request.app.state.ignored_fields
    if new := req.ignored_fields() - warned:
        warned |= new
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(sorted(new)))
    return req


def _submit(scheduler: Scheduler, jobs: list[Job]) -> list[asyncio.Queue]:
    """Queue the first of ``jobs`` with the engine, the rest being its copies (one request's
    choices of one prompt); each job's events arrive on its asyncio queue, returned in order."""
    loop = asyncio.get_running_loop()
    queues = []
    for job in jobs:
        queue: asyncio.Queue[Event | None] = asyncio.Queue()  # None: the client went away (see _collect)
        job.emit = functools.partial(loop.call_soon_threadsafe, queue.put_nowait)
        queues.append(queue)
    try:
        scheduler.submit(jobs[0])
    except QueueFull:
        scheduler.metrics.rejected.inc()
        raise APIError("the server is at capacity (every slot busy, queue full); retry later.", status=503) from None
    except Draining:
        scheduler.metrics.rejected.inc()
        raise APIError("the server is shutting down and admits no new request.", status=503) from None
    return queues


def tool_finish(calling: ToolRequest, reason: str | None) -> str | None:
    """The finish reason of a choice that called tools: ``tool_calls``, except where the request
    named the function (OpenAI then says ``stop``) or the length ran out."""
    if reason == "stop" and calling.choice in ("auto", "required"):
        return "tool_calls"
    return reason


async def _pieces(
    scheduler: Scheduler, job: Job, queue: asyncio.Queue, choice: Choice
) -> AsyncIterator[tuple[str, Event]]:
    """The text piece of each token of ``job`` (and any text left at the end) with its event,
    until it finishes.

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
                yield piece, event  # one chunk per token (empty while text is held back), so clients can time tokens
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


async def _merged(
    scheduler: Scheduler, jobs: list[Job], queues: list[asyncio.Queue], choices: list[Choice]
) -> AsyncIterator[tuple[int, str, Event]]:
    """The pieces of every choice of a stream (:func:`_pieces`) as they come, each with its
    choice's index: one task per choice, ended (its job cancelled) when the stream ends early."""
    if len(jobs) == 1:
        async for piece, event in _pieces(scheduler, jobs[0], queues[0], choices[0]):
            yield 0, piece, event
        return
    merged: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int) -> None:
        try:
            async for piece, event in _pieces(scheduler, jobs[i], queues[i], choices[i]):
                await merged.put((i, piece, event))
        except APIError as exc:
            await merged.put((i, exc, end))
        await merged.put((i, None, end))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(jobs))]
    try:
        running = len(tasks)
        while running:
            i, piece, event = await merged.get()
            if event is end:
                if isinstance(piece, APIError):
                    raise piece
                running -= 1
                continue
            yield i, piece, event
    finally:
        for task in tasks:
            task.cancel()


async def _ending(
    rid, kind, req, last_choices, prompt_tokens: int, choices: list[Choice], cost: dict
) -> AsyncIterator[dict]:
    """The finishing chunk (with ``cost``) and, with ``stream_options.include_usage``, the usage chunk."""
    yield chunk(rid, kind, req.model, last_choices, cost=cost)
    if req.stream_options is not None and req.stream_options.include_usage:
        tokens = sum(len(c.tokens) for c in choices)
        yield chunk(rid, kind, req.model, [], usage=usage(prompt_tokens, tokens), cost=cost)


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
