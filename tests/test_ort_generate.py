"""Greedy and sampled tokens from exported engines equal LoopedModel generation, token for
token, at every budget (ELR: both KV policies), on four architectures and both schemes."""

from __future__ import annotations

import pytest
import torch

import looptool
from looptool.backends.onnx.export import export_onnx
from looptool.backends.ort.runtime import Runtime
from looptool.engine.sampling import SamplingParams
from looptool.runtime.generation import generate
from looptool.testing import tiny_model

CASES = {  # dense, parallel residual, post-norm (sandwich norms, sliding windows), MoE via looptool::moe
    "llama-recurrent": ("llama", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=2, conditioning=True)),
    "gpt_neox-prefix": ("gpt_neox", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "gemma3_text-prefix": ("gemma3_text", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
    "qwen3_moe-prefix": ("qwen3_moe", looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))),
}


class _Exports(dict):
    """Each case converted, its new parameters trained-like (non-zero), exported (ELR: both KV
    policies) when a test first asks for it: the cases are separate xdist work units (conftest)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, case: str):
        arch, plan = CASES[case]
        model = looptool.convert(tiny_model(arch), plan)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, p in model.new_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        # the tests below compare more than validation does; last-loop caches matter for ELR (prefix
        # last-loop engines are covered by tests/test_onnx.py), so prefix cases export per-loop only
        kv = "all" if isinstance(plan, looptool.RecurrentLoop) else "per-loop"
        # one graph per budget: the row-wise graph has tests of its own (tests/test_rowwise_onnx.py)
        export_onnx(model, self.root / case, "all", kv=kv, rowwise=False, validate=False)
        self[case] = (model, Runtime(self.root / case))
        return self[case]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _Exports(tmp_path_factory.mktemp("generate"))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_pytorch_generation(exported, case):
    model, rt = exported[case]
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    distinct = set()
    for kv in rt.kv_policies:
        for k in model.budgets:
            ref = generate(model, ids, attention_mask=mask, budget=k, kv=kv, max_new_tokens=12, output_logits=True)
            got = rt.generate(ids, attention_mask=mask, budget=k, kv=kv, max_new_tokens=12, output_logits=True)
            assert torch.equal(got.sequences, ref.sequences), (case, kv, k)
            assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) < 1e-4
            assert got.kv_bytes == ref.kv_bytes
            distinct.add(tuple(got.sequences[0, 7:].tolist()))
    assert len(distinct) > 1  # the budgets (and policies) do compute different things


def test_sampling_and_eos_follow_pytorch(exported):
    model, rt = exported["llama-recurrent"]
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(8))
    kwargs = dict(budget=2, max_new_tokens=10, sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11))
    assert torch.equal(rt.generate(ids, **kwargs).sequences, generate(model, ids, **kwargs).sequences)
    greedy = generate(model, ids, budget=2, max_new_tokens=10).sequences
    eos = int(greedy[0, 7])  # a token row 0 emits: that row stops there and pads afterwards
    ref = generate(model, ids, budget=2, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    got = rt.generate(ids, budget=2, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got.sequences, ref.sequences) and got.new_tokens == ref.new_tokens
    streamed = []
    rt.generate(ids[:1], budget=2, max_new_tokens=4, on_step=lambda t: streamed.append(int(t[0])))
    assert streamed == generate(model, ids[:1], budget=2, max_new_tokens=4).sequences[0, 5:].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_tensorrt_variants_run_in_onnxruntime_like_the_ort_graphs(exported, case):
    """Every budget's TensorRT variant (layer functions inlined, looptool nodes as plugin
    nodes, AdaptiveDelta split, weights as inputs) gives the ORT graph's logits and caches
    in onnxruntime, for a prefill and a decode step."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from looptool.backends.manifest import Manifest
    from looptool.backends.tensorrt.export import PLUGIN_NAMESPACE, weight_arrays, write_variants

    model, rt = exported[case]
    directory = rt.directory
    manifest = Manifest.read(directory)
    graphs = write_variants(directory, manifest)
    weights = weight_arrays(directory, manifest)
    rng = np.random.default_rng(0)
    for budget in (model.budgets[0], model.budgets[-1]):
        entry = graphs[budget]["per-loop"]
        variant = onnx.load(str(directory / entry.file))
        plugin_nodes = [n for n in variant.graph.node if n.domain == PLUGIN_NAMESPACE]
        assert sum(entry.plugins.values()) == len(plugin_nodes)
        assert all({"plugin_namespace", "plugin_version"} <= {a.name for a in n.attribute} for n in plugin_nodes)
        assert "AdaptiveDelta" not in entry.plugins
        ref_session, var_session = (
            rt.session(budget, "per-loop"),
            ort.InferenceSession(str(directory / entry.file), providers=["CPUExecutionProvider"]),
        )
        batch, capacity = 2, 12
        caches = {
            i.name: np.zeros((batch, i.shape[1], capacity, i.shape[3]), np.float32)
            for i in ref_session.get_inputs()
            if i.name.startswith("past")
        }
        for start, step in ((0, 5), (5, 1)):
            feeds = {
                "input_ids": rng.integers(0, model.config.vocab_size, (batch, step)),
                "attention_mask": np.ones((batch, capacity), rt.mask_dtype),
                "position_ids": np.tile(np.arange(start, start + step), (batch, 1)),
                "cache_position": np.arange(start, start + step),
                **caches,
            }
            ref = ref_session.run(None, feeds)
            got = var_session.run(None, {**feeds, **{n: weights[n] for n in entry.weight_inputs}})
            for a, b in zip(ref, got):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
            caches = dict(zip(caches, ref[1:]))
