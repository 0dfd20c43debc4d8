"""Casting a looped model to another dtype: graphs are dtype-specialised, so a cast copy is a
rebuild in that dtype (recapture on meta, recipe replayed, cast weights bound). The reference
is independent of the cast: the source converted from its directory in the target dtype
(what ``looptool convert --dtype`` does), given the same trained new parameters."""

from __future__ import annotations

import pytest
import torch

import looptool
from looptool.core.errors import LooptoolError
from looptool.storage.tensors import graph_tensors
from looptool.testing import tiny_model

CASES = {
    "llama-prefix": ("llama", looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))),
    "llama-elr-cond": (
        "llama",
        looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, conditioning=True, cond_dim=16, rank=4),
    ),
    "qwen3_moe-elr-replay": ("qwen3_moe", looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3, route_replay=True)),
}


def _trained(model: looptool.LoopedModel) -> looptool.LoopedModel:
    """Non-zero new parameters (as after training), so a cast that dropped or mis-bound one shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


_converted: dict[str, tuple] = {}


def _case(name: str, root):
    if name not in _converted:
        arch, plan = CASES[name]
        directory = root / arch
        tiny_model(arch).save_pretrained(directory)
        _converted[name] = directory, plan, _trained(looptool.convert(directory, plan))
    return _converted[name]


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("llama-prefix", torch.float16),
        ("llama-prefix", torch.bfloat16),
        ("llama-elr-cond", torch.float16),
        ("qwen3_moe-elr-replay", torch.bfloat16),
    ],
)
def test_cast_equals_converting_the_source_in_that_dtype(name, dtype, tmp_path_factory):
    directory, plan, model = _case(name, tmp_path_factory.getbasetemp())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    before = {k: model(ids, budget=k).logits for k in model.budgets}
    cast = looptool.cast(model, dtype)
    reference = looptool.convert(directory, plan, dtype=dtype)
    with torch.no_grad():
        for (name, p), (ref_name, q) in zip(model.new_parameters(), reference.new_parameters(), strict=True):
            assert name == ref_name
            q.copy_(p.to(dtype))
    assert next(cast.parameters()).dtype == dtype and cast.layer_graph.source.dtype == str(dtype)
    for k in model.budgets:
        got = cast(ids, budget=k).logits
        assert got.dtype == dtype
        assert torch.equal(got, reference(ids, budget=k).logits), k
        assert torch.equal(model(ids, budget=k).logits, before[k]), k  # the original is untouched
    assert next(model.parameters()).dtype == torch.float32
    # one copy of each tensor, the same set of names as the original
    assert set(graph_tensors(cast)) == set(graph_tensors(model))
    assert {id(t) for t in graph_tensors(cast).values()}.isdisjoint({id(t) for t in model.parameters()})


def test_cast_keeps_ties_trainability_and_refuses_non_floats(tmp_path):
    model = looptool.convert(
        tiny_model("llama", tie_word_embeddings=True), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2))
    )
    next(iter(model.parameters())).requires_grad_(False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    cast = looptool.cast(model, torch.float16)
    unique = {id(t) for t in graph_tensors(model).values()}
    assert len({id(t) for t in graph_tensors(cast).values()}) == len(unique)  # tied tensors stay one copy
    assert {n for n, p in cast.named_parameters() if not p.requires_grad} == frozen
    assert looptool.cast(model, torch.float32) is model  # nothing to do
    with pytest.raises(LooptoolError, match="is not a floating-point dtype"):
        looptool.cast(model, torch.int8)
    assert looptool.cast(model, "float32") is model
    with pytest.raises(LooptoolError, match=r"cannot change dtype in place.*looptool\.cast"):
        model.half()


def test_load_in_another_dtype_equals_the_cast_copy(model_dir):
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(4))
    saved = looptool.load(model_dir)
    for dtype in (torch.float16, "bfloat16"):
        loaded = looptool.load(model_dir, dtype=dtype)
        cast = looptool.cast(saved, getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        for k in saved.budgets:
            assert torch.equal(loaded(ids, budget=k).logits, cast(ids, budget=k).logits), (dtype, k)
    meta = looptool.load(model_dir, device="meta", dtype=torch.float16)  # structure only, header checked
    assert next(meta.parameters()).dtype == torch.float16
    with pytest.raises(LooptoolError, match="'int8' is not a floating-point dtype"):
        looptool.load(model_dir, dtype="int8")
