"""The settings looptool traces under (looptool.core.tracing): set inside, the user's values
restored after; the FakeTensor cache changes how fast a capture is, never what it captures."""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.fx.config as fx_config

from looptool.capture import capture
from looptool.capture.export import FAKE_CACHE_MIN_LAYERS, export_decode_step, export_source
from looptool.core.tracing import fast_tracing
from looptool.testing import tiny_model

# torch 2.11 has no stack-trace setting (it always records them): there the first setting
# reads None inside and outside, and only the FakeTensor cache is switched.
HAS_STACK_SETTING = hasattr(fx_config, "do_not_emit_stack_traces")
OFF = True if HAS_STACK_SETTING else None  # the stack-trace setting inside fast_tracing


def _settings() -> tuple[bool | None, bool]:
    return getattr(fx_config, "do_not_emit_stack_traces", None), dynamo_config.fake_tensor_cache_enabled


def test_settings_hold_inside_and_the_users_come_back(monkeypatch):
    if HAS_STACK_SETTING:
        monkeypatch.setattr(fx_config, "do_not_emit_stack_traces", False)  # (torch's own config: patch() only)
    with dynamo_config.patch(fake_tensor_cache_enabled=True):
        _nest()


def _nest() -> None:
    user = False if HAS_STACK_SETTING else None
    with fast_tracing():
        assert _settings() == (OFF, True)
        with fast_tracing(fake_tensor_cache=False):
            assert _settings() == (OFF, False)
        assert _settings() == (OFF, True)
    assert _settings() == (user, True)
    with pytest.raises(RuntimeError), fast_tracing(fake_tensor_cache=False):
        raise RuntimeError("a failed trace")
    assert _settings() == (user, True)


@pytest.mark.parametrize("layers", [2, FAKE_CACHE_MIN_LAYERS])
def test_small_captures_trace_without_the_fake_cache(layers, monkeypatch):
    """A forward export of fewer than FAKE_CACHE_MIN_LAYERS layers and every decode step
    trace with the cache off; deeper forwards keep it."""
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    seen, real = [], torch.export.export

    def spy(*args, **kwargs):
        seen.append(_settings())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spy)
    model = tiny_model("llama", num_layers=layers)
    export_source(model)
    export_decode_step(model)
    # the decode step may be exported twice (a torch that needs automatic dims: 2.11)
    assert seen[0] == (OFF, layers >= FAKE_CACHE_MIN_LAYERS)
    assert len(seen) in (2, 3) and set(seen[1:]) == {(OFF, False)}
    assert dynamo_config.fake_tensor_cache_enabled  # the default, back after the exports


def test_the_fake_cache_does_not_change_the_capture(monkeypatch, input_ids):
    """With the cache on and off: the same ops with the same arguments in the same order, and
    the same logits (node names may differ)."""
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    model = tiny_model("qwen3_moe")
    graphs = []
    for on in (True, False):  # the user's default (on), then looptool's override (off)
        monkeypatch.setattr(sys.modules["looptool.capture.export"], "FAKE_CACHE_MIN_LAYERS", 1 if on else 10**6)
        graphs.append(capture(model).module)

    def ops(gm):
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        ref = lambda a: ("node", index[a]) if isinstance(a, torch.fx.Node) else a  # noqa: E731
        return [(n.op, str(n.target), torch.fx.node.map_aggregate(n.args, ref)) for n in gm.graph.nodes]

    assert ops(graphs[0]) == ops(graphs[1])
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        a, b = (gm(input_ids, mask) for gm in graphs)
        assert torch.equal(a, b) and torch.equal(a, model(input_ids=input_ids).logits)
