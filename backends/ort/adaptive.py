"""Per-token adaptive depth with onnxruntime: :meth:`Runtime.generate(..., budget="auto")
<looptool.backends.ort.runtime.Runtime.generate>`.

The decode loop is the PyTorch runtime's own (:func:`looptool.runtime.generation.decode_loop`);
its step is the engine's adaptive-depth graph (:mod:`looptool.backends.onnx.adaptive`, exported
with ``adaptive=True`` under last-loop KV), bound once like any graph
(:class:`~looptool.backends.ort.binding.CacheBinding`: every row's ``min_budget``, ``max_budget``
and ``exit_threshold`` bound for the whole call, its ``depth`` output into a buffer read after
each step). The graph runs every loop up to the batch's deepest ``max_budget`` and masks the rows
that stopped, so it saves depth (the cost a row is charged), not time.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from looptool.backends.errors import EngineError
from looptool.backends.onnx.adaptive import ADAPTIVE_KV
from looptool.backends.ort.binding import CacheBinding
from looptool.engine.budgets import PER_LOOP_AUTO, AutoRow, RowBudgets


def auto_policy(kv: str | None) -> str:
    """The KV policy of ``budget="auto"`` (None: ``"last-loop"``); one sentence for another."""
    kv = ADAPTIVE_KV[0] if kv is None else kv
    if kv not in ADAPTIVE_KV:
        raise EngineError(
            f"budget='auto' needs kv='last-loop', not {kv!r}: {PER_LOOP_AUTO}",
            parameter="kv",
        )
    return kv


def adaptive_generate(
    rt,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    kv: str | None,
    auto: dict,
    capacity: int,
    max_new_tokens: int,
    output_logits: bool = False,
    **loop,
):
    """Generate with adaptive depth on the engine of ``rt`` (a
    :class:`~looptool.backends.ort.runtime.Runtime`; ``ids`` and ``mask`` checked by the caller):
    ``auto`` holds ``min_budget``, ``max_budget``, ``exit_threshold`` and ``exit_rule`` as
    :meth:`~looptool.runtime.adaptive.AutoDepth.resolve` takes them (checked against the
    graph's menu), ``loop`` the decode loop's sampling, EOS and ``on_step`` arguments. The
    result's ``depths`` is ``[batch, new_tokens]``, the depth that produced each token."""
    from looptool.runtime.adaptive import AutoDepth
    from looptool.runtime.generation import decode_loop

    kv = auto_policy(kv)
    settings = AutoDepth.resolve(SimpleNamespace(budgets=rt.manifest.menu), **auto)  # the model's menu
    session = rt.adaptive_session(settings.exit_rule, kv)  # one sentence where the engine has no such graph
    entry = rt.manifest.adaptive_graph(settings.exit_rule, kv)
    batch = ids.shape[0]
    row = AutoRow(settings.min_budget, settings.max_budget, settings.exit_threshold)
    binding = CacheBinding(
        session,
        entry.cache,
        batch,
        capacity,
        rt.vocab_size,
        budgets=RowBudgets((settings.max_budget,) * batch, (row,) * batch),
    )
    depths: list[torch.Tensor] = []

    def step(*args) -> torch.Tensor:
        logits = binding.step(*args)
        depths.append(torch.from_numpy(binding.depth.copy()))  # the buffer is rewritten next step
        return logits

    out = decode_loop(
        step,
        ids,
        mask,
        capacity=capacity,
        max_new_tokens=max_new_tokens,
        mask_dtype=getattr(torch, str(rt.mask_dtype)),
        output_logits=output_logits,
        kv_bytes=binding.kv_bytes,
        **loop,
    )
    taken = depths[: out.new_tokens]
    return dataclasses.replace(
        out, depths=torch.stack(taken, dim=1) if taken else torch.zeros(batch, 0, dtype=torch.int64)
    )
