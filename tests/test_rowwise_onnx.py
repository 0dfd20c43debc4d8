"""The row-wise-budget graph through onnxruntime: every row of one left-padded batch gets
exactly its own budget's tokens and logits (fixed-prefix and ELR with conditioning, both KV
policies, new parameters non-zero), the step engine a server drives, the TensorRT variant
in onnxruntime, and one sentence for each bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import looptool
from looptool.backends.errors import EngineError
from looptool.backends.manifest import MANIFEST, Manifest
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.engine import OrtStepEngine
from looptool.backends.ort.runtime import Runtime
from looptool.core.graph import ROWWISE
from looptool.engine.budgets import RowBudgets
from looptool.runtime.generation import generate
from looptool.testing import byte_tokenizer, tiny_model

PLANS = {  # exports kept few and small: prefix, the row-wise graph plus budget 0's own; ELR, row-wise only
    "prefix": looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)),
    "elr": looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True),
}
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Each plan on a tiny Llama, new parameters non-zero, exported with both KV policies: the
    prefix engine validated by the export, with the row-wise graph (the default) beside budget
    0's own graph; the ELR engine with the row-wise graph only (``budgets="none"``)."""
    root = tmp_path_factory.mktemp("rowwise")
    out = {}
    for name, plan in PLANS.items():
        model = looptool.convert(tiny_model("llama"), plan, tokenizer=byte_tokenizer())
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, p in model.new_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        budgets = model.budgets[:1] if name == "prefix" else "none"
        report = export_onnx(model, root / name, budgets, kv="all", validate=name == "prefix")
        out[name] = (model, Runtime(root / name), report)
    return out


def _batch(model, rows: int):
    """``rows`` random prompts of different lengths, left-padded to one width."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, model.config.vocab_size, (rows, 9), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : (2 * r) % 5] = 0
    return ids, mask


def _alone(model, ids, mask, budgets, kv):
    """Each row generated alone (its padding dropped) at its own budget by the PyTorch path."""
    refs = []
    for r, k in enumerate(budgets):
        row = ids[r : r + 1, int((mask[r] == 0).sum()) :]
        refs.append(generate(model, row, budget=k, kv=kv, max_new_tokens=NEW_TOKENS, output_logits=True))
    return refs


def _without_rowwise(directory, copy):
    """A copy of an engine whose manifest lists no row-wise graph (an engine exported without it)."""
    shutil.copytree(directory, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest[ROWWISE]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def _worst_row(got, refs, width: int) -> tuple[float, bool]:
    """Max |logits difference| over every row and step, and whether every row's tokens match."""
    diff, same = 0.0, True
    for r, ref in enumerate(refs):
        diff = max(diff, max((a[r] - b[0]).abs().max().item() for a, b in zip(got.logits, ref.logits)))
        same &= torch.equal(got.sequences[r, width:], ref.sequences[0, -NEW_TOKENS:])
    return diff, same


@pytest.mark.parametrize("kv", ["per-loop", "last-loop"])
@pytest.mark.parametrize("name", list(PLANS))
def test_each_row_runs_exactly_its_own_budget(engines, name, kv):
    model, rt, _ = engines[name]
    budgets = [*model.budgets, model.budgets[-1], model.budgets[0]]  # every budget, mixed order
    ids, mask = _batch(model, len(budgets))
    refs = _alone(model, ids, mask, budgets, kv)
    got = rt.generate(ids, attention_mask=mask, budget=budgets, kv=kv, max_new_tokens=NEW_TOKENS, output_logits=True)
    diff, same = _worst_row(got, refs, ids.shape[1])
    assert same and diff <= 1e-5, (name, kv, diff)
    assert got.budgets == tuple(budgets)
    assert [c.budget for c in got.row_costs] == budgets
    assert got.row_costs[0].layer_executions < got.row_costs[len(model.budgets) - 1].layer_executions
    # a deliberately wrong budget in one row must be caught by the same comparison
    wrong = [budgets[1], *budgets[1:]]
    bad = rt.generate(ids, attention_mask=mask, budget=wrong, kv=kv, max_new_tokens=NEW_TOKENS, output_logits=True)
    bad_diff, bad_same = _worst_row(bad, refs, ids.shape[1])
    assert bad_diff > 1e-3 or not bad_same, (name, kv, bad_diff)


