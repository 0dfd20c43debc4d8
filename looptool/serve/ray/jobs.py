"""What crosses from a Ray Serve ingress to an engine replica and back: a :class:`JobSpec` (a
scheduler job without its callbacks, plus what routing reads) and, at the end of a job's
events, the replica's :class:`ReplicaStats`. Plain picklable data; no Ray import."""

from __future__ import annotations

from dataclasses import dataclass, field

from looptool.engine.budgets import AutoRow
from looptool.engine.core import Job
from looptool.engine.prefix_cache import block_digests
from looptool.engine.sampling import GREEDY, SamplingParams
from looptool.engine.speculation import Speculation
from looptool.serve.routing import RouteKey
from looptool.serve.structured import GrammarSpec


@dataclass(frozen=True)
class JobSpec:
    """One scheduler job as a replica rebuilds it (:meth:`job`), and its routing ``key``."""

    prompt: tuple[int, ...]
    budget: int
    max_tokens: int
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    auto: AutoRow | None = None
    speculation: Speculation | None = None
    grammar: GrammarSpec | None = None  # the grammar its output follows; the replica compiles it
    key: RouteKey = field(default_factory=lambda: RouteKey(""))

    @classmethod
    def of(cls, job: Job, prefix_blocks: bool = True) -> JobSpec:
        """``job``'s spec; with ``prefix_blocks``, its key names the prompt's blocks (the
        replicas keep a prefix cache)."""
        digests = tuple(block_digests(job.prompt)) if prefix_blocks else ()
        return cls(
            tuple(job.prompt),
            job.budget,
            job.max_tokens,
            job.sampling,
            job.logprobs,
            job.prompt_logprobs,
            job.ignore_eos,
            job.auto,
            job.speculation,
            getattr(job.constraint, "spec", None),
            RouteKey(job.label, job.budget, digests),
        )

    def job(self) -> Job:
        """A fresh job of this spec (its own arrival time, no consumer yet)."""
        return Job(
            list(self.prompt),
            self.budget,
            self.max_tokens,
            self.sampling,
            self.logprobs,
            self.prompt_logprobs,
            self.ignore_eos,
            auto=self.auto,
            speculation=self.speculation,
        )


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's counts when it sends a job's last event: its id and its steps by batch kind
    (:data:`looptool.serve.metrics.BATCH_KINDS`)."""

    replica: str
    steps: dict[str, int]
