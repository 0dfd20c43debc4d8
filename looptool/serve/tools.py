"""OpenAI tool calling for ``looptool serve``: checking a request's ``tools`` and ``tool_choice``,
putting the tools into the prompt, reading calls out of the generated text (whole or as it streams),
and the grammar that forces a call when the client requires one.

A model calls tools in the text it writes, in its chat template's format; a parser turns that text
into the OpenAI ``tool_calls`` objects. The Hermes format (Hermes-2-Pro, Qwen2.5, Qwen3; parsers
``"hermes"`` and ``"qwen"``) writes each call as a JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and reads each result back inside a user turn as ``<tool_response>...</tool_response>``. A call's
``arguments`` is the JSON text the model wrote, unchanged. A block that is not such an object, or
that names a tool the request did not declare, stays in the content as text (as vLLM does): a
malformed call is the model's output, not the client's error. The content is the text outside the
calls, without the whitespace around each call; a reply without calls is its text unchanged.

Streaming sends text as soon as it cannot be the start of ``<tool_call>``, a call's name as soon
as it is known, and its arguments as they arrive, so that the streamed pieces add up to what
:meth:`ToolParser.parse` reads from the whole text. A block that starts as
``{"name": "<declared tool>", "arguments": {`` is sent as a call from then on; if the model then
breaks the format (or stops early), the client has the call with what arguments arrived, where
:meth:`ToolParser.parse` would keep the block as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from looptool.core.errors import LooptoolError
from looptool.serve.protocol import APIError

if TYPE_CHECKING:
    import xgrammar

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*\{')
_TAIL = re.compile(r"\s*" + re.escape(END))
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: ``tools`` the OpenAI tool objects, ``choice`` its ``tool_choice``
    (``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``),
    ``parallel`` whether the model may make more than one call."""

    tools: tuple[dict, ...]
    choice: str | dict
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        """The declared tools' names."""
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> str | None:
        """The name ``tool_choice`` forces, or None."""
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """Check a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the OpenAI API
    takes them; None when the request has no tools and does not ask for any (``tool_choice``
    defaults to ``"auto"`` with tools, ``"none"`` without). Raises an :class:`APIError` naming the
    field at fault."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _refused("parallel_tool_calls", "must be true or false")
    if tools is not None and not isinstance(tools, list):
        raise _refused("tools", "must be a list of tool objects")
    checked = tuple(_check_tool(tool, f"tools.{i}") for i, tool in enumerate(tools or []))
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            rule = f"{name!r} repeats tools.{names.index(name)}'s name; names must be unique"
            raise _refused(f"tools.{i}.function.name", rule)
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if isinstance(choice, str) and choice not in _CHOICES:
        raise _refused("tool_choice", f"must be 'none', 'auto', 'required' or a function, got {choice!r}")
    if not isinstance(choice, (str, dict)):
        raise _refused("tool_choice", "must be a string or a function object")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise _refused("tool_choice.type", f"must be 'function', got {choice.get('type')!r}")
    if not checked:
        if choice != "none":
            raise _refused("tool_choice", "needs tools; send tools or leave tool_choice out")
        return None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            rule = f"must be one of the declared tools ({', '.join(names)}), got {name!r}"
            raise _refused("tool_choice.function.name", rule)
        choice = {"type": "function", "function": {"name": name}}
    return ToolRequest(checked, choice, parallel_tool_calls is not False)


def _refused(field: str, rule: str) -> APIError:
    """The 400 for one field: ``FIELD RULE.``"""
    return APIError(f"{field} {rule}.", param=field)


def _check_tool(tool: Any, field: str) -> dict:
    """One checked entry of ``tools``: ``{"type": "function", "function": {...}}``."""
    if not isinstance(tool, dict):
        raise _refused(field, f"must be an object, got {json.dumps(tool, default=str)[:40]}")
    if tool.get("type") != "function":
        raise _refused(f"{field}.type", f"must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _refused(f"{field}.function", "must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        rule = f"must be 1 to 64 letters, digits, underscores or dashes, got {name!r}"
        raise _refused(f"{field}.function.name", rule)
    if not isinstance(fn.get("description", ""), str):
        raise _refused(f"{field}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise _refused(f"{field}.function.parameters", 'must be a JSON schema of type "object"')
    if not isinstance(fn.get("strict", False), bool):
        raise _refused(f"{field}.function.strict", "must be true or false")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def call_ids() -> Iterator[str]:
    """Fresh OpenAI-style call ids, ``call_`` and 24 hex digits."""
    while True:
        yield f"call_{uuid.uuid4().hex[:24]}"


class _Scan:
    """A resumable scan for the end of the JSON object opening at ``start``: braces and brackets
    counted outside strings."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str, self.escaped = start, 0, False, False

    def feed(self, text: str, stop: int) -> int | None:
        """Scan on up to ``stop``; the index just past the object, or None if it is still open."""
        for i in range(self.pos, stop):
            c = text[i]
            if self.in_str:
                self.escaped, self.in_str = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = max(self.pos, stop)
        return None


