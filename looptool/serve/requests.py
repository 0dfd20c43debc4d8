"""What one request asks of the engine, checked: its budget (or adaptive-depth settings), its
sampling settings (temperature, top-k/p, min-p, penalties, logit bias, seed), its speculation,
the grammar its output follows, and the scheduler jobs of its ``n`` choices.

A request's ``n`` choices of one prompt are one job and ``n - 1`` copies of it
(:attr:`~looptool.engine.core.Job.copies`): the prompt is prefilled once and each copy's row
starts as a copy of it. Choice ``j`` samples with seed ``seed + j`` (vLLM's rule), so it equals
the same request sent alone with that seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from looptool.core.errors import LooptoolError
from looptool.engine.budgets import AutoRow
from looptool.engine.sampling import RowConstraint, SamplingParams
from looptool.engine.speculation import Speculation
from looptool.serve.budgets import BudgetChoiceError, BudgetResolver
from looptool.serve.drafting import choose_speculation
from looptool.serve.protocol import APIError
from looptool.serve.scheduler import Job, Scheduler

BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-100, 100], as OpenAI documents and vLLM does


@dataclass(frozen=True)
class Plan:
    """A request's budget (or adaptive-depth settings), sampling settings and speculation."""

    budget: int | AutoRow
    sampling: SamplingParams
    speculation: Speculation | None


def plan(
    req,
    resolver: BudgetResolver,
    scheduler,
    runtime: str,
    draft_tokens: int | None,
    vocab_size: int,
    constrained: bool = False,
) -> Plan:
    """The request's :class:`Plan`, checked (one 400 naming the field): its budget, its sampling
    settings, and its speculation (:func:`choose_speculation`; ``draft_tokens``: the server's
    speculative default, None when off). A request whose tokens are shaped by its own history
    or a grammar (``constrained``) decodes plainly: a ``draft_budget`` with it is refused."""
    try:
        budget = resolver.choose(
            req.model, req.budget, req.reasoning_effort, req.min_budget, req.max_budget, req.exit_threshold
        )
    except BudgetChoiceError as exc:
        raise refusal_of(exc) from None
    sampling = sampling_of(req, vocab_size)
    speculation = choose_speculation(req, budget, resolver.budgets, scheduler.capabilities, runtime, draft_tokens)
    if speculation is not None and (constrained or sampling.shapes):
        if req.draft_budget is not None and "draft_budget" in req.model_fields_set:
            what = "a grammar" if constrained else "penalties or logit_bias"
            raise APIError(
                f"draft_budget cannot be combined with {what}: drafts are not shaped by them; drop one of them.",
                param="draft_budget",
            )
        speculation = None
    if isinstance(budget, AutoRow) and (refusal := scheduler.capabilities.adaptive_refusal) is not None:
        if getattr(refusal, "parameter", None) == "kv":
            message = (
                'budget "auto" needs last-loop KV and this server keeps per-loop KV; start it with --kv last-loop.'
            )
        else:
            message = (
                f'budget "auto" is not served by the {runtime} engine (it has no adaptive-depth graph); serve an '
                "onnxruntime engine exported with it (looptool export --adaptive --kv last-loop) or the looped model "
                "directory on PyTorch, with --kv last-loop."
            )
        raise APIError(message, param="budget")
    return Plan(budget, sampling, speculation)


def refusal_of(exc: BudgetChoiceError) -> APIError:
    """The HTTP error of a budget or model the resolver refused (its status, field and code)."""
    return APIError(str(exc), status=exc.status, param=exc.parameter, code=exc.code)


def known_model(model: str | None, resolver: BudgetResolver) -> None:
    """A ``model`` the server does not serve is the resolver's 404, as on the ``/v1`` routes (None:
    not named, fine)."""
    if model is not None:
        try:
            resolver.resolve(model)
        except BudgetChoiceError as exc:
            raise refusal_of(exc) from None


def sampling_of(req, vocab_size: int) -> SamplingParams:
    """The request's sampling settings; ``logit_bias`` keys must be token ids of the vocabulary."""
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}.", param="logit_bias")
        bias.append((int(key), max(-BIAS_LIMIT, min(BIAS_LIMIT, float(value)))))
    try:
        return SamplingParams(
            req.temperature,
            req.checked_top_k(),
            req.top_p if req.top_p < 1 else None,
            req.seed,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=tuple(bias),
        )
    except LooptoolError as exc:
        raise APIError(str(exc), param=exc.parameter) from None


def choice_jobs(
    prompt: list[int],
    plan_: Plan,
    n: int,
    max_tokens: int,
    constraint=None,
    **kwargs,
) -> list[Job]:
    """The jobs of ``n`` choices of ``prompt``: the first holds the others as its copies. Choice
    ``j`` samples with seed ``seed + j`` and, where the request has a grammar, its own
    ``constraint()``. The HTTP side counts each finish (see :func:`looptool.serve.app._pieces`)."""
    budget, auto = plan_.budget, None
    if isinstance(budget, AutoRow):  # run up to its deepest budget
        budget, auto = budget.max_budget, budget
    jobs = []
    for j in range(n):
        sampling = plan_.sampling
        if j and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + j)
        row: RowConstraint | None = constraint() if constraint is not None else None
        jobs.append(
            Job(
                prompt,
                budget,
                max_tokens,
                sampling,
                auto=auto,
                consumer_counts=True,
                speculation=plan_.speculation,
                constraint=row,
                **kwargs,
            )
        )
    jobs[0].copies = jobs[1:]
    return jobs


def check_n(n: int, scheduler: Scheduler) -> None:
    """Refuse ``n`` choices the server cannot hold at once (they are prefilled together)."""
    slots = getattr(scheduler, "max_batch", None)  # a Ray ingress's replicas run the choices apart
    if slots is not None and n > slots:
        raise APIError(
            f"n={n} choices exceed this server's {slots} slots (max_batch), which they take at once; send n <= "
            f"{slots}.",
            param="n",
        )
