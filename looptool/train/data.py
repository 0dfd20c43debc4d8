"""Training and evaluation text: files → tokens → fixed-length rows.

Three formats. ``text``: plain-text files, folders of them (searched recursively), glob
patterns, and JSONL files whose lines carry a ``text`` field; documents are tokenised with
the model's tokenizer, joined with the EOS token and packed into ``seq_len``-token rows,
and every token is a target. ``completion``: JSONL lines with ``prompt`` and
``completion``; each example is one row (prompt, completion, EOS, right-padded), and only
the completion and its EOS are targets (labels −100 elsewhere). ``chat``: JSONL lines with
a ``messages`` list of ``{"role", "content"}``; each conversation is rendered with the
tokenizer's chat template into one right-padded row, and only the tokens of assistant turns
(with the end-of-turn marker the template writes after them) are targets. Everything is
deterministic given the seed. The train/validation split is by file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from looptool.core.errors import LooptoolError
from looptool.core.words import counted

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst", ""}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}


class DataError(LooptoolError):
    """Unusable training or evaluation data."""


def find_files(specs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files, folders (recursively) and glob patterns into a sorted file list."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    files: set[Path] = set()
    for spec in specs:
        text = str(spec)
        matches = [Path(p) for p in glob.glob(text, recursive=True)] if glob.has_magic(text) else [Path(text)]
        if not matches or not all(m.exists() for m in matches):
            raise DataError(f"data path '{text}' does not exist; pass text files, folders, globs or .jsonl files.")
        for m in matches:
            if m.is_dir():
                files |= {p for p in m.rglob("*") if p.is_file() and not p.name.startswith(".")}
            else:
                files.add(m)
    usable = sorted(p for p in files if p.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES)
    if not usable:
        raise DataError(f"no .txt/.md/.jsonl files found in {', '.join(map(str, specs))}; pass a folder of text files.")
    return usable


def _read_text(path: Path) -> str:
    """A file's UTF-8 text, or one sentence on why it is not."""
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise DataError(f"'{path}' looks binary (it contains NUL bytes); pass UTF-8 text or JSONL files.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"'{path}' is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8."
        ) from None


def _jsonl_records(path: Path, text: str) -> Iterator[tuple[int, object]]:
    """``(line number, parsed record)`` of every non-blank JSONL line."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"'{path}' line {number} is not valid JSON ({exc.msg}); fix or remove that line.") from None


def read_documents(path: Path) -> list[str]:
    """The documents of one file: the whole text, or each JSONL line's ``text`` field."""
    text = _read_text(path)
    if path.suffix.lower() not in JSONL_SUFFIXES:
        return [text] if text.strip() else []
    docs = []
    for number, record in _jsonl_records(path, text):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"'{path}' line {number} has no string 'text' field; JSONL records need one.")
        if record["text"].strip():
            docs.append(record["text"])
    return docs


def read_completions(path: Path) -> list[tuple[str, str]]:
    """``(prompt, completion)`` of every line of a JSONL file."""
    if path.suffix.lower() not in JSONL_SUFFIXES:
        raise DataError(
            f"'{path}' is not a .jsonl file; format 'completion' reads JSONL lines with 'prompt' and 'completion'.",
            parameter="format",
        )
    pairs = []
    for number, record in _jsonl_records(path, _read_text(path)):
        if not (
            isinstance(record, dict)
            and isinstance(record.get("prompt"), str)
            and isinstance(record.get("completion"), str)
        ):
            raise DataError(
                f"'{path}' line {number} needs string 'prompt' and 'completion' fields (format 'completion').",
                parameter="format",
            )
        if not record["completion"]:
            raise DataError(f"'{path}' line {number} has an empty completion; there would be nothing to learn from it.")
        pairs.append((record["prompt"], record["completion"]))
    return pairs


@dataclass(frozen=True)
class Conversation:
    """One chat example: its messages (``{"role", "content"}`` dicts, passed to the chat
    template as they are) and where it comes from, for error messages."""

    messages: list[dict]
    origin: str = "a conversation"


