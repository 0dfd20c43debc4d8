"""Self-speculative decoding with onnxruntime: :meth:`Runtime.generate(...,
draft_budget=j, draft_tokens=n) <looptool.backends.ort.runtime.Runtime.generate>`.

The draft-verify loop is the PyTorch runtime's own
(:func:`looptool.runtime.speculative.speculative_loop`); here its steps are three graphs of an
engine exported with ``speculative=True``: budget ``k``'s serving graph runs the prefill, budget
``j``'s drafts one token at a time, and budget ``k``'s verify graph
(:mod:`looptool.backends.onnx.speculative`: logits at every position) scores the last accepted
token and the ``n`` drafts in one step. All three read and write ONE set of numpy cache buffers,
budget ``k``'s pairs: the draft graph's pairs are a subset of them, matched by ``(layer,
execution)`` (per-loop KV: a pair per attention execution), and bound as views of the same
buffers, so the draft reads the keys and values budget ``k`` wrote for every accepted token and
the verify step rewrites every slot the draft wrote. When a round would pass the end of the
buffers the loop grows them (keeping their first positions) and every graph is bound again.
"""

from __future__ import annotations

import dataclasses

import torch

from looptool.backends.errors import EngineError
from looptool.backends.ort.binding import CacheBinding
from looptool.engine.interface import with_length
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.engine.speculation import Speculation


def draft_pairs(target, draft) -> list[int]:
    """For each cache pair of the ``draft`` layout, the index of the same ``(layer, execution)``
    among the ``target`` layout's pairs; one sentence where a pair is missing."""
    index = {(p.layer, p.execution): i for i, p in enumerate(target.pairs)}
    missing = [p for p in draft.pairs if (p.layer, p.execution) not in index]
    if missing:
        raise EngineError(
            f"the draft graph's cache pair (layer {missing[0].layer}, execution {missing[0].execution}) is not one of "
            "the verified budget's pairs, so the draft cannot share its cache.",
            parameter="draft_budget",
        )
    return [index[p.layer, p.execution] for p in draft.pairs]


def speculative_generate(
    rt,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    budget: int,
    speculation: Speculation,
    capacity: int,
    max_new_tokens: int,
    kv: str = "per-loop",
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step=None,
    output_logits: bool = False,
):
    """Generate at ``budget`` with drafts from ``speculation.budget`` on the engine of ``rt`` (a
    :class:`~looptool.backends.ort.runtime.Runtime`; ``speculation`` checked, ``ids`` and ``mask``
    checked by the caller); arguments and result as :meth:`Runtime.generate`'s, the result's
    ``speculation`` counting the drafts. The caches start at ``capacity`` positions, at least
    what a round past the last new token needs."""
    from looptool.runtime.speculative import speculative_loop

    k, j, n = budget, speculation.budget, speculation.tokens
    verify = rt.verify_session(k, kv)  # one sentence where the engine has no verify graph for k
    target, drafter = rt.layout(k, kv), rt.layout(j, kv)
    if rt.verify_layout(k, kv) != target:
        raise EngineError(
            f"the verify graph of budget {k} ({kv}) has another cache layout than budget {k}'s graph; export the "
            "engine again."
        )
    picks = draft_pairs(target, drafter)
    batch = ids.shape[0]
    capacity = max(capacity, ids.shape[1] + max_new_tokens + n + 1)
    # budget k's graph allocates the buffers (it runs the prefill only, before any resize)
    bound = {"prefill": CacheBinding(rt.session(k, kv), target, batch, capacity, rt.vocab_size)}
    caches = bound["prefill"].caches
    draft = rt.session(j, kv)

    def bind() -> None:
        """Bind the draft and the verify graph over the current buffers."""
        length = caches[0].shape[2]
        shared = [caches[2 * i + kind] for i in picks for kind in (0, 1)]
        bound["draft"] = CacheBinding(draft, drafter, batch, length, rt.vocab_size, caches=shared)
        bound["verify"] = CacheBinding(verify, target, batch, length, rt.vocab_size, caches=caches, steps=n + 1)

    def resize(length: int) -> None:
        caches[:] = [with_length(c, length, dim=2) for c in caches]
        bind()

    def step(name: str, last: bool):
        def run(*args) -> torch.Tensor:
            logits = bound[name].run(*args)
            return torch.from_numpy((logits[:, -1] if last else logits).copy())  # the buffer is reused

        return run

    bind()
    out = speculative_loop(
        step("prefill", True),
        step("draft", True),
        step("verify", False),
        resize,
        ids,
        mask,
        capacity=capacity,
        speculation=speculation,
        max_new_tokens=max_new_tokens,
        mask_dtype=getattr(torch, str(rt.mask_dtype)),
        sampling=sampling,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        on_step=on_step,
        output_logits=output_logits,
        kv_bytes=lambda: sum(c.nbytes for c in caches),
    )
    return dataclasses.replace(out, budgets=(k,) * batch, row_costs=rt.manifest.row_costs((k,) * batch))
