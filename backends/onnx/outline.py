"""Outlining fused ops: the exporter inlines every ``looptool``-domain function; its nodes
(grouped by the FX node they came from) are put back into one call, body checked node by node."""

from __future__ import annotations

from looptool.backends.errors import ExportError


def outline_looptool_functions(onnx_model) -> dict[str, int]:
    """Replace the inlined body of every fused op by one ``looptool``-domain node and add
    the function definitions (bodies) to the model; returns the count per function."""
    import onnx_ir as ir

    from looptool.backends.onnx.functions import DOMAIN, DOMAIN_VERSION, FUNCTIONS

    groups: dict[str, list] = {}
    kinds: dict[str, str] = {}
    for node in onnx_model.graph:
        scope = node.metadata_props.get("namespace", "")
        target = scope.rsplit(": ", 1)[-1]
        kind = target[len(DOMAIN) + 1 : -len(".default")] if target.endswith(".default") else None
        if target.startswith(f"{DOMAIN}.") and kind in FUNCTIONS:
            key = node.metadata_props.get("pkg.torch.onnx.name_scopes", scope)
            groups.setdefault(key, []).append(node)
            kinds[key] = kind
    counts: dict[str, int] = {}
    used: set[str] = set()
    for key, nodes in groups.items():
        function = FUNCTIONS[kinds[key]]
        body = ir.serde.deserialize_function(function.to_function_proto())
        _outline(onnx_model.graph, nodes, body)
        used.add(kinds[key])
        counts[body.name] = counts.get(body.name, 0) + 1
    for kind in sorted(used):
        body = ir.serde.deserialize_function(FUNCTIONS[kind].to_function_proto())
        onnx_model.functions[body.identifier()] = body
    if used:
        onnx_model.opset_imports[DOMAIN] = DOMAIN_VERSION
    return counts


def _outline(graph, nodes: list, function) -> None:
    """Swap the inlined copy of ``function`` (the last nodes of ``nodes``) for one call."""
    import onnx_ir as ir

    body = list(function)
    inlined = nodes[-len(body) :]
    if len(nodes) < len(body) or [n.op_type for n in inlined] != [n.op_type for n in body]:
        raise ExportError(
            f"the exported nodes of looptool.{function.name} do not match its function body; "
            "please report this as a bug."
        )
    params: dict[int, ir.Value] = {}
    position = {id(v): i for i, v in enumerate(function.inputs)}
    produced = {id(out): out for n in inlined for out in n.outputs}
    for fn_node, node in zip(body, inlined):
        for fn_in, actual in zip(fn_node.inputs, node.inputs):
            if fn_in is not None and id(fn_in) in position:
                params[position[id(fn_in)]] = actual
    if len(params) != len(function.inputs):
        raise ExportError(f"could not recover the inputs of looptool.{function.name}; please report this as a bug.")
    out_index = {id(v): i for i, v in enumerate(function.outputs)}
    old_outputs = [None] * len(function.outputs)
    for fn_node, node in zip(body, inlined):
        for fn_out, actual in zip(fn_node.outputs, node.outputs):
            if id(fn_out) in out_index:
                old_outputs[out_index[id(fn_out)]] = actual
    call = ir.Node(
        function.domain,
        function.name,
        [params[i] for i in range(len(params))],
        num_outputs=len(old_outputs),
        name=inlined[-1].name,
    )
    call.metadata_props.update(inlined[-1].metadata_props)
    graph.insert_before(inlined[0], call)
    for old, new in zip(old_outputs, call.outputs):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        old.name = None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    for node in reversed(inlined):
        leaked = [
            o for o in node.outputs if o.uses() and id(o) in produced and not all(u.node in inlined for u in o.uses())
        ]
        if leaked:
            raise ExportError(
                f"an intermediate of looptool.{function.name} is read outside it; please report this as a bug."
            )
    graph.remove(inlined, safe=True)