def _check_messages(messages: object, origin: str) -> list[dict]:
    """``messages`` if it is a usable conversation, else one sentence on why not."""
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise DataError(
            f"{origin} needs a 'messages' list of objects with string 'role' and 'content' fields (format 'chat').",
            parameter="format",
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{origin} has no assistant message; there would be nothing to learn from it.")
    return [dict(m) for m in messages]


def read_conversations(path: Path) -> list[Conversation]:
    """The conversation of every line of a JSONL file (its ``messages``; other fields are ignored)."""
    if path.suffix.lower() not in JSONL_SUFFIXES:
        raise DataError(
            f"'{path}' is not a .jsonl file; format 'chat' reads JSONL lines with a 'messages' list.",
            parameter="format",
        )
    conversations = []
    for number, record in _jsonl_records(path, _read_text(path)):
        origin = f"'{path}' line {number}"
        messages = record.get("messages") if isinstance(record, dict) else None
        conversations.append(Conversation(_check_messages(messages, origin), origin))
    return conversations


def split_files(files: Sequence[Path], val_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file: ``round(val_fraction * n)`` files (at least one when the
    fraction is positive and there are two or more files) go to validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction {val_fraction} must be in [0, 1).")
    files = list(files)
    n_val = round(val_fraction * len(files))
    if val_fraction > 0 and len(files) > 1:
        n_val = max(1, n_val)
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    val = sorted(files[i] for i in order[:n_val])
    train = sorted(files[i] for i in order[n_val:])
    return train, val


def tokenize_files(files: Iterable[Path], tokenizer) -> torch.Tensor:
    """All documents of ``files`` tokenised and joined with EOS, as one 1-D LongTensor."""
    if tokenizer is None:
        raise DataError(
            "this model has no tokenizer; pass one as tokenizer (a Hugging Face tokenizer, e.g. "
            "AutoTokenizer.from_pretrained(folder)).",
            parameter="tokenizer",
        )
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for path in files:
        for doc in read_documents(path):
            ids.extend(tokenizer(doc, add_special_tokens=False).input_ids)
            if eos is not None:
                ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class _SeededRows:
    """Rows visited in a seeded permutation per epoch (shared by both formats)."""

    def __len__(self) -> int:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def order(self, epoch: int, seed: int) -> torch.Tensor:
        """Row order of an epoch (deterministic; the latest epoch's order is cached)."""
        key = (epoch, seed)
        if getattr(self, "_order_key", None) != key:
            self._order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            self._order_key = key
        return self._order

    def indices(self, position: int, batch: int, seed: int) -> list[int]:
        """The row indices of ``batch`` rows from global row ``position`` of the seeded stream
        of epochs; the same ``position`` always gives the same rows (resumable)."""
        out = []
        for p in range(position, position + batch):
            epoch, i = divmod(p, len(self))
            out.append(int(self.order(epoch, seed)[i]))
        return out


@dataclass
class PackedTokens(_SeededRows):
    """A token stream cut into ``seq_len`` rows; row order is a seeded permutation."""

    tokens: torch.Tensor
    seq_len: int

    def __post_init__(self):
        if self.seq_len < 2:
            raise DataError(f"seq_len {self.seq_len} is too short; use at least 2.", parameter="seq_len")
        if len(self) == 0:
            raise DataError(
                f"the data holds {counted(self.tokens.numel(), 'token')}, fewer than one sequence of "
                f"{self.seq_len}; add text or lower seq_len.",
                parameter="seq_len",
            )

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def row(self, index: int) -> torch.Tensor:
        """Row ``index`` (unshuffled)."""
        return self.tokens[index * self.seq_len : (index + 1) * self.seq_len]

    def batch(self, position: int, batch: int, seed: int) -> torch.Tensor:
        """The ``batch`` rows starting at global row ``position`` of the seeded stream of
        epochs; the same ``position`` always gives the same rows (resumable)."""
        return torch.stack([self.row(i) for i in self.indices(position, batch, seed)])

    def labeled_batch(self, position: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``: every token is a target."""
        ids = self.batch(position, batch, seed)
        return ids, ids


IGNORE = -100  # label of tokens that are not targets (the loss skips them)


class _LabeledRows(_SeededRows):
    """One example per ``seq_len`` row, right-padded with the pad token (else EOS, else 0),
    with per-token labels (−100 where a token is not a target); shared by the completion
    and chat formats."""

    ids: torch.Tensor
    labels: torch.Tensor
    seq_len: int

    def _fill(
        self, examples: Sequence[tuple[list[int], list[int]]], names: Sequence[str], tokenizer, seq_len: int
    ) -> None:
        """Lay out ``(token ids, labels)`` pairs, one per row; ``names[i]`` names example ``i``
        in the error that refuses one longer than ``seq_len``."""
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
        self.seq_len = seq_len
        self.ids = torch.full((len(examples), seq_len), pad, dtype=torch.long)
        self.labels = torch.full((len(examples), seq_len), IGNORE, dtype=torch.long)
        for row, ((ids, labels), name) in enumerate(zip(examples, names, strict=True)):
            if len(ids) > seq_len:
                raise DataError(
                    f"{name} has {counted(len(ids), 'token')}, more than seq_len {seq_len}; raise seq_len or shorten it.",
                    parameter="seq_len",
                )
            self.ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            self.labels[row, : len(labels)] = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def labeled_batch(self, position: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of ``batch`` examples from global row ``position``."""
        rows = self.indices(position, batch, seed)
        return self.ids[rows], self.labels[rows]


class CompletionExamples(_LabeledRows):
    """Prompt/completion examples, one ``seq_len`` row each: ``prompt + completion + EOS``
    right-padded; labels are −100 on the prompt and the padding."""

    def __init__(self, pairs: Sequence[tuple[str, str]], tokenizer, seq_len: int, source: str = "the data"):
        if tokenizer is None:
            raise DataError(
                "this model has no tokenizer; pass one as tokenizer (a Hugging Face tokenizer, e.g. "
                "AutoTokenizer.from_pretrained(folder)).",
                parameter="tokenizer",
            )
        if not pairs:
            raise DataError(f"{source} holds no prompt/completion examples.")
        eos = tokenizer.eos_token_id
        examples, names = [], []
        for row, (prompt, completion) in enumerate(pairs):
            p = tokenizer(prompt, add_special_tokens=True).input_ids
            c = tokenizer(completion, add_special_tokens=False).input_ids + ([eos] if eos is not None else [])
            if not p:
                raise DataError(
                    f"example {row + 1} of {source} has an empty prompt; the first target needs a token before it."
                )
            examples.append((p + c, [IGNORE] * len(p) + c))
            names.append(f"example {row + 1} of {source}")
        self._fill(examples, names, tokenizer, seq_len)


class ChatExamples(_LabeledRows):
    """Conversations rendered with the tokenizer's chat template, one ``seq_len`` row each,
    right-padded; labels are the token ids of assistant turns (their content and the
    end-of-turn marker the template writes after it, so the model learns to stop) and −100
    on everything else: system and user turns, the assistant header the generation prompt
    writes (such as ``<|im_start|>assistant`` and its newline) and the padding.

    Assistant turn ``i`` is the character span from the end of
    ``render(messages[:i], add_generation_prompt=True)`` to the end of
    ``render(messages[:i + 1])`` of the whole rendered conversation (so any template that
    renders turns incrementally works); the conversation is tokenised once, and a token is a
    target when its character span starts inside an assistant span (this needs a fast
    tokenizer's offsets).

    Conversations are not packed several to a row: the captured graphs take a 2-D padding
    mask ``[batch, seq]``, so conversations sharing a row would attend across their boundary
    (block-diagonal attention would need a 4-D mask input in the captured graph).
    """

    def __init__(
        self,
        conversations: Sequence[Conversation | Sequence[Mapping]],
        tokenizer,
        seq_len: int,
        source: str = "the data",
    ):
        if tokenizer is None:
            raise DataError(
                "this model has no tokenizer; pass one as tokenizer (a Hugging Face tokenizer, e.g. "
                "AutoTokenizer.from_pretrained(folder)).",
                parameter="tokenizer",
            )
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "this tokenizer has no chat template; pass a tokenizer that has one as tokenizer, or use "
                "format='completion'.",
                parameter="tokenizer",
            )
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "format 'chat' needs a fast tokenizer (one with token offsets) to find the assistant "
                "tokens; pass a fast tokenizer (one with a tokenizer.json) as tokenizer.",
                parameter="tokenizer",
            )
        if not conversations:
            raise DataError(f"{source} holds no conversations.")
        examples, names = [], []
        for n, conversation in enumerate(conversations, 1):
            if not isinstance(conversation, Conversation):
                origin = f"conversation {n} of {source}"
                conversation = Conversation(_check_messages(list(conversation), origin), origin)
            examples.append(_chat_tokens(conversation, tokenizer))
            names.append(conversation.origin)
        self._fill(examples, names, tokenizer, seq_len)


def _render_chat(tokenizer, messages: list[dict], origin: str, add_generation_prompt: bool = False) -> str:
    """``messages`` rendered with the tokenizer's chat template (may be empty: the text before
    a first assistant turn), or one sentence on why the template refuses them."""
    from jinja2 import TemplateError

    try:  # a batch of one: apply_chat_template refuses an empty conversation but renders an empty batch item
        return tokenizer.apply_chat_template([messages], tokenize=False, add_generation_prompt=add_generation_prompt)[0]
    except TemplateError as exc:
        raise DataError(
            f"the chat template cannot render {origin} ({exc}); fix that conversation or use format='completion'.",
            parameter="format",
        ) from None


def _chat_tokens(conversation: Conversation, tokenizer) -> tuple[list[int], list[int]]:
    """``(token ids, labels)`` of one conversation: labels are the ids of assistant-turn tokens
    and −100 elsewhere (see :class:`ChatExamples`)."""
    messages, origin = conversation.messages, conversation.origin
    text = _render_chat(tokenizer, messages, origin)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], origin, add_generation_prompt=True)
        through = _render_chat(tokenizer, messages[: i + 1], origin)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(
                f"the chat template does not render {origin} turn by turn (the text before message "
                f"{i + 1} is not a prefix of the whole conversation), so its assistant tokens cannot "
                "be found; use format='completion'.",
                parameter="format",
            )
        spans.append((len(before), len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc.input_ids)
    labels = [t if any(a <= start < b for a, b in spans) else IGNORE for t, (start, _) in zip(ids, enc.offset_mapping)]
    if all(label == IGNORE for label in labels):
        raise DataError(
            f"the assistant messages of {origin} render to no tokens; there would be nothing to learn from it."
        )
    if labels[0] != IGNORE:
        raise DataError(
            f"{origin} starts with an assistant token; the first target needs a token before it, so add "
            "a user or system message before it."
        )
    return ids, labels


FORMATS = ("text", "completion", "chat")


def training_rows(
    specs, tokenizer, seq_len: int, format: str = "text"
) -> PackedTokens | CompletionExamples | ChatExamples:
    """The rows a run trains on, in any of the :data:`FORMATS`."""
    if format not in FORMATS:
        raise DataError(f"format {format!r} is unknown; use {', '.join(FORMATS)}.", parameter="format")
    files = find_files(specs)
    if format == "text":
        return PackedTokens(tokenize_files(files, tokenizer), seq_len)
    source = ", ".join(map(str, files))
    if format == "chat":
        return ChatExamples([c for path in files for c in read_conversations(path)], tokenizer, seq_len, source=source)
    pairs = [pair for path in files for pair in read_completions(path)]
    return CompletionExamples(pairs, tokenizer, seq_len, source=source)
