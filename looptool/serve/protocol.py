"""The OpenAI wire format the server speaks: request bodies (strict pydantic models, so a wrong
type is one 400 naming the field), OpenAI-shaped errors, and the response and stream-chunk dicts.

Every declared field takes its JSON type only, as vLLM's strict models do: an integer field a
JSON integer (not ``"4"``, ``4.0`` or ``true``), a number field a JSON integer or float (not
``"0.5"`` or ``true``), a boolean field ``true`` or ``false`` (not ``"true"`` or ``1``); anything
else is one sentence naming the field and what it got (:func:`invalid_field`). Fields no model
declares are accepted and ignored, as OpenAI servers do, and listed by
:meth:`Body.ignored_fields` so the server can say so.

Fields the OpenAI API defines that the server does not serve (:data:`UNSUPPORTED`: ``audio``,
``prediction``, ``suffix``, ...) are refused with one 400 naming the field rather than ignored
(:func:`refused_fields`); a few metadata fields (``user``, ``metadata``, ``service_tier``, ...)
are accepted and have no effect, as vLLM takes them.

Extensions travel as extra body fields, as vLLM takes them (clients send them with
``extra_body``): vLLM's ``repetition_penalty``, ``min_p``, ``top_k``, ``ignore_eos`` and
structured-output fields ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``; and ``budget`` (an integer of the menu, an effort level, or ``"auto"``: adaptive
depth per token, with ``min_budget``, ``max_budget`` and ``exit_threshold``), ``draft_budget``
and ``draft_tokens`` (self-speculative decoding, :mod:`looptool.engine.rounds`). Responses carry ``cost`` beside ``usage``: the budget that ran and its cost-table
entry (layer executions and KV bytes per token, Accordion Eq. 6), or for ``"auto"`` the mean
depth the generated tokens realised (:func:`looptool.serve.cost.request_cost`), and for a
speculating request its drafted and accepted token counts, and for a request under a grammar
the tokens it forced (``forced_tokens``, taken without a step).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import ErrorDetails, PydanticCustomError

from looptool.core.errors import LooptoolError


class APIError(LooptoolError):
    """A request the server refuses: HTTP ``status`` with an OpenAI-shaped error body."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None, kind: str = ""
    ):
        super().__init__(message, parameter=param)
        self.status = status
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns it."""
        return error_body(str(self), self.kind, self.parameter, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_EXPECTED = {  # what a type error's field takes, in JSON's words
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
}
_SHOWN = 40  # characters of a refused value a message quotes


def invalid_field(err: ErrorDetails) -> APIError:
    """The 400 of one pydantic error: ``FIELD must be WHAT, got VALUE.`` (the field's path
    dotted, e.g. ``messages.0.role``; a long value cut short), or ``FIELD is required``."""
    field = ".".join(str(part) for part in err["loc"])
    if err["type"] == "missing":
        return APIError(f"{field} is required; send it.", param=field)
    msg = err["msg"]
    if err["type"] in _EXPECTED:
        rule = f"must be {_EXPECTED[err['type']]}"
    elif msg.startswith("Input should be "):
        rule = "must be " + msg.removeprefix("Input should be ")
    else:
        rule = f"is refused ({msg[:1].lower()}{msg[1:]})"
    shown = json.dumps(err["input"], default=str)
    if len(shown) > _SHOWN:
        shown = shown[: _SHOWN - 3] + "..."
    return APIError(f"{field} {rule}, got {shown}.", param=field)


def _one_of(expected: str) -> WrapValidator:
    """A union field's refusal as one error saying what the field takes (pydantic's own is one
    error per member of the union, each under a type tag)."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("one_of", "Input should be {expected}", {"expected": expected}) from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[str] | list[int] | list[list[int]],
    _one_of("a string, a list of strings, a list of token ids or a list of lists of token ids"),
]
Stop = Annotated[str | list[str] | None, _one_of("a string, a list of strings or null")]
Content = Annotated[str | list[dict[str, Any]] | None, _one_of("a string, a list of content parts or null")]


class Body(BaseModel):
    """A request body or a part of one: strict JSON types (see the module docstring); fields
    it does not declare are kept in ``model_extra`` and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    refuses: ClassVar[tuple[str, ...]] = ()  # the OpenAI fields of this body the server refuses (UNSUPPORTED)

    def ignored_fields(self) -> set[str]:
        """The fields the request sent that no model declares, those of a part under its field
        (``stream_options.NAME``, ``messages.NAME``)."""
        names = set(self.model_extra or {})
        for field in type(self).model_fields:
            value = getattr(self, field)
            for part in value if isinstance(value, list) else [value]:
                if isinstance(part, Body):
                    names |= {f"{field}.{name}" for name in part.ignored_fields()}
        return names


class StreamOptions(Body):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` (and ``cost``)."""

    include_usage: bool = False


