"""Parameter-group merging (task arithmetic) of looped models.

Accordion's post-training merges fine-tuned experts into a base model per parameter group:
for every group ``q`` and expert ``j``::

    theta_q = theta_base,q + sum_j lambda_{j,q} * (theta_j,q - theta_base,q)

computed in float32 (float64 tensors in float64) and cast back to the parameter's dtype. A
tensor whose lambdas are all 0 is the base tensor bit for bit; one whose only non-zero
lambda is a 1 is that expert's tensor bit for bit.

Parameter groups
----------------
Every parameter belongs to exactly one group of each of two families, read from the
captured graph's own annotations (never from parameter names, which are architecture
facts that live only in :mod:`looptool.capture`):

* **kind** (which computation reads the tensor): ``embed_head`` (embedding and LM head),
  ``attention``, ``mlp`` (dense MLPs and MoE experts), ``router`` (MoE routers), ``norm``
  (every normalisation's scale/shift: pre-, post-, q/k- and final norms) and ``loop``
  (the ``loop.*`` parameters the looping passes add: gates, ELR state update,
  conditioning);
* **block** (where on the depth axis): ``input`` (the embedding and the layers before the
  looped window / recurrent block), ``looped`` (the window / recurrent block), ``output``
  (the layers after it, the final norm, the head) and ``loop`` (the ``loop.*``
  parameters).

A parameter's kind is the role (:func:`looptool.core.graph.annotation`) of the graph nodes that
read it: embedding/head → ``embed_head``, attention → ``attention``, MLP/MoE → ``mlp``,
router → ``router``, final norm → ``norm``. A norm inside a layer has the role of the branch
it belongs to, so a parameter is a ``norm`` parameter when capture marked it as one (the
``NORM_PARAM_KEY`` annotation of its ``get_attr`` nodes, :mod:`looptool.capture.norms`:
every use is a normalisation's scale or shift). A tensor read by several branches takes the first of ``embed_head``, ``router``, ``attention``,
``mlp``; its block is the earliest block that reads it (tied embeddings are ``input``).
``loop.*`` parameters are recognised by their namespace (:attr:`LayerGraph.new_params`).

Lambda specs
------------
``VALUE`` (every group, every expert), ``GROUP=VALUE`` (that group, every expert),
``EXPERT:GROUP=VALUE`` (one expert, numbered from 0 in the order given) and
``EXPERT:VALUE`` (one expert, every group). ``GROUP`` is a kind, a block or
``BLOCK.KIND`` (``looped.attention``). For a parameter and an expert, the matching spec
with the most specific group wins (``BLOCK.KIND`` over a kind or a block, over every
group); at equal group specificity an expert's own spec beats an all-experts spec, and
after that the spec given last wins (so between a kind and a block, the later one). A
group that no spec matches keeps the base (lambda 0). At least one spec is required; a
spec naming a group that holds no parameter of the model is refused.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from looptool.core.errors import LooptoolError
from looptool.core.graph import (
    NORM_PARAM_KEY,
    ROLE_ATTENTION,
    ROLE_EMBEDDING,
    ROLE_FINAL_NORM,
    ROLE_HEAD,
    ROLE_INPUT,
    ROLE_MLP,
    ROLE_MOE,
    ROLE_PROLOGUE,
    ROLE_ROUTER,
    annotation,
)
from looptool.core.words import counted
from looptool.runtime.model import LoopedModel

KINDS = ("embed_head", "attention", "mlp", "router", "norm", "loop")
BLOCKS = ("input", "looped", "output", "loop")
LOOP = "loop"  # the kind and the block of the new loop.* parameters

_ROLE_KIND = {
    ROLE_EMBEDDING: "embed_head",
    ROLE_HEAD: "embed_head",
    ROLE_ROUTER: "router",
    ROLE_ATTENTION: "attention",
    ROLE_MLP: "mlp",
    ROLE_MOE: "mlp",
    ROLE_FINAL_NORM: "norm",
}
_BEFORE_LAYERS = (ROLE_EMBEDDING, ROLE_PROLOGUE, ROLE_INPUT)
_KIND_ORDER = ("embed_head", "router", "attention", "mlp", "norm")  # precedence for shared tensors
_SPEC = re.compile(r"^\s*(?:(?P<expert>[^:=]*):)?(?:(?P<group>[^:=]*)=)?(?P<value>[^:=]*)$")


class MergeError(LooptoolError, ValueError):
    """Models that cannot be merged, or lambda specs that cannot be applied."""


# ---------------------------------------------------------------------- groups
def _combined_groups() -> tuple[str, ...]:
    """The ``BLOCK.KIND`` groups (``loop.loop`` for the new parameters)."""
    return (*(f"{b}.{k}" for b in BLOCKS if b != LOOP for k in KINDS if k != LOOP), f"{LOOP}.{LOOP}")


def group_vocabulary() -> tuple[str, ...]:
    """Every group name a lambda spec may use: the kinds, the blocks and ``BLOCK.KIND``."""
    return (*KINDS, *(b for b in BLOCKS if b not in KINDS), *_combined_groups())


def parameter_groups(model: LoopedModel) -> dict[str, str]:
    """Parameter name → its group ``"BLOCK.KIND"`` (``"loop.loop"`` for the new ``loop.*``
    parameters), for every parameter of ``model`` (``named_parameters()``, tied names once).
    The kind is the part after the dot, the block the part before."""
    lg = model.layer_graph
    named = dict(model.named_parameters())
    by_id = {id(p): name for name, p in named.items()}
    all_names = dict(model.named_parameters(remove_duplicate=False))
    attrs: dict[str, list[fx.Node]] = {name: [] for name in named}  # the get_attr nodes of each parameter
    for node in lg.graph.nodes:
        if node.op == "get_attr" and node.target in all_names:
            attrs[by_id[id(all_names[node.target])]].append(node)
    added = {n for n, _ in model.new_parameters()} | {p.name for p in lg.new_params}  # the passes' loop.* namespace
    looped = looped_range(model)
    groups: dict[str, str] = {}
    for name in named:
        if name in added:
            groups[name] = f"{LOOP}.{LOOP}"
            continue
        nodes = [u for a in attrs[name] for u in a.users]
        if not nodes:
            raise MergeError(
                f"parameter '{name}' is read by no node of the captured graph, so it belongs to no "
                "parameter group; this model cannot be merged by groups."
            )
        kind = "norm" if all(annotation(a).get(NORM_PARAM_KEY) for a in attrs[name]) else _kind_of(name, nodes)
        groups[name] = f"{_block_of(nodes, *looped)}.{kind}"
    return groups


def looped_range(model: LoopedModel) -> tuple[int, int]:
    """``(start, stop)`` of the looped layers (the plan's :meth:`looped_layers`: the prefix
    window or the recurrent block)."""
    looped = model.plan.looped_layers()
    return looped.start, looped.stop


def group_sizes(model: LoopedModel) -> list[tuple[str, str, int, int]]:
    """``(family, group, tensors, scalars)`` for every non-empty group: the kinds, then the
    blocks, then the ``BLOCK.KIND`` groups, each in vocabulary order."""
    params = dict(model.named_parameters())
    groups = parameter_groups(model)
    rows = []
    for family, names in (("kind", KINDS), ("block", BLOCKS), ("block.kind", _combined_groups())):
        for group in names:
            members = [n for n, g in groups.items() if _matches(g, *_split_group(group))]
            if members:
                rows.append((family, group, len(members), sum(params[n].numel() for n in members)))
    return rows


def _kind_of(name: str, nodes: list[fx.Node]) -> str:
    kinds = {_ROLE_KIND.get(annotation(n).get("role")) for n in nodes} - {None}
    for kind in _KIND_ORDER:
        if kind in kinds:
            return kind
    roles = sorted({str(annotation(n).get("role")) for n in nodes})
    raise MergeError(
        f"parameter '{name}' is read only by nodes of role {', '.join(roles)}, which belong to no "
        "parameter group; this model cannot be merged by groups."
    )


def _block_of(nodes: list[fx.Node], start: int, stop: int) -> str:
    blocks = set()
    for node in nodes:
        ann = annotation(node)
        layer = ann.get("layer")
        if layer is None:  # outside the layers: the embedding before them, final norm and head after
            blocks.add("input" if ann.get("role") in _BEFORE_LAYERS else "output")
        else:
            blocks.add("input" if layer < start else "looped" if layer < stop else "output")
    return next(b for b in BLOCKS if b in blocks)


def _split_group(group: str | None) -> tuple[str | None, str | None]:
    """``(block, kind)`` of a group name; None for the part it leaves open."""
    if group is None:
        return None, None
    if "." in group:
        block, kind = group.split(".", 1)
        return block, kind
    if group in KINDS:
        return None, group  # "loop" is a kind and a block of the same parameters
    return group, None


def _matches(full: str, block: str | None, kind: str | None) -> bool:
    b, k = full.split(".", 1)
    return (block is None or block == b) and (kind is None or kind == k)


# ---------------------------------------------------------------------- lambda specs
@dataclass(frozen=True)
class LambdaSpec:
    """One parsed lambda spec: ``value`` for ``group`` (None: every group) of ``expert``
    (None: every expert); ``text`` is what the user wrote."""

    value: float
    group: str | None = None
    expert: int | None = None
    text: str = ""

    @property
    def specificity(self) -> int:
        """0 for every group, 1 for a kind or a block, 2 for ``BLOCK.KIND``."""
        if self.group is None:
            return 0
        return 2 if "." in self.group else 1

    def matches(self, group: str, expert: int) -> bool:
        """Whether this spec applies to expert ``expert`` on parameters of ``group`` (``BLOCK.KIND``)."""
        return (self.expert is None or self.expert == expert) and _matches(group, *_split_group(self.group))


def parse_lambdas(specs: Sequence[str], n_experts: int) -> tuple[LambdaSpec, ...]:
    """Parse lambda specs (``VALUE``, ``GROUP=VALUE``, ``EXPERT:GROUP=VALUE``,
    ``EXPERT:VALUE``) for ``n_experts`` experts; refuses an empty list, malformed specs,
    unknown groups and expert indices out of range, each in one sentence."""
    if isinstance(specs, str):
        specs = [specs]
    if not specs:
        raise MergeError(
            "give at least one lambda spec (e.g. lambdas=0.5 or lambdas=['looped=1']); groups no spec matches keep the "
            "base weights.",
            parameter="lambdas",
        )
    out = []
    for text in map(str, specs):
        m = _SPEC.match(text)
        if m is None or not m["value"].strip():
            raise _malformed(text)
        expert = None
        if m["expert"] is not None:
            if not re.fullmatch(r"\s*\d+\s*", m["expert"]):
                raise _malformed(text)
            expert = int(m["expert"])
        group = m["group"].strip() if m["group"] is not None else None
        out.append(
            _checked(LambdaSpec(value=_float(m["value"], text), group=group, expert=expert, text=text), n_experts)
        )
    return tuple(out)


def _checked(spec: LambdaSpec, n_experts: int) -> LambdaSpec:
    """``spec`` if its group is a known name and its expert index is in range."""
    text = spec.text or f"{spec.expert}:{spec.group}={spec.value}"
    if spec.group is not None and spec.group not in group_vocabulary():
        raise MergeError(
            f"lambda spec {text!r} names the unknown group {spec.group!r}; groups are the kinds "
            f"{', '.join(KINDS)}, the blocks {', '.join(BLOCKS)}, or BLOCK.KIND such as looped.attention."
        )
    if spec.expert is not None and not 0 <= spec.expert < n_experts:
        raise MergeError(
            f"lambda spec {text!r} names expert {spec.expert}, but there {'is' if n_experts == 1 else 'are'} "
            f"{n_experts} expert{'s' if n_experts != 1 else ''}, numbered from 0 in the order given."
        )
    if not math.isfinite(spec.value):
        raise MergeError(f"lambda spec {text!r} has a value that is not a finite number; use e.g. 0.5.")
    return spec


def resolve_lambda(specs: Sequence[LambdaSpec], group: str, expert: int) -> float:
    """The lambda of ``expert`` for parameters of ``group`` (``BLOCK.KIND``): the matching
    spec of the most specific group, an expert's own over an all-experts spec, the later over
    the earlier; 0 when none matches."""
    best, key = 0.0, None
    for index, spec in enumerate(specs):
        if spec.matches(group, expert):
            k = (spec.specificity, spec.expert is not None, index)
            if key is None or k > key:
                best, key = spec.value, k
    return best


def _float(raw: str, text: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise _malformed(text) from None


def _malformed(text: str) -> MergeError:
    return MergeError(
        f"lambda spec {text!r} is not VALUE, GROUP=VALUE or EXPERT:GROUP=VALUE (e.g. 0.5, looped.attention=1, 0:router=0.5)."
    )


def _as_specs(lambdas, n_experts: int) -> tuple[LambdaSpec, ...]:
    """The specs of :func:`merge`'s ``lambdas`` argument, parsed and checked."""
    if isinstance(lambdas, (int, float)) and not isinstance(lambdas, bool):
        items: list = [repr(float(lambdas))]
    elif isinstance(lambdas, Mapping):
        items = [f"{group}={value}" for group, value in lambdas.items()]
    elif isinstance(lambdas, (str, LambdaSpec)):
        items = [lambdas]
    else:
        items = list(lambdas)
    if not items:
        parse_lambdas([], n_experts)  # raises: at least one spec
    return tuple(
        _checked(item, n_experts) if isinstance(item, LambdaSpec) else parse_lambdas([item], n_experts)[0]
        for item in items
    )


