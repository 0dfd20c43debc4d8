"""The files beside an engine's graphs: the external data a graph may read (only its own
``weights.bin``, never a path outside the engine directory) and the tokenizer exported with it."""

from __future__ import annotations

import os
from pathlib import Path

from looptool.backends.errors import EngineError
from looptool.backends.manifest import WEIGHTS, Manifest


def inside(directory: Path, location: str) -> Path:
    """The file a relative ``location`` names, refused unless it lies inside ``directory``."""
    if os.path.isabs(location) or location.startswith(("/", "\\")):
        raise EngineError(
            f"external data location '{location}' is an absolute path; engines may only reference files inside their own directory."
        )
    target = (directory / location).resolve()
    if directory.resolve() not in target.parents:
        raise EngineError(
            f"external data location '{location}' points outside the engine directory '{directory}'; refusing to load it."
        )
    return target


def check_external_data(directory: Path, graph_path: Path) -> list[str]:
    """Names of the external initializers of one graph, each checked to live in this
    engine's ``weights.bin``."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    names = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        target = inside(directory, info.get("location", ""))
        if target != (directory / WEIGHTS).resolve():
            raise EngineError(
                f"initializer '{init.name}' of {graph_path.name} reads '{info.get('location')}', not {WEIGHTS}; export the engine again."
            )
        names.append(init.name)
    return names


def engine_tokenizer(directory: str | os.PathLike, manifest: Manifest, tokenizer: str | os.PathLike | None):
    """The tokenizer given, else the one exported beside the engine; one sentence if neither."""
    from looptool.core.errors import LooptoolError
    from looptool.runtime import text

    source = tokenizer if tokenizer is not None else (directory if manifest.tokenizer else None)
    if source is None:
        raise LooptoolError(
            "this engine was exported without a tokenizer; pass tokenizer=PATH (a Hugging Face tokenizer folder).",
            parameter="tokenizer",
        )
    return text.load_tokenizer(source)
