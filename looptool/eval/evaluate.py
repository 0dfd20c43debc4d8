"""Per-budget evaluation: held-out loss and perplexity, share of the endpoint gain,
latency measured side by side, and the quality-against-cost plot."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import torch

from looptool.eval.timing import interleaved
from looptool.runtime.devices import device_of
from looptool.runtime.model import LoopedModel
from looptool.train.data import PackedTokens, find_files, tokenize_files

log = logging.getLogger(__name__)


@torch.inference_mode()
def mean_loss(
    forward: Callable[[torch.Tensor], torch.Tensor], data: PackedTokens, batch: int, device: torch.device | str = "cpu"
) -> float:
    """Token-weighted mean next-token loss of ``forward(ids) -> loss`` over all rows, in order
    (batches are moved to ``device``)."""
    total, count = 0.0, 0
    for start in range(0, len(data), batch):
        ids = torch.stack([data.row(i) for i in range(start, min(start + batch, len(data)))]).to(device)
        loss = forward(ids)
        n = ids.numel() - ids.shape[0]  # predicted positions
        total += float(loss) * n
        count += n
    return total / count


def evaluate(
    model: LoopedModel,
    data: str | Sequence[str],
    *,
    seq_len: int = 512,
    max_tokens: int = 65536,
    batch: int = 4,
    source=None,
    timing_rounds: int = 3,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Evaluate every budget of ``model`` (and ``source``, an HF causal LM, if given)."""
    tokens = tokenize_files(find_files(data), model.tokenizer)[:max_tokens]
    packed = PackedTokens(tokens, seq_len)
    budgets = model.budgets
    device = device_of(model)
    losses: dict[int, float] = {}
    for k in budgets:
        if on_progress:
            on_progress(f"loss at budget {k}")
        losses[k] = mean_loss(lambda ids, k=k: model(ids, labels=ids, budget=k).loss, packed, batch, device)
    source_loss = None
    if source is not None:
        if on_progress:
            on_progress("loss of the source model")
        source_loss = mean_loss(lambda ids: source(input_ids=ids, labels=ids).loss, packed, batch, device_of(source))
    if on_progress:
        on_progress("latency, interleaved")
    ids = packed.row(0).unsqueeze(0).to(device)
    timings = interleaved(
        {k: functools.partial(model, ids, budget=k) for k in budgets}, repeats=timing_rounds, warmup=1
    )
    costs = {c.budget: c for c in model.cost_table()}
    shallow = budgets[0]
    shares = gain_shares(losses)
    rows = []
    for k in budgets:
        rows.append(
            {
                "budget": k,
                "loss": losses[k],
                "ppl": math.exp(losses[k]),
                "delta_vs_shallowest": losses[k] - losses[shallow],
                "share_of_endpoint_gain": shares[k],
                "latency": timings[k].as_dict(),
                "latency_ratio": timings[k].median / timings[shallow].median,
                "ideal_layer_ratio": costs[k].layer_executions / costs[shallow].layer_executions,
                "ideal_flops_ratio": costs[k].relative_flops,
                "tokens_per_s": seq_len / timings[k].median,
            }
        )
    return {
        "tokens": packed.tokens.numel(),
        "sequences": len(packed),
        "seq_len": seq_len,
        "endpoint_gain": losses[shallow] - losses[budgets[-1]],
        "source_loss": source_loss,
        "source_ppl": math.exp(source_loss) if source_loss is not None else None,
        "budgets": rows,
    }


# Below this many nats the deepest budget's improvement is noise: there is no gain to share.
MIN_ENDPOINT_GAIN = 1e-4


def gain_shares(losses: dict[int, float]) -> dict[int, float | None]:
    """Each budget's share of the endpoint gain, ``(loss_0 - loss_k) / (loss_0 - loss_deepest)``
    over budgets in increasing order; every share is ``None`` when the deepest budget does
    not improve on the shallowest by more than :data:`MIN_ENDPOINT_GAIN` (no gain to share)."""
    budgets = sorted(losses)
    shallow, deep = budgets[0], budgets[-1]
    endpoint_gain = losses[shallow] - losses[deep]
    if endpoint_gain <= MIN_ENDPOINT_GAIN:
        return {k: None for k in budgets}
    return {k: (losses[shallow] - losses[k]) / endpoint_gain for k in budgets}


def format_share(share: float | None) -> str:
    """``0.64`` → ``"64%"``; ``None`` → ``"no gain"``; never ``"-0%"``."""
    return "no gain" if share is None else f"{round(100 * share)}%"  # round() gives an int: no "-0"
