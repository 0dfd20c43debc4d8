"""Self-speculative decoding (``generate(..., draft_budget=j, draft_tokens=n)``): greedy output
token for token budget ``k``'s own for every (draft, target) pair of a fixed-prefix and a
conditioned ELR model, in a left-padded batch; sampled output distributed exactly as budget
``k``'s (chi-square, with a broken acceptance rule as the negative control); the errors."""

from __future__ import annotations

import functools

import pytest
import scipy.stats
import torch

import looptool
from looptool.core.errors import LooptoolError
from looptool.engine import speculation
from looptool.engine.sampling import SamplingParams, TokenPicker
from looptool.runtime.generation import generate
from looptool.testing import left_padded_batch, move_off_init, tiny_model

# each plan, and how far its new parameters move from their exact init: far enough that budgets
# disagree on some tokens and agree on others, so drafts are both kept and rejected (a tiny
# random ELR model's budgets part ways sooner)
MODELS = {
    "prefix": (looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), 0.05),
    "elr-conditioning": (looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True), 0.01),
}


@functools.cache
def _model(name: str, scale: float | None = None):
    """A converted tiny llama whose new parameters sit ``scale`` (default: the plan's) away
    from their exact init."""
    plan, default = MODELS[name]
    scale = default if scale is None else scale
    model = looptool.convert(tiny_model("llama"), plan)
    move_off_init(model, scale)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_speculation_is_budget_k_token_for_token(name, monkeypatch):
    import looptool.engine.core as core

    grown = []
    real = core.with_length
    monkeypatch.setattr(core, "with_length", lambda a, n, dim: grown.append(n) or real(a, n, dim))
    model = _model(name)
    prompt, mask = left_padded_batch(3)
    kept = proposed = 0
    for k in model.budgets:
        plain = generate(model, prompt, attention_mask=mask, budget=k, max_new_tokens=10, output_logits=True)
        for j in (b for b in model.budgets if b < k):
            for n in (1, 3):
                out = generate(
                    model,
                    prompt,
                    attention_mask=mask,
                    budget=k,
                    max_new_tokens=10,
                    draft_budget=j,
                    draft_tokens=n,
                    output_logits=True,
                )
                assert torch.equal(out.sequences, plain.sequences), (k, j, n)
                assert out.new_tokens == plain.new_tokens == len(out.logits)
                for a, b in zip(out.logits, plain.logits):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                assert out.budgets == (k,) * 3 and out.speculation.rounds >= 10 // (n + 1)
                kept += out.speculation.accepted
                proposed += out.speculation.proposed
    assert 0 < kept < proposed  # both branches of the rule ran
    # the ELR model's rows kept different numbers of drafts until their shared clock outgrew the caches
    assert grown or name != "elr-conditioning"


