"""The on-disk format of an ONNX engine directory: file names, the manifest, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from looptool.core.errors import LooptoolError
from looptool.core.graph import ROWWISE
from looptool.storage.files import sha256_file

if TYPE_CHECKING:
    from looptool.backends.onnx_store import WeightStore


FORMAT = "looptool-onnx-engine"
FORMAT_VERSION = 2  # 2: serving graphs with KV caches, one per budget and policy
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"


class ExportError(LooptoolError):
    """An export failed (unsupported model, exporter failure, or validation mismatch)."""


class EngineError(LooptoolError):
    """An engine directory is incomplete, tampered with or points outside itself."""


def budget_file(budget: int | str, kv: str = "per-loop") -> str:
    """File name of one budget's graph under KV policy ``kv`` (``budget`` :data:`ROWWISE`: the
    row-wise-budget graph, ``rowwise.<policy>.onnx``)."""
    return f"{ROWWISE}.{kv}.onnx" if budget == ROWWISE else f"budget_{budget}.{kv}.onnx"


def write_manifest(
    model,
    directory: Path,
    store: WeightStore,
    graphs: dict[tuple[int | str, str], dict],
    functions: dict[str, dict[str, int]],
    ort_fusions: bool,
) -> None:
    """Write ``manifest.json``: ``graphs`` maps ``(budget, policy)`` to each graph's entry; the
    row-wise graphs (key :data:`ROWWISE`) go to the ``rowwise`` section, by policy."""
    from looptool.backends.onnx_functions import DOMAIN, DOMAIN_VERSION, OPSET
    from looptool.backends.serving import BUDGETS, INPUTS, LOGITS
    from looptool.core.version import __version__

    budgets: dict[str, dict] = {}
    rowwise: dict[str, dict] = {}
    order = {key: (key[0] == ROWWISE, 0 if key[0] == ROWWISE else key[0], key[1]) for key in graphs}
    for (budget, policy), info in sorted(graphs.items(), key=lambda item: order[item[0]]):
        path = directory / info["file"]
        entry = {**info, "sha256": sha256_file(path), "bytes": path.stat().st_size}
        if budget == ROWWISE:
            rowwise[policy] = entry
        else:
            budgets.setdefault(str(budget), {})[policy] = entry
    mask_dtype = str(model.mask_dtype).removeprefix("torch.")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "looptool_version": __version__,
        "opset": {"": OPSET, DOMAIN: DOMAIN_VERSION},
        "interface": {
            "inputs": dict(
                zip(
                    INPUTS,
                    ("int64 [batch, step]", f"{mask_dtype} [batch, capacity]", "int64 [batch, step]", "int64 [step]"),
                )
            ),
            "caches": "past_key_values.{j}.key / .value [batch, kv_heads, capacity, head_dim] in, present.{j}.key / "
            ".value out (same buffers may be bound to both)",
            "outputs": {LOGITS: "[batch, 1, vocab] (last position)"},
            "rowwise": f"the {ROWWISE} graphs take {BUDGETS} int64 [batch] (each row's budget) after "
            f"{INPUTS[-1]}; their caches are the deepest budget's",
        },
        "kv_policies": sorted({policy for _, policy in graphs}),
        "functions": {"ort_fusions": ort_fusions, "fused_per_body": functions},
        "mask_dtype": mask_dtype,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "plan": model.plan.to_dict(),
        "costs": [c.as_dict() for c in model.cost_table()],  # per budget: what a row at it costs per token
        "budgets": budgets,
        ROWWISE: rowwise,
        "weights": {
            "file": WEIGHTS,
            "sha256": sha256_file(directory / WEIGHTS),
            "bytes": store.size,
            "tensors": store.tensors,
        },
        "parameter_bytes": model.dims().param_bytes,
        "source_config": model.config.to_dict(),
        "tokenizer": model.tokenizer is not None,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
