"""Capture a Hugging Face causal LM as an annotated FX graph.

``torch.export`` (dynamic batch and sequence) produces the graph; the unlifted
``GraphModule`` holds the *source's own* parameter objects, so nothing is copied. Then every
node is annotated with its layer and role (:mod:`looptool.graph`). This module is the only
place that knows about architectures: it finds the decoder-layer list, and identifies each
layer's residual stream by data flow:

* walking back from the layer's output through the layer's own ``add`` nodes: each sum is
  flattened into its addends (any association and operand order), the addend that is an
  ancestor of all the others is the *stream*, and the others are *writes* into it; one
  write per sum is a sequential layer (Llama), two are parallel writes (GPT-NeoX, Cohere);
* each write is classified by the ops between it and the stream: ``topk`` → MoE, attention
  (``scaled_dot_product_attention`` / ``softmax``) → attention, otherwise MLP.

Pre-norm (Llama), branch-post-norm (OLMo2, Gemma3), Conv1D (GPT-2), parallel residual
(GPT-NeoX, Cohere) and MoE (Mixtral, Qwen-MoE, OLMoE) layers all reduce to this form. A layer that
does not is refused with a :class:`~looptool.errors.CaptureError` naming what was missing.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from looptool.errors import CaptureError
from looptool.graph import (
    FORM_PARALLEL,
    FORM_SEQUENTIAL,
    ROLE_ATTENTION,
    ROLE_EMBEDDING,
    ROLE_FINAL_NORM,
    ROLE_HEAD,
    ROLE_INPUT,
    ROLE_LAYER,
    ROLE_MLP,
    ROLE_MOE,
    ROLE_OUTPUT,
    ROLE_PARAM,
    ROLE_PROLOGUE,
    ROLE_RESIDUAL,
    ROLE_ROUTER,
    ROLE_SHAPE,
    LayerGraph,
    LayerInfo,
    SourceInfo,
    Write,
    annotate,
    annotation,
)

log = logging.getLogger(__name__)

_ADD_TARGETS = {torch.ops.aten.add.Tensor, operator.add}
_ATTENTION_TARGETS = {
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._softmax.default,
    torch.ops.aten.softmax.int,
}
_TOPK_TARGETS = {torch.ops.aten.topk.default}
NORM_TARGETS = {  # normalisation ops (also read by looptool.merge to find norm parameters)
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.layer_norm.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.rms_norm.default,
}
_MATMUL_TARGETS = {
    torch.ops.aten.linear.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.bmm.default,
}
_INPUT_NAMES = ("input_ids", "attention_mask")


def num_layers_of(config) -> int:
    """Number of decoder layers of a (possibly multimodal) HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise CaptureError(
            f"the model config ({type(config).__name__}) has no 'num_hidden_layers'; "
            "looptool needs a decoder-only causal LM."
        )
    return n


def hidden_size_of(config) -> int:
    """Hidden (residual stream) width of an HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def find_layers_path(model: nn.Module, num_layers: int) -> str:
    """Dotted path of the ``ModuleList`` that holds the decoder layers."""
    candidates = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers and name
    ]
    if not candidates:
        raise CaptureError(
            f"no ModuleList of {num_layers} decoder layers was found in "
            f"{type(model).__name__}; looptool supports decoder-only models whose layers "
            "live in one nn.ModuleList."
        )
    return min(candidates, key=lambda n: n.count("."))


def _module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, mod in model.named_modules() if mod is target), None)


def export_source(model: nn.Module, seq_len: int = 8, batch: int = 2) -> fx.GraphModule:
    """``torch.export`` the model's full-sequence forward (dynamic batch/sequence), unlifted.

    The returned GraphModule's parameters and buffers are the model's own tensor objects.
    """
    device = next(model.parameters()).device
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    dims = {0: Dim.AUTO, 1: Dim.AUTO}
    return _export(
        model,
        {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False},
        {"input_ids": dims, "attention_mask": dims, "use_cache": None},
    )


def moe_shape_of(config) -> tuple[int | None, int | None]:
    """``(routed experts, experts per token)`` of an HF MoE config; ``(None, None)`` if dense."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else (None, None)


def norm_eps_of(config) -> float | None:
    """The RMSNorm epsilon of an HF config, None where the layers use another norm."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    eps = getattr(text, "rms_norm_eps", None)
    return float(eps) if eps else None


def kv_shape_of(config) -> tuple[int, int]:
    """``(key/value heads, head dim)`` of one attention layer of an HF config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden_size_of(config) // heads
    return int(kv_heads), int(head_dim)


