"""TensorRT export on SmolLM2-135M without TensorRT: `export_tensorrt(..., build_on_target=True)`
(ONNX graphs, TensorRT variants, build.py), its time and files, and each variant run in
onnxruntime against its ORT graph (prefill of 128 tokens, then one decode step).

Run: python tests/bench/bench_trt_variants.py [--budgets 0,12] [--out DIR]. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import looptool
from looptool.backends.manifest import WEIGHTS, Manifest
from looptool.backends.tensorrt.export import export_tensorrt, weight_arrays
from looptool.capture.sources import load_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,12")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    src = load_source("smollm2")
    model = looptool.convert(
        src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)), tokenizer=src.tokenizer
    )
    out = Path(args.out or tempfile.mkdtemp()) / "smollm2-trt"
    t0 = time.perf_counter()
    export_tensorrt(model, out, budgets, precision="fp32", build_on_target=True, validate=False, overwrite=True)
    seconds = time.perf_counter() - t0
    manifest = Manifest.read(out)
    weights = weight_arrays(out, manifest)
    result = {"export_seconds": seconds, "budgets": {}}
    rng = np.random.default_rng(0)
    for b in budgets:
        entry = manifest.tensorrt.graphs[b]["per-loop"]
        ref = ort.InferenceSession(str(out / manifest.graphs[b]["per-loop"].file), providers=["CPUExecutionProvider"])
        var = ort.InferenceSession(str(out / entry.file), providers=["CPUExecutionProvider"])
        capacity, prompt = 160, 128
        caches = {
            i.name: np.zeros((1, i.shape[1], capacity, i.shape[3]), np.float32)
            for i in ref.get_inputs()
            if i.name.startswith("past")
        }
        diffs = []
        for start, step in ((0, prompt), (prompt, 1)):
            feeds = {
                "input_ids": rng.integers(0, model.config.vocab_size, (1, step)),
                "attention_mask": np.ones((1, capacity), np.int64),
                "position_ids": np.arange(start, start + step)[None],
                "cache_position": np.arange(start, start + step),
                **caches,
            }
            a = ref.run(None, feeds)
            c = var.run(None, {**feeds, **{n: weights[n] for n in entry.weight_inputs}})
            diffs.append(max(float(np.abs(x - y).max()) for x, y in zip(a, c)))
            caches = dict(zip(caches, a[1:]))
        result["budgets"][b] = {
            "max_abs_diff_prefill_decode": diffs,
            "plugins": entry.plugins,
            "weight_inputs": len(entry.weight_inputs),
            "variant_bytes": (out / entry.file).stat().st_size,
            "ort_graph_bytes": (out / manifest.graphs[b]["per-loop"].file).stat().st_size,
        }
    result["weights_bytes"] = (out / WEIGHTS).stat().st_size
    print(json.dumps(result))


if __name__ == "__main__":
    main()
