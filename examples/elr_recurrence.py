"""Elastic latent recurrence (ELR): loop a middle block k times, exact at conversion.

Run: python examples/elr_recurrence.py [OUTPUT_DIR]
Uses a tiny random Qwen3-MoE so it runs in seconds; the same call works on any supported
pretrained model (try looptool.convert("smollm2", plan)).
"""

import sys
import tempfile

import torch

import looptool
from looptool.report.tables import summary
from looptool.testing import tiny_model

source = tiny_model("qwen3_moe", num_layers=6)
plan = looptool.RecurrentLoop(
    recurrent=(1, 5),
    max_loops=4,
    update="adaptive-delta",
    conditioning=True,
    cond_dim=32,
    rank=8,
    route_replay=True,
    init="exact",
)
model = looptool.convert(source, plan)
ids = torch.randint(0, source.config.vocab_size, (2, 10))
with torch.no_grad():
    ref = source(input_ids=ids).logits
    for row in summary(model)["budgets"]:
        k = row["budget"]
        exact = torch.equal(ref, model(ids, budget=k).logits)
        print(f"k={k}: D_eff={row['layer_executions']:2d}  path {row['path']:<14} exact={exact}")
        assert exact
print(f"parameters added: {model.added_parameter_count():,} (adaptive-delta gate + loop conditioning)")

# Training moves the zero-initialised exit heads; after that, more loops compute more.
with torch.no_grad():
    for _, p in model.new_parameters():
        p.add_(0.05 * torch.randn_like(p))
    losses = {k: model(ids, labels=ids, budget=k).loss.item() for k in model.budgets}
print("after perturbing the new parameters, loss per loop count:", {k: round(v, 4) for k, v in losses.items()})

out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/elr"
model.save_pretrained(out_dir)
reloaded = looptool.load(out_dir)
assert all(torch.equal(model(ids, budget=k).logits, reloaded(ids, budget=k).logits) for k in model.budgets)
print(f"saved to {out_dir} and reloaded bit-identically; try: looptool inspect {out_dir}")
