"""Generate text at every budget with a KV cache, and see what each cache policy costs.

Run: python examples/generate_budgets.py [OUTPUT_DIR]
Uses a tiny random Llama with a byte-level tokenizer so it runs in seconds; on a real
model use ``looptool.convert("smollm2")`` (or ``looptool generate ./looped --budget 6``).
"""

import sys
import tempfile

import torch

import looptool
from looptool.runtime.generation import generate
from looptool.testing import byte_tokenizer, tiny_model

source = tiny_model("llama", num_layers=6)
tokenizer = byte_tokenizer()
model = looptool.convert(source, looptool.PrefixLoop(window=(1, 5), budgets=(0, 2, 4)), tokenizer=tokenizer)
prompt = tokenizer("The Constitution", return_tensors="pt").input_ids

# Right after conversion every budget generates exactly what the source's own generate does.
reference = source.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
for k in model.budgets:
    assert torch.equal(model.generate(prompt, budget=k, max_new_tokens=12, eos_token_id=None), reference)
print("every budget reproduces the source model's greedy generation")

# Training moves the gates; then budgets differ. per-loop caching is exact (it equals
# recomputing the whole sequence); last-loop keeps the cache at the source's size.
with torch.no_grad():
    for _, p in model.new_parameters():
        p.add_(0.5 * torch.randn_like(p))
for k in model.budgets:
    for kv in ("per-loop", "last-loop"):
        out = generate(model, prompt, budget=k, max_new_tokens=12, kv=kv, eos_token_id=None)
        text = tokenizer.decode(out.sequences[0, prompt.shape[1] :])
        print(
            f"budget {k} {kv:>9}: KV {out.kv_bytes_per_token:6.0f} B/token, {out.tokens_per_second:7.1f} tok/s, {text!r}"
        )

out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/looped"
model.save_pretrained(out_dir)
print(f"saved to {out_dir}; try: looptool generate {out_dir} --budget 4 --prompt 'We the People' --stream")