# ---------------------------------------------------------------------- merge
def check_compatible(base: LoopedModel, expert: LoopedModel, label: str = "the expert") -> None:
    """Refuse an expert of another architecture, plan, dtype or parameter set than ``base``."""
    a, b = base.layer_graph.source, expert.layer_graph.source
    arch_a = (a.model_type, a.num_layers, a.hidden_size, a.layers_path)
    arch_b = (b.model_type, b.num_layers, b.hidden_size, b.layers_path)
    if arch_a != arch_b:
        raise MergeError(
            f"{label} is a {b.model_type} model with {counted(b.num_layers, 'layer')} of width {b.hidden_size}, the "
            f"base a {a.model_type} model with {counted(a.num_layers, 'layer')} of width {a.hidden_size}; merge only models converted "
            "from the same architecture."
        )
    if expert.plan != base.plan:
        raise MergeError(
            f"{label} was looped with {expert.plan}, the base with {base.plan}; merge only models converted with the same plan."
        )
    if a.dtype != b.dtype:
        raise MergeError(f"{label} is stored in {b.dtype}, the base in {a.dtype}; convert both in the same dtype.")
    mine, theirs = dict(base.named_parameters()), dict(expert.named_parameters())
    if mine.keys() != theirs.keys():
        extra, missing = sorted(theirs.keys() - mine.keys()), sorted(mine.keys() - theirs.keys())
        what = (
            f"has parameters the base lacks ({', '.join(extra[:3])})"
            if extra
            else f"lacks the base's parameters {', '.join(missing[:3])}"
        )
        raise MergeError(f"{label} {what}; merge only models with the same parameters.")
    for name, p in mine.items():
        if theirs[name].shape != p.shape:
            raise MergeError(
                f"parameter '{name}' has shape {tuple(theirs[name].shape)} in {label} but {tuple(p.shape)} in the base; "
                "merge only models of the same size."
            )