def test_export_lists_validates_and_shares_weights(engines):
    model, rt, report = engines["prefix"]
    manifest = Manifest.read(rt.directory)
    assert sorted(manifest.graphs[ROWWISE]) == ["last-loop", "per-loop"]
    assert [(b.budget, b.kv, b.file) for b in report.rowwise] == [
        (ROWWISE, "per-loop", "rowwise.per-loop.onnx"),
        (ROWWISE, "last-loop", "rowwise.last-loop.onnx"),
    ]
    assert [b.form for b in report.rowwise] == ["loop", "unrolled"]  # last-loop KV keeps the masked graph
    alone = {f"{p}@{k}" for p in ("random", "real") for k in model.budgets}  # the looped graph at each budget
    assert [set(b.max_abs_diff) for b in report.rowwise] == [{"random", "real"} | alone, {"random", "real"}]
    assert all(b.composed for b in report.rowwise)
    assert max(d for b in report.rowwise for d in b.max_abs_diff.values()) <= 1e-4
    entry = manifest.graphs[ROWWISE]["per-loop"]
    assert entry.menu == tuple(model.budgets) and max(p.execution for p in entry.cache.pairs) == 2
    deepest_pairs = len(model.layer_graph.layers) + 2  # the window's two layers repeated
    assert len(entry.cache.pairs) == deepest_pairs
    assert set(entry.initializers) <= set(manifest.weights.tensors)  # over the one weights.bin
    assert len(list(rt.directory.glob("*.bin"))) == 1
    # a uniform list runs that budget's own graph where it has one, the row-wise graph otherwise
    ids, mask = _batch(model, 2)
    for k in (model.budgets[0], model.budgets[-1]):
        got = rt.generate(ids, attention_mask=mask, budget=[k, k], max_new_tokens=3)
        assert torch.equal(got.sequences, rt.generate(ids, attention_mask=mask, budget=k, max_new_tokens=3).sequences)
    assert rt.budgets == model.budgets[:1] and (model.budgets[0], "per-loop") in rt._sessions


def test_bad_row_budgets_get_one_sentence(engines, tmp_path):
    model, rt, _ = engines["prefix"]
    ids, _ = _batch(model, 2)
    for budget, match in (
        ([0, 7], r"budget 7 is not in the budget menu \[0, 1, 2\]"),
        ([0, 1, 2], "3 budgets for a batch of 2 rows"),
        ([0, 1.5], "budget 1.5 is not an integer"),
        (torch.tensor([0.0, 1.0]), "budget 0.0 is not an integer"),
    ):
        with pytest.raises(EngineError, match=match):
            rt.generate(ids, budget=budget, max_new_tokens=2)
    bare = _without_rowwise(rt.directory, tmp_path / "bare")
    old = Runtime(bare)
    assert old.generate(ids, budget=[0, 0], max_new_tokens=2).budgets == (0, 0)  # its own graph needs none
    with pytest.raises(EngineError, match="exported without the row-wise graph"):
        old.generate(ids, budget=[0, 2], max_new_tokens=2)
    with pytest.raises(EngineError, match="exported without the row-wise graph"):
        OrtStepEngine(old)


