"""Mixture of experts in a TensorRT engine without Python: the TensorRT variant of a graph
splits each ``looptool.Moe`` node into four one-kernel AOT plugin nodes,

    rows, block_expert, used, pair_row = MoeAlign(expert_ids)            num_experts, block_m
    act = MoeGateUp(x, gate_up_proj, rows, block_expert, used)           block_m
    out = MoeDown(act, down_proj, block_expert, used)                    block_m
    y   = MoeCombine(out, pair_row, routing_weights)

whose kernels are :mod:`looptool.ops.moe_kernels` (:func:`aot_spec` says how each is compiled
to PTX) and whose ONNX function bodies (:mod:`looptool.backends.tensorrt.moe_functions`) let
onnxruntime run the variant. Every output shape is a static function of the input shapes:
``B = ⌈T·k / block_m⌉ + E`` row blocks of ``block_m`` rows bound the padded rows of any routing.
``num_experts`` comes from the expert weights' first dimension (a graph initializer).
"""

from __future__ import annotations

from looptool.backends.errors import ExportError

MOE_OPS = ("MoeAlign", "MoeGateUp", "MoeDown", "MoeCombine")  # one Triton kernel each
BLOCK_M = 16  # rows per block: the align output's size depends on it, so one value per engine


def split_moe(model, domain: str) -> int:
    """Replace every ``Moe`` node of ``model``'s graph (layer functions already inlined) by
    the four step nodes and add their function bodies; returns how many were split."""
    from onnx import helper

    from looptool.backends.tensorrt.moe_functions import FUNCTIONS

    graph = model.graph
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    for value in list(graph.input) + list(graph.value_info):
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            shapes.setdefault(value.name, [dims[0].dim_value])
    nodes, split = [], 0
    for i, node in enumerate(graph.node):
        if not (node.domain == domain and node.op_type == "Moe"):
            nodes.append(node)
            continue
        x, routing_weights, expert_ids, gate_up_proj, down_proj = node.input
        if not shapes.get(gate_up_proj):
            raise ExportError(
                f"the MoE node {node.name or i!r} takes its expert weights from {gate_up_proj!r}, whose number "
                "of experts the graph does not state; TensorRT's MoE plugins need it when the engine is built."
            )
        p, name = f"_trt_moe{i}_", node.name or f"Moe{i}"
        rows, blocks, used, pair_row, act, out = (p + s for s in ("rows", "blocks", "used", "pair_row", "act", "out"))
        nodes += [
            helper.make_node(
                "MoeAlign",
                [expert_ids],
                [rows, blocks, used, pair_row],
                domain=domain,
                name=name + "_align",
                num_experts=shapes[gate_up_proj][0],
                block_m=BLOCK_M,
            ),
            helper.make_node(
                "MoeGateUp",
                [x, gate_up_proj, rows, blocks, used],
                [act],
                domain=domain,
                name=name + "_gate_up",
                block_m=BLOCK_M,
            ),
            helper.make_node(
                "MoeDown", [act, down_proj, blocks, used], [out], domain=domain, name=name + "_down", block_m=BLOCK_M
            ),
            helper.make_node(
                "MoeCombine", [out, pair_row, routing_weights], list(node.output), domain=domain, name=name + "_combine"
            ),
        ]
        split += 1
    del graph.node[:]
    graph.node.extend(nodes)
    if split:
        model.functions.extend(f.to_function_proto() for f in FUNCTIONS)
    return split


def aot_spec(op: str, t: str, *, num_experts: int, block_m: int) -> tuple:
    """``(kernel, signature, constexprs, scalars, block, columns, options)`` to compile step
    ``op`` with Triton for float type ``t`` (``*fp16`` …): the signature in TensorRT's argument
    order (input pointers, the i32 scalars, output pointers), the scalars' names, the rows or
    elements per program along the grid's x axis, the columns per program along its y axis
    (1: a 1-D grid) and the compiler options."""
    kernel, signature, constexprs, scalars, block, options = _spec(op, t, num_experts, block_m)
    columns = constexprs.get("BLOCK_N", 1)
    return kernel, signature | dict.fromkeys(constexprs, "constexpr"), constexprs, scalars, block, columns, options


def _spec(op: str, t: str, num_experts: int, block_m: int) -> tuple:
    from looptool.ops import kernels, moe_kernels

    fp32 = t == "*fp32"
    gemm = moe_kernels.gemm_config("fp32" if fp32 else "fp16")
    tiles = {"BLOCK_M": block_m, "BLOCK_N": gemm["BLOCK_N"], "BLOCK_K": gemm["BLOCK_K"]}
    numerics = {"PRECISION": "ieee" if fp32 else "tf32", "UPCAST": False}
    options = {"num_warps": gemm["num_warps"], "num_stages": gemm["num_stages"]}
    if op == "MoeAlign":
        signature = {
            "ids_ptr": "*i64",
            "pairs": "i32",
            "top_k": "i32",
            "rows_ptr": "*i32",
            "block_expert_ptr": "*i32",
            "used_ptr": "*i32",
            "pair_row_ptr": "*i32",
        }
        constexprs = {
            "NUM_EXPERTS": num_experts,
            "EXPERTS": moe_kernels.experts_block(num_experts),
            "BLOCK_M": block_m,
            "PAIRS": moe_kernels.pairs_block(num_experts),
        }
        return moe_kernels.moe_align_kernel, signature, constexprs, ("pairs", "top_k"), 1, {"num_warps": 4}
    if op == "MoeGateUp":  # the rows hold token indices: pair // top_k with top_k = 1
        signature = {
            "x_ptr": t,
            "w_ptr": t,
            "rows_ptr": "*i32",
            "block_expert_ptr": "*i32",
            "used_ptr": "*i32",
            "d": "i32",
            "inter": "i32",
            "top_k": "constexpr",
            "act_ptr": t,
        }
        return (
            kernels.moe_gate_up_kernel,
            signature,
            {"top_k": 1, **tiles, **numerics},
            ("d", "inter"),
            block_m,
            options,
        )
    if op == "MoeDown":
        signature = {
            "act_ptr": t,
            "w_ptr": t,
            "block_expert_ptr": "*i32",
            "used_ptr": "*i32",
            "d": "i32",
            "inter": "i32",
            "out_ptr": "*fp32",
        }
        return moe_kernels.moe_down_rows_kernel, signature, {**tiles, **numerics}, ("d", "inter"), block_m, options
    if op == "MoeCombine":
        signature = {
            "out_ptr": "*fp32",
            "pair_row_ptr": "*i32",
            "weights_ptr": t,
            "n": "i32",
            "d": "i32",
            "top_k": "i32",
            "y_ptr": t,
        }
        constexprs = {"BLOCK": kernels.ELEMENTWISE_BLOCK}
        return (
            moe_kernels.moe_combine_kernel,
            signature,
            constexprs,
            ("n", "d", "top_k"),
            kernels.ELEMENTWISE_BLOCK,
            {"num_warps": 4},
        )
    raise ExportError(f"no MoE step {op!r}; the steps are {', '.join(MOE_OPS)}.")
