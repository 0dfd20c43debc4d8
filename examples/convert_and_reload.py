"""One call: convert a Hugging Face causal LM, run every budget, save, reload.

Run: python examples/convert_and_reload.py [OUTPUT_DIR]
Uses a tiny random Llama so it runs in seconds; pass any AutoModelForCausalLM instead.
"""

import sys
import tempfile

import torch

import looptool
from looptool.testing import tiny_model

source = tiny_model("llama", num_layers=6)  # or AutoModelForCausalLM.from_pretrained(path)
plan = looptool.PrefixLoop(window=(1, 5), budgets=(0, 2, 4))
model = looptool.convert(source, plan)

ids = torch.randint(0, source.config.vocab_size, (1, 12))
with torch.no_grad():
    ref = source(input_ids=ids).logits
    for k in model.budgets:
        out = model(ids, labels=ids, budget=k)
        print(f"budget {k}: loss {out.loss:.4f}  bit-exact vs source: {torch.equal(out.logits, ref)}")
        assert torch.equal(out.logits, ref)

out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/looped"
model.save_pretrained(out_dir)
reloaded = looptool.load(out_dir)
assert all(torch.equal(model(ids, budget=k).logits, reloaded(ids, budget=k).logits) for k in model.budgets)
print(f"saved to {out_dir} and reloaded bit-identically; budgets {reloaded.budgets}")
