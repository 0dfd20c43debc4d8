"""Request prompts as token ids: completion prompts (text, texts, token ids, lists of token
ids), chat messages through the tokenizer's chat template, and the capacity check."""

from __future__ import annotations

from looptool.core.words import counted
from looptool.serve.protocol import APIError, ChatMessage


def completion_prompts(prompt, tok, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """``(token ids per prompt, text per prompt)`` of a completions ``prompt``; an empty prompt
    or a token id outside the vocabulary is refused."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("the prompt is empty; send at least one token.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            tokens = list(tok(p)["input_ids"])
            texts.append(p)
        else:
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}).", param="prompt")
            tokens = list(p)
            texts.append(tok.decode(tokens))
        if not tokens:
            raise APIError("the prompt is empty; send at least one token.", param="prompt")
        ids.append(tokens)
    return ids, texts


def chat_prompt(messages: list[ChatMessage], tok, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template (with the generation
    prompt unless told otherwise)."""
    if not messages:
        raise APIError("messages is empty; send at least one message.", param="messages")
    if not getattr(tok, "chat_template", None):
        raise APIError(
            "this model's tokenizer has no chat template; use /v1/completions with a text prompt.", param="messages"
        )
    out = tok.apply_chat_template(
        [m.as_dict() for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
    )
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    if not ids:
        raise APIError("the chat template produced an empty prompt.", param="messages")
    return [int(t) for t in ids]


def check_room(prompt_tokens: int, max_tokens: int | None, capacity: int) -> None:
    """Refuse a prompt that leaves no room in a slot of ``capacity`` tokens, or ``max_tokens``
    that would run past it."""
    if prompt_tokens >= capacity:
        raise APIError(
            f"the prompt has {counted(prompt_tokens, 'token')}; this server's capacity is {counted(capacity, 'token')} per request "
            "(prompt plus completion). Shorten the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > capacity:
        raise APIError(
            f"max_tokens={max_tokens} plus the prompt's {counted(prompt_tokens, 'token')} exceed the capacity of "
            f"{counted(capacity, 'token')}; ask for at most {capacity - prompt_tokens}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
