"""Optimising exported graphs without copying weights: the onnxscript optimizer under a folding
rule that never touches a node reading a weight, and provenance metadata dropped."""

from __future__ import annotations


def _reads_weights(node) -> bool | None:
    """Folding rule: never fold a node that reads a weight-sized initializer (the result
    would be a second copy of the weight); otherwise the optimizer's default rules."""
    for value in node.inputs:
        if (
            value is not None
            and value.is_initializer()
            and value.const_value is not None
            and value.const_value.size > 64
        ):
            return False
    return None


def simplify(onnx_model) -> None:
    """Fold the exporter's shape arithmetic, simplify and drop dead nodes (about 3x fewer
    nodes), keeping the looptool functions as calls and every weight as it is stored."""
    import onnxscript

    # one pass, no ONNX shape inference: on SmolLM2 this halves the graph (877 → 429 KB) and
    # makes onnxruntime ~7% faster for ~20 s of export time per budget
    onnxscript.optimizer.optimize_ir(
        onnx_model, num_iterations=1, onnx_shape_inference=False, inline=False, should_fold=_reads_weights
    )


def strip_metadata(onnx_model) -> None:
    """Drop the exporter's per-node provenance (FX node text, stack traces): it is most of
    a graph file's bytes and nothing reads it."""
    for node in onnx_model.graph.all_nodes():
        node.metadata_props.clear()
    for fn in onnx_model.functions.values():
        for node in fn:
            node.metadata_props.clear()