def export_decode_step(model: nn.Module, seq_len: int = 3, cache_len: int = 8, batch: int = 2) -> fx.GraphModule:
    """``torch.export`` one cached step of the model (prefill or decode), unlifted.

    The step is the way transformers' export-with-static-cache wrappers run a model: a
    ``StaticCache`` whose layers hold caller-owned tensors, written in place with
    ``index_copy_`` at ``cache_position`` (``T`` consecutive slots), and attention over
    all ``cache_len`` slots masked by a ``[batch, cache_len]`` attention mask. Inputs:
    ``input_ids [B, T]``, ``attention_mask [B, S]``, ``position_ids [B, T]``,
    ``cache_position [T]`` and ``2 * layers`` caches ``[B, kv_heads, S, head_dim]``
    (layer ``i``: keys ``caches_{2i}``, values ``caches_{2i+1}``); output: logits.
    """
    config = model.config.get_text_config()
    n_layers = num_layers_of(config)
    kv_heads, head_dim = kv_shape_of(config)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    caches = [torch.zeros(batch, kv_heads, cache_len, head_dim, dtype=dtype, device=device) for _ in range(2 * n_layers)]
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, cache_len, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq_len, device=device).expand(batch, seq_len),
        "cache_position": torch.arange(seq_len, device=device),
        "caches": caches,
    }
    # Named dims shared by all inputs: one batch, one step length, one cache length (per-input
    # AUTO dims would give every cache its own symbols, and export time grows with them).
    b, t, s = Dim("batch"), Dim("step"), Dim("cache_len")
    shapes = {
        "input_ids": {0: b, 1: t},
        "attention_mask": {0: b, 1: s},
        "position_ids": {0: b, 1: t},
        "cache_position": {0: t},
        "caches": [{0: b, 2: s}] * len(caches),
    }
    forward = type(model).forward
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

    def step(input_ids, attention_mask, position_ids, cache_position, caches):
        cache = _bind_static_cache(config, caches, cache_position)
        out = forward(model, input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=True, **{cache_kw: cache})
        return out.logits

    model.forward = step  # export traces the step with the model's own parameter names
    try:
        return _export(model, inputs, shapes)
    finally:
        del model.forward


