"""The OpenAI wire format the server speaks: request bodies (pydantic models, so a wrong type
is one 400 naming the field), OpenAI-shaped errors, and the response and stream-chunk dicts.

Extensions travel as extra body fields, as vLLM takes them (clients send them with
``extra_body``): ``budget`` (an integer of the menu, an effort level, or ``"auto"``: adaptive
depth per token, with ``min_budget``, ``max_budget`` and ``exit_threshold``), ``draft_budget``
and ``draft_tokens`` (self-speculative decoding, :mod:`looptool.serve.speculation`), ``top_k``
and ``ignore_eos``. Responses carry ``cost`` beside ``usage``: the budget that ran and its cost-table
entry (layer executions and KV bytes per token, Accordion Eq. 6), or for ``"auto"`` the mean
depth the generated tokens realised (:func:`looptool.serve.cost.request_cost`), and for a
speculating request its drafted and accepted token counts.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` (and ``cost``)."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints take. Unknown fields are accepted and ignored, as OpenAI servers do."""

    model_config = ConfigDict(extra="allow")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None  # extension; None, 0 or -1: no top-k
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    budget: Any = None  # extension: a JSON integer of the menu, an effort level or "auto"; checked by BudgetResolver
    min_budget: Any = None  # extension, with budget "auto" only (as the next two); checked by BudgetResolver.choose
    max_budget: Any = None
    exit_threshold: Any = None
    draft_budget: Any = None  # extension: self-speculative decoding's draft budget; checked by choose_speculation
    draft_tokens: Any = None  # extension: tokens drafted per verify step (default 4, or the server's)
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

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    """One chat message; ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message text (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False


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
