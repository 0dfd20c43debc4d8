"""Capture that holds on other torch versions and devices than this machine's: captured
graphs carry no trace-time dtype checks (they run cast and under autocast), and a guard a torch
version cannot prove for named dims falls back to automatic dims instead of failing."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import UserError, UserErrorType
from torch.export import Dim

import looptool
from looptool.capture import capture as capture_graph
from looptool.capture.export import export_decode_step
from looptool.core.errors import CaptureError
from looptool.testing import tiny_model

CHECK = torch.ops.aten._assert_tensor_metadata.default


def _graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    return [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _named(shapes) -> bool:
    """Whether export's ``dynamic_shapes`` hold a named dim anywhere."""
    if isinstance(shapes, dict):
        return any(_named(v) for v in shapes.values())
    if isinstance(shapes, (list, tuple)):
        return any(_named(v) for v in shapes)
    return shapes is not None and shapes is not Dim.AUTO and shapes is not Dim.STATIC


@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
def test_captured_graphs_hold_no_dtype_checks(decode, monkeypatch):
    """Export records a dtype check before every ``.to()`` (the rotary embedding's
    autocast-disabled block has some); capture drops them all, in every nested graph, and the
    bf16-autocast forward still equals the fp32 one to bf16 precision."""
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    model = tiny_model("llama", num_layers=2)
    gm = capture_graph(model, decode=decode).module
    nodes = [n for g in _graphs(gm) for n in g.nodes]
    assert nodes and not [n for n in nodes if n.target is CHECK]
    if not decode:
        looped = looptool.convert(model, looptool.PrefixLoop(window=(0, 2), budgets=(0, 2)))
        ids = torch.randint(0, model.config.vocab_size, (1, 8))
        want = looped(ids, budget=2).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = looped(ids, budget=2).logits
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.1)


def test_a_constraint_violation_retries_with_automatic_dims(monkeypatch):
    """A torch that raises a constraint violation for the named dims (as torch 2.11 does for
    the decode step on CUDA) gets a second export with automatic dims, which succeeds."""
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    real, calls = torch.export.export, []

    def strict_about_names(*args, dynamic_shapes=None, **kwargs):
        calls.append(_named(dynamic_shapes))
        if calls[-1]:
            raise UserError(UserErrorType.CONSTRAINT_VIOLATION, "Constraints violated (cache_len)!")
        return real(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.export, "export", strict_about_names)
    gm = export_decode_step(tiny_model("llama", num_layers=1))
    assert calls == [True, False]
    assert any(n.op == "call_function" for n in gm.graph.nodes)


def test_another_export_error_is_not_retried(monkeypatch):
    """Only constraint violations are retried; other export errors say which model failed."""
    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    calls = []

    def unsupported(*args, **kwargs):
        calls.append(1)
        raise UserError(UserErrorType.UNSUPPORTED_ALIASED_MUTATED_DYNAMIC_INPUTS, "no")

    monkeypatch.setattr(torch.export, "export", unsupported)
    with pytest.raises(CaptureError, match="could not capture LlamaForCausalLM"):
        export_decode_step(tiny_model("llama", num_layers=1))
    assert calls == [1]


class _Unusable(torch.nn.Module):
    def forward(self, *args):
        raise AssertionError("the decode path ran the forward capture's body")


def test_decode_paths_run_the_decode_captures_own_bodies(monkeypatch):
    """The forward and the decode-step captures name their higher-order-op bodies alike
    (``submod_3``: llama's rotary embedding under a grad-mode or autocast block); a decode path
    bound to the model's tensors must run its own capture's body, which can take other
    arguments (a size, under automatic dims), never the forward's of the same name."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from looptool.core.graph import own_bodies
    from looptool.runtime.decode_graphs import cached_layer_graph, cached_paths
    from looptool.runtime.generation import generate

    monkeypatch.setenv("LOOPTOOL_CACHE", "off")
    rotary = LlamaRotaryEmbedding.forward

    def without_autocast(self, *args, **kwargs):  # as transformers 5.17 writes it: a body in each capture
        with torch.autocast(device_type="cpu", enabled=False):
            return rotary(self, *args, **kwargs)

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", without_autocast)
    model = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    forward = {name: m for name, m in model._modules.items() if isinstance(m, torch.fx.GraphModule)}
    assert forward  # the forward capture has bodies of its own
    for name in forward:
        monkeypatch.setitem(model._modules, name, _Unusable())
    out = generate(model, ids, max_new_tokens=3, budget=2)
    decode = cached_layer_graph(model, "per-loop")
    for path in cached_paths(model, "per-loop").values():
        bodies = own_bodies(decode.module, path.module.graph)
        assert bodies and bodies.keys() & forward.keys()  # the same names in both captures
        assert all(path.module._modules[n] is b for n, b in bodies.items())
    assert out.sequences.shape == (2, 9)


def test_exporting_engines_on_an_older_torch_is_refused_in_one_sentence(monkeypatch):
    """torch 2.11's ONNX exporter cannot trace the serving graphs: export says so before any
    slow work, for both backends, and names the version it needs."""
    from looptool.backends.engines import export_options
    from looptool.backends.errors import ExportError
    from looptool.core import compat

    monkeypatch.setattr(compat, "installed_version", lambda library: (2, 11))
    for backend in ("onnx", "tensorrt"):
        with pytest.raises(ExportError, match=r"needs torch 2\.13 or newer, and torch here is 2\.11"):
            export_options(backend, build_on_target=True)
