"""Structured outputs: a request's ``response_format`` (``json_object``, ``json_schema``) or
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extensions
turned into a grammar (xgrammar, vLLM's default backend, on the CPU), and that grammar into one
:class:`~looptool.engine.sampling.RowConstraint` per choice, which the engine core applies to
its row's logits at every step.

Compiling a grammar costs far more than a token (milliseconds for a JSON schema), so compiled
grammars are kept per grammar text (:class:`Grammars`, a least-recently-used cache of
:data:`CACHED` entries); each choice gets only a fresh matcher over its compiled grammar.
JSON is written compactly (``{"a": 1, "b": 2}``, no free whitespace between tokens, where the
grammar decides every byte of the layout): the same data in fewer tokens, and a model cannot
wander off into whitespace, which vLLM's default allows.

Two limits of xgrammar are closed here. A JSON-schema string with ``minLength`` /
``maxLength`` compiles to a character class that admits raw control characters, which JSON
forbids (github.com/mlc-ai/xgrammar/issues/800); such a string without a ``pattern`` is compiled as the pattern
``^.{min,max}$``, whose path excludes them, instead (:func:`bounded_strings`). And on a
vocabulary of byte-level tokens its character classes let a grammar's text hold invalid UTF-8
(a surrogate's bytes, an overlong form), which no JSON parser reads; :class:`Utf8Guard` masks
every token whose bytes would not continue valid UTF-8 from where the row's text stands.

Where the grammar forces what comes next (a key of the schema, the quotes and colon after it,
the closing brace, the stop token once nothing else may follow), :meth:`GrammarRow.forced`
says so and the engine takes those tokens without a step (jump-forward decoding,
:mod:`looptool.engine.core`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from cachetools import LRUCache

from looptool.serve.protocol import APIError

CACHED = 256  # compiled grammars kept


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``kind`` (``json`` for any JSON object,
    ``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``) and its ``text`` (the schema as
    canonical JSON, the expression, the grammar or the tag's JSON); ``field`` names the request
    field it came from, for errors."""

    kind: str
    text: str
    field: str


