"""Validating an engine: greedy generation with every graph in onnxruntime against the PyTorch
cached path on the same prompts."""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

from looptool.backends.errors import ExportError
from looptool.core.graph import ADAPTIVE, ROWWISE

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


def _check(ref, run, ids, mask, atol: float, what: str, label: str) -> float:
    """Max abs difference of the next-token logits of a PyTorch generation ``ref`` (greedy,
    from ``ids``/``mask``) and onnxruntime's (``run(ids, mask, max_new_tokens)``);
    :class:`ExportError` above ``atol × max(1, max |logits|)``, or where onnxruntime picks a
    token whose reference logit lies more than that limit below the reference's pick.

    A pick within the limit is a near tie, not an error: two fp16 logits one ulp apart (2.4e-4
    at 0.35) swap places under either runtime's rounding, and from there on the generations
    read different tokens, so their logits no longer compare. onnxruntime then resumes from
    the reference's tokens (a prefill of the prompt and the tokens so far), so every step is
    compared on the same history."""
    if not all(bool(torch.isfinite(t).all()) for t in ref.logits):
        dtype = str(ref.logits[0].dtype).removeprefix("torch.")
        raise ExportError(
            f"{what}: the model's own PyTorch path gives non-finite logits in {dtype} on the {label} prompt, so "
            f"its values overflow this precision (float16 stops at 65504); export in bfloat16 or float32 "
            f"(precision='bf16' or 'fp32').",
            parameter="precision",
        )
    # fp32 kernels accumulate in different orders, so the limit scales with the logits
    # once they exceed 1 (SmolLM2: |logits| ~ 36, diff ~ 2e-4 even with ORT optimisations off)
    limit = atol * max(1.0, max(float(t.abs().max()) for t in ref.logits))
    prompt, steps = ids.shape[1], len(ref.logits)
    diff, start = 0.0, 0

    def fail(tokens: bool) -> None:
        raise ExportError(
            f"{what}: onnxruntime and PyTorch differ by {diff:.3g} on the {label} prompt (limit {limit:.3g})"
            f"{' and generate different tokens' if tokens else ''}; the export was discarded, please report this as a bug."
        )

    while start < steps:
        seen = mask if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], start)], dim=1)
        got = run(ref.sequences[:, : prompt + start], seen, steps - start)
        if len(got.logits) != steps - start or got.sequences.shape != ref.sequences.shape:
            fail(True)
        resume = steps
        for i, (a, b) in enumerate(zip(ref.logits[start:], got.logits), start):
            want, pick = ref.sequences[:, prompt + i], got.sequences[:, prompt + i]
            same = torch.equal(want, pick)
            diff = max(diff, float((a.float() - b.float()).abs().max()))
            if not np.isfinite(diff) or diff > limit:
                fail(not same)
            if not same:
                rows = (want != pick).nonzero().squeeze(-1)
                scores = a.float()[rows]
                gap = scores.gather(1, want[rows, None]) - scores.gather(1, pick[rows, None])
                if float(gap.max()) > limit:
                    fail(True)  # not a near tie: by PyTorch's logits onnxruntime's pick is clearly worse
                resume = i + 1  # a near tie: onnxruntime goes on from the reference's pick
                break
        start = resume
    return diff


# Weight-only quantized graphs (looptool.backends.onnx.quantize) cannot reproduce PyTorch's
# logits; they are held to a bound on the relative error of the next-token logits instead:
# rms(Δ - mean Δ) / rms(ref - mean ref) per row and step (logits centred, since a constant shift
# changes no probability). Blockwise symmetric rounding leaves each weight an rms error of
# step/√12, a step being absmax/8 per 32-weight block at 4 bits and absmax/128 at 8 bits; through the
# layers that gives, measured with float activations (accuracy level 1, the default; int8
# activations, level 4, in brackets): tiny test llama int4 0.16-0.24 (0.15-0.24), int8
# 0.011-0.012 (0.015-0.020); SmolLM2-135M int4 0.47-0.49 (0.48-0.49; its weights come from a Q4_1
# GGUF, an asymmetric 4-bit grid that symmetric int4 does not fit). A broken quantization (blocks read
# for the wrong row, a wrong K/N or block layout) gives logits unrelated to the reference, a
# relative error near √2 (measured 1.45-1.51 on the tiny llama with its blocks shifted by one
# row), so the bounds sit between the two.
QUANTIZED_BOUNDS = {"int8": 0.1, "int4": 0.8}


def relative_logit_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Worst row's rms(Δ - mean Δ) / rms(ref - mean ref) of next-token logits ``[batch, vocab]``."""
    ref, got = ref.double(), got.double()
    delta = got - ref
    delta = delta - delta.mean(-1, keepdim=True)
    spread = ref - ref.mean(-1, keepdim=True)
    return float((delta.pow(2).mean(-1).sqrt() / spread.pow(2).mean(-1).sqrt().clamp_min(1e-12)).max())


def mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) ‖ softmax(got)) in nats."""
    p = torch.log_softmax(ref.double(), -1)
    q = torch.log_softmax(got.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def check_quantized(ref, run, ids, mask, bound: float, what: str, label: str) -> dict[str, float]:
    """A quantized graph's greedy generation (``run``) against PyTorch's float one (``ref``),
    step by step while both pick the same tokens (after the first disagreement the histories
    differ): worst :func:`relative_logit_error` (``rel``) and worst per-step :func:`mean_kl`
    (``kl``); :class:`ExportError` where ``rel`` exceeds ``bound`` or is not finite."""
    prompt, steps = ids.shape[1], len(ref.logits)
    got = run(ids, mask, steps)
    rel, kl = 0.0, 0.0
    for i, (a, b) in enumerate(zip(ref.logits, got.logits)):
        rel = max(rel, relative_logit_error(a, b))
        kl = max(kl, mean_kl(a, b))
        if not np.isfinite(rel) or rel > bound:
            raise ExportError(
                f"{what}: the quantized graph's logits differ from PyTorch's by a relative error of {rel:.3g} "
                f"on the {label} prompt (bound {bound}); the export was discarded, please report this as a bug."
            )
        if not torch.equal(ref.sequences[:, prompt + i], got.sequences[:, prompt + i]):
            break
    return {"rel": rel, "kl": kl}


def _compare(out: dict, key: str, ref, run, ids, mask, atol: float, quantized: str | None, what: str, label: str):
    """Check ``run`` against ``ref`` on one prompt (:func:`check_quantized` for quantized
    weights, else :func:`_check`) and record it in ``out`` under ``key`` (quantized: the relative
    error, and the KL under ``<key>.kl``)."""
    if quantized:
        got = check_quantized(ref, run, ids, mask, QUANTIZED_BOUNDS[quantized], what, label)
        out.update({key: got["rel"], f"{key}.kl": got["kl"]})
    else:
        out[key] = _check(ref, run, ids, mask, atol, what, label)


def _run(rt, budget, policy: str, ids, mask, new_tokens: int, **speculation):
    """Greedy generation with the engine's graph for ``budget`` (one, or one per row);
    ``speculation``: ``draft_budget`` and ``draft_tokens`` (the verify graph's logits)."""
    return rt.generate(
        ids, attention_mask=mask, budget=budget, kv=policy, max_new_tokens=new_tokens, output_logits=True, **speculation
    )


VERIFY = "verify"  # third element of a verify graph's key in validate_engine's result
VERIFY_DRAFTS = 3  # tokens drafted per verify step when validating a verify graph


def validate_engine(
    model,
    directory: str | os.PathLike,
    *,
    atol: float | None = None,
    new_tokens: int = 6,
    quantized: str | None = None,
) -> dict[tuple[int | str, str], dict[str, float]]:
    """Generate greedily with every graph of an engine (onnxruntime, :class:`Runtime`) and
    with the PyTorch cached path on the same prompts; returns the max abs difference of the
    next-token logits over the prefill and every decode step, per ``(budget, policy)`` and
    prompt (the row-wise graph: key ``(ROWWISE, policy)``, against the PyTorch row-wise path), raising :class:`ExportError` above ``atol × max(1, max |logits|)`` (``atol``
    default: :func:`default_atol` of the model's dtype) or when the greedy tokens differ.

    ``quantized`` (``"int8"``/``"int4"``): the graphs hold weight-only quantized linears, so each
    prompt's entry is the worst relative logit error (:func:`check_quantized`, bounded by
    :data:`QUANTIZED_BOUNDS`), and ``<label>.kl`` the worst per-step mean KL in nats.

    A verify graph (speculative decoding, key ``(budget, policy, VERIFY)``) is checked the same
    way against budget ``budget``'s PyTorch generation: onnxruntime decodes speculatively, the
    shallowest exported budget drafting :data:`VERIFY_DRAFTS` tokens, so every logit after the
    prefill comes from the verify graph.

    An adaptive-depth graph (``budget="auto"``, key ``(ADAPTIVE, policy, exit rule)``) is checked
    against the PyTorch adaptive path (:func:`_validate_adaptive`): logits alike, depths equal."""
    from looptool.backends.ort.runtime import Runtime
    from looptool.runtime.generation import generate

    atol = default_atol(model) if atol is None else atol
    rt = Runtime(directory)
    diffs: dict[tuple, dict[str, float]] = {}
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
                runs = {(budget, policy): (functools.partial(_run, rt, budget, policy), f"budget {budget} ({policy})")}
                if rt.has_verify(budget, policy):
                    draft = dict(draft_budget=rt.budgets[0], draft_tokens=VERIFY_DRAFTS)
                    what = f"the verify graph of budget {budget} ({policy})"
                    runs[budget, policy, VERIFY] = (functools.partial(_run, rt, budget, policy, **draft), what)
                for key, (run, what) in runs.items():
                    _compare(diffs.setdefault(key, {}), label, ref, run, ids, mask, atol, quantized, what, label)
            log.info("budget %d (%s) validated: %s", budget, policy, diffs[budget, policy])
        if rt.has_rowwise(policy):
            diffs[ROWWISE, policy] = _validate_rowwise(model, rt, policy, atol, new_tokens, quantized)
        for rule in (r for r, graphs in rt.manifest.adaptive_graphs.items() if policy in graphs):
            diffs[ADAPTIVE, policy, rule] = _validate_adaptive(model, rt, policy, rule, atol, new_tokens, quantized)
    rt.close()
    return diffs


def _validate_rowwise(
    model, rt, policy: str, atol: float, new_tokens: int, quantized: str | None = None
) -> dict[str, float]:
    """The row-wise graph against the PyTorch row-wise path on a left-padded batch whose rows
    take every budget of the menu (and a second, reversed, on the real prompt repeated)."""
    from looptool.runtime.generation import generate

    menu = rt.rowwise_menu(policy)
    out: dict[str, float] = {}
    if rt.manifest.graph(ROWWISE, policy).loops:  # its trip counts follow the batch: every budget alone too
        for label, (ids, mask) in validation_prompts(model).items():
            for k in menu:
                ref = generate(
                    model, ids, attention_mask=mask, budget=k, kv=policy, max_new_tokens=new_tokens, output_logits=True
                )
                what = f"the looped row-wise graph ({policy}) at budget {k}"
                _compare(
                    out,
                    f"{label}@{k}",
                    ref,
                    functools.partial(_run, rt, [k] * ids.shape[0], policy),
                    ids,
                    mask,
                    atol,
                    quantized,
                    what,
                    label,
                )
    for label, (ids, mask) in validation_prompts(model).items():
        rows = list(menu) if label == "random" else list(reversed(menu))
        reps = -(-len(rows) // ids.shape[0])
        ids, mask = ids.repeat(reps, 1)[: len(rows)], mask.repeat(reps, 1)[: len(rows)]
        if len(set(rows)) == 1:
            continue  # a one-budget menu: the budget's own graph runs it
        ref = generate(
            model, ids, attention_mask=mask, budget=rows, kv=policy, max_new_tokens=new_tokens, output_logits=True
        )
        run = functools.partial(_run, rt, rows, policy)
        what = f"the row-wise graph ({policy}, rows at budgets {rows})"
        _compare(out, label, ref, run, ids, mask, atol, quantized, what, label)
    log.info("row-wise graph (%s) validated: %s", policy, out)
    return out


def _run_kept(rt, runs: list, auto: dict, ids, mask, new_tokens: int):
    """``rt.generate(..., **auto)``, its result also appended to ``runs``."""
    runs.append(rt.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **auto))
    return runs[-1]


def adaptive_thresholds(rule: str = "state") -> dict[str, float]:
    """The exit thresholds an adaptive-depth graph of ``rule`` is validated at: the two ends
    (state and KL rules: 0, every row at its ``max_budget``, and infinity, every row at its
    ``min_budget``; the learned exits: q = 1 and q = 0) and the rule's default (depths that vary)."""
    from looptool.engine.budgets import EXIT_THRESHOLDS

    scale = EXIT_THRESHOLDS[rule]
    return {f"{scale.deepest:g}": scale.deepest, "default": scale.default, f"{scale.shallowest:g}": scale.shallowest}


def _validate_adaptive(
    model, rt, policy: str, rule: str, atol: float, new_tokens: int, quantized: str | None = None
) -> dict[str, float]:
    """The adaptive-depth graph of exit rule ``rule`` against PyTorch's ``generate(budget="auto")``
    over the whole menu, at each of :func:`adaptive_thresholds` on every validation prompt: the
    logits as :func:`_check` compares them (:func:`check_quantized` for quantized weights) and,
    while the greedy tokens agree, each token's depth equal. Keys ``<prompt>.<threshold>``, and
    ``<prompt>``: the worst over the thresholds."""
    from looptool.runtime.generation import generate

    out: dict[str, float] = {}
    for name, threshold in adaptive_thresholds(rule).items():
        auto = dict(budget="auto", exit_threshold=threshold, exit_rule=rule, kv=policy, output_logits=True)
        for label, (ids, mask) in validation_prompts(model).items():
            ref = generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens, **auto)
            runs: list = []
            run = functools.partial(_run_kept, rt, runs, auto)

            what = f"the adaptive-depth graph ({rule} rule, {policy}, exit_threshold {threshold})"
            key = f"{label}.{name}"
            _compare(out, key, ref, run, ids, mask, atol, quantized, what, label)
            if quantized:
                continue
            out[label] = max(out.get(label, 0.0), out[key])  # the worst over the thresholds, as other graphs report it
            first, prompt = runs[0], ids.shape[1]
            agree = (ref.sequences[:, prompt:] == first.sequences[:, prompt:]).all(0).long().cumprod(0).sum()
            agree = int(agree) + (1 if int(agree) < ref.depths.shape[1] else 0)  # a token's depth precedes its pick
            if not torch.equal(ref.depths[:, :agree], first.depths[:, :agree]):
                raise ExportError(
                    f"{what}: onnxruntime's depths {first.depths.tolist()} differ from PyTorch's {ref.depths.tolist()} "
                    f"on the {label} prompt; the export was discarded, please report this as a bug."
                )
    log.info("adaptive-depth graph (%s, %s) validated: %s", rule, policy, out)
    return out
