"""The text of one choice as its tokens arrive: decoded piece by piece
(:class:`looptool.runtime.text.IncrementalDecoder`) and cut at the first stop string, holding
back just enough characters that a stop string split across tokens is still found."""

from __future__ import annotations

from looptool.runtime.text import IncrementalDecoder


class TextStream:
    """Text pieces safe to send for a growing token sequence, ending at the first of ``stops``."""

    def __init__(self, tok, stops: list[str] | None = None):
        self.decoder = IncrementalDecoder(tok)
        self.stops = [s for s in stops or [] if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""  # decoded, not sent yet
        self.text = ""  # sent so far
        self.stopped = False  # a stop string was found

    def push(self, token: int) -> str:
        """Add one token; the text it releases (empty while held back or after a stop)."""
        if self.stopped:
            return ""
        self.pending += self.decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The text left at the end."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
        elif final or not self.hold:
            out, self.pending = self.pending, ""
        else:
            cut = max(len(self.pending) - self.hold, 0)
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out