class _CallerOwnedLayer(StaticLayer):
    """A static cache layer over caller-owned tensors that writes the step's keys/values
    at ``cache_position`` (no in-place position counter, so a layer copied by a looping
    pass writes the same slots as the original)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor):
        super().__init__(keys.shape[2])
        self.keys, self.values, self.positions = keys, values, cache_position
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = cache_position[0]  # the mask's query offset
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values


def _bind_static_cache(config, caches: list[torch.Tensor], cache_position: torch.Tensor) -> StaticCache:
    """A transformers ``StaticCache`` whose layers write into ``caches`` (full-length layers
    throughout: sliding windows are applied by the mask, as the export wrappers do)."""
    cache = StaticCache(config=config, max_cache_len=caches[0].shape[2])
    for i in range(len(cache.layers)):
        cache.layers[i] = _CallerOwnedLayer(caches[2 * i], caches[2 * i + 1], cache_position)
    return cache


def _export(model: nn.Module, kwargs: dict, dynamic_shapes: dict) -> fx.GraphModule:
    try:
        ep = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch.export raises many types; say which model failed
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})."
        ) from exc
    return ep.module()


def build_skeleton(config, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """The source architecture of ``config`` on ``meta`` (no weights), in eval mode."""
    import transformers

    kwargs: dict = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()


def capture(model: nn.Module, *, decode: bool = False) -> LayerGraph:
    """Capture ``model`` (an HF causal LM, on any device including ``meta``) as a LayerGraph.

    The graph is specialised to the model's dtype and device (export bakes both in). No weight is
    copied: the LayerGraph's module holds the model's own parameter tensors. With
    ``decode=True`` the graph is one cached step (:func:`export_decode_step`); its cache
    writes are marked ``kv`` and each cache input says which layer it serves.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise CaptureError(
            f"{type(model).__name__} has no Hugging Face 'config'; wrap a transformers "
            "causal LM (AutoModelForCausalLM) or pass a model directory."
        )
    was_training = model.training
    model.eval()
    try:
        exported = export_decode_step(model) if decode else export_source(model)
    finally:
        model.train(was_training)
    n_layers = num_layers_of(config)
    layers_path = find_layers_path(model, n_layers)
    head_path = _module_path(model, model.get_output_embeddings())
    module = _clean_module(exported, None if decode else _INPUT_NAMES)
    layers = annotate_graph(module.graph, layers_path, n_layers, head_path)
    if decode:
        annotate_cache(module.graph, n_layers)
    param = next(model.parameters())
    num_experts, experts_per_token = moe_shape_of(config)
    kv_heads, head_dim = kv_shape_of(config)
    source = SourceInfo(
        model_type=getattr(config, "model_type", type(model).__name__),
        dtype=str(param.dtype),
        device=str(param.device),
        attn_implementation=getattr(config, "_attn_implementation", None),
        num_layers=n_layers,
        hidden_size=hidden_size_of(config),
        layers_path=layers_path,
        norm_eps=norm_eps_of(config),
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    log.info("captured %s: %d layers, %d nodes", source.model_type, n_layers, len(module.graph.nodes))
    return LayerGraph(module=module, layers=layers, source=source, config=config)


def _clean_module(exported: fx.GraphModule, inputs: tuple[str, ...] | None) -> fx.GraphModule:
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
        env[node] = new.node_copy(node, lambda n: env[n])
    leaves = [leaf for leaf in _flatten(out_node.args[0]) if isinstance(leaf, fx.Node)]
    if len(leaves) != 1:
        raise CaptureError(
            f"the exported forward returned {len(leaves)} tensors; expected only the logits "
            "(looptool calls the model with use_cache=False)."
        )
    new.output(env[leaves[0]])
    _drop_noop_casts(new)
    new.eliminate_dead_code()
    gm = fx.GraphModule(exported, new)
    for graph in [gm.graph] + [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]:
        _device_neutral_histc(graph)
    return gm


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


def annotate_cache(graph: fx.Graph, n_layers: int) -> None:
    """Mark the KV cache of a decode-step graph: each ``caches_*`` input gets
    ``kv = {"layer", "kind"}`` and its in-place write (``index_copy_``) ``kv = kind``.

    Refuses a graph in which a cache is written more than once, read other than through
    its write (or for its size), or not written by exactly one decoder layer.
    """
    for node in graph.nodes:
        if node.op != "placeholder" or not str(node.target).startswith("caches_"):
            continue
        writes = [u for u in node.users if u.target is torch.ops.aten.index_copy_.default and u.args[0] is node]
        layers = {annotation(u).get("layer") for u in writes}
        readers = [u for u in node.users if u not in writes and annotation(u).get("role") != ROLE_SHAPE]
        if len(writes) != 1 or readers or None in layers:
            raise CaptureError(
                f"cached decoding: cache input '{node.target}' is not written exactly once by one "
                "decoder layer's attention; this architecture's cache layout is not supported."
            )
        index = int(str(node.target).split("_")[-1])
        kind = "k" if index % 2 == 0 else "v"
        ann = annotation(node)
        ann["kv"] = {"layer": layers.pop(), "kind": kind}
        annotation(writes[0])["kv"] = kind
    marked = sum(1 for n in graph.nodes if n.op == "placeholder" and "kv" in annotation(n))
    if marked != 2 * n_layers:
        raise CaptureError(f"cached decoding: found {marked} cache inputs for {n_layers} layers; expected {2 * n_layers}.")


CAST_TARGETS = {  # dtype/device casts (also read by looptool.merge)
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.device,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._to_copy.default,
}


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


def _layer_of(node: fx.Node, layers_path: str) -> int | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    prefix = layers_path + "."
    for path, _ in stack.values():
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _innermost_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]


