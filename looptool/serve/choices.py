"""One choice of a response as engine events arrive: its text (decoded, cut at stop strings),
its finish reason, its token count, the depth each token ran at, the tokens its grammar forced
and its log-probabilities in both of the API's shapes: ``/v1/completions``' legacy ``logprobs``
object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) with the prompt tokens
first when ``echo`` is set (what lm-evaluation-harness's ``local-completions`` reads:
``token_logprobs[ctxlen:-1]``), and chat's ``logprobs.content`` entries (``token``,
``logprob``, ``bytes``, ``top_logprobs``), whole or one token per stream chunk."""

from __future__ import annotations

from looptool.serve.scheduler import Event
from looptool.serve.text import TextStream


class Choice:
    """The state of one choice; :meth:`push` takes each event and returns the text it releases."""

    def __init__(self, index: int, tok, stops: list[str], *, logprobs: int | None = None):
        self.index = index
        self.tok = tok
        self.text = TextStream(tok, stops)
        self.tokens: list[int] = []
        self.depths: list[int] = []  # the depth that produced each token (none for a forced one)
        self.forced = 0  # tokens the grammar forced, taken without a step
        self.reason: str | None = None
        self.failed = ""
        self.want_logprobs = logprobs is not None
        self.lp_tokens: list[int] = []
        self.lp_values: list[float | None] = []
        self.lp_top: list[list[tuple[int, float]] | None] = []

    @property
    def done(self) -> bool:
        """Whether the choice has its finish reason (or failed)."""
        return self.reason is not None or bool(self.failed)

    def echo_prompt(self, prompt: list[int]) -> None:
        """Start the ``logprobs`` lists with the prompt tokens (the first has no log-probability)."""
        self.lp_tokens.extend(prompt)
        self.lp_values.append(None)
        self.lp_top.append(None)

    def push(self, event: Event) -> str:
        """Take one engine event; the new text (empty if none)."""
        if event.kind == "prompt":
            for logprob, top in event.prompt_logprobs or []:
                self.lp_values.append(logprob)
                self.lp_top.append(top)
            return ""
        if event.kind == "failed":
            self.failed = event.message or "the engine failed"
            return ""
        if event.kind == "finished":
            piece = self.text.finish()
            self.reason = event.reason
            return piece
        self.tokens.append(event.token)
        if event.depth is not None:
            self.depths.append(event.depth)
        self.forced += event.forced
        if self.want_logprobs:
            self.lp_tokens.append(event.token)
            self.lp_values.append(event.logprob)
            self.lp_top.append(event.top)
        piece = self.text.push(event.token)
        if self.text.stopped:
            self.reason = "stop"
        return piece

    def _string(self, token: int) -> str:
        return self.tok.decode([token])

    def logprobs(self, start: int = 0, offset: int = 0) -> dict | None:
        """The legacy completions ``logprobs`` object of the tokens from ``start`` on (their text
        offsets counted from ``offset``), or None when not asked for."""
        if not self.want_logprobs:
            return None
        strings = [self._string(t) for t in self.lp_tokens[start:]]
        offsets, at = [], offset
        for s in strings:
            offsets.append(at)
            at += len(s)
        top = [None if t is None else {self._string(i): v for i, v in t} for t in self.lp_top[start:]]
        return {
            "tokens": strings,
            "token_logprobs": self.lp_values[start:],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat_logprobs(self, start: int = 0) -> dict | None:
        """Chat's ``logprobs`` object (``content``: one entry per generated token from ``start``
        on, each with its ``top_logprobs``), or None when not asked for."""
        if not self.want_logprobs:
            return None

        def entry(token: int, logprob: float) -> dict:
            s = self._string(token)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        content = [
            {**entry(t, v), "top_logprobs": [entry(i, p) for i, p in top or []]}
            for t, v, top in zip(self.lp_tokens[start:], self.lp_values[start:], self.lp_top[start:])
        ]
        return {"content": content, "refusal": None}