@pytest.mark.parametrize("name", list(PLANS))
def test_step_engine_slices_equal_generating_each_row_alone(engines, name):
    """A server's use: each request prefilled into its own slot, then one decode step over a
    slice of rows at mixed budgets (views bound in place) and one at a shared budget."""
    model, rt, _ = engines[name]
    engine = OrtStepEngine(rt, kv="per-loop")
    assert engine.budgets == model.budgets and engine.vocab_size == model.config.vocab_size
    length, steps = 16, 3
    cache = engine.allocate(4, length)
    assert all(isinstance(b, np.ndarray) and b.shape[::2] == (4, length) for b in cache.buffers)
    assert cache.nbytes == sum(b.nbytes for b in cache.buffers)
    budgets = [model.budgets[-1], model.budgets[0], model.budgets[1 % len(model.budgets)]]
    prompts = [torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 3, 4)]
    refs = [rt.generate(p, budget=k, max_new_tokens=steps + 1, output_logits=True) for p, k in zip(prompts, budgets)]
    mask = torch.zeros(3, length, dtype=engine.mask_dtype)
    tokens, clock = [], 5  # every prompt ends at the shared clock: slots [clock - len, clock)
    for r, (p, ref) in enumerate(zip(prompts, refs)):
        n = p.shape[1]
        mask[r, clock - n : clock] = 1
        pos = torch.arange(n)[None]
        logits = engine.step(
            cache, slice(r, r + 1), p, mask[r : r + 1], pos, torch.arange(clock - n, clock), RowBudgets((budgets[r],))
        )
        assert logits.dtype == torch.float32 and logits.shape == (1, engine.vocab_size)
        assert (logits[0] - ref.logits[0][0]).abs().max().item() <= 1e-5
        tokens.append(int(logits.argmax()))
    positions = torch.tensor([[p.shape[1]] for p in prompts])
    for i in range(steps):  # one step over rows 0..2, each at its own budget
        mask[:, clock] = 1
        logits = engine.step(
            cache,
            slice(0, 3),
            torch.tensor(tokens)[:, None],
            mask,
            positions,
            torch.tensor([clock]),
            RowBudgets(tuple(budgets)),
        )
        for r, ref in enumerate(refs):
            assert (logits[r] - ref.logits[i + 1][0]).abs().max().item() <= 1e-5, (name, i, r)
        tokens, clock, positions = logits.argmax(-1).tolist(), clock + 1, positions + 1
    # rows that share a budget run that budget's own graph on the matching cache pairs
    shared = model.budgets[0]
    cache.copy_row(1, 0)
    assert all(np.array_equal(b[0], b[1]) for b in cache.buffers)
    mask[0] = mask[1]
    mask[:, clock] = 1
    pair = engine.step(
        cache,
        slice(0, 2),
        torch.tensor([tokens[1]] * 2)[:, None],
        mask[:2],
        positions[1:2].repeat(2, 1),
        torch.tensor([clock]),
        RowBudgets((shared, shared)),
    )
    assert torch.equal(pair[0], pair[1])
    ref = rt.generate(prompts[1], budget=shared, max_new_tokens=steps + 2, output_logits=True)
    assert (pair[0] - ref.logits[steps + 1][0]).abs().max().item() <= 1e-5
    before = [b.copy() for b in cache.buffers]
    cache.shift_left(4)
    assert all(np.array_equal(b[:, :, : length - 4], old[:, :, 4:]) for b, old in zip(cache.buffers, before))
    with pytest.raises(EngineError, match="budget 9 is not in the budget menu"):  # checked at the edge
        RowBudgets.resolve([9], engine.budgets, 1, error=EngineError)


def test_a_server_reads_the_rowwise_menu_of_an_engine_without_budget_graphs(engines):
    """What ``looptool serve`` reads before loading (the facts) names the budgets its step
    engine serves: the row-wise menu, also for an engine exported with no budget graph of its
    own (``budgets="none"``, whose server failed on an empty menu) or with some of them only."""
    from looptool.backends.ort.engine import OrtStepEngine
    from looptool.engine import describe

    for name in PLANS:
        model, rt, _ = engines[name]
        assert describe(rt.directory).budgets == OrtStepEngine(rt).budgets == tuple(model.budgets), name
    assert engines["elr"][1].manifest.budgets == ()  # no graph of its own