def test_speculation_stops_rows_at_eos_and_streams_columns():
    model = _model("prefix")
    prompt, mask = left_padded_batch(3)
    plain = generate(model, prompt, attention_mask=mask, budget=2, max_new_tokens=12)
    eos = int(plain.sequences[0, 7 + 3])  # row 0's fourth new token
    ref = generate(model, prompt, attention_mask=mask, budget=2, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    seen = []
    out = generate(
        model,
        prompt,
        attention_mask=mask,
        budget=2,
        max_new_tokens=12,
        eos_token_id=eos,
        pad_token_id=0,
        draft_budget=0,
        draft_tokens=3,
        on_step=lambda t: seen.append(t.clone()),
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(torch.stack(seen, dim=1), out.sequences[:, 7:])
    stopped = generate(
        model, prompt, attention_mask=mask, budget=2, max_new_tokens=12, draft_budget=0, on_step=lambda t: True
    )
    assert stopped.new_tokens == 1 and torch.equal(stopped.sequences, plain.sequences[:, :8])


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``samples`` (token ids) against ``probs [vocab]``; cells expecting < 5 merged."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(scipy.stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_acceptance_rule_samples_the_target_distribution():
    """The rule alone, with fixed distributions: each emitted position is distributed as ``p``."""
    picker = TokenPicker(SamplingParams(temperature=1.0, seed=0))
    g = torch.Generator().manual_seed(1)
    rows, n, vocab = 20_000, 2, 6
    p_logits = torch.randn(1, n + 1, vocab, generator=g).expand(rows, -1, -1)
    q = torch.softmax(torch.randn(1, n, vocab, generator=g) * 2, -1).expand(rows, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(rows, n)
    p = torch.softmax(p_logits[0], -1)
    kept, nxt = speculation.accept_drafts(picker, p_logits, drafts, q)
    first = torch.where(kept > 0, drafts[:, 0], nxt)
    assert _chi_square(first, p[0]) > 0.01
    second = torch.where(kept > 1, drafts[:, 1], nxt)[kept >= 1]  # position 2, where position 1 was a draft
    assert _chi_square(second, p[1]) > 0.01
    # negative control: the rule told the drafts came from another distribution than they did
    wrong = torch.softmax(torch.randn(1, n, vocab, generator=g), -1).expand(rows, -1, -1)
    kept, nxt = speculation.accept_drafts(picker, p_logits, drafts, wrong)
    assert _chi_square(torch.where(kept > 0, drafts[:, 0], nxt), p[0]) < 0.01


def _second_token_distribution(model, prompt, k, sampling) -> torch.Tensor:
    """Exact marginal of the second new token at budget ``k``: sum over first tokens ``t`` of
    p(t) p(· | t), both after the sampling warpers."""
    warp = sampling.warpers()

    def probs(ids):
        return torch.softmax(warp(ids, model(ids, budget=k).logits[:, -1].float()), -1)

    first = probs(prompt)[0]
    support = first.nonzero()[:, 0]
    ids = torch.cat([prompt.expand(len(support), -1), support[:, None]], dim=1)
    return (first[support, None] * probs(ids)).sum(0)


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_speculation_matches_budget_k(broken, monkeypatch):
    """20,000 seeded rows, each's second token (the first drafted one) against budget 2's exact
    distribution; a rule that resamples rejections from ``p`` instead of the residual must fail."""
    if broken:

        def accept_then_resample_from_p(picker, target_logits, drafts, draft_dist):
            kept, _ = real(picker, target_logits, drafts, draft_dist)
            p = speculation.draft_probs(picker, target_logits)[torch.arange(len(kept)), kept]
            return kept, torch.multinomial(p, 1, generator=picker.generator)[:, 0]

        real = speculation.accept_drafts
        monkeypatch.setattr("looptool.engine.rounds.accept_drafts", accept_then_resample_from_p)
    model = _model("prefix", 0.3)
    prompt = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(5))
    sampling = SamplingParams(temperature=1.0, top_k=6, seed=11)
    with torch.no_grad():
        exact = _second_token_distribution(model, prompt, 2, sampling)
    out = generate(
        model, prompt.expand(20_000, -1), budget=2, max_new_tokens=2, sampling=sampling, draft_budget=0, draft_tokens=2
    )
    assert 0 < out.speculation.accepted < out.speculation.proposed
    pvalue = _chi_square(out.sequences[:, -1], exact)
    assert (pvalue < 0.01) if broken else (pvalue > 0.01), pvalue


def test_speculation_errors():
    model = _model("prefix")
    prompt, _ = left_padded_batch(3)
    cases = [
        (dict(budget=2, draft_budget=2), "shallower"),
        (dict(budget=2, draft_budget=5), "menu"),
        (dict(budget=2, draft_budget=0, draft_tokens=0), "draft_tokens"),
        (dict(budget=[0, 1, 2], draft_budget=0), "one budget"),
        (dict(budget=2, draft_budget=0, kv="last-loop"), "per-loop"),
    ]
    for kwargs, words in cases:
        with pytest.raises(LooptoolError, match=words):
            generate(model, prompt, max_new_tokens=4, **kwargs)