def _read_call(obj: str, names: set[str]) -> tuple[str, str] | None:
    """``(name, arguments text)`` of a call object's JSON text, or None if it is not one."""
    try:
        call = json.loads(obj, strict=False)  # control characters in strings, as grammars may let through
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    decoder, ws, i = json.JSONDecoder(strict=False), re.compile(r"\s*"), 1
    while True:  # walk the keys for the span of the first "arguments" value
        key, i = decoder.raw_decode(obj, ws.match(obj, i).end())
        start = ws.match(obj, ws.match(obj, i).end() + 1).end()
        _, i = decoder.raw_decode(obj, start)
        if key == "arguments":
            return call["name"], obj[start:i]
        i = ws.match(obj, i).end() + 1


def _read_block(buf: str, names: set[str], final: bool) -> tuple[int, tuple[str, str] | None] | None:
    """What the text after a ``<tool_call>`` holds: ``(length, (name, arguments))`` for a call and
    the closing tag after it, ``(length, None)`` for a malformed block (up to its first closing tag,
    or all the text when ``final`` and there is none), None when more text is needed."""
    tag = buf.find(END)
    q = len(buf) - len(buf.lstrip())
    if q == len(buf) and not final:
        return None
    if q < len(buf) and buf[q] == "{":
        scan = _Scan(q)
        end = scan.feed(buf, tag if tag >= 0 else len(buf))
        if end is None and tag >= 0 and scan.in_str:  # the first closing tag is inside a string
            end = scan.feed(buf, len(buf))
            if end is None and not final:
                return None
        if end is not None:
            rest, tail = buf[end:], _TAIL.match(buf, end)
            call = _read_call(buf[q:end], names) if tail else None
            if call:
                return tail.end(), call
            if not tail and not final and END.startswith(rest.lstrip()):
                return None
    if tag >= 0:
        return tag + len(END), None
    return (len(buf), None) if final else None


class _Content:
    """Content as it is released: whitespace next to a call is dropped, so trailing whitespace
    waits until text (not a call) follows it."""

    def __init__(self):
        self.pending, self.after_call = "", False

    def text(self, s: str) -> str:
        if self.after_call:
            s = s.lstrip()
            if not s:
                return ""
            self.after_call = False
        s = self.pending + s
        kept = s.rstrip()
        self.pending = s[len(kept) :]
        return kept

    def call(self) -> None:
        self.pending, self.after_call = "", True

    def flush(self) -> str:
        s, self.pending = self.pending, ""
        return s