def merge(
    base: LoopedModel,
    experts: Sequence[LoopedModel],
    lambdas,
    *,
    labels: Sequence[str] | None = None,
) -> LoopedModel:
    """A new looped model ``theta_base + sum_j lambda_j (theta_j - theta_base)`` per parameter
    group (see the module docstring for groups and specs); ``base`` and ``experts`` are not
    modified. Buffers, graphs, config and tokenizer are the base's.

    ``lambdas``: a number (every group, every expert), a spec string, a mapping
    ``{GROUP: value}``, or a sequence of spec strings / :class:`LambdaSpec`. ``labels`` name
    the experts in error messages (default ``expert 0``, ``expert 1``, ...).
    """
    experts = list(experts)
    if not experts:
        raise MergeError("give at least one expert model to merge into the base.")
    labels = list(labels) if labels is not None else [f"expert {j}" for j in range(len(experts))]
    specs = _as_specs(lambdas, len(experts))
    for label, expert in zip(labels, experts):
        check_compatible(base, expert, label)
    groups = parameter_groups(base)
    present = set(groups.values())
    for spec in specs:
        if spec.group is not None and not any(_matches(g, *_split_group(spec.group)) for g in present):
            raise MergeError(
                f"lambda spec {spec.text or spec.group!r} names the group {spec.group!r}, which holds no parameter of "
                f"this model; its groups are {', '.join(_present_names(present))}."
            )
    expert_params = [dict(e.named_parameters()) for e in experts]
    memo: dict[int, object] = {id(base._paths): {}, id(base.derived): {}}
    if base.tokenizer is not None:
        memo[id(base.tokenizer)] = base.tokenizer  # shared, not copied
    with torch.no_grad():
        for name, p in base.named_parameters():
            weights = [resolve_lambda(specs, groups[name], j) for j in range(len(experts))]
            tensors = [params[name] for params in expert_params]
            merged = merge_tensor(p.detach(), tensors, weights)
            memo[id(p)] = nn.Parameter(merged, requires_grad=p.requires_grad)
    merged_model = copy.deepcopy(base, memo)
    merged_model._paths.clear()
    return merged_model


