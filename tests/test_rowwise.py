"""Row-wise budgets: one batch, every row at its own budget (the ``rowwise_budget`` pass,
``generate(budget=[...])`` and the step engine a server drives), checked row by row against
generating that row alone at its budget, with non-zero new parameters."""

from __future__ import annotations

import functools

import pytest
import torch

import looptool
from looptool.core.errors import LooptoolError, PassError
from looptool.engine import TensorSlotCache
from looptool.engine.budgets import RowBudgets
from looptool.passes import PassManager
from looptool.passes.rowwise_budget import BUDGETS, ROWWISE
from looptool.runtime.decode_graphs import cached_layer_graph, rowwise_path
from looptool.runtime.generation import generate
from looptool.runtime.step_engine import TorchStepEngine
from looptool.testing import left_padded_batch, move_off_init, tiny_model

NEW = 4
MODELS = {
    "prefix-llama": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "elr-llama-conditioning": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True)),
    "elr-qwen3_moe-route-replay": (
        "qwen3_moe",
        looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True),
    ),
}


@functools.cache
def _model(name: str):
    """A converted tiny model whose new parameters are moved away from their exact init."""
    arch, plan = MODELS[name]
    model = looptool.convert(tiny_model(arch), plan)
    move_off_init(model, 0.5)
    return model


def _worst_row_error(model, prompt, mask, budgets, kv) -> tuple[float, bool]:
    """(largest logit difference, all greedy tokens equal) of the row-wise batch against each
    row generated alone at ``model``'s menu budgets."""
    out = generate(model, prompt, attention_mask=mask, budget=budgets, max_new_tokens=NEW, kv=kv, output_logits=True)
    worst, same = 0.0, True
    for r, k in enumerate(model.budgets):
        alone = generate(
            model,
            prompt[r : r + 1],
            attention_mask=mask[r : r + 1],
            budget=k,
            max_new_tokens=NEW,
            kv=kv,
            output_logits=True,
        )
        worst = max(worst, max((a[0] - b[r]).abs().max().item() for a, b in zip(alone.logits, out.logits)))
        same &= torch.equal(alone.sequences[0], out.sequences[r])
    return worst, same


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kv", ["per-loop", "last-loop"])
def test_every_row_runs_its_own_budget(name, kv):
    model = _model(name)
    menu = list(model.budgets)
    prompt, mask = left_padded_batch(len(menu))
    worst, same = _worst_row_error(model, prompt, mask, menu, kv)
    assert same and worst < 1e-5, (worst, same)
    wrong, _ = _worst_row_error(model, prompt, mask, menu[::-1], kv)  # rows 0 and -1 swap budgets
    assert wrong > 1e-3  # a wrong row budget is caught by the same comparison


def test_generate_reports_row_budgets_and_costs():
    model = _model("prefix-llama")
    prompt, mask = left_padded_batch(3)
    out = generate(model, prompt, attention_mask=mask, budget=torch.tensor([2, 0, 1]), max_new_tokens=2)
    costs = {c.budget: c for c in model.cost_table()}
    assert out.budgets == (2, 0, 1)
    assert [c.layer_executions for c in out.row_costs] == [costs[k].layer_executions for k in (2, 0, 1)]
    uniform = generate(model, prompt, attention_mask=mask, budget=[1, 1, 1], max_new_tokens=2)
    assert torch.equal(
        uniform.sequences, generate(model, prompt, attention_mask=mask, budget=1, max_new_tokens=2).sequences
    )
    assert uniform.kv_bytes == generate(model, prompt, budget=1, max_new_tokens=2).kv_bytes  # its own path's cache


def test_bad_row_budgets():
    model = _model("prefix-llama")
    prompt, _ = left_padded_batch(2)
    with pytest.raises(LooptoolError, match="budget 7 is not in"):
        generate(model, prompt, budget=[0, 7])
    with pytest.raises(LooptoolError, match="3 budgets for a batch of 2"):
        generate(model, prompt, budget=[0, 1, 2])
    with pytest.raises(LooptoolError, match="not an integer"):
        generate(model, prompt, budget=[0, 1.5])
    with pytest.raises(LooptoolError, match="not an integer"):
        generate(model, prompt, budget=[0, True])
    assert generate(model, prompt, budget=[torch.tensor(0), 2], max_new_tokens=1).budgets == (0, 2)
    with pytest.raises(LooptoolError, match="budget 0.0 is not an integer"):
        generate(model, prompt, budget=torch.tensor([0.0, 1.0]))


def test_row_budgets_split_into_runs_of_one_budget():
    """What a verify step runs one budget's path over: each run of consecutive rows, in order."""
    assert RowBudgets((2, 2, 0, 2, 1, 1)).runs() == [
        (2, slice(0, 2)),
        (0, slice(2, 3)),
        (2, slice(3, 4)),
        (1, slice(4, 6)),
    ]
    assert RowBudgets((3,)).runs() == [(3, slice(0, 1))]


