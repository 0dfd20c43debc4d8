"""Self-speculative decoding through onnxruntime (``Runtime.generate(..., draft_budget=j,
draft_tokens=n)`` over an engine exported with ``speculative=True``): greedy output token for
token what the engine decodes at budget ``k`` alone, for every (draft, target) pair of a
fixed-prefix and a conditioned ELR model, in a left-padded batch; verify graphs that share the
weights and the fused lowering; the errors; ``looptool export --speculative`` and ``looptool run
--draft-budget``."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch
from typer.testing import CliRunner

import looptool
from looptool.backends.errors import EngineError, ExportError
from looptool.backends.manifest import MANIFEST
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.cli import app
from looptool.testing import byte_tokenizer, left_padded_batch, move_off_init, tiny_model

# as tests/test_speculative.py: far enough from the exact init that budgets disagree on some
# tokens and agree on others, so drafts are both kept and rejected
MODELS = {
    "prefix": (looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2)), 0.05),
    "elr-conditioning": (looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True), 0.01),
}
PROMPT = "Hello"


def _model(name: str) -> looptool.LoopedModel:
    plan, scale = MODELS[name]
    model = looptool.convert(tiny_model("llama"), plan)
    move_off_init(model, scale)
    return model


class _Engines(dict):
    """Each model exported with its verify graphs when a test first asks for it: the fixed-prefix
    one through ``looptool export --speculative`` (validated, with a tokenizer for ``looptool
    run``), the ELR one through ``export_onnx`` (its report kept; with the row-wise graph, so
    its step engine serves speculating requests in mixed batches)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str):
        model, engine = _model(name), self.root / name
        if name == "prefix":
            model.tokenizer = byte_tokenizer()
            model.save_pretrained(self.root / "looped")
            args = ["export", str(self.root / "looped"), "-o", str(engine), "--speculative", "--no-rowwise"]
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 0, res.output
            assert "1 verify" in res.output and "verify_2.per-loop.onnx" in res.output
            report = None
        else:
            report = export_onnx(model, engine, "all", speculative=True, validate=False)  # its step engine serves
        self[name] = (model, Runtime(engine), report)
        return self[name]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return _Engines(tmp_path_factory.mktemp("speculative"))


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_speculation_is_the_engines_budget_k_token_for_token(engines, name, monkeypatch):
    import looptool.engine.core as core

    grown = []
    real = core.with_length
    monkeypatch.setattr(core, "with_length", lambda a, n, dim: grown.append(n) or real(a, n, dim))
    model, rt, _ = engines[name]
    prompt, mask = left_padded_batch(3)
    kept = proposed = 0
    for k in rt.budgets[1:]:
        plain = rt.generate(prompt, attention_mask=mask, budget=k, max_new_tokens=10, output_logits=True)
        for j in (b for b in rt.budgets if b < k):
            for n in (1, 3):
                out = rt.generate(
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
                for a, b in zip(out.logits, plain.logits):  # the verify graph's logits, the budget graph's
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
                assert out.budgets == (k,) * 3 and out.speculation.rounds >= 10 // (n + 1)
                kept += out.speculation.accepted
                proposed += out.speculation.proposed
    assert 0 < kept < proposed  # both branches of the rule ran
    # the ELR model's rows kept different numbers of drafts until their shared clock outgrew the caches
    assert grown or name != "elr-conditioning"


@pytest.mark.parametrize("name", list(MODELS))
def test_seeded_sampled_speculation_matches_pytorch(engines, name):
    """Sampling: the same seed gives the same tokens through onnxruntime as through PyTorch (one
    loop, one acceptance rule, one generator; the logits agree to float rounding), so the
    distribution checks of tests/test_speculative.py carry over to the engine."""
    from looptool.engine.sampling import SamplingParams
    from looptool.runtime.generation import generate

    model, rt, _ = engines[name]
    prompt, mask = left_padded_batch(3)
    k, j = rt.budgets[-1], rt.budgets[0]
    kept = 0
    for seed in range(3):
        sampling = SamplingParams(temperature=1.0, top_k=8, seed=seed)
        kw = dict(attention_mask=mask, budget=k, max_new_tokens=10, sampling=sampling, draft_budget=j, draft_tokens=3)
        ours, torch_out = rt.generate(prompt, **kw), generate(model, prompt, **kw)
        assert torch.equal(ours.sequences, torch_out.sequences), seed
        assert ours.speculation.accepted == torch_out.speculation.accepted
        kept += ours.speculation.accepted
    assert kept > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_verify_graphs_share_the_weights_and_the_fused_lowering(engines, name):
    model, rt, report = engines[name]
    manifest = rt.manifest
    assert sorted(manifest.verify_graphs) == list(rt.budgets[1:]) == list(model.budgets[1:])
    for k in rt.budgets[1:]:
        entry, own = manifest.verify_graph(k, "per-loop"), manifest.graph(k, "per-loop")
        assert entry.file == f"verify_{k}.per-loop.onnx" and entry.cache == own.cache
        # the same tensors of weights.bin as budget k's own graph, and its layer functions but the
        # last (whose head reads every position)
        assert set(entry.initializers) == set(own.initializers)
        assert entry.composed and sum(entry.layer_calls.values()) == sum(own.layer_calls.values())
        assert len(set(entry.layer_calls) - set(own.layer_calls)) == 1
        graph = onnx.load(str(rt.directory / entry.file), load_external_data=False)
        logits = graph.graph.output[0].type.tensor_type.shape.dim
        assert logits[1].dim_param == "step"  # every position (a budget's graph: 1)
        ops = {n.op_type for f in graph.functions for n in f.node}
        assert {"Attention", "FusedMatMul", "RotaryEmbedding"} <= ops  # fuse_ort ran on the bodies
        if name == "prefix":  # validated through the CLI export
            assert set(entry.max_abs_diff) == {"random", "real"} and max(entry.max_abs_diff.values()) < 1e-4
    if report is not None:
        assert [(r.budget, r.kv) for r in report.verify] == [(k, "per-loop") for k in rt.budgets[1:]]
        assert all(r.ort_ops.get("attention") for r in report.verify)


def test_errors(engines, tmp_path):
    model, rt, _ = engines["prefix"]
    prompt, mask = left_padded_batch(3)
    with pytest.raises(looptool.LooptoolError, match="must be shallower"):
        rt.generate(prompt, budget=1, draft_budget=2)
    with pytest.raises(EngineError, match="one budget for every row"):
        rt.generate(prompt, budget=[2, 1, 2], draft_budget=0)
    with pytest.raises(ExportError, match="there is none"):
        export_onnx(model, tmp_path / "one", 2, speculative=True, validate=False)
    with pytest.raises(ExportError, match="backend='onnx'"):
        from looptool.backends.engines import export_options

        export_options("tensorrt", speculative=True, build_on_target=True)
    plain = tmp_path / "plain"  # the same engine without its verify graphs
    shutil.copytree(rt.directory, plain)
    data = json.loads((plain / MANIFEST).read_text())
    del data["verify"]
    (plain / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(EngineError, match=r"no verify graph for budget 2 \(per-loop\).*speculative=True"):
        Runtime(plain).generate(prompt, budget=2, draft_budget=0)
    res = CliRunner().invoke(app, ["run", str(plain), "--prompt", PROMPT, "--budget", "2", "--draft-budget", "0"])
    assert res.exit_code == 1 and "looptool export --speculative" in res.output, res.output
    assert "Traceback" not in res.output


def test_cli_run_draft_budget(engines):
    model, rt, _ = engines["prefix"]
    args = ["run", str(rt.directory), "--prompt", PROMPT, "--max-new-tokens", "8", "--budget", "2"]
    plain = CliRunner().invoke(app, args)
    res = CliRunner().invoke(app, [*args, "--draft-budget", "1"])  # --draft-tokens at its default
    assert plain.exit_code == 0 and res.exit_code == 0, (plain.output, res.output)
    assert res.stdout.startswith(PROMPT) and res.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    ids = torch.tensor([list(PROMPT.encode())])
    eos = byte_tokenizer().eos_token_id
    stats = rt.generate(ids, budget=2, max_new_tokens=8, draft_budget=1, eos_token_id=eos).speculation
    assert f"drafted at 1 ({stats.accepted}/{stats.proposed} drafts kept)" in res.output
    assert stats.proposed % 4 == 0  # four drafts a round: the default


def test_the_step_engine_serves_speculating_and_plain_requests_in_one_batch(engines, monkeypatch):
    """``OrtStepEngine.verify`` in the server's scheduler: speculating requests beside plain ones
    (some arriving while others run) get what the same engine gives them without drafting; an
    engine without a budget's verify graph refuses in one sentence."""
    from serve_process import prompt_ids, run_jobs

    from looptool.backends.ort.engine import OrtStepEngine
    from looptool.engine.speculation import Speculation
    from looptool.serve.scheduler import Job

    _, rt, _ = engines["elr-conditioning"]
    engine = OrtStepEngine(rt)
    assert engine.capabilities.verify
    lo, mid, hi = rt.budgets
    asked = [(hi, Speculation(lo, 3), 8), (mid, None, 5), (hi, Speculation(mid, 2), 7), (mid, Speculation(lo, 1), 6)]

    def tokens(speculate: bool) -> tuple[list[list[int]], list[Job]]:
        jobs = [
            Job(prompt_ids(i), k, n, ignore_eos=True, speculation=sp if speculate else None)
            for i, (k, sp, n) in enumerate(asked)
        ]
        events = run_jobs(engine, jobs, max_batch=3, start_after=3).events
        return [[e.token for e in ev if e.kind == "token"] for ev in events], jobs

    drafted, jobs = tokens(True)
    assert drafted == tokens(False)[0]
    assert all(len(t) == n for t, (_, _, n) in zip(drafted, asked))
    assert 0 < sum(job.speculated.accepted for job in jobs) < sum(job.speculated.proposed for job in jobs)
    monkeypatch.setattr(rt, "has_verify", lambda budget, kv="per-loop": budget != hi)
    with pytest.raises(looptool.LooptoolError, match=f"no verify graph for budget {hi}") as err:
        raise OrtStepEngine(rt).capabilities.verify_refusal
    assert err.value.parameter == "runtime"
