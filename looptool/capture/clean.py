"""Cleaning an exported graph: plain tensor inputs, the logits as the one output, no-op casts
dropped, device-specific choices of the source code made device-neutral."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from looptool.core.errors import CaptureError
from looptool.core.graph import copy_node, lazy_graph_module

CAST_TARGETS = {  # dtype/device casts (also read by looptool.posttrain.merge)
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.device,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._to_copy.default,
}


def clean_module(exported: fx.GraphModule, inputs: tuple[str, ...] | None) -> fx.GraphModule:
    """Rebuild the exported graph with plain tensor inputs (``inputs``, or all when None)
    and the logits as its one output.

    Drops the ``use_cache`` placeholder and the export guard call; parameters stay shared.
    """
    old = exported.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_node = None
    for node in old.nodes:
        if node.op == "placeholder":
            if inputs is None or node.target in inputs:
                env[node] = new.placeholder(node.target)
                env[node].meta = dict(node.meta)
            continue
        if node.op == "call_module":  # the export's _guards_fn; nothing else is a module call
            continue
        if node.op == "output":
            out_node = node
            continue
        env[node] = copy_node(
            new, node, fx.node.map_arg(node.args, env.__getitem__), fx.node.map_arg(node.kwargs, env.__getitem__)
        )
    leaves = [leaf for leaf in _flatten(out_node.args[0]) if isinstance(leaf, fx.Node)]
    if len(leaves) != 1:
        raise CaptureError(
            f"the exported forward returned {len(leaves)} tensors; expected only the logits "
            "(looptool calls the model with use_cache=False)."
        )
    new.output(env[leaves[0]])
    _drop_noop_casts(new)
    new.eliminate_dead_code()
    gm = lazy_graph_module(exported, new)  # capture never runs it: its code only if asked
    for graph in [gm.graph] + [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]:
        _device_neutral_histc(graph)
        _drop_metadata_asserts(graph)
    return gm


def _drop_metadata_asserts(graph: fx.Graph) -> None:
    """Drop export's ``_assert_tensor_metadata`` checks (one before each recorded ``.to()``).

    They pin every cast's input to the dtype it had while tracing, but a captured graph is
    meant to run in other dtypes too: cast to bf16, or under autocast, which on CUDA turns
    tensors the trace saw in fp32 into bf16 before such a check (a CUDA bf16 training step
    stopped at one, inside the rotary embedding's autocast-disabled block). The casts
    themselves stay; nothing reads the checks' results.
    """
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)


def _device_neutral_histc(graph: fx.Graph) -> None:
    """Make transformers' MoE token counting run on every device.

    Its experts dispatch counts tokens per expert with ``histc`` on int32 expert ids except on
    CPU, where histc needs a float input (it casts there). Which branch the capture recorded
    depends on the device it ran on (``meta`` when loading takes the int one), so integer
    inputs are cast to float32 here, once: the counts are identical on every device and no
    later pass needs to know about it.
    """
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.histc.default:
            src = node.args[0]
            val = src.meta.get("val") if isinstance(src, fx.Node) else None
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                with graph.inserting_before(node):
                    cast = graph.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": torch.float32})
                cast.meta = {**node.meta, "val": val.float()}
                node.replace_input_with(src, cast)


def _drop_noop_casts(graph: fx.Graph) -> None:
    """Replace ``.to()`` nodes that change nothing by their input.

    ``x.to(float32)`` on an fp32 tensor returns ``x`` itself, so export records later uses
    of ``x`` (e.g. the residual kept before an RMSNorm) as uses of the cast node. Undoing
    that alias restores the true data flow (the residual stream) without changing a bit.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CAST_TARGETS:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node):
            continue
        a, b = src.meta.get("val"), node.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if node.target is torch.ops.aten._to_copy.default:
            continue  # an explicit copy: keep it
        if a.dtype == b.dtype and a.device == b.device and a.layout == b.layout:
            node.replace_all_uses_with(src)


def _flatten(value) -> Iterable:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)
    else:
        yield value
