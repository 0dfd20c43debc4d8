"""The ``unflatten_crossings`` pass: tensors that cross layer applications with their tokens
flattened are carried as ``[batch, step, …]``.

A composed ONNX graph (:mod:`looptool.backends.onnx.layers`) exports each layer application
as a body with named dynamic dimensions (batch, step, capacity). A body input of
``[batch·step, …]`` has none that ``torch.export`` accepts (derived dimensions are linear in
one symbol), and MoE route replay (ELR Sec. 3.4) passes loop 1's top-k weights and experts,
flattened, to later loops. The pass carries each such tensor as ``[batch, step, …]`` (a view
in the producing application) and flattens it again inside each reading application: the
same values in the same order. Paths with no such tensor come back as unchanged copies. Not
recorded in the recipe: it lowers paths, it does not change the model.
"""

from __future__ import annotations

import torch
from torch import fx

from looptool.core.graph import ROLE_SHAPE, LayerGraph, annotate, copy_graph
from looptool.passes.checkpoint import application_of
from looptool.passes.manager import LOOPING_PASSES, register_pass


# after fuse (its MoE pattern reads the flattened routing) and the decode interface (it lowers that interface's paths)
@register_pass("unflatten_crossings", replayable=False, requires=LOOPING_PASSES, after=("fuse", "decode_interface"))
def unflatten_crossings(lg: LayerGraph, config: dict) -> LayerGraph:
    """Every path of ``lg`` with its flattened-token crossings unflattened (``config`` is unused)."""
    return lg.replace(paths={k: unflattened(g) for k, g in lg.paths.items()})


def unflattened(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` in which every tensor that one layer application hands to another
    with its tokens flattened (``[batch·step, …]``) is carried as ``[batch, step, …]``,
    flattened again inside the reader. The producer's application gets the view, each reading
    application its own flatten (same values, same order)."""
    graph = copy_graph(graph)
    sized = [n for n in graph.nodes if n.op == "placeholder" and _is_tensor(n) and n.meta["val"].dim() >= 2]
    for node in list(graph.nodes):
        owner = application_of(node)
        if owner is None or not _is_tensor(node) or node.meta["val"].dim() == 0:
            continue
        readers: dict[tuple[int, int], list[fx.Node]] = {}
        for user in node.users:
            key = application_of(user)
            if key is not None and key != owner:
                readers.setdefault(key, []).append(user)
        source = _tokens_source(node.meta["val"], sized) if readers else None
        if source is None:
            continue
        val = node.meta["val"]
        with graph.inserting_after(node):
            batch = graph.call_function(torch.ops.aten.sym_size.int, (source, 0))
            batch.meta["val"] = source.meta["val"].shape[0]
            annotate(batch, ROLE_SHAPE, None)
        with graph.inserting_after(batch):
            step = graph.call_function(torch.ops.aten.sym_size.int, (source, 1))
            step.meta["val"] = source.meta["val"].shape[1]
            annotate(step, ROLE_SHAPE, None)
        with graph.inserting_after(step):
            tokens = graph.call_function(torch.ops.aten.view.default, (node, [batch, step, *val.shape[1:]]))
            tokens.meta = {**node.meta, "val": val.unflatten(0, tuple(source.meta["val"].shape[:2]))}
        for users in readers.values():
            with graph.inserting_before(users[0]):
                flat = graph.call_function(torch.ops.aten.flatten.using_ints, (tokens, 0, 1))
                flat.meta = {**users[0].meta, "val": val}
            for user in users:
                user.replace_input_with(node, flat)
    return graph


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _tokens_source(val: torch.Tensor, sized: list[fx.Node]) -> fx.Node | None:
    """An input whose first two sizes (batch, step) multiply to ``val``'s first, when that
    is a product of symbols; else None."""
    first = val.shape[0]
    if not isinstance(first, torch.SymInt):
        return None
    expr = first.node.expr
    for node in sized:
        b, s = node.meta["val"].shape[:2]
        if isinstance(b, torch.SymInt) and isinstance(s, torch.SymInt) and (b.node.expr * s.node.expr - expr) == 0:
            return node
    return None
