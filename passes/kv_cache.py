"""The ``kv_cache`` pass: give every attention execution of a cached budget path its slot.

It runs on budget paths built from a decode-step capture (``capture(model, decode=True)``),
where each decoder layer's attention writes its keys and values in place into the cache
inputs ``caches_{2l}`` / ``caches_{2l+1}`` and attends over them. A looping pass copies a
layer's nodes, so by default every execution of a layer writes the layer's one slot:

* ``last-loop`` (ELR Sec. 3.4): keep that. Loop ``i`` overwrites the current tokens' keys
  and values and attends to earlier tokens' final-loop entries plus its own loop-``i``
  entry; the cache stays at the one-loop size.
* ``per-loop`` (Accordion Eq. 6): the second pass of a repeated layer, or loop ``i >= 2`` of
  a recurrent block, gets a cache input of its own (``caches_{j}_loop{i}``), so cached
  decoding computes exactly what the full-sequence path computes; KV grows with the
  number of attention executions.

Not recorded in the recipe: the cache policy is how a model is run, not what it is.
"""

from __future__ import annotations

from torch import fx

from looptool.core.errors import PassError, PlanError
from looptool.core.graph import META_KEY, LayerGraph, annotation, copy_graph
from looptool.passes.manager import LOOPING_PASSES, register_pass

KV_POLICIES = ("per-loop", "last-loop")


def execution_of(node: fx.Node) -> int:
    """Which execution of its layer a node belongs to: 2 for a repeated layer's second
    pass, ``i`` for loop ``i`` of a recurrent block, else 1."""
    ann = annotation(node)
    if isinstance(ann.get("repeat"), int):
        return ann["repeat"]
    loop = ann.get("loop")
    return loop if isinstance(loop, int) else 1


# before checkpoint: outlined layer applications hide their cache writes from this pass
@register_pass("kv_cache", replayable=False, requires=LOOPING_PASSES, before=("checkpoint",))
def kv_cache(lg: LayerGraph, config: dict) -> LayerGraph:
    """``config = {"policy": "per-loop" | "last-loop"}`` (default per-loop)."""
    policy = config.get("policy", "per-loop")
    if policy not in KV_POLICIES:
        raise PlanError(f"unknown KV cache policy {policy!r}; use one of {list(KV_POLICIES)}.")
    if not any(n.op == "placeholder" and "kv" in annotation(n) for n in lg.graph.nodes):
        raise PassError(
            "kv_cache needs a decode-step capture (capture(model, decode=True)); this graph has no cache inputs."
        )
    if not lg.paths:
        raise PassError("kv_cache: the graph has no budget paths; run a looping pass first.")
    paths = {k: route_cache_slots(g, policy) for k, g in lg.paths.items()}
    return lg.replace(paths=paths)


def route_cache_slots(graph: fx.Graph, policy: str) -> fx.Graph:
    """A copy of one cached budget path with its cache writes routed by ``policy``."""
    new = copy_graph(graph)
    if policy == "last-loop":
        return new
    placeholders = [n for n in new.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    slots: dict[tuple[str, int], fx.Node] = {}
    for node in list(new.nodes):
        if node.op != "call_function" or "kv" not in annotation(node):
            continue
        execution = execution_of(node)
        if execution == 1:
            continue
        base = node.args[0]
        key = (base.target, execution)
        if key not in slots:
            with new.inserting_after(last):
                slot = new.placeholder(f"{base.target}_loop{execution}")
            slot.meta = {k: v for k, v in base.meta.items() if k != META_KEY}
            ann = annotation(base)
            slot.meta[META_KEY] = {**ann, "kv": {**ann["kv"], "execution": execution}}
            slots[key] = last = slot
        node.args = (slots[key], *node.args[1:])
    return new
