"""Validating an engine: greedy generation with every graph in onnxruntime against the PyTorch
cached path on the same prompts."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from looptool.backends.onnx_format import ROWWISE, ExportError

log = logging.getLogger(__name__)


DEFAULT_ATOL = 1e-4  # float32 graphs
# float16 graphs: fp16 rounds every intermediate to 11 significant bits (eps 9.8e-4) and
# onnxruntime and PyTorch round in different places, so the limit is ~10 fp16 ulps of the logits
FP16_ATOL = 1e-2


def default_atol(model) -> float:
    """The validation limit (relative to ``max(1, max |logits|)``) for ``model``'s dtype."""
    dtype = next(model.parameters()).dtype
    return FP16_ATOL if dtype == torch.float16 else DEFAULT_ATOL


VALIDATION_TEXT = "The quick brown fox jumps over the lazy dog, then counts: one, two, three, four."


def validation_prompts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, attention_mask)`` per label: two random rows, the second left-padded,
    and a real sentence (tokenised when the model has a tokenizer)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {"random": (ids, mask)}
    if model.tokenizer is not None:
        real = model.tokenizer(VALIDATION_TEXT, return_tensors="pt").input_ids
    else:
        real = torch.tensor([list(VALIDATION_TEXT.encode())]) % vocab
    out["real"] = (real, torch.ones_like(real))
    return out


def _check(ref, got, atol: float, what: str, label: str) -> float:
    """Max abs difference of the next-token logits of two generations; :class:`ExportError`
    above ``atol × max(1, max |logits|)`` or where the tokens differ."""
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.logits, got.logits))
    # fp32 kernels accumulate in different orders, so the limit scales with the logits
    # once they exceed 1 (SmolLM2: |logits| ~ 36, diff ~ 2e-4 even with ORT optimisations off)
    limit = atol * max(1.0, max(float(t.abs().max()) for t in ref.logits))
    same = torch.equal(ref.sequences, got.sequences)
    if not np.isfinite(diff) or diff > limit or not same:
        raise ExportError(
            f"{what}: onnxruntime and PyTorch differ by {diff:.3g} on the {label} prompt (limit {limit:.3g})"
            f"{'' if same else ' and generate different tokens'}; the export was discarded, please report this as a bug."
        )
    return diff


def validate_engine(
    model, directory: str | os.PathLike, *, atol: float | None = None, new_tokens: int = 6
) -> dict[tuple[int | str, str], dict[str, float]]:
    """Generate greedily with every graph of an engine (onnxruntime, :class:`Runtime`) and
    with the PyTorch cached path on the same prompts; returns the max abs difference of the
    next-token logits over the prefill and every decode step, per ``(budget, policy)`` and
    prompt (the row-wise graph: key ``(ROWWISE, policy)``, against the PyTorch row-wise path), raising :class:`ExportError` above ``atol × max(1, max |logits|)`` (``atol``
    default: :func:`default_atol` of the model's dtype) or when the greedy tokens differ."""
    from looptool.backends.ort import Runtime
    from looptool.runtime.generation import generate

    atol = default_atol(model) if atol is None else atol
    rt = Runtime(directory)
    diffs: dict[tuple[int, str], dict[str, float]] = {}
    for policy in rt.kv_policies:
        for budget in rt.budgets:
            diffs[budget, policy] = {}
            for label, (ids, mask) in validation_prompts(model).items():
                ref = generate(
                    model,
                    ids,
                    attention_mask=mask,
                    budget=budget,
                    kv=policy,
                    max_new_tokens=new_tokens,
                    output_logits=True,
                )
                got = rt.generate(
                    ids, attention_mask=mask, budget=budget, kv=policy, max_new_tokens=new_tokens, output_logits=True
                )
                diffs[budget, policy][label] = _check(ref, got, atol, f"budget {budget} ({policy})", label)
            log.info("budget %d (%s) validated: %s", budget, policy, diffs[budget, policy])
        if rt.has_rowwise(policy):
            diffs[ROWWISE, policy] = _validate_rowwise(model, rt, policy, atol, new_tokens)
    rt.close()
    return diffs


def _validate_rowwise(model, rt, policy: str, atol: float, new_tokens: int) -> dict[str, float]:
    """The row-wise graph against the PyTorch row-wise path on a left-padded batch whose rows
    take every budget of the menu (and a second, reversed, on the real prompt repeated)."""
    from looptool.runtime.generation import generate

    menu = rt.rowwise_menu(policy)
    out: dict[str, float] = {}
    for label, (ids, mask) in validation_prompts(model).items():
        rows = list(menu) if label == "random" else list(reversed(menu))
        reps = -(-len(rows) // ids.shape[0])
        ids, mask = ids.repeat(reps, 1)[: len(rows)], mask.repeat(reps, 1)[: len(rows)]
        if len(set(rows)) == 1:
            continue  # a one-budget menu: the budget's own graph runs it
        ref = generate(
            model, ids, attention_mask=mask, budget=rows, kv=policy, max_new_tokens=new_tokens, output_logits=True
        )
        got = rt.generate(
            ids, attention_mask=mask, budget=rows, kv=policy, max_new_tokens=new_tokens, output_logits=True
        )
        out[label] = _check(ref, got, atol, f"the row-wise graph ({policy}, rows at budgets {rows})", label)
    log.info("row-wise graph (%s) validated: %s", policy, out)
    return out