def test_pass_builds_one_graph_over_the_deepest_slots():
    model = _model("prefix-llama")
    graph = rowwise_path(model).module.graph
    inputs = [n.target for n in graph.nodes if n.op == "placeholder"]
    assert inputs[:5] == ["input_ids", "attention_mask", "position_ids", "cache_position", BUDGETS]
    deepest = cached_layer_graph(model).paths[max(model.budgets)]
    assert inputs[5:] == [n.target for n in deepest.nodes if n.op == "placeholder"][4:]
    wheres = [n for n in graph.nodes if n.target is torch.ops.aten.where.self]
    assert len(wheres) == 2  # one per second pass of the two window layers (per-loop: no masked writes)
    last = rowwise_path(model, "last-loop").module.graph
    assert len([n for n in last.nodes if n.target is torch.ops.aten.where.self]) == 2 + 2 * 2  # + K and V writes
    with pytest.raises(PassError, match="must run before"):  # order declared with the PassManager
        PassManager([("rowwise_budget", {}), ("kv_cache", {})])
    assert ROWWISE in PassManager([("rowwise_budget", {})])(cached_layer_graph(model)).paths


@pytest.mark.parametrize("kv", ["per-loop", "last-loop"])
def test_step_engine_over_a_slice_of_a_bigger_cache(kv):
    """The server's pattern: each request prefilled alone into its slot, then decode steps of
    all rows together (mixed budgets) over a slice of a bigger slot cache: every row's logits
    equal generating it alone."""
    model = _model("elr-llama-conditioning")
    engine = TorchStepEngine(model, kv) if kv != "per-loop" else TorchStepEngine(model)  # the default
    menu = list(engine.budgets)
    prompt, mask = left_padded_batch(len(menu), length=6)
    cache = engine.allocate(slots=len(menu) + 2, length=12)
    rows = slice(1, 1 + len(menu))
    full_mask = torch.zeros(len(menu), 12, dtype=engine.mask_dtype)
    full_mask[:, :6] = mask.to(engine.mask_dtype)
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = []
    for r, k in enumerate(menu):
        one = engine.step(
            cache,
            slice(1 + r, 2 + r),
            prompt[r : r + 1],
            full_mask[r : r + 1],
            position[r : r + 1],
            torch.arange(6),
            RowBudgets((k,)),
        )
        logits.append(one)
    steps = [torch.cat(logits)]
    ids = steps[0].argmax(-1)
    for i in range(NEW - 1):
        full_mask[:, 6 + i] = 1
        position = position[:, -1:] + 1
        steps.append(
            engine.step(cache, rows, ids[:, None], full_mask, position, torch.tensor([6 + i]), RowBudgets(tuple(menu)))
        )
        ids = steps[-1].argmax(-1)
    assert steps[0].dtype == torch.float32 and steps[0].shape == (len(menu), engine.vocab_size)
    for r, k in enumerate(menu):
        alone = generate(
            model,
            prompt[r : r + 1],
            attention_mask=mask[r : r + 1],
            budget=k,
            max_new_tokens=NEW,
            kv=kv,
            output_logits=True,
        )
        err = max((a[0] - s[r]).abs().max().item() for a, s in zip(alone.logits, steps))
        assert err < 1e-5, (k, err)
    lp = engine.prompt_logprobs(prompt[-1:, :], menu[-1])
    assert lp.shape == (6, engine.vocab_size) and torch.allclose(lp.exp().sum(-1), torch.ones(6))


def test_slot_cache_copy_row_and_shift_left():
    buffers = [torch.arange(3 * 1 * 5 * 2, dtype=torch.float32).view(3, 1, 5, 2) * (j + 1) for j in range(2)]
    before = [b.clone() for b in buffers]
    cache = TensorSlotCache(buffers)
    assert cache.nbytes == 2 * 30 * 4 and cache.slots == 3 and cache.length == 5
    cache.copy_row(2, 0)
    assert all(torch.equal(b[0], o[2]) and torch.equal(b[1:], o[1:]) for b, o in zip(cache.buffers, before))
    cache.shift_left(2)
    for b, o in zip(cache.buffers, before):
        assert torch.equal(b[1:, :, :3], o[1:, :, 2:]) and torch.equal(b[0, :, :3], o[2, :, 2:])
        assert torch.equal(b[1:, :, 3:], o[1:, :, 3:])  # the tail keeps its values
    with pytest.raises(LooptoolError, match="cannot shift"):
        cache.shift_left(6)


def test_generate_cli_one_budget_per_prompt(model_dir):
    from typer.testing import CliRunner

    from looptool.cli import app

    args = ["generate", str(model_dir), "-p", "We", "-p", "The cat", "-p", "A", "--max-new-tokens", "3"]
    res = CliRunner().invoke(app, [*args, "--budget", "0,2,1"])
    assert res.exit_code == 0, res.output
    assert "budgets 0,2,1" in res.output and "per row" in res.output
    table = res.output[res.output.index("per row") :]
    rows = [line.split("│") for line in table.splitlines() if line.startswith("│")]
    assert [(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows] == [
        ("0", "0", "4"),
        ("1", "2", "6"),
        ("2", "1", "5"),
    ]
    for bad, message in [
        ("0,9,1", "budget 9 is not in the budget menu"),
        ("0,1", "2 budgets for 3 --prompts"),
        ("0,1.5,2", "'1.5' is not an integer"),
    ]:
        res = CliRunner().invoke(app, [*args, "--budget", bad])
        assert res.exit_code == 1 and message in res.output, (bad, res.output)


def test_looped_model_generate_takes_row_budgets():
    model = _model("prefix-llama")
    prompt, mask = left_padded_batch(3)
    ids = model.generate(prompt, attention_mask=mask, budget=[2, 0, 1], max_new_tokens=2, eos_token_id=None)
    ref = generate(model, prompt, attention_mask=mask, budget=[2, 0, 1], max_new_tokens=2).sequences
    assert torch.equal(ids, ref)
