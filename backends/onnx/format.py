"""The ONNX engine directory: graph file names, and the manifest of an export
(:class:`looptool.backends.manifest.Manifest`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from looptool.backends.manifest import WEIGHTS, GraphEntry, Manifest, WeightsEntry
from looptool.core.graph import ROWWISE
from looptool.storage.files import sha256_file

if TYPE_CHECKING:
    from looptool.backends.onnx.store import WeightStore


def budget_file(budget: int | str, kv: str = "per-loop") -> str:
    """File name of one budget's graph under KV policy ``kv`` (``budget`` :data:`ROWWISE`: the
    row-wise-budget graph, ``rowwise.<policy>.onnx``)."""
    return f"{ROWWISE}.{kv}.onnx" if budget == ROWWISE else f"budget_{budget}.{kv}.onnx"


def verify_file(budget: int, kv: str = "per-loop") -> str:
    """File name of budget ``budget``'s verify graph (speculative decoding) under KV policy ``kv``."""
    return f"verify_{budget}.{kv}.onnx"


def adaptive_file(rule: str, kv: str = "last-loop") -> str:
    """File name of the adaptive-depth graph (``budget="auto"``) of exit rule ``rule`` under KV policy ``kv``."""
    return f"adaptive.{rule}.{kv}.onnx"


def _hashed(directory: Path, entries: dict[tuple, GraphEntry], order=None) -> dict:
    """``{key[0]: {key[1]: entry}}`` of ``entries`` (keyed ``(budget or rule, policy)``, in the
    sort order ``order`` gives a key, default the keys' own), each entry given its file's
    sha256 and size."""
    out: dict = {}
    for (key, policy), entry in sorted(entries.items(), key=lambda item: order(item[0]) if order else item[0]):
        path = directory / entry.file
        entry.sha256, entry.bytes = sha256_file(path), path.stat().st_size
        out.setdefault(key, {})[policy] = entry
    return out


def export_manifest(
    model,
    directory: Path,
    store: WeightStore,
    graphs: dict[tuple[int | str, str], GraphEntry],
    functions: dict[str, dict[str, int]],
    ort_fusions: bool,
    verify: dict[tuple[int, str], GraphEntry] | None = None,
    adaptive: dict[tuple[str, str], GraphEntry] | None = None,
) -> Manifest:
    """The manifest of an export into ``directory``: ``graphs`` maps ``(budget, policy)`` to each
    graph's entry (the row-wise graphs under :data:`ROWWISE`), each given its file's sha256 and
    size here; ``store`` holds the weights; ``verify``: the verify graphs, keyed alike;
    ``adaptive``: the adaptive-depth graphs, keyed ``(exit rule, policy)``."""
    from looptool.backends.onnx.functions import DOMAIN, DOMAIN_VERSION, OPSET

    return Manifest(
        graphs=_hashed(directory, graphs, lambda key: (key[0] == ROWWISE, 0 if key[0] == ROWWISE else key[0], key[1])),
        kv_policies=tuple(sorted({policy for _, policy in graphs})),
        weights=WeightsEntry(
            WEIGHTS,
            sha256_file(directory / WEIGHTS),
            store.size,
            dict(store.tensors),
        ),
        mask_dtype=str(model.mask_dtype).removeprefix("torch."),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        source_config=model.config.to_dict(),
        costs=tuple(model.cost_table()),  # per budget: what a row at it costs per token
        plan=model.plan.to_dict(),
        opset={"": OPSET, DOMAIN: DOMAIN_VERSION},
        ort_fusions=ort_fusions,
        fused_per_body=functions,
        parameter_bytes=model.dims().param_bytes,
        tokenizer=model.tokenizer is not None,
        verify_graphs=_hashed(directory, verify or {}),
        adaptive_graphs=_hashed(directory, adaptive or {}),
    )
