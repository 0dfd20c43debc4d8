"""Text in, text out around a looped model (or an exported engine): loading a tokenizer,
left-padded token ids of a batch of prompts, the decoded continuations, and the text of a
growing token sequence piece by piece for streaming (:class:`IncrementalDecoder`)."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from looptool.capture.tokenizer_cache import load_tokenizer as cached_tokenizer
from looptool.core.errors import LooptoolError


def load_tokenizer(path: str | os.PathLike):
    """The Hugging Face tokenizer at ``path``, or one sentence saying it could not be loaded."""
    try:
        return cached_tokenizer(path)
    except Exception as exc:
        raise LooptoolError(
            f"no tokenizer could be loaded from '{path}' ({type(exc).__name__}).", parameter="tokenizer"
        ) from exc


def model_tokenizer(model, tokenizer: str | os.PathLike | None = None):
    """The tokenizer at ``tokenizer`` (a folder) when given, else ``model``'s own; one sentence
    when the model was saved without one and none is given."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if model.tokenizer is None:
        raise LooptoolError(
            "this model was saved without a tokenizer; pass tokenizer=PATH (a Hugging Face tokenizer folder).",
            parameter="tokenizer",
        )
    return model.tokenizer


def encode_prompts(tok, prompts: Sequence[str]):
    """Left-padded token ids and mask of a batch of prompts (``input_ids``, ``attention_mask``).
    The tokenizer (often the model's own) is left as it was: the padding side is given per
    call, and a tokenizer without a pad token pads a batch with EOS through a copy."""
    if len(prompts) > 1 and tok.pad_token is None:
        tok = copy.deepcopy(tok)
        tok.pad_token = tok.eos_token
    return tok(list(prompts), return_tensors="pt", padding=len(prompts) > 1, padding_side="left")


def continuations(tok, sequences, prompt_width: int) -> list[str]:
    """The decoded new tokens of each row of ``sequences`` (prompt ids then generated ids,
    the prompts left-padded to ``prompt_width``), special tokens skipped."""
    return [tok.decode(row[prompt_width:], skip_special_tokens=True) for row in sequences]


class IncrementalDecoder:
    """The text of a growing token sequence, piece by piece, for streaming: each step decodes
    only the tokens since the last piece plus the piece before it as context (the prefix/read
    offsets of text-generation-inference's and vLLM's detokenizers), so n tokens cost O(n)
    decoding, not O(n²). A piece that ends in U+FFFD (a token that splits a multi-byte
    character) is held back until the character completes; :meth:`flush` gives what is left.
    The pieces joined equal ``tok.decode(all ids, skip_special_tokens=True)``."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # end of what has been emitted

    def push(self, token: int) -> str:
        """Add one token; the new text it completes (possibly empty)."""
        self.ids.append(int(token))
        return self._piece(final=False)

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