def merge_tensor(base: torch.Tensor, experts: Sequence[torch.Tensor], lambdas: Sequence[float]) -> torch.Tensor:
    """``base + sum_j lambdas[j] * (experts[j] - base)`` as a new tensor in ``base``'s dtype and
    device, computed in float32 (float64 for float64); exact copies where no arithmetic is
    needed (all lambdas 0: the base; one non-zero lambda of 1: that expert)."""
    active = [(t, lam) for t, lam in zip(experts, lambdas) if lam != 0.0]
    if not active:
        return base.clone()
    if len(active) == 1 and active[0][1] == 1.0:
        return active[0][0].detach().to(device=base.device, dtype=base.dtype, copy=True)
    dtype = torch.promote_types(base.dtype, torch.float32)
    b = base.to(dtype)
    acc = b.clone()
    for t, lam in active:
        acc.add_(t.detach().to(device=base.device, dtype=dtype) - b, alpha=lam)
    return acc.to(base.dtype)


# ---------------------------------------------------------------------- provenance
MERGE_CONFIG = "merge_config.json"  # beside the merged model, as mergekit writes its config


def merge_config(
    base: LoopedModel, specs: Sequence[LambdaSpec], *, base_path: str, expert_paths: Sequence[str]
) -> dict:
    """What a merge was made of, JSON-ready: the base and expert paths (expert ``j`` is
    ``experts[j]``), the lambda specs as given and parsed, and the lambda every ``BLOCK.KIND``
    group of ``base`` got from each expert. :func:`read_merge_config` reads it back."""
    from looptool.core.version import __version__

    n = len(expert_paths)
    return {
        "method": "task_arithmetic",
        "formula": "theta = theta_base + sum_j lambda_j (theta_j - theta_base), in float32, per parameter group",
        "looptool_version": __version__,
        "base": str(base_path),
        "experts": [str(path) for path in expert_paths],
        "lambdas": [
            {"text": spec.text, "value": spec.value, "group": spec.group, "expert": spec.expert} for spec in specs
        ],
        "lambda_by_group": {
            group: [resolve_lambda(specs, group, j) for j in range(n)]
            for family, group, _, _ in group_sizes(base)
            if family == "block.kind"
        },
    }


