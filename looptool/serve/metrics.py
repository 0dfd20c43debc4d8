"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own: requests
running (holding a slot) and waiting, prompt and generated tokens, finished requests by
reason, and time-to-first-token, time-per-output-token and end-to-end latency histograms,
each labelled by budget (``auto`` for requests of adaptive depth); and the realised depth of
every token an adaptive request generated (a histogram whose buckets are the depths from the
menu's shallowest to its deepest budget); and the tokens speculating requests drafted and the
drafts their budget accepted; and the steps by whether their batch ran one budget or a mix;
and the tokens grammars forced, which no step chose (structured outputs)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from looptool.engine.core import Job, Observer

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_KINDS = ("one-budget", "mixed")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def batch_kind(labels: frozenset[str]) -> str:
    """``one-budget`` for a step whose rows share one budget label, else ``mixed``."""
    return BATCH_KINDS[0] if len(labels) <= 1 else BATCH_KINDS[1]


class Metrics(Observer):
    """The server's metrics for the budget menu ``budgets``; the engine core reports to them on
    the scheduler thread (prometheus-client is thread-safe), the HTTP side counts the rest."""

    def __init__(self, budgets: Sequence[int] = (0,)) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("looptool_requests_running", "Requests holding a cache slot.", registry=r)
        self.waiting = Gauge("looptool_requests_waiting", "Requests queued for a slot.", registry=r)
        self.prompt_tokens = Counter("looptool_prompt_tokens", "Prompt tokens prefilled.", ["budget"], registry=r)
        self.generation_tokens = Counter("looptool_generation_tokens", "Tokens generated.", ["budget"], registry=r)
        self.finished = Counter(
            "looptool_requests_finished",
            "Requests that left the engine, by finish reason.",
            ["budget", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "looptool_requests_rejected", "Requests refused with 503 (queue full or draining).", registry=r
        )
        self.ttft = Histogram(
            "looptool_time_to_first_token_seconds", "Arrival to first token.", ["budget"], buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "looptool_time_per_output_token_seconds",
            "Time between consecutive tokens of a request.",
            ["budget"],
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "looptool_e2e_request_latency_seconds",
            "Arrival to the request leaving the engine.",
            ["budget"],
            buckets=_LATENCY,
            registry=r,
        )
        self.draft_tokens = Counter(
            "looptool_draft_tokens",
            "Tokens drafted by requests that decode speculatively (kind drafted) and those their budget kept "
            "(kind accepted).",
            ["budget", "kind"],
            registry=r,
        )
        self.prefix_tokens = Counter(
            "looptool_prefix_cache_tokens",
            "Prompt tokens looked up in the prefix cache (kind queried) and those whose keys and values it held "
            "(kind hit).",
            ["kind"],
            registry=r,
        )
        self.forced_tokens = Counter(
            "looptool_forced_tokens",
            "Tokens a request's grammar forced (structured outputs), taken without a step of the model.",
            ["budget"],
            registry=r,
        )
        self.prefix_bytes = Gauge("looptool_prefix_cache_bytes", "Bytes the prefix cache's blocks hold.", registry=r)

        self.steps = Counter(
            "looptool_decode_steps",
            "Steps that advanced every running request (decode, draft and verify steps), by batch: one-budget (every "
            "row at one budget, which the step costs) or mixed (the step costs its deepest row).",
            ["batch"],
            registry=r,
        )
        lo, hi = min(budgets), max(budgets)
        self.depth = Histogram(
            "looptool_realised_depth",
            'Depth each token of a budget "auto" request ran (loops or repeated layers).',
            buckets=tuple(float(d) for d in range(lo, hi + 1)),
            registry=r,
        )

    def prefilled(self, job: Job, tokens: int, cached: int, prefix_bytes: int) -> None:
        self.prompt_tokens.labels(budget=job.label).inc(tokens)
        if cached >= 0:
            self.prefix_tokens.labels(kind="queried").inc(tokens)
            self.prefix_tokens.labels(kind="hit").inc(cached)
            self.prefix_bytes.set(prefix_bytes)

    def emitted(self, job: Job, depth: int | None, first: bool, seconds: float) -> None:
        if job.auto is not None and depth is not None:
            self.depth.observe(depth)
        (self.ttft if first else self.tpot).labels(budget=job.label).observe(seconds)
        self.generation_tokens.labels(budget=job.label).inc()

    def drafted(self, job: Job, drafted: int, accepted: int) -> None:
        self.draft_tokens.labels(budget=job.label, kind="drafted").inc(drafted)
        self.draft_tokens.labels(budget=job.label, kind="accepted").inc(accepted)

    def retired(self, job: Job, seconds: float) -> None:
        self.e2e.labels(budget=job.label).observe(seconds)

    def forced(self, job: Job, tokens: int) -> None:
        self.forced_tokens.labels(budget=job.label).inc(tokens)

    def stepped(self, labels: frozenset[str]) -> None:
        self.steps.labels(batch=batch_kind(labels)).inc()

    def step_counts(self) -> dict[str, int]:
        """Steps so far by batch kind (:data:`BATCH_KINDS`), read from the counter."""
        value = self.registry.get_sample_value
        return {kind: int(value("looptool_decode_steps_total", {"batch": kind}) or 0) for kind in BATCH_KINDS}

    def render(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