def _is_ancestor(candidate: fx.Node, node: fx.Node, scope: set[fx.Node]) -> bool:
    """True if ``candidate`` feeds ``node`` through nodes of ``scope``."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp is candidate:
                return True
            if inp in scope and inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return False


def _branch_nodes(write: fx.Node, stream: fx.Node, scope: set[fx.Node]) -> set[fx.Node]:
    """Nodes of the layer between the stream value and a write (the branch computation)."""
    out = {write}
    todo = [write]
    while todo:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp is not stream and inp in scope and inp not in out:
                out.add(inp)
                todo.append(inp)
    return out


def _is_layer_add(node: fx.Node, scope: set[fx.Node], layer_module: str) -> bool:
    return (
        node in scope
        and node.op == "call_function"
        and node.target in _ADD_TARGETS
        and len(node.args) == 2
        and all(isinstance(a, fx.Node) for a in node.args)
        and not node.kwargs.get("alpha")
        and _innermost_path(node) == layer_module
    )


def _sum_tree(
    root: fx.Node, scope: set[fx.Node], layer_module: str
) -> tuple[list[tuple[fx.Node, fx.Node]], list[fx.Node]]:
    """Flatten the sum rooted at ``root``: ``(leaf, add that reads it)`` for every addend and
    the adds of the tree. An operand that is itself a layer add read only by this sum is
    expanded, so ``a + b + c`` is three addends in any association and operand order
    (``(h + A) + M``, Cohere; ``(M + A) + h``, GPT-NeoX; ``h + (A + M)``); an add read
    elsewhere too (the stream a later branch reads) stays a leaf."""
    leaves: list[tuple[fx.Node, fx.Node]] = []
    tree = [root]

    def visit(add: fx.Node) -> None:
        for arg in add.args:
            if _is_layer_add(arg, scope, layer_module) and len(arg.users) == 1:
                tree.append(arg)
                visit(arg)
            else:
                leaves.append((arg, add))

    visit(root)
    return leaves, tree


def _analyse_layer(index: int, nodes: list[fx.Node], layer_module: str) -> tuple[LayerInfo, dict, set]:
    scope = set(nodes)
    escaping = [n for n in nodes if any(u not in scope for u in n.users)]
    if len(escaping) != 1:
        names = ", ".join(n.name for n in escaping) or "none"
        raise CaptureError(
            f"layer {index} has {len(escaping)} values used outside it ({names}); looptool "
            "expects one residual-stream output per decoder layer."
        )
    output = escaping[0]
    residual_adds: list[fx.Node] = []
    steps: list[tuple[list[tuple[fx.Node, fx.Node]], fx.Node]] = []  # ([(write, add)], stream-before)
    stream = output
    while _is_layer_add(stream, scope, layer_module):
        leaves, tree = _sum_tree(stream, scope, layer_module)
        values = [leaf for leaf, _ in leaves]
        bases = [v for v in values if all(o is v or _is_ancestor(v, o, scope) for o in values)]
        if len(bases) != 1:
            break
        steps.append(([(leaf, add) for leaf, add in leaves if leaf is not bases[0]], bases[0]))
        residual_adds.extend(tree)
        stream = bases[0]
    if stream in scope or not steps:
        raise CaptureError(
            f"layer {index}: no residual stream was found (walking back from output "
            f"'{output.name}' did not reach the layer input through residual adds); this "
            "architecture's layer structure is not supported."
        )
    layer_input = stream
    form = FORM_PARALLEL if any(len(parts) > 1 for parts, _ in steps) else FORM_SEQUENTIAL
    writes: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (write, add, stream-before)
    for parts, base in reversed(steps):  # steps run output → input
        writes.extend((w, a, base) for w, a in parts)
    roles: dict[fx.Node, str] = {n: ROLE_LAYER for n in nodes}
    router_logits: set[fx.Node] = set()  # the router's logits matmul, for the balance loss
    infos: list[Write] = []
    for write, add, base in writes:
        branch = _branch_nodes(write, base, scope) - set(residual_adds)
        targets = {n.target for n in branch}
        if targets & _TOPK_TARGETS:
            kind = ROLE_MOE
        elif targets & _ATTENTION_TARGETS:
            kind = ROLE_ATTENTION
        else:
            kind = ROLE_MLP
        for n in branch:
            roles[n] = kind
        if kind == ROLE_MOE:
            router = _router_nodes(branch, write, layer_module)
            for n in router:
                roles[n] = ROLE_ROUTER
            matmuls = [n for n in nodes if n in router and n.target in _MATMUL_TARGETS]
            if matmuls:
                router_logits.add(matmuls[0])
        norm = _branch_norm(branch, base, layer_module)
        infos.append(Write(node=write.name, add=add.name, kind=kind, norm=norm.name if norm is not None else None))
    kinds = [w.kind for w in infos]
    if ROLE_ATTENTION not in kinds or len(set(kinds)) != len(kinds):
        raise CaptureError(
            f"layer {index}: expected one attention write and one MLP/MoE write into the "
            f"residual stream, found {kinds}; this layer structure is not supported."
        )
    for add in residual_adds:
        roles[add] = ROLE_RESIDUAL
    info = LayerInfo(
        index=index,
        nodes=tuple(n.name for n in nodes),
        input=layer_input.name,
        output=output.name,
        writes=tuple(infos),
        form=form,
    )
    return info, roles, router_logits


def _is_shape(node: fx.Node) -> bool:
    """Symbolic-size arithmetic: its value is a SymInt/int, not a tensor."""
    val = node.meta.get("val")
    return val is not None and not isinstance(val, torch.Tensor) and not (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)
    )


def _branch_norm(branch: set[fx.Node], stream: fx.Node, layer_module: str) -> fx.Node | None:
    """The output of the normalisation that a branch applies to the residual stream first
    (``input_layernorm`` of a pre-norm layer), or None when the branch reads the stream
    raw (OLMo2-style post-norm). A norm is a direct child module of the layer that reads
    the stream, normalises (rsqrt / layer_norm) and does no matmul."""
    readers = [n for n in stream.users if n in branch]
    paths = {_innermost_path(n) or "" for n in readers}
    if len(paths) != 1:
        return None
    path = paths.pop()
    if not path.startswith(layer_module + ".") or "." in path[len(layer_module) + 1:]:
        return None
    members = {n for n in branch if _innermost_path(n) == path}
    targets = {n.target for n in members}
    if not targets & NORM_TARGETS or targets & _MATMUL_TARGETS:
        return None
    outputs = [n for n in members if any(u in branch and u not in members for u in n.users)]
    return outputs[0] if len(outputs) == 1 else None


def _router_nodes(branch: set[fx.Node], write: fx.Node, layer_module: str) -> set[fx.Node]:
    """The MoE router: the nodes of the submodule that computes ``topk`` (expert indices and
    routing weights). Empty when the router is not a submodule of its own (then it cannot
    be told apart from the experts and route replay is refused)."""
    out: set[fx.Node] = set()
    for topk in (n for n in branch if n.target in _TOPK_TARGETS):
        path = _innermost_path(topk) or ""
        if not path.startswith(layer_module + ".") or (_innermost_path(write) or "").startswith(path):
            continue
        out |= {n for n in branch if (_innermost_path(n) or "") == path or (_innermost_path(n) or "").startswith(path + ".")}
    return out if write not in out else set()


def annotate_graph(
    graph: fx.Graph, layers_path: str, n_layers: int, head_path: str | None
) -> tuple[LayerInfo, ...]:
    """Annotate every node of a captured graph with layer and role; return the layer infos."""
    by_layer: dict[int, list[fx.Node]] = {i: [] for i in range(n_layers)}
    for node in graph.nodes:
        layer = _layer_of(node, layers_path)
        if layer is not None and node.op == "call_function" and not _is_shape(node):
            by_layer[layer].append(node)
    missing = [i for i, ns in by_layer.items() if not ns]
    if missing:
        raise CaptureError(
            f"no graph nodes were attributed to decoder layer(s) {missing[:5]}; the export "
            "lost the module structure needed to find them."
        )
    infos = []
    layer_roles: dict[fx.Node, tuple[str, int]] = {}
    logits_nodes: set[fx.Node] = set()
    for index, nodes in by_layer.items():
        info, roles, router_logits = _analyse_layer(index, nodes, f"{layers_path}.{index}")
        infos.append(info)
        layer_roles.update({n: (r, index) for n, r in roles.items()})
        logits_nodes |= router_logits
    for prev, nxt in zip(infos, infos[1:]):
        if nxt.input != prev.output:
            raise CaptureError(
                f"layer {nxt.index} does not read layer {prev.index}'s output; looptool "
                "needs the decoder layers to form one residual chain."
            )
    seen_layers = False
    for node in graph.nodes:
        if node in layer_roles:
            role, index = layer_roles[node]
            annotate(node, role, index, **({"router_logits": True} if node in logits_nodes else {}))
            seen_layers = True
        elif node.op == "placeholder":
            annotate(node, ROLE_INPUT, None)
        elif node.op == "get_attr":
            annotate(node, ROLE_PARAM, None)
        elif node.op == "output":
            annotate(node, ROLE_OUTPUT, None)
        elif _is_shape(node):
            annotate(node, ROLE_SHAPE, None)
        elif not seen_layers:
            is_embedding = node.target is torch.ops.aten.embedding.default
            annotate(node, ROLE_EMBEDDING if is_embedding else ROLE_PROLOGUE, None)
        else:
            path = _innermost_path(node)
            is_head = head_path is not None and path is not None and path.startswith(head_path)
            annotate(node, ROLE_HEAD if is_head else ROLE_FINAL_NORM, None)
    return tuple(infos)