def request_grammar(req) -> GrammarSpec | None:
    """The grammar ``req`` asks for (its ``response_format`` or one of vLLM's ``guided_*``
    fields), or None; one 400 naming the field for a malformed one or for two at once."""
    given = [
        name
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if getattr(req, name) is not None
    ]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise APIError(f"{given[0]} and {given[1]} both constrain the output; send one of them.", param=given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        if fmt.type == "json_object":
            return GrammarSpec("json", "", name)
        if fmt.json_schema is None or fmt.json_schema.get("schema") is None:
            raise APIError(
                'response_format of type "json_schema" needs json_schema.schema, the JSON schema of the answer.',
                param="response_format.json_schema",
            )
        return _schema(fmt.json_schema["schema"], "response_format.json_schema.schema")
    value = getattr(req, name)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(f"guided_json is not valid JSON ({exc.msg}).", param=name) from None
        return _schema(value, name)
    if name == "guided_regex":
        return GrammarSpec("regex", value, name)
    if name == "guided_grammar":
        return GrammarSpec("ebnf", value, name)
    if not value or not all(isinstance(c, str) and c for c in value):
        raise APIError("guided_choice must be a list of one or more non-empty strings.", param=name)
    return GrammarSpec("regex", "|".join(_literal(c) for c in value), name)


def _schema(schema, field: str) -> GrammarSpec:
    """A JSON-schema spec; a schema that is not a JSON object is refused."""
    if not isinstance(schema, dict):
        raise APIError(f"{field} must be a JSON schema (an object), got {json.dumps(schema)[:40]}.", param=field)
    return GrammarSpec("json_schema", json.dumps(bounded_strings(schema), sort_keys=True), field)


def bounded_strings(schema):
    """``schema`` with every string subschema bounded by ``minLength`` / ``maxLength`` and no
    ``pattern`` given the pattern ``^.{min,max}$`` instead (the same strings: a pattern's ``.`` is
    one character), so xgrammar compiles it on its pattern path, which keeps out the raw control
    characters its length path lets in (module docstring)."""
    if isinstance(schema, list):
        return [bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_strings(value) for key, value in schema.items()}
    bounds = ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out
    if bounds and out.get("type") == "string" and "enum" not in out and "const" not in out:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^.{{{low},{'' if high is None else int(high)}}}$"
    return out


def _literal(text: str) -> str:
    """``text`` as a regular expression matching exactly it (xgrammar's dialect: only the
    metacharacters escaped)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


class Grammars:
    """Compiles grammars for one tokenizer (xgrammar's :class:`~xgrammar.GrammarCompiler`) and
    keeps the compiled ones; :meth:`row` starts one choice's :class:`GrammarRow`."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        try:
            import xgrammar
        except ImportError as exc:
            raise APIError(
                "structured outputs need xgrammar on the server (pip install 'looptool[serve]').",
                param="response_format",
            ) from exc
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        special = {*self.info.special_token_ids, *stop_ids}
        self.guard = Utf8Guard(self.info.decoded_vocab, vocab_size, sorted(special))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1)
        self.stop_ids = tuple(stop_ids)
        self.cache: LRUCache = LRUCache(maxsize=CACHED)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """``spec`` compiled (from the cache where it was compiled before); a grammar xgrammar
        refuses is one 400 naming the request field with its reason."""
        key = (spec.kind, spec.text)
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            reason = re.sub(r"^\[[^\]]*\] \S+: ", "", reason)  # xgrammar's log prefix
            raise APIError(
                f"{spec.field} is not a grammar this server can follow: {reason}", param=spec.field
            ) from None
        with self._lock:
            self.cache[key] = compiled
        return compiled

    def _compile(self, spec: GrammarSpec):
        c = self.compiler
        if spec.kind == "json":  # a JSON object, as OpenAI's json_object means (and vLLM compiles it)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.text)
        return c.compile_grammar(spec.text)

    def row(self, compiled, spec: GrammarSpec) -> GrammarRow:
        """A fresh matcher over ``compiled`` (``spec``'s grammar) for one choice."""
        matcher = self.xgr.GrammarMatcher(compiled)
        return GrammarRow(self.xgr, matcher, self.info.vocab_size, self.stop_ids, spec, self.guard)


_UTF8_STATES = ((0, 0x80, 0xBF), (1, 0x80, 0xBF), (2, 0x80, 0xBF), (3, 0x80, 0xBF))
_UTF8_STATES += ((2, 0xA0, 0xBF), (2, 0x80, 0x9F), (3, 0x90, 0xBF), (3, 0x80, 0x8F))
_UTF8_LEADS = (  # lead bytes and the state after them (RFC 3629's table)
    (0xC2, 0xDF, (1, 0x80, 0xBF)),
    (0xE0, 0xE0, (2, 0xA0, 0xBF)),
    (0xE1, 0xEC, (2, 0x80, 0xBF)),
    (0xED, 0xED, (2, 0x80, 0x9F)),
    (0xEE, 0xEF, (2, 0x80, 0xBF)),
    (0xF0, 0xF0, (3, 0x90, 0xBF)),
    (0xF1, 0xF3, (3, 0x80, 0xBF)),
    (0xF4, 0xF4, (3, 0x80, 0x8F)),
)


def _utf8_step(state: tuple[int, int, int], byte: int) -> tuple[int, int, int] | None:
    """The UTF-8 validator's state after ``byte`` (None: invalid): how many continuation bytes
    are still due and the range the next one must lie in."""
    need, low, high = state
    if need:
        return (need - 1, 0x80, 0xBF) if low <= byte <= high else None
    if byte < 0x80:
        return state
    return next((after for first, last, after in _UTF8_LEADS if first <= byte <= last), None)


class Utf8Guard:
    """Which tokens keep a text valid UTF-8, by where the text stands (one of eight validator
    states: between characters, or inside one with so many bytes due in such a range), for one
    vocabulary (``decoded`` the bytes of each token; ``special`` tokens only between
    characters): :attr:`allowed` ``[8, vocab]`` and :attr:`after` (each token's next state,
    -1 where not allowed)."""

    def __init__(self, decoded: Sequence[bytes], vocab_size: int, special: Sequence[int]):
        index = {state: i for i, state in enumerate(_UTF8_STATES)}
        after = torch.full((len(_UTF8_STATES), vocab_size), -1, dtype=torch.int8)
        after[0, :] = 0  # ids beyond the tokenizer's and special tokens: between characters only
        skip = set(special)
        for token, text in enumerate(decoded[:vocab_size]):
            if text.isascii() or token in skip:
                continue
            for i, state in enumerate(_UTF8_STATES):
                for byte in text:
                    state = _utf8_step(state, byte)
                    if state is None:
                        break
                after[i, token] = -1 if state is None else index[state]
        self.after = after
        self.allowed = after >= 0


class GrammarRow:
    """One choice's grammar state (:class:`~looptool.engine.sampling.RowConstraint`): its
    matcher and the bitmask of the tokens allowed next, filled once per token; ``spec`` is the
    grammar it follows (what a Ray replica rebuilds it from); ``guard`` keeps its text valid
    UTF-8 (:class:`Utf8Guard`), ``utf8`` being where the text stands."""

    def __init__(self, xgr, matcher, vocab_size: int, stop_ids: Sequence[int], spec: GrammarSpec, guard: Utf8Guard):
        self.xgr = xgr
        self.spec = spec
        self.guard = guard
        self.utf8 = 0
        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.stop_ids = tuple(stop_ids)
        self.filled = False

    def _fill(self) -> torch.Tensor:
        if not self.filled:
            self.matcher.fill_next_token_bitmask(self.bitmask, 0)
            self.filled = True
        return self.bitmask

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits ``[vocab]`` of the tokens the grammar does not allow next to ``-inf``."""
        bitmask = self._fill()
        width = logits.shape[-1]
        self.xgr.apply_token_bitmask_inplace(logits.view(1, width), bitmask.to(logits.device), vocab_size=width)
        allowed = self.guard.allowed[self.utf8, :width].to(logits.device)
        guarded = logits.masked_fill(~allowed, float("-inf"))
        if torch.isfinite(guarded).any():  # never mask every token the grammar allows
            logits.copy_(guarded)

    def accept(self, token: int) -> bool:
        """Follow ``token`` (one the mask allowed); whether the grammar has ended (a stop token)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the grammar")
        self.filled = False
        self.utf8 = max(int(self.guard.after[self.utf8, token]), 0)
        return self.matcher.is_terminated()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next: its jump-forward tokens, or the stop token once
        the grammar is complete and nothing else may follow; empty where the model chooses."""
        if self.matcher.is_terminated():
            return []
        tokens = list(self.matcher.find_jump_forward_tokens())
        if tokens or not self.matcher.is_completed():
            return tokens
        words = self._fill()[0].tolist()
        for stop in self.stop_ids:
            words[stop // 32] &= ~(1 << (stop % 32))
        if any(w & 0xFFFFFFFF for w in words):
            return []  # the grammar may end here or go on: the model decides
        allowed = [s for s in self.stop_ids if int(self.bitmask[0, s // 32]) >> (s % 32) & 1]
        return allowed[:1]
