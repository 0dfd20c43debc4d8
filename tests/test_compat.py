"""looptool's patches of other libraries (looptool.core.compat): each applies to the installed
versions and does what it is for (a test per patch that fails once a library update stops it
applying), and outside the versions it is known for it steps aside with a warning naming the
version."""

from __future__ import annotations

import contextlib
import logging
import re
import sys

import pytest
import torch

from looptool.core import compat
from looptool.core.compat import CompatWarning, overridden


def test_every_patch_is_known_for_the_installed_versions():
    """A library update past a patch's range fails here first: re-check the patch on the new
    version (the tests below) and widen its range, or retire it. A library older than a
    patch's range (torch 2.11 has no stack-trace setting) runs without it, saying so."""
    for patch in compat.PATCHES:
        version = compat.installed_version(patch.library)
        if version is None:
            continue  # an optional library (its patch's test skips)
        if version < patch.first:
            with pytest.warns(CompatWarning, match=re.escape(patch.target)):
                assert not patch.known()
            continue
        with _no_compat_warning():
            assert patch.known(), patch


def _requires(patch: compat.Patch) -> None:
    version = compat.installed_version(patch.library)
    if version is not None and version < patch.first:
        have = ".".join(map(str, version))
        pytest.skip(f"{patch.library} {have} is older than the versions of {patch.target} ({patch.versions()})")


@contextlib.contextmanager
def _no_compat_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompatWarning)
        yield


# ---------------------------------------------------------------------- one test a patch
def test_stack_traces_patch_leaves_traced_nodes_without_one():
    _requires(compat.STACK_TRACES)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)

    def traced_with_traces() -> list[bool]:
        program = torch.export.export(module, (x,))
        return [bool(n.meta.get("stack_trace")) for n in program.graph.nodes if n.op == "call_function"]

    assert all(traced_with_traces())  # torch's default: a stack trace on every traced call
    with _no_compat_warning(), compat.without_stack_traces():
        assert not any(traced_with_traces())
    assert all(traced_with_traces())


def test_fake_tensor_cache_patch_reaches_a_new_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert FakeTensorMode().cache_enabled
    with _no_compat_warning(), compat.without_fake_tensor_cache():
        assert not FakeTensorMode().cache_enabled
    assert FakeTensorMode().cache_enabled


def _onnx_export(module: torch.nn.Module) -> None:
    pytest.importorskip("onnxscript", reason="the ONNX exporter needs onnxscript")
    with logging_silenced("torch.onnx"):
        torch.onnx.export(module.eval(), (torch.randn(2, 4),), dynamo=True, optimize=False, verbose=False)


@contextlib.contextmanager
def logging_silenced(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def test_decomposition_patch_skips_the_retrace_the_exporter_runs(monkeypatch):
    """torch's exporter decomposes (``run_decompositions``) a program of translatable ops;
    inside the block it does not, and exports the same."""
    calls = []
    real = torch.export.ExportedProgram.run_decompositions

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    _onnx_export(module)
    assert calls, "torch's exporter no longer decomposes through run_decompositions"
    calls.clear()
    with _no_compat_warning(), compat.decompose_only_what_onnx_lacks():
        _onnx_export(module)
    assert not calls


def test_registry_patch_builds_the_exporters_registry_once(monkeypatch):
    """The exporter takes its torchlib registry from ``ONNXRegistry.from_torchlib``: inside the
    block, two exports build it once (kept in ``_registries()``) and get copies; torch's own
    classmethod is back after."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    own = vars(ONNXRegistry)["from_torchlib"]
    held = compat._Registries()
    monkeypatch.setattr(compat, "_registries", lambda: held)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with _no_compat_warning(), compat.reused_torchlib_registry():
        _onnx_export(module)
        kept = dict(held.kept)
        _onnx_export(module)
    assert len(kept) == 1 and held.kept == kept  # built by the first export only
    assert vars(ONNXRegistry)["from_torchlib"] is own


def test_registry_patch_builds_again_once_more_operators_are_registered(monkeypatch):
    """The registry translates the operators that exist when it is built: an operator library
    registered after the first build (here a test library; in a test run, e.g. the
    ``quantized_decomposed`` ops an import of torch.ao.quantization brings) gets a new build,
    equal to the one torch would make."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    held = compat._Registries()
    monkeypatch.setattr(compat, "_registries", lambda: held)
    with _no_compat_warning(), compat.reused_torchlib_registry():
        first = ONNXRegistry.from_torchlib()
        kept = held.kept[first.opset_version]
        ONNXRegistry.from_torchlib()
        assert held.kept[first.opset_version] is kept  # nothing registered in between: reused
        library = torch.library.Library("looptool_compat_test", "DEF")
        library.define("noop(Tensor x) -> Tensor")
        try:
            again = ONNXRegistry.from_torchlib()
            assert held.kept[first.opset_version] is not kept
        finally:
            del library
    assert again.functions.keys() == ONNXRegistry.from_torchlib().functions.keys()


def test_torchvision_notice_patch_drops_the_exporters_records(caplog):
    """The records come from the registry module's own logger, under the name the block filters."""
    from torch.onnx._internal.exporter import _registration

    assert _registration.logger.name == "torch.onnx._internal.exporter._registration"
    with caplog.at_level(logging.WARNING, logger=_registration.logger.name):
        with _no_compat_warning(), compat.without_torchvision_notice():
            _registration.logger.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
            _registration.logger.warning("another record")
        _registration.logger.warning("torchvision is not installed. Skipping %s", "torchvision::roi_align")
    assert [r.getMessage() for r in caplog.records] == [
        "another record",
        "torchvision is not installed. Skipping torchvision::roi_align",
    ]


def test_gguf_patch_parses_a_file_and_maps_names_once_per_load(tmp_path, monkeypatch):
    """transformers' GGUF load reaches gguf's reader and name map at call time: inside the
    block, two loads of one file construct one reader and build one name map."""
    gguf = pytest.importorskip("gguf", reason="the GGUF patch needs gguf")
    import numpy as np
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("block_count", 1), ("context_length", 16), ("embedding_length", 8)]:
        getattr(writer, f"add_{add}")(value)
    for add, value in [("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 2), ("vocab_size", 4)]:
        getattr(writer, f"add_{add}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    readers, maps = [], []
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountedReader(reader_class):
        def __init__(self, *args, **kwargs):
            readers.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in config.items()}))
    readers.clear()
    alone = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    assert len(readers) == 1 and len(maps) > 1  # transformers' own: a name map per module
    readers.clear()
    maps.clear()
    with _no_compat_warning(), compat.gguf_parsed_once():
        loads = [load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model) for _ in range(2)]
    assert len(readers) == 1 and len(maps) == 1
    for loaded in loads:
        assert torch.equal(
            loaded["tensors"]["model.embed_tokens.weight"], alone["tensors"]["model.embed_tokens.weight"]
        )