def merge_counts(base: LoopedModel, lambdas, n_experts: int) -> tuple[int, int]:
    """``(merged, total)`` tensors of a merge into ``base``: those some expert's lambda changes, of all."""
    specs, groups = _as_specs(lambdas, n_experts), parameter_groups(base)
    return sum(1 for g in groups.values() if any(resolve_lambda(specs, g, j) for j in range(n_experts))), len(groups)


def save_merge(merged: LoopedModel, directory, config: dict, *, overwrite: bool = False) -> None:
    """Save ``merged`` with its :func:`merge_config` as :data:`MERGE_CONFIG` beside it, atomically."""
    import json

    from looptool.storage.files import prepare_output_dir
    from looptool.storage.save import commit_model

    commit_model(merged, *prepare_output_dir(directory, overwrite), files={MERGE_CONFIG: json.dumps(config, indent=2)})


def read_merge_config(directory) -> tuple[dict, tuple[LambdaSpec, ...]]:
    """The :data:`MERGE_CONFIG` of a merged model directory and its lambda specs, rebuilt (so
    ``merge(base, experts, specs)`` reproduces the merge); one sentence when it is absent or
    unreadable."""
    import json
    from pathlib import Path

    path = Path(directory) / MERGE_CONFIG
    if not path.exists():
        raise MergeError(f"'{directory}' has no {MERGE_CONFIG}; it was not written by looptool merge.")
    try:
        config = json.loads(path.read_text())
        specs = tuple(
            _checked(
                LambdaSpec(value=float(s["value"]), group=s["group"], expert=s["expert"], text=s["text"]),
                len(config["experts"]),
            )
            for s in config["lambdas"]
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise MergeError(f"{path} could not be read ({type(exc).__name__}: {exc}); merge the models again.") from exc
    return config, specs


def _present_names(present: set[str]) -> list[str]:
    names = [k for k in KINDS if any(_matches(g, None, k) for g in present)]
    names += [b for b in BLOCKS if b not in names and any(_matches(g, b, None) for g in present)]
    return names + sorted(present - {f"{LOOP}.{LOOP}"})
