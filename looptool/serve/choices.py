"""One choice of a response as engine events arrive: its text (decoded, cut at stop strings),
its finish reason, its token count, the depth each token ran at and, for ``/v1/completions`` with ``logprobs``, the legacy
``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) with the
prompt tokens first when ``echo`` is set (what lm-evaluation-harness's ``local-completions``
reads: ``token_logprobs[ctxlen:-1]``)."""

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
        self.depths: list[int] = []  # the depth that produced each token
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
        if self.want_logprobs:
            self.lp_tokens.append(event.token)
            self.lp_values.append(event.logprob)
            self.lp_top.append(event.top)
        piece = self.text.push(event.token)
        if self.text.stopped:
            self.reason = "stop"
        return piece

    def logprobs(self) -> dict | None:
        """The legacy completions ``logprobs`` object, or None when not asked for."""
        if not self.want_logprobs:
            return None
        strings = [self.tok.decode([t]) for t in self.lp_tokens]
        offsets, at = [], 0
        for s in strings:
            offsets.append(at)
            at += len(s)
        top = [None if t is None else {self.tok.decode([i]): v for i, v in t} for t in self.lp_top]
        return {"tokens": strings, "token_logprobs": self.lp_values, "top_logprobs": top, "text_offset": offsets}