# ---------------------------------------------------------------------- outside the known versions
TORCH_PATCHES = {
    compat.STACK_TRACES: compat.without_stack_traces,
    compat.FAKE_TENSOR_CACHE: compat.without_fake_tensor_cache,
    compat.ONNX_DECOMPOSITION: compat.decompose_only_what_onnx_lacks,
    compat.ONNX_REGISTRY: compat.reused_torchlib_registry,
}


def _current(target: str) -> object:
    """The value of the attribute ``target`` names (a class's own entry for a class attribute)."""
    owner, _, name = target.rpartition(".")
    holder = compat._resolve(owner)
    return vars(holder).get(name) if isinstance(holder, type) else getattr(holder, name, None)


@pytest.mark.parametrize("patch", list(TORCH_PATCHES), ids=lambda p: p.target.rpartition(".")[2])
def test_outside_its_torch_versions_a_patch_steps_aside_and_says_so(patch, monkeypatch):
    before = _current(patch.target)
    monkeypatch.setattr(compat, "installed_version", lambda library: (2, 99))
    known = re.escape(f"known for torch {patch.versions()}, and torch here is 2.99")
    with pytest.warns(CompatWarning, match=known):
        with TORCH_PATCHES[patch]():
            assert _current(patch.target) is before
    assert _current(patch.target) is before


def test_outside_its_transformers_versions_the_gguf_patch_steps_aside(monkeypatch):
    gguf = pytest.importorskip("gguf", reason="the GGUF patch needs gguf")
    reader = gguf.GGUFReader
    monkeypatch.setattr(compat, "installed_version", lambda library: (6, 0))
    with pytest.warns(CompatWarning, match=r"gguf\.GGUFReader.*transformers 5\.17 to 5\.25.*is 6\.0"):
        with compat.gguf_parsed_once():
            assert gguf.GGUFReader is reader


def test_a_target_of_another_shape_steps_aside_and_says_so(monkeypatch):
    """Inside the known versions, a setting the library no longer has is a warning, not an error."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.delattr(dynamo_config, "fake_tensor_cache_enabled")
    with pytest.warns(CompatWarning, match="has no fake_tensor_cache_enabled"):
        with compat.without_fake_tensor_cache():
            pass


def test_installed_version_reads_major_and_minor():
    assert compat.installed_version("torch") == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert compat.installed_version("no-such-library-anywhere") is None


# ---------------------------------------------------------------------- the override itself
class _Base:
    @classmethod
    def build(cls) -> str:
        return "base"


class _Child(_Base):
    @classmethod
    def make(cls) -> str:
        return "child"


def test_overridden_restores_a_class_attribute_as_it_was(monkeypatch):
    """A class's own classmethod comes back as the very descriptor it was; an inherited one is
    overridden on the class and the override deleted after; nested uses keep the first value."""
    monkeypatch.setattr(sys.modules[__name__], "_Child", _Child)  # reachable by its dotted path
    own = vars(_Child)["make"]
    path = f"{__name__}._Child"
    with overridden(path, "make", classmethod(lambda cls: "patched")):
        with overridden(path, "make", classmethod(lambda cls: "inner")):
            assert _Child.make() == "patched"
        assert _Child.make() == "patched"
    assert vars(_Child)["make"] is own and _Child.make() == "child"
    with overridden(path, "build", classmethod(lambda cls: "patched")):
        assert _Child.build() == "patched" and _Base.build() == "base"
    assert "build" not in vars(_Child) and _Child.build() == "base"
    with overridden(path, "missing", 1):
        assert not hasattr(_Child, "missing")