def test_prompt_logprobs_match_the_full_forward(engines):
    model, rt, _ = engines["elr"]
    engine = OrtStepEngine(rt)
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    assert rt.budgets == () and rt.has_rowwise("last-loop")  # an engine of row-wise graphs only
    for k in (None, model.budgets[1]):  # one budget for all rows runs the row-wise graph too
        ref = generate(model, ids, budget=k, max_new_tokens=3).sequences
        assert torch.equal(rt.generate(ids, budget=k, max_new_tokens=3).sequences, ref)
    for k in (model.budgets[0], model.budgets[-1]):
        with torch.no_grad():
            ref = torch.log_softmax(model(ids, budget=k).logits[0].float(), dim=-1)
        got = engine.prompt_logprobs(ids, k)
        assert got.shape == (6, model.config.vocab_size) and (got - ref).abs().max().item() <= 1e-4


def test_tensorrt_variant_of_the_rowwise_graph_runs_in_onnxruntime(engines, tmp_path):
    """The TensorRT-flavoured row-wise graph (functions inlined, plugin nodes, weights as
    inputs) gives the ORT graph's logits and caches for a prefill and a decode step."""
    import onnxruntime as ort

    from looptool.backends.manifest import Profiles
    from looptool.backends.tensorrt.export import profile_shapes, trt_graph_file, weight_arrays, write_variants

    model, rt, _ = engines["elr"]
    directory = tmp_path / "e"
    shutil.copytree(rt.directory, directory)
    manifest = Manifest.read(directory)
    graphs = write_variants(directory, manifest)
    assert list(graphs) == [ROWWISE]  # one graph, so a TensorRT deployment builds one engine per policy
    entry = graphs[ROWWISE]["per-loop"]
    assert entry.file == trt_graph_file(ROWWISE, "per-loop") == "rowwise.per-loop.trt.onnx"
    assert entry.plugins.get("AdaptiveDeltaUpdate", 0) >= 1 and "AdaptiveDelta" not in entry.plugins
    layout = Runtime(directory).layout(ROWWISE, "per-loop")
    limits = Profiles(max_batch=4, max_prefill=8, max_capacity=16)
    assert profile_shapes(limits, layout, True, rowwise=True)["budgets"] == ((1,), (1,), (4,))
    weights = weight_arrays(directory, manifest)
    ref_session = rt.session(ROWWISE, "per-loop")
    var_session = ort.InferenceSession(str(directory / entry.file), providers=["CPUExecutionProvider"])
    batch, capacity = len(model.budgets), 12
    caches = {
        i.name: np.zeros((batch, i.shape[1], capacity, i.shape[3]), np.float32)
        for i in ref_session.get_inputs()
        if i.name.startswith("past")
    }
    rng = np.random.default_rng(0)
    for start, step in ((0, 5), (5, 1)):
        feeds = {
            "input_ids": rng.integers(0, model.config.vocab_size, (batch, step)),
            "attention_mask": np.ones((batch, capacity), rt.mask_dtype),
            "position_ids": np.tile(np.arange(start, start + step), (batch, 1)),
            "cache_position": np.arange(start, start + step),
            "budgets": np.array(model.budgets, dtype=np.int64),
            **caches,
        }
        ref = ref_session.run(None, feeds)
        got = var_session.run(None, {**feeds, **{n: weights[n] for n in entry.weight_inputs}})
        for a, b in zip(ref, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
        caches = dict(zip(caches, ref[1:]))


def test_run_command_takes_one_budget_per_prompt(engines, tmp_path):
    from typer.testing import CliRunner

    from looptool.cli import app

    _, rt, _ = engines["prefix"]
    runner = CliRunner()
    base = ["run", str(rt.directory), "-p", "ab", "-p", "cde", "-p", "f", "--max-new-tokens", "3", "--budget"]
    res = runner.invoke(app, [*base, "0,2,1"])
    assert res.exit_code == 0, res.output
    assert "budgets 0,2,1" in res.output and "per row" in res.output
    bare = _without_rowwise(rt.directory, tmp_path / "bare")
    for args, message in (
        ([*base, "0,7,1"], "budget 7 is not in the budget menu"),
        ([*base, "0,1"], "2 budgets for 3 --prompt"),
        ([*base, "0,x,1"], "is not an integer"),
        ([*base[:1], str(bare), *base[2:], "0,2,1"], "exported without the row-wise graph"),
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and message in " ".join(res.output.split()), (args, res.output)
