"""The pass API by hand: capture, read the annotated graph, run a named pass, lower a path.

Run: python examples/pass_api.py
"""

import collections

import torch

from looptool import LoopedModel, capture
from looptool.core.graph import annotation
from looptool.passes import PassManager, registered_passes
from looptool.testing import tiny_model

source = tiny_model("gpt_neox", num_layers=4)  # parallel-residual layers

# 1. Capture: torch.export graph + per-node layer/role annotations.
lg = capture(source)
roles = collections.Counter(annotation(n)["role"] for n in lg.graph.nodes)
print("roles:", dict(roles))
for info in lg.layers:
    writes = ", ".join(f"{w.kind}→{w.add}" for w in info.writes)
    print(f"layer {info.index} [{info.form}]: {info.input} → {info.output}; writes: {writes}")

# 2. Passes by name, with their configs; the manager verifies after each and records the recipe.
print("registered passes:", registered_passes())
looped_graph = PassManager([("prefix_loop", {"kind": "prefix", "version": 1, "window": [1, 3], "budgets": [0, 2]})])(lg)
print("recipe:", looped_graph.recipe)
print("new parameters:", [(p.name, p.shape, "no_decay" if p.no_decay else "") for p in looped_graph.new_params])

# 3. Each budget is a straight-line FX graph over the same parameters.
for k, graph in looped_graph.paths.items():
    gates = [n.target for n in graph.nodes if n.op == "get_attr" and str(n.target).startswith("loop.")]
    print(f"budget {k}: {len(graph.nodes)} nodes, gates read: {gates}")

# 4. The runtime model; one budget path as a GraphModule you can print, export or compile.
model = LoopedModel(looped_graph)
path = model.path(2)
ids = torch.randint(0, 256, (2, 7))
assert torch.equal(path(ids, torch.ones_like(ids)), source(input_ids=ids).logits)
exported = torch.export.export(path, (ids, torch.ones_like(ids)))
print(f"budget 2 path re-exports with torch.export: {len(exported.graph.nodes)} nodes")