def _held(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolStream:
    """Reads tool calls out of text as it is generated; :meth:`push` each decoded piece and send the
    chat-completion-chunk ``delta`` objects it returns, then those of :meth:`finish`. ``calls``
    counts the calls begun (finish_reason ``"tool_calls"`` when non-zero)."""

    def __init__(self, tools: ToolRequest, ids: Iterator[str] | None = None):
        self.calls = 0
        self._names, self._on = set(tools.names), tools.choice != "none"
        self._ids = ids or call_ids()
        self._buf, self._block, self._content = "", False, _Content()
        self._args: _Scan | None = None  # the arguments of the call being streamed
        self._sent = self._end = 0

    def push(self, piece: str) -> list[dict]:
        """Take the next piece of text; the deltas it releases."""
        self._buf += piece
        return self._drain(final=False)

    def finish(self) -> list[dict]:
        """The deltas still held at the end of the text (an unfinished block as content)."""
        out = self._drain(final=True)
        rest = self._content.flush()
        return out + [{"content": rest}] if rest else out

    def _drain(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while self._buf or (final and self._block):
            if not self._block:
                i = self._buf.find(START) if self._on else -1
                if i < 0:
                    cut = len(self._buf) - (0 if final or not self._on else _held(self._buf, START))
                    self._text(out, self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                self._text(out, self._buf[:i])
                self._buf, self._block = self._buf[i + len(START) :], True
            elif self._args is not None:
                if not self._stream_args(out, final):
                    return out
            elif (found := _read_block(self._buf, self._names, final)) is not None:
                n, call = found
                if call:
                    self._begin(out, call[0])
                    self._arguments(out, call[1])
                else:
                    self._text(out, START + self._buf[:n])
                self._buf, self._block = self._buf[n:], False
            elif (head := _HEAD.match(self._buf)) and head.group(1) in self._names:
                self._begin(out, head.group(1))
                self._args, self._sent = _Scan(head.end() - 1), head.end() - 1
            else:
                return out
        return out

    def _stream_args(self, out: list[dict], final: bool) -> bool:
        """Send the arguments that arrived; whether the call's block is over."""
        assert self._args is not None
        if not self._end:
            end = self._args.feed(self._buf, len(self._buf))
            stop = end or len(self._buf)
            self._arguments(out, self._buf[self._sent : stop])
            self._sent, self._end = stop, end or 0
        tag = self._buf.find(END, self._end) if self._end else -1
        if tag < 0 and not final:
            return False
        self._buf = self._buf[tag + len(END) :] if tag >= 0 else ""
        self._block, self._args, self._end = False, None, 0
        return True

    def _text(self, out: list[dict], s: str) -> None:
        if s := self._content.text(s):
            out.append({"content": s})

    def _begin(self, out: list[dict], name: str) -> None:
        self._content.call()
        call = {"index": self.calls, "id": next(self._ids), "type": "function"}
        out.append({"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]})
        self.calls += 1

    def _arguments(self, out: list[dict], piece: str) -> None:
        if piece:
            out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": piece}}]})


class ToolParser:
    """A model family's tool-call format. This base reads and writes the Hermes format (see the
    module); a family with another format overrides its methods."""

    def parse(self, text: str, tools: ToolRequest, ids: Iterator[str] | None = None) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a whole generated text: content None when it is empty and
        there are calls; each call ``{"id", "type": "function", "function": {"name", "arguments"}}``.
        Every call is read, ``parallel`` or not (:meth:`constraint` is what limits them); with
        ``tool_choice`` ``"none"`` the text is all content. ``ids`` gives the call ids (fresh ones
        by default)."""
        ids = ids or call_ids()
        if tools.choice == "none":
            return text, []
        names, content, calls, parts, pos = set(tools.names), _Content(), [], [], 0
        while (i := text.find(START, pos)) >= 0:
            parts.append(content.text(text[pos:i]))
            n, call = _read_block(text[i + len(START) :], names, final=True)
            if call:
                content.call()
                calls.append({"id": next(ids), "type": "function", "function": {"name": call[0], "arguments": call[1]}})
            else:
                parts.append(content.text(text[i : i + len(START) + n]))
            pos = i + len(START) + n
        text = "".join(parts) + content.text(text[pos:]) + content.flush()
        return (text or None) if calls else text, calls

    def stream(self, tools: ToolRequest, ids: Iterator[str] | None = None) -> ToolStream:
        """A :class:`ToolStream` for one choice of a streamed response."""
        return ToolStream(tools, ids)

    def constraint(self, tools: ToolRequest) -> xgrammar.StructuralTag | None:
        """The ``xgrammar.StructuralTag`` that forces the reply to be calls (one, or with
        ``parallel`` one or more separated by newlines) of the forced tool or, for ``"required"``,
        of any declared tool, with arguments that match the tool's ``parameters``; None when the
        model may answer in text. A tool without ``parameters`` (or with ``strict: false``) takes
        any JSON object. No reasoning block is allowed before the calls."""
        if tools.choice in ("none", "auto"):
            return None
        import xgrammar as xgr

        from looptool.serve.structured import bounded_strings

        listed = [{**t, "function": bounded_strings(t["function"])} for t in tools.tools]
        builtin = xgr.get_model_structural_tag(
            "qwen_3", tools=listed, tool_choice=tools.choice, reasoning="disabled"
        ).format
        tags = [builtin] if isinstance(builtin, xgr.structural_tag.TagFormat) else list(builtin.tags)
        tags = [t.model_copy(update={"content": _object_schema(t.content)}) for t in tags]
        calls = xgr.structural_tag.TagsWithSeparatorFormat(
            tags=tags, separator="\n", at_least_one=True, stop_after_first=not tools.parallel
        )
        return xgr.StructuralTag(format=calls)

    def render(self, messages: list[dict], tools: ToolRequest | None, tok) -> list[int]:
        """The prompt's token ids: the chat template given the tools, or, when it ignores them,
        the Hermes system prompt describing them (calls in assistant turns as ``<tool_call>``
        blocks, results as ``<tool_response>`` blocks in user turns). ``tool_choice`` ``"none"``
        leaves the tools out."""
        messages = [_template_message(m) for m in messages]
        if tools is None or tools.choice == "none":
            return _render(tok, messages)
        listed = [dict(t) for t in tools.tools]
        probe = [{"role": "user", "content": "Hi"}]
        if _render(tok, probe, listed) != _render(tok, probe):
            return _render(tok, messages, listed)
        return _render(tok, _hermes_messages(messages, listed))


def _render(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids through the chat template (``apply_chat_template`` returns a list or a ``BatchEncoding``)."""
    rendered = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return list(ids[0]) if ids and isinstance(ids[0], list) else ids


def _object_schema(content):
    """Arguments content whose unconstrained schema (``True``) is narrowed to a JSON object, with
    at most one whitespace character between its tokens (a model cannot wander off into
    whitespace)."""
    schema = {"type": "object"} if content.json_schema is True else content.json_schema
    return content.model_copy(update={"json_schema": schema, "max_whitespace_cnt": 1})


def _template_message(message: dict) -> dict:
    """A message as chat templates read it: assistant call arguments as objects, not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _text(content: Any) -> str:
    """A message's content as text (content parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def _hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages that carry the tools in the Hermes format for a template that knows only text."""
    prompt = _TOOLS_PROMPT.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict] = []
    if messages and messages[0].get("role") == "system":
        out.append({"role": "system", "content": _text(messages[0].get("content")) + "\n\n" + prompt})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        parts = [_text(m.get("content"))] if _text(m.get("content")) else []
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            args = args.strip() if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            call_json = f'{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}'
            parts.append(f"{START}\n{call_json}\n{END}")
        out.append({"role": m.get("role"), "content": "\n".join(parts)})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


class HermesParser(ToolParser):
    """Hermes-2-Pro, Qwen2.5 and Qwen3: ``<tool_call>`` blocks of JSON."""


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser}


def parser_for(name: str) -> ToolParser:
    """The tool-call parser called ``name`` (``tool_call_parser``)."""
    if name not in PARSERS:
        known = ", ".join(sorted(PARSERS))
        message = f"tool_call_parser {name!r} is not known; use one of {known}."
        raise LooptoolError(message, parameter="tool_call_parser")
    return PARSERS[name]()
