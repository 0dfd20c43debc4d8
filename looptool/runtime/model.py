"""The looped model users hold: :class:`LoopedModel`, a looped network
(:class:`~looptool.runtime.network.LoopedNetwork`: parameters, budget paths, forward, cost
model) with its two Hugging Face-style conveniences, ``generate`` (the decoding loop of
:mod:`looptool.runtime.generation`) and ``save_pretrained`` (the format of
:mod:`looptool.storage.save`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from looptool.runtime.generation import generate
from looptool.runtime.network import LoopedNetwork
from looptool.storage.save import save


class LoopedModel(LoopedNetwork):
    """A looped decoder: the source's parameters (shared, never copied), the new ``loop.*``
    parameters, one straight-line FX graph per budget, and ``generate`` and ``save_pretrained``.

    ``model(input_ids, attention_mask=None, labels=None, budget=k)`` returns a Hugging
    Face ``CausalLMOutputWithPast`` (``.logits``, ``.loss`` when ``labels`` are given,
    shifted next-token cross-entropy ignoring ``-100`` as HF does).
    """

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        budget: int | list[int] | torch.Tensor | str | None = None,
        max_new_tokens: int = 32,
        kv: str | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Generate at ``budget`` (one for all rows, a list / tensor with one per row, or
        ``"auto"``: each token's depth decided as it runs, with ``min_budget``, ``max_budget``,
        ``exit_threshold``) with a KV cache (``kv="per-loop"`` or ``"last-loop"``; None: per-loop,
        last-loop for ``"auto"``); returns ``[batch, prompt + new]`` ids.

        Greedy by default; ``sampling`` (a :class:`~looptool.engine.sampling.SamplingParams`),
        ``attention_mask`` (left padding), ``eos_token_id`` (default: the config's) and
        ``pad_token_id`` are passed to :func:`looptool.runtime.generation.generate`.
        """
        kwargs.setdefault("eos_token_id", getattr(self.config, "eos_token_id", None))
        out = generate(self, input_ids, budget=budget, max_new_tokens=max_new_tokens, kv=kv, **kwargs)
        return out.sequences

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write config.json, looptool.json, model.safetensors and the tokenizer (atomic)."""
        return save(self, directory, overwrite=overwrite)
