"""The looped network: shared parameters plus one FX graph per budget, its forward at any
budget and its cost model.

It holds no file format and no decoding loop: the decode graphs, the decoding loop and the
saved format (:mod:`looptool.runtime.decode_graphs`, :mod:`~looptool.runtime.generation`,
:mod:`looptool.storage`) work on a :class:`LoopedNetwork`, and
:class:`looptool.runtime.model.LoopedModel` adds the Hugging Face-style ``generate`` and
``save_pretrained`` on top of them, so every import runs one way. Whatever those modules keep
with a network lives in :attr:`LoopedNetwork.derived`.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import torch
import torch.fx as fx
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from looptool.core.errors import LooptoolError, PassError
from looptool.core.graph import (
    ROLE_HEAD,
    ROLE_MOE,
    LayerGraph,
    NewParam,
    annotation,
    dtype_from_str,
    shared_graph_module,
)
from looptool.core.plan import BudgetCost, LoopPlan, ModelDims, cost_table
from looptool.passes import PassManager
from looptool.passes.checkpoint import bind_regions
from looptool.passes.exit_gate import gated_depths
from looptool.passes.router_outputs import router_logit_nodes
from looptool.runtime.devices import resolve_device

log = logging.getLogger(__name__)


class LoopedNetwork(nn.Module):
    """A looped decoder: the source's parameters (shared, never copied), the new ``loop.*``
    parameters, and one straight-line FX graph per budget.

    ``model(input_ids, attention_mask=None, labels=None, budget=k)`` returns a Hugging
    Face ``CausalLMOutputWithPast`` (``.logits``, ``.loss`` when ``labels`` are given,
    shifted next-token cross-entropy ignoring ``-100`` as HF does).
    """

    def __init__(self, layer_graph: LayerGraph, tokenizer=None):
        super().__init__()
        if not layer_graph.paths or layer_graph.plan is None:
            raise PassError("the layer graph has no budget paths; run a looping pass before building a LoopedModel.")
        lg = layer_graph
        for name, child in lg.module.named_children():
            self.add_module(name, child)
        for node in lg.graph.nodes:  # top-level tensor constants of the export, if any
            if node.op == "get_attr" and "." not in node.target and not hasattr(self, node.target):
                self.register_buffer(node.target, getattr(lg.module, node.target), persistent=False)
        param = next(lg.module.parameters())
        self.loop = _build_new_params(lg.new_params, param.dtype, param.device)
        self.layer_graph = lg
        self.config = lg.config
        self.tokenizer = tokenizer
        self._paths: dict[tuple, fx.GraphModule] = {}
        self.activation_checkpointing = False
        self.compile_options: dict | None = None  # set by compile(): paths are torch.compile'd
        # each layer application runs as a call of its source layer module (FSDP2 hooks fire)
        self.shard_layers = False
        self._mask_dtype = dtype_from_str(lg.source.mask_dtype)
        # Artefacts other modules build from this model and keep with it (the decode graphs of
        # looptool.runtime.decode_graphs): the model does not know what they are; it drops them
        # when it moves.
        self.derived: dict[str, object] = {}

    # ------------------------------------------------------------------ structure
    @property
    def mask_dtype(self) -> torch.dtype:
        """The attention-mask dtype the captured graphs were traced with."""
        return self._mask_dtype

    @property
    def plan(self) -> LoopPlan:
        """The resolved loop plan."""
        return self.layer_graph.plan

    @property
    def budgets(self) -> tuple[int, ...]:
        """The budget menu, shallowest first."""
        return tuple(sorted(self.layer_graph.paths))

    @property
    def exit_gates(self) -> tuple[int, ...]:
        """The depths with a learned exit head (:mod:`looptool.passes.exit_gate`; empty: none)."""
        return gated_depths(self.layer_graph)

    @property
    def default_budget(self) -> int:
        """The budget used when ``forward`` is called without one: the deepest."""
        return self.budgets[-1]

    @property
    def recipe(self) -> tuple[tuple[str, dict], ...]:
        """The ``(pass name, config)`` steps that built this model, replayed on load."""
        return self.layer_graph.recipe

    def path(
        self, budget: int, *, router_logits: bool = False, exits: bool = False, gates: bool = False
    ) -> fx.GraphModule:
        """The GraphModule of one budget; built on first use, sharing this model's tensors.

        With ``router_logits=True`` the path also returns every MoE router evaluation's
        logits (after the LM logits), in execution order, for a load-balancing loss. With
        ``exits=True`` (ELR only) it returns the logits at loop exits ``1..k-1`` right after
        the LM logits (see :func:`looptool.passes.recurrent_loop.with_exit_outputs`). With
        ``gates=True`` it returns, last, the learned exits' logits ``z_d`` (``[batch, seq]``) of
        each gated depth ``d < budget`` (:func:`looptool.passes.exit_gate.with_gate_outputs`).
        Each is a pass (``router_outputs``, ``checkpoint``, ``exit_outputs``,
        ``exit_gate_outputs``) run by the PassManager on this budget's path alone.
        """
        budget = self.check_budget(budget)
        if exits and not self.plan.has_loop_exits:
            raise LooptoolError(f"intermediate loop exits exist only in ELR models; this one is {self.plan.kind}.")
        if gates and not self.exit_gates:
            raise LooptoolError("this model has no learned exit gates; add them with exit_gate=True.")
        key = (budget, router_logits, exits, gates, self.activation_checkpointing, self.shard_layers)
        if key not in self._paths:
            steps: list[tuple[str, dict]] = [("router_outputs", {})] if router_logits else []
            if self.activation_checkpointing or self.shard_layers:
                steps.append(
                    ("checkpoint", {"checkpoint": self.activation_checkpointing, "shard_layers": self.shard_layers})
                )
            if exits:
                steps.append(("exit_outputs", {}))
            if gates:
                steps.append(("exit_gate_outputs", {}))
            lg = self.layer_graph.replace(paths={budget: self.layer_graph.paths[budget]})
            graph = (PassManager(steps)(lg) if steps else lg).paths[budget]
            gm = bind_regions(shared_graph_module(self, graph), self)
            self._paths[key] = gm if self.compile_options is None else _Compiled(gm, self.compile_options, budget)
        return self._paths[key]

    # ------------------------------------------------------------------ placement
    def to(self, *args, **kwargs) -> Self:
        """Move the model to another device: parameters move in place (still one copy) and
        the budget paths are retargeted, since a captured graph bakes its device in. A dtype
        change is refused: the graphs are specialised to the capture dtype."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        current = self._device()
        if dtype is not None and dtype != dtype_from_str(self.layer_graph.source.dtype):
            raise LooptoolError(
                f"a looped model cannot change dtype in place ({self.layer_graph.source.dtype} → {dtype}): its "
                "graphs are specialised to the dtype they were captured in; make a copy rebuilt in that dtype with "
                f"looptool.cast(model, {dtype}) (or looptool.load(directory, dtype={dtype})), or use "
                "torch.autocast for mixed precision."
            )
        if device is None or torch.device(device) == current:
            return self
        target = resolve_device(device)
        super().to(target, non_blocking=non_blocking)
        return self.retarget(target)

    def retarget(self, device: torch.device | str) -> Self:
        """Point the budget paths at ``device`` (the graphs bake their device in) without
        moving any tensor: for callers that moved the parameters themselves (FSDP2)."""
        current, target = self._device(), torch.device(device)
        if target != current:
            self.layer_graph = PassManager([("retarget_device", {"to": str(target), "from": str(current)})])(
                self.layer_graph
            )
            for name, child in self.layer_graph.module.named_children():
                if isinstance(child, fx.GraphModule):  # higher-order op bodies were retargeted as new objects
                    self._modules[name] = child
            self._paths.clear()
            self.derived.clear()  # built for the old device
        return self

    def cuda(self, device: int | torch.device | None = None) -> Self:
        """``to("cuda")`` (or ``cuda:N``)."""
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def cpu(self) -> Self:
        """``to("cpu")``."""
        return self.to("cpu")

    def half(self) -> Self:
        """``to(torch.float16)``: a no-op in that dtype, refused otherwise."""
        return self.to(dtype=torch.float16)

    def bfloat16(self) -> Self:
        """``to(torch.bfloat16)``: a no-op in that dtype, refused otherwise."""
        return self.to(dtype=torch.bfloat16)

    def float(self) -> Self:
        """``to(torch.float32)``: a no-op in that dtype, refused otherwise."""
        return self.to(dtype=torch.float32)

    def double(self) -> Self:
        """``to(torch.float64)``: a no-op in that dtype, refused otherwise."""
        return self.to(dtype=torch.float64)

    def _device(self) -> torch.device:
        return torch.device(self.layer_graph.source.device)

    def compile(self, **options) -> None:
        """``torch.compile`` each budget path when it is first used (``options`` go to
        ``torch.compile``); a path whose compilation fails falls back to eager with a warning."""
        self.compile_options = dict(options)
        self._paths.clear()

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each layer application's activations in backward (one checkpointed
        region per execution of a layer, so memory stops growing with depth); exact."""
        self.activation_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Keep every activation for backward again (the default)."""
        self.activation_checkpointing = False

    def router_logits_weights(self, budget: int) -> tuple[int, ...]:
        """How many loops each router evaluation of ``path(budget, router_logits=True)``
        stands for: ``k`` for a route-replayed router of the recurrent block (its auxiliary
        loss is counted once and scaled by ``k``, ELR Sec. 3.4), else 1."""
        budget = self.check_budget(budget)
        plan = self.plan
        replayed = set()
        if getattr(plan, "route_replay", False):
            replayed = set(range(*plan.recurrent))
        return tuple(
            budget if annotation(n).get("layer") in replayed else 1
            for n in router_logit_nodes(self.layer_graph.paths[budget])
        )

    def check_budget(self, budget: int | None) -> int:
        """Validate a budget (None → the default) and return it."""
        if budget is None:
            return self.default_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget not in self.layer_graph.paths:
            raise LooptoolError(
                f"budget {budget!r} is not in this model's budget menu {list(self.budgets)}; pick one of those."
            )
        return budget

    def no_decay_parameter_names(self) -> set[str]:
        """Names of parameters that take no weight decay (tagged by the passes)."""
        return {p.name for p in self.layer_graph.new_params if p.no_decay}

    def gate_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The new parameters the passes declared as gates (``NewParam.gate``: prefix-loop
        gates, the ELR exit gate), found by that declaration, not by name."""
        params = dict(self.named_parameters())
        return [(spec.name, params[spec.name]) for spec in self.layer_graph.new_params if spec.gate]

    def new_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters the passes added (``loop.*``)."""
        for name, p in self.named_parameters():
            if name.startswith("loop."):
                yield name, p

    # ------------------------------------------------------------------ compute
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        budget: int | None = None,
        output_router_logits: bool = False,
        output_exit_logits: bool = False,
        output_exit_gates: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Run the budget-``budget`` path; HF-style output with ``logits`` (and ``loss``).

        ``output_router_logits=True`` adds ``router_logits`` (one tensor per router
        evaluation; weights in :meth:`router_logits_weights`). ``output_exit_logits=True``
        (ELR) adds ``exit_logits``: the logits at loop exits ``1..k-1`` of budget ``k``.
        ``output_exit_gates=True`` adds ``exit_gate_logits``: the learned exits' logits (float32
        ``[batch, seq]``) at each gated depth below the budget (:attr:`exit_gates`).
        """
        loss_kwargs = _check_forward_kwargs(kwargs, input_ids)
        budget = self.check_budget(budget)
        gm = self.path(budget, router_logits=output_router_logits, exits=output_exit_logits, gates=output_exit_gates)
        if input_ids.dim() != 2:
            raise LooptoolError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=self._mask_dtype)
        else:
            attention_mask = attention_mask.to(self._mask_dtype)
        out = gm(input_ids, attention_mask)
        out = tuple(out) if output_router_logits or output_exit_logits or output_exit_gates else (out,)
        logits, rest = out[0], out[1:]
        gate_logits = None
        if output_exit_gates:
            n_gates = sum(d < budget for d in self.exit_gates)
            gate_logits, rest = tuple(rest[len(rest) - n_gates :]), rest[: len(rest) - n_gates]
        exit_logits = None
        if output_exit_logits:
            n_exits = budget - 1
            exit_logits, rest = tuple(rest[:n_exits]), rest[n_exits:]
        loss = None
        if labels is not None:
            # imported here: transformers' loss package imports scipy.optimize (~0.5 s of every
            # `import looptool`) for losses a causal LM never uses
            from transformers.loss.loss_utils import ForCausalLMLoss

            loss = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], **loss_kwargs)
        if output_exit_logits or output_exit_gates:
            return LoopedCausalLMOutput(
                loss=loss,
                logits=logits,
                router_logits=rest if output_router_logits else None,
                exit_logits=exit_logits,
                exit_gate_logits=gate_logits,
            )
        if output_router_logits:
            return MoeCausalLMOutputWithPast(loss=loss, logits=logits, router_logits=rest)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # ------------------------------------------------------------------ cost model
    def dims(self) -> ModelDims:
        """Model dimensions for the cost model (from the graph's parameter use and config)."""
        return model_dims(self.layer_graph, self)

    def cost_table(self) -> list[BudgetCost]:
        """Per-budget layer executions, FLOPs/token and KV bytes/token (Accordion Eq. 6)."""
        return cost_table(self.plan, self.dims())

    def added_parameter_count(self) -> int:
        """Number of scalars the passes added."""
        return sum(p.numel() for _, p in self.new_parameters())


# Hugging Face forward arguments: passed to the loss, accepted at their no-op value, or refused
_LOSS_KWARGS = frozenset({"num_items_in_batch", "ignore_index"})
_NO_OP_KWARGS = {
    "use_cache": (None, False),
    "return_dict": (None, True),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "past_key_values": (None,),
    "inputs_embeds": (None,),
    "cache_position": (None,),
    "logits_to_keep": (None, 0),
}


def _check_forward_kwargs(kwargs: dict, input_ids: torch.Tensor) -> dict:
    """The loss arguments among ``forward``'s extra keyword arguments; every other argument
    must be one the captured path already implies (``position_ids`` equal to
    ``0..seq-1``, ``use_cache=False``, ...), else one sentence refuses it."""
    for name, value in kwargs.items():
        if name in _LOSS_KWARGS:
            continue
        if name == "position_ids":
            if value is None:
                continue
            expected = torch.arange(input_ids.shape[-1], device=value.device)
            if value.shape[-1] == input_ids.shape[-1] and bool((value == expected).all()):
                continue
            raise LooptoolError(
                "position_ids other than 0..seq-1 are not supported by the captured budget paths "
                "(they derive positions from the sequence); use model.generate for left-padded "
                "batches, or drop position_ids."
            )
        if name in _NO_OP_KWARGS:
            if any(value is ok or (ok is not None and value == ok) for ok in _NO_OP_KWARGS[name]):
                continue
            raise LooptoolError(
                f"{name}={value!r} is not supported by LoopedModel.forward: a budget path returns "
                f"logits (and the loss) of a whole sequence, without a KV cache; drop {name} "
                "(model.generate decodes with a cache)."
            )
        raise LooptoolError(
            f"LoopedModel.forward got an unsupported argument {name!r}; it takes input_ids, "
            "attention_mask, labels, budget, output_router_logits, output_exit_logits, output_exit_gates and the "
            "loss arguments num_items_in_batch and ignore_index."
        )
    return {k: v for k, v in kwargs.items() if k in _LOSS_KWARGS}


@dataclass
class LoopedCausalLMOutput(MoeCausalLMOutputWithPast):
    """``MoeCausalLMOutputWithPast`` plus ``exit_logits``: the LM logits at loop exits
    ``1..k-1`` of an ELR budget-``k`` path (intermediate-exit loss), and ``exit_gate_logits``:
    the learned exits' logits at the gated depths below the budget."""

    exit_logits: tuple[torch.Tensor, ...] | None = None
    exit_gate_logits: tuple[torch.Tensor, ...] | None = None


class _Compiled:
    """A budget path compiled with ``torch.compile`` on its first call; if compilation
    fails there, a warning names the error and the eager path is used from then on."""

    def __init__(self, gm: fx.GraphModule, options: dict, budget: int):
        self.eager = gm
        self.budget = budget
        self.fn = torch.compile(gm, **options)
        self.checked = False

    @property
    def graph(self) -> fx.Graph:
        return self.eager.graph

    def __call__(self, *args):
        if self.checked:
            return self.fn(*args)
        try:
            out = self.fn(*args)
        except Exception as exc:  # torch.compile raises many types; eager still works
            log.warning(
                "torch.compile failed for budget %s (%s: %s); running it eagerly",
                self.budget,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
            self.fn = self.eager
            out = self.fn(*args)
        self.checked = True
        return out


def _build_new_params(specs: tuple[NewParam, ...], dtype: torch.dtype, device: torch.device) -> nn.Module:
    root = nn.Module()
    for spec in specs:
        parts = spec.name.split(".")
        if parts[0] != "loop":
            raise PassError(f"new parameter {spec.name!r} is outside the 'loop.' namespace.")
        mod = root
        for part in parts[1:-1]:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(parts[-1], nn.Parameter(_initial_value(spec, dtype, device)))
    return root


def _initial_value(spec: NewParam, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new parameter's initial value; "normal" draws from a generator seeded by the name,
    so conversion is deterministic."""
    if spec.init in ("zeros", "fill"):
        value = spec.value if spec.init == "fill" else 0.0
        return torch.full(spec.shape, value, dtype=dtype, device=device)
    if spec.init == "normal":
        gen = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
        values = torch.randn(spec.shape, generator=gen, dtype=torch.float32) * spec.value
        return values.to(dtype=dtype, device=device)
    raise PassError(f"unknown init {spec.init!r} for {spec.name}.")


def model_dims(lg: LayerGraph, module: nn.Module) -> ModelDims:
    """FLOPs/token per layer = 2 x the parameters the layer's nodes read (MoE expert
    tensors scaled by top-k / experts); fixed FLOPs = 2 x the LM head; KV from config."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(dict(module.named_buffers(remove_duplicate=False)))
    experts, top_k = lg.source.num_experts, lg.source.experts_per_token
    nodes = lg.node_map()

    def flops_of(node_names) -> float:
        total = 0.0
        seen = set()
        for name in node_names:
            node = nodes[name]
            for inp in node.all_input_nodes:
                if inp.op != "get_attr" or inp.target in seen:
                    continue
                seen.add(inp.target)
                t = tensors.get(inp.target)
                if t is None or not t.is_floating_point():
                    continue
                n = t.numel()
                if (
                    experts
                    and top_k
                    and annotation(node).get("role") == ROLE_MOE
                    and t.dim() >= 2
                    and t.shape[0] == experts
                ):
                    n = n * top_k / experts
                total += 2.0 * n
        return total

    layer_flops = tuple(flops_of(info.nodes) for info in lg.layers)
    head_nodes = [n.name for n in lg.graph.nodes if annotation(n).get("role") == ROLE_HEAD]
    fixed = flops_of(head_nodes)
    kv_heads, head_dim = lg.source.kv_heads, lg.source.head_dim
    itemsize = dtype_from_str(lg.source.dtype).itemsize
    unique = {id(t): t for t in tensors.values()}
    param_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    return ModelDims(
        num_layers=len(lg.layers),
        layer_flops=layer_flops,
        fixed_flops=fixed,
        kv_bytes_per_layer=2 * kv_heads * head_dim * itemsize,
        param_bytes=param_bytes,
        hidden_size=lg.source.hidden_size,
    )