class ResponseFormat(Body):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (``json_schema.schema``, with its ``name`` and ``strict``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


MAX_N = 128  # choices per request (vLLM's bound on n is the engine's; this keeps one request's rows sane)


class _Sampling(Body):
    """Fields both endpoints take."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None  # extension; None, 0 or -1: no top-k
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension (vLLM's)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # extension (vLLM's); 1: none
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: Stop = None
    n: int = Field(1, ge=1, le=MAX_N)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extensions (vLLM's structured outputs)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # accepted, no effect (as the next ones)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    budget: Any = None  # extension: a JSON integer of the menu, an effort level or "auto"; checked by BudgetResolver
    min_budget: Any = None  # extension, with budget "auto" only (as the next two); checked by BudgetResolver.choose
    max_budget: Any = None
    exit_threshold: Any = None
    draft_budget: Any = None  # extension: self-speculative decoding's draft budget; checked by choose_speculation
    draft_tokens: int | None = None  # extension: tokens drafted per verify step (default 4, or the server's)
    ignore_eos: bool = False  # extension (vLLM's): generate max_tokens tokens whatever comes
    reasoning_effort: str | None = None

    def stops(self) -> list[str]:
        """The stop strings as a list (empty strings dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stop if s]

    def checked_top_k(self) -> int | None:
        """``top_k`` with 0 and -1 meaning no top-k; other values below 1 refused."""
        if self.top_k is None or self.top_k in (0, -1):
            return None
        if self.top_k < 1:
            raise APIError(f"top_k must be at least 1 (or 0/-1 for none), got {self.top_k}.", param="top_k")
        return self.top_k


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt, a list of them, token ids, or lists of token ids."""

    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None  # served where it equals n (no candidates beyond the choices returned)

    refuses: ClassVar[tuple[str, ...]] = ("suffix",)


class ChatMessage(Body):
    """One chat message; ``content`` may be a string or a list of text parts."""

    role: str
    content: Content = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (a conversation sent back)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message text (text parts joined); a part other than text is one 400."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type", "text") != "text":
                    raise APIError(
                        f"content parts of type {part.get('type')!r} are not supported by this text-only server; "
                        "send text parts.",
                        param="messages.content",
                    )
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """The message as a chat template reads it (text content, the fields it sent)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    refuses: ClassVar[tuple[str, ...]] = (
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
        "verbosity",
    )


# Fields the OpenAI API defines that this server does not serve: each is one 400 naming it,
# unless it carries the value that asks for nothing (the second entry).
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "audio": ("audio output; this server answers in text", (None,)),
    "modalities": ("output modalities other than text", (None, ["text"])),
    "prediction": ("predicted outputs", (None,)),
    "web_search_options": ("web search", (None,)),
    "functions": ("the deprecated functions field; send tools", (None,)),
    "function_call": ("the deprecated function_call field; send tool_choice", (None,)),
    "verbosity": ("verbosity", (None,)),
    "suffix": ("suffix (insertion)", (None, "")),
}


def refused_fields(data: dict, names: tuple[str, ...]) -> None:
    """One 400 for the first of ``names`` (an endpoint's fields in :data:`UNSUPPORTED`) that
    ``data`` sends with a value that asks for something."""
    for name in names:
        what, fine = UNSUPPORTED[name]
        if name in data and data[name] not in fine:
            raise APIError(f"{name} is not supported by this server ({what}); drop the field.", param=name)


class TokenizeRequest(Body):
    """``POST /tokenize`` (vLLM's): a ``prompt``'s token ids, or those of chat ``messages``
    through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    """``POST /detokenize`` (vLLM's): the text of ``tokens``."""

    model: str | None = None
    tokens: list[int]


def request_id(prefix: str) -> str:
    """A fresh id like OpenAI's (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    rid: str,
    kind: Literal["text_completion", "chat.completion"],
    model: str,
    choices: list[dict],
    usage_: dict,
    cost: dict,
) -> dict:
    """A whole (non-streamed) response."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
        "cost": cost,
    }


def chunk(rid: str, kind: str, model: str, choices: list[dict], **extra: Any) -> dict:
    """One stream chunk (``text_completion`` or ``chat.completion.chunk``)."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
