"""Per-token adaptive depth (the ``adaptive_depth`` pass, ``generate(budget="auto")``), checked
against generating at fixed budgets, with non-zero new parameters: threshold 0 is exactly
``max_budget``, an infinite threshold exactly ``min_budget``, depths in between really vary, and
each row of a left-padded batch gets exactly what it gets alone; the ``skip_exited`` path, which
stops looping once every row has exited, is bit-identical to the masked path and skips."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import fx

import looptool
from looptool.core.errors import LooptoolError, PassError
from looptool.passes import PassManager
from looptool.passes.adaptive_depth import ADAPTIVE, AUTO_INPUTS
from looptool.passes.skip_exited import segments
from looptool.runtime.decode_graphs import adaptive_path, allocate_cache, cached_layer_graph, cached_paths
from looptool.runtime.generation import generate
from looptool.testing import decode_loop, left_padded_batch, move_off_init, tiny_model

NEW = 5
MODELS = {
    "prefix-llama": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "elr-llama": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)),
    "elr-llama-conditioning": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True)),
}
UNCONDITIONED = ["prefix-llama", "elr-llama"]
MOE = {"elr-moe-route-replay": ("qwen3_moe", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True))}


@functools.cache
def _model(name: str):
    """A converted tiny model whose new parameters are moved away from their exact init."""
    arch, plan = {**MODELS, **MOE}[name]
    model = looptool.convert(tiny_model(arch), plan)
    move_off_init(model, 0.5)
    return model


def _run(model, prompt, mask, **kw):
    return generate(model, prompt, attention_mask=mask, max_new_tokens=NEW, output_logits=True, **kw)


def _same(a, b, rows=slice(None)) -> bool:
    """Equal tokens and logits within 1e-5 (``rows`` of ``b`` against all of ``a``)."""
    return torch.equal(a.sequences, b.sequences[rows]) and all(
        torch.allclose(x, y[rows], atol=1e-5, rtol=0) for x, y in zip(a.logits, b.logits)
    )


def _first_token_criteria(model, prompt, mask, rule: str = "state") -> torch.Tensor:
    """``[rows, decisions]``: the criterion of each of the adaptive path's decisions at the
    first token (the prefill), every step run (threshold 0), read by returning them too."""
    path = adaptive_path(model, exit_rule=rule, skip=False)  # the masked path: every criterion in one graph
    graph = copy.deepcopy(path.module.graph)
    criteria = [n.args[0] for n in graph.nodes if n.target is torch.ops.aten.ge.Tensor]  # c >= threshold
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((*output.args[0], *criteria),)
    module = fx.GraphModule(path.module, graph)
    rows, length = prompt.shape
    caches = allocate_cache(path, rows, length, dtype=torch.float32, device="cpu")
    depth_range = [torch.full((rows,), b) for b in (min(model.budgets), max(model.budgets))]
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    args = (prompt, mask.to(model.mask_dtype), position, torch.arange(length), *depth_range, torch.zeros(rows), *caches)
    with torch.no_grad():
        return torch.stack(module(*args)[2:], dim=1)


def _varying_threshold(model, prompt, mask, rule: str = "state") -> float:
    """A threshold between the rows' measured first-token criteria of the first decision (the
    geometric middle of their widest gap), so some rows go on and some stop."""
    first = torch.sort(_first_token_criteria(model, prompt, mask, rule)[:, 0]).values
    gaps = first[1:].log() - first[:-1].log()
    i = int(gaps.argmax())
    return float((first[i] * first[i + 1]).sqrt())


@pytest.mark.parametrize("name", list(MODELS))
def test_threshold_zero_is_max_budget(name):
    model = _model(name)
    prompt, mask = left_padded_batch(2)
    for hi in sorted(model.budgets)[-2:]:  # the deepest budget, and one below it (masked deeper steps)
        auto = _run(model, prompt, mask, budget="auto", max_budget=hi, exit_threshold=0.0)
        fixed = _run(model, prompt, mask, budget=hi, kv="last-loop")
        assert _same(fixed, auto), (name, hi)
        assert auto.depths.shape == (2, NEW) and bool((auto.depths == hi).all())


@pytest.mark.parametrize("name", UNCONDITIONED)
def test_infinite_threshold_is_min_budget(name):
    model = _model(name)
    prompt, mask = left_padded_batch(2)
    for lo in sorted(model.budgets)[:2]:  # the smallest budget, and one above it (forced steps)
        auto = _run(model, prompt, mask, budget="auto", min_budget=lo, exit_threshold=float("inf"))
        fixed = _run(model, prompt, mask, budget=lo, kv="last-loop")
        assert _same(fixed, auto), (name, lo)
        assert bool((auto.depths == lo).all())
        assert _same(fixed, _run(model, prompt, mask, budget="auto", min_budget=lo, exit_threshold=1e9))


@pytest.mark.parametrize("name", UNCONDITIONED)
def test_intermediate_threshold_varies_depth_and_rows_match_alone(name):
    model = _model(name)
    lo, hi = min(model.budgets), max(model.budgets)
    prompt, mask = left_padded_batch(3)
    thr = _varying_threshold(model, prompt, mask)
    batch = _run(model, prompt, mask, budget="auto", exit_threshold=thr)
    assert batch.depths.dtype == torch.int64 and bool(((batch.depths >= lo) & (batch.depths <= hi)).all())
    assert bool(((batch.depths > lo) & (batch.depths < hi)).any()), (thr, batch.depths)
    assert batch.depths[:, 0].unique().numel() > 1, (thr, batch.depths)  # the rows' first tokens differ in depth
    for r in range(3):
        alone = _run(model, prompt[r : r + 1], mask[r : r + 1], budget="auto", exit_threshold=thr)
        assert _same(alone, batch, slice(r, r + 1)), (name, r)
        assert torch.equal(alone.depths[0], batch.depths[r])


@pytest.mark.parametrize("name", UNCONDITIONED)
def test_mixed_depths_equal_each_tokens_budget_over_one_last_loop_cache(name):
    """Each row alone at a threshold that mixes depths equals running, token by token, the
    fixed-budget cached path of the depth it realised over one shared last-loop cache."""
    model = _model(name)
    prompt, mask = left_padded_batch(3)
    thr = _varying_threshold(model, prompt, mask)
    paths = cached_paths(model, "last-loop")
    deepest = paths[max(model.budgets)]
    mixed = False
    for r in range(3):
        auto = _run(model, prompt[r : r + 1], mask[r : r + 1], budget="auto", exit_threshold=thr)
        mixed |= auto.depths.unique().numel() > 1
        caches = allocate_cache(deepest, 1, prompt.shape[1] + NEW, dtype=torch.float32, device="cpu")
        by_slot = {(s.layer, s.kind): c for s, c in zip(deepest.slots, caches)}
        depths = iter(auto.depths[0].tolist())

        def step(ids, m, position, cache_position, depths=depths, by_slot=by_slot):
            path = paths[next(depths)]
            return path.module(ids, m, position, cache_position, *(by_slot[s.layer, s.kind] for s in path.slots))[:, -1]

        ref = decode_loop(
            step,
            prompt[r : r + 1],
            mask[r : r + 1],
            capacity=prompt.shape[1] + NEW,
            max_new_tokens=NEW,
            mask_dtype=model.mask_dtype,
            output_logits=True,
        )
        assert _same(ref, auto), (name, r, auto.depths)
    assert mixed  # some row changed depth from token to token


@pytest.mark.parametrize("name", UNCONDITIONED)
def test_kl_rule(name):
    model = _model(name)
    lo, hi = min(model.budgets), max(model.budgets)
    prompt, mask = left_padded_batch(3)
    thr = _varying_threshold(model, prompt, mask, "kl")
    batch = _run(model, prompt, mask, budget="auto", exit_rule="kl", exit_threshold=thr)
    assert batch.depths[:, 0].unique().numel() > 1, (thr, batch.depths)
    for r in range(3):
        alone = _run(model, prompt[r : r + 1], mask[r : r + 1], budget="auto", exit_rule="kl", exit_threshold=thr)
        assert _same(alone, batch, slice(r, r + 1)) and torch.equal(alone.depths[0], batch.depths[r])
    prompt, mask = prompt[:2], mask[:2]
    auto = _run(model, prompt, mask, budget="auto", exit_rule="kl", exit_threshold=0.0)
    assert _same(_run(model, prompt, mask, budget=hi, kv="last-loop"), auto)
    auto = _run(model, prompt, mask, budget="auto", exit_rule="kl", exit_threshold=float("inf"))
    assert _same(_run(model, prompt, mask, budget=lo, kv="last-loop"), auto) and bool((auto.depths == lo).all())


def test_kl_rule_where_the_final_norm_reads_the_length():
    """GPT-2's captured final norm reshapes to the step's length: the logit lens runs it on
    every position of the state (the path's last-position cut keeps the head to one)."""
    model = looptool.convert(tiny_model("gpt2"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    prompt, mask = left_padded_batch(2)
    auto = _run(model, prompt, mask, budget="auto", exit_rule="kl", exit_threshold=0.0)
    assert _same(_run(model, prompt, mask, budget=2, kv="last-loop"), auto)


def test_pass_builds_one_path_with_depth_inputs_and_output():
    model = _model("prefix-llama")
    graph = adaptive_path(model).module.graph
    inputs = [n.target for n in graph.nodes if n.op == "placeholder"]
    assert tuple(inputs[: len(AUTO_INPUTS)]) == AUTO_INPUTS
    deepest = cached_layer_graph(model, "last-loop").paths[max(model.budgets)]
    assert inputs[len(AUTO_INPUTS) :] == [n.target for n in deepest.nodes if n.op == "placeholder"][4:]
    output = next(n for n in graph.nodes if n.op == "output")
    assert len(output.args[0]) == 2  # logits, depth
    with pytest.raises(PassError, match="last-loop KV"):
        PassManager([("adaptive_depth", {})])(cached_layer_graph(model, "per-loop"))
    with pytest.raises(PassError, match="must run before"):
        PassManager([("adaptive_depth", {}), ("kv_cache", {})])
    assert ADAPTIVE in PassManager([("adaptive_depth", {})])(cached_layer_graph(model, "last-loop")).paths


def test_bad_adaptive_arguments():
    model = _model("prefix-llama")
    prompt, _ = left_padded_batch(2)
    for kwargs, message in [
        ({"kv": "per-loop"}, "needs kv='last-loop'"),
        ({"exit_threshold": -0.1}, "exit_threshold must be a number >= 0"),
        ({"exit_threshold": float("nan")}, "exit_threshold must be a number >= 0"),
        ({"min_budget": 2, "max_budget": 1}, "min_budget 2 is above max_budget 1"),
        ({"max_budget": 5}, "max_budget 5 is not in this model's budget menu"),
        ({"min_budget": 1.0}, "min_budget must be one integer budget"),
        ({"exit_rule": "entropy"}, "unknown exit_rule"),
        ({"draft_budget": 0}, "speculative decoding needs a fixed budget"),
    ]:
        with pytest.raises(LooptoolError, match=message):
            generate(model, prompt, budget="auto", max_new_tokens=1, **kwargs)
    with pytest.raises(LooptoolError, match="cannot be mixed into a per-row list"):
        generate(model, prompt, budget=["auto", 1], max_new_tokens=1)
    with pytest.raises(LooptoolError, match="min_budget applies to budget='auto' only"):
        generate(model, prompt, budget=1, min_budget=0, max_new_tokens=1)
    with pytest.raises(LooptoolError, match="'fast' is not a budget"):
        generate(model, prompt, budget="fast", max_new_tokens=1)


def test_looped_model_generate_takes_auto():
    model = _model("elr-llama")
    prompt, mask = left_padded_batch(2)
    ids = model.generate(
        prompt, attention_mask=mask, budget="auto", exit_threshold=0.0, max_new_tokens=3, eos_token_id=None
    )
    ref = generate(model, prompt, attention_mask=mask, budget=3, kv="last-loop", max_new_tokens=3)
    assert torch.equal(ids, ref.sequences)
    fixed = generate(model, prompt, attention_mask=mask, budget=2, max_new_tokens=2)
    assert fixed.depths is None


class _PathStep:
    """A decode step over one adaptive path and its own caches, keeping every step's depths."""

    def __init__(self, path, batch: int, capacity: int, lo, hi, thr):
        self.path, self.depths, self.calls = path, [], 0
        self.caches = allocate_cache(path, batch, capacity, dtype=torch.float32, device="cpu")
        self.inputs = (torch.as_tensor(lo), torch.as_tensor(hi), torch.as_tensor(thr, dtype=torch.float32))

    def __call__(self, ids, mask, position, cache_position):
        self.calls += 1
        logits, depth = self.path.module(ids, mask, position, cache_position, *self.inputs, *self.caches)
        self.depths.append(depth)
        return logits[:, -1]


def _decode_both(model, prompt, mask, rule: str, lo, hi, thr):
    """The skipping and the masked adaptive paths decoding ``prompt`` greedily; the two steps."""
    capacity = prompt.shape[1] + NEW
    out = []
    for skip in (True, False):
        step = _PathStep(adaptive_path(model, exit_rule=rule, skip=skip), prompt.shape[0], capacity, lo, hi, thr)
        for seg in segments(step.path.module):
            seg.runs = 0
        result = decode_loop(
            step, prompt, mask, capacity=capacity, max_new_tokens=NEW, mask_dtype=model.mask_dtype, output_logits=True
        )
        out.append((result, step))
    return out


@pytest.mark.parametrize("name,rule", [(name, rule) for name in MODELS for rule in ("state", "kl")] + [(*MOE, "state")])
def test_skipping_is_bit_identical_to_masking(name, rule):
    """Logits, depths and every cache equal exactly between the path that skips the steps no
    row runs and the masked path, over a multi-step decode of a left-padded batch, at
    thresholds 0, in between (per row) and infinite; in between, some steps are skipped (an
    MoE recurrent block with route replay included: its experts' scatter buffers are local)."""
    model = _model(name)
    prompt, mask = left_padded_batch(3)
    lo, hi = min(model.budgets), max(model.budgets)
    mid = _varying_threshold(model, prompt, mask, rule)
    skipped_some = False
    for thr in ([0.0] * 3, [mid] * 3, [mid * 0.5, mid, mid * 2], [float("inf")] * 3):
        (fast, skip), (slow, masked) = _decode_both(model, prompt, mask, rule, [lo] * 3, [hi] * 3, thr)
        assert torch.equal(fast.sequences, slow.sequences), (name, thr)
        assert all(torch.equal(a, b) for a, b in zip(fast.logits, slow.logits)), (name, thr)
        assert all(torch.equal(a, b) for a, b in zip(skip.depths, masked.depths)), (name, thr)
        assert all(torch.equal(a, b) for a, b in zip(skip.caches, masked.caches)), (name, thr)
        runs = [seg.runs for seg in segments(skip.path.module)]
        assert runs and all(r <= skip.calls for r in runs)
        skipped_some |= thr[0] == mid and 0 < sum(runs) < len(runs) * skip.calls
    # in between, some steps ran for some tokens and not for others (the conditioned model's
    # first criteria are all about 1: its threshold in between runs every step or none)
    assert skipped_some or name not in (*UNCONDITIONED, *MOE), name


@pytest.mark.parametrize("name", UNCONDITIONED)
def test_skipped_steps_do_not_run(name):
    """The segment of a step runs once per decode step while some row runs it: at an
    infinite threshold none past ``min_budget`` runs, at threshold 0 every one up to
    ``max_budget`` runs at every decode step; each row at its own range."""
    model = _model(name)
    prompt, mask = left_padded_batch(2)
    budgets = sorted(model.budgets)
    lo, hi = budgets[0], budgets[-1]
    for rows_lo, rows_hi, thr, ran in [
        ([lo, lo], [hi, hi], float("inf"), lambda step: False),
        ([lo, lo], [hi, hi], 0.0, lambda step: True),
        ([lo, budgets[1]], [hi, hi], float("inf"), lambda step: step <= budgets[1]),
        ([lo, lo], [budgets[1], budgets[1]], 0.0, lambda step: step <= budgets[1]),
    ]:
        (fast, skip), (slow, _) = _decode_both(model, prompt, mask, "state", rows_lo, rows_hi, [thr] * 2)
        assert torch.equal(fast.sequences, slow.sequences)
        runs = {seg.step: seg.runs for seg in segments(skip.path.module)}
        assert len(runs) == hi - lo
        assert runs == {step: skip.calls if ran(step) else 0 for step in runs}, (name, rows_lo, rows_hi, thr, runs)
