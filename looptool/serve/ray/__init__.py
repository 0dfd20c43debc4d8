"""``looptool serve`` on Ray Serve: the same OpenAI API from several engine replicas, with
Ray's autoscaling and replica restarts, and a depth-aware request router.

:func:`app` gives the Ray Serve application for a looped model or engine directory (two
deployments: ``ingress``, the HTTP side without a model, and ``engine``, one engine core per
replica; :mod:`looptool.serve.ray.deployments`); :func:`build` is the same for ``serve run``
and Ray Serve config files (``import_path: looptool.serve.ray:build``, its ``args`` the
keywords of :func:`app`); :func:`run` starts or joins a cluster, serves the application and
drains it on SIGTERM, which ``looptool serve --replicas N`` does. The request router
(:class:`looptool.serve.ray.router.DepthAwareRouter`, the default; ``router="ray"`` keeps Ray's
own power-of-two-choices router) is described in :mod:`looptool.serve.routing`.

Needs the ``ray`` extra (``pip install looptool[ray]``); the single-process server does not
import Ray.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from looptool.core.errors import LooptoolError, require_extra
from looptool.passes.adaptive_depth import check_exit_rule
from looptool.serve.models import read_facts
from looptool.serve.routing import HOLD_S, MAX_HOLD_S
from looptool.serve.server import ResolvedOptions, ServeOptions, bind

__all__ = ["ROUTERS", "RayOptions", "app", "build", "run"]

ROUTERS = ("depth", "ray")  # depth-aware routing, or Ray's default (power of two choices)
APP_NAME = "looptool"
ROUTE_BACKOFF_S = 0.005  # seconds between a held request's looks for a replica (depth-aware router)
DRAIN_POLL = 0.2  # seconds between checks that a draining application has finished its requests


class RayOptions(BaseModel):
    """How the application is spread over Ray (the keywords of :func:`app` beside the serve
    options): ``replicas`` engine replicas (the initial count when autoscaling), autoscaling
    between ``min_replicas`` and ``max_replicas`` when either is given, each replica with
    ``replica_cpus`` CPUs (its torch threads, unless ``threads`` is given) and ``replica_gpus``
    GPUs, requests routed by ``router``; ``hold_s`` and ``max_hold_s`` are the depth-aware
    router's waits and ``ride`` whether it lets a request join a deeper batch rather than wait
    (:mod:`looptool.serve.routing`);
    ``autoscaling`` adds to (or overrides) the autoscaling settings, in Ray's ``AutoscalingConfig``
    keys (``upscale_delay_s``, ``downscale_delay_s``, ``look_back_period_s``: Ray's defaults
    otherwise)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    router: str = "depth"
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    hold_s: float = HOLD_S
    max_hold_s: float = MAX_HOLD_S
    ride: bool = True
    autoscaling: dict = {}  # more of Ray's AutoscalingConfig (upscale_delay_s, look_back_period_s, ...)

    def check(self) -> None:
        """One sentence per setting out of range."""
        if self.router not in ROUTERS:
            raise LooptoolError(f"unknown router {self.router!r}; use one of {', '.join(ROUTERS)}.", parameter="router")
        if self.replicas < 1:
            raise LooptoolError(f"replicas must be at least 1, got {self.replicas}.", parameter="replicas")
        lo, hi = self.scale
        if lo is not None and not (0 <= lo <= self.replicas <= hi):
            raise LooptoolError(
                f"autoscaling needs 0 <= min_replicas <= replicas <= max_replicas (and max_replicas >= 1), got "
                f"min_replicas {lo}, replicas {self.replicas}, max_replicas {hi}.",
                parameter="min_replicas",
            )
        if self.replica_cpus <= 0 or self.replica_gpus < 0:
            raise LooptoolError(
                f"a replica needs replica_cpus > 0 and replica_gpus >= 0, got {self.replica_cpus} and "
                f"{self.replica_gpus}.",
                parameter="replica_cpus",
            )
        if not 0 <= self.hold_s <= self.max_hold_s:
            raise LooptoolError(
                f"the router's waits need 0 <= hold_s <= max_hold_s, got {self.hold_s} and {self.max_hold_s}.",
                parameter="hold_s",
            )

    @property
    def scale(self) -> tuple[int | None, int | None]:
        """``(min_replicas, max_replicas)`` when autoscaling (a missing bound is ``replicas``),
        else ``(None, None)``."""
        if self.min_replicas is None and self.max_replicas is None:
            return None, None
        lo = self.replicas if self.min_replicas is None else self.min_replicas
        hi = max(self.replicas, 1) if self.max_replicas is None else self.max_replicas
        return lo, hi


def app(
    model_dir: str | os.PathLike,
    options: ServeOptions | None = None,
    *,
    name: str | None = None,
    runtime: str = "auto",
    device: str = "auto",
    kv: str = "per-loop",
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    exit_rule: str = "state",
    ray: RayOptions | None = None,
    **session,
):
    """The Ray Serve application serving ``model_dir`` (a looped model or an exported engine
    directory, at the same path on every node) with ``options`` (as :func:`looptool.serve.prepare`
    takes them; ``host`` and ``port`` are Ray's HTTP proxy's, set by :func:`run` or your Serve
    config) and ``ray`` (:class:`RayOptions`). Every option is checked here, against the model's
    JSON files, before any replica starts; ``session`` goes to onnxruntime (``prepack``, ``spin``)."""
    require_extra("ray", "serving on Ray", "ray.serve")
    from ray.serve.config import RequestRouterConfig

    from looptool.serve.ray.deployments import EngineReplica, OpenAIIngress, model_path
    from looptool.serve.ray.router import DepthAwareRouter

    options = options or ServeOptions()
    ray = ray or RayOptions()
    options.check()
    options.check_kv(kv)
    check_exit_rule(exit_rule)
    ray.check()
    path = model_path(model_dir)
    name = name or os.path.basename(path)
    resolved: ResolvedOptions = options.for_model(read_facts(path, runtime), name, exit_rule)
    gpus = ray.replica_gpus or (1.0 if str(device).startswith("cuda") else 0.0)
    open_kwargs = dict(
        name=name,
        runtime=runtime,
        device=device,
        kv=kv,
        tokenizer=None if tokenizer is None else str(tokenizer),
        threads=threads or max(1, int(ray.replica_cpus)),
        exit_rule=exit_rule,
        **session,
    )
    lo, hi = ray.scale
    per_replica = resolved.max_batch + resolved.max_queue
    quiet = {"log_level": resolved.log_level.upper(), "enable_access_log": False}  # as the single server logs
    engine_options: dict = {
        "name": "engine",
        "logging_config": quiet,
        "max_ongoing_requests": per_replica,
        "ray_actor_options": {"num_cpus": ray.replica_cpus, "num_gpus": gpus},
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": 60.0,
    }
    if lo is None:
        engine_options["num_replicas"] = ray.replicas
    else:
        engine_options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": ray.replicas,
            "target_ongoing_requests": resolved.max_batch,  # a full batch each; queued requests ask for more
            **ray.autoscaling,
        }
    if ray.router == "depth":
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=DepthAwareRouter,
            # a held request looks again every few milliseconds (Ray's default backs off to 0.5 s,
            # longer than a decode step: a freed slot would idle that long)
            initial_backoff_s=ROUTE_BACKOFF_S,
            backoff_multiplier=1,
            max_backoff_s=ROUTE_BACKOFF_S,
            request_router_kwargs={
                "max_batch": resolved.max_batch,
                "hold_s": ray.hold_s,
                "max_hold_s": ray.max_hold_s,
                "ride": ray.ride,
            },
        )
    engine = EngineReplica.options(**engine_options).bind(path, resolved, open_kwargs)
    most = hi if hi is not None else ray.replicas
    return OpenAIIngress.options(
        name="ingress",
        logging_config=quiet,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=per_replica * max(most, 1) + 64,
    ).bind(engine, resolved)


class BuildArgs(RayOptions):
    """The ``args`` of :func:`build` (``serve run looptool.serve.ray:build model_dir=...``, or a
    Serve config file's ``args:``): :func:`app`'s keywords, the :class:`ServeOptions` fields among
    them."""

    model_dir: str
    name: str | None = None
    runtime: str = "auto"
    device: str = "auto"
    kv: str = "per-loop"
    tokenizer: str | None = None
    threads: int | None = None
    exit_rule: str = "state"
    max_batch: int = 8
    capacity: int | None = None
    max_queue: int = 64
    default_budget: int | None = None
    effort: str | None = None
    api_key: str | None = None
    speculative: bool = False
    prefix_cache: bool = True


def build(args: BuildArgs | dict):
    """:func:`app` from Ray Serve's builder arguments (strings on ``serve run``'s command line,
    or a Serve config's ``args``, converted and checked by :class:`BuildArgs`)."""
    if not isinstance(args, BuildArgs):
        try:
            args = BuildArgs.model_validate(dict(args))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise LooptoolError(f"build argument {where}: {error['msg']}.", parameter=where or None) from None
    values = args.model_dump()
    serve_fields = {f.name for f in dataclasses.fields(ServeOptions)} & set(values)  # those of ServeOptions
    options = ServeOptions(**{key: values.pop(key) for key in serve_fields})
    ray = RayOptions(**{key: values.pop(key) for key in RayOptions.model_fields})
    return app(values.pop("model_dir"), options, ray=ray, **values)


def run(
    application,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``application`` (:func:`app`) on Ray until SIGTERM or Ctrl-C (or ``stop`` is set),
    then drain: new requests get 503 while the admitted ones finish, and the application is
    deleted. Joins the cluster at ``address`` (``auto``: the one ``ray start`` runs on this
    machine), else starts a local one and shuts it down at the end. ``on_ready`` gets the
    OpenAI API's base URL once the application is up."""
    require_extra("ray", "serving on Ray", "ray.serve")
    import ray
    from ray import serve

    bind(host, port).close()  # a port in use is one sentence, before Ray starts
    started = address is None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        ingress = serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        if on_ready is not None:
            on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1")
        stop.wait()
        drain(ingress)
        serve.delete(APP_NAME)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            serve.shutdown()
            ray.shutdown()


def drain(ingress, poll: float = DRAIN_POLL) -> None:
    """Tell ``ingress`` (the application's handle) to admit nothing more, and wait until the
    requests under way through it have finished."""
    left = ingress.drain.remote().result()
    while left:
        time.sleep(poll)
        left = ingress.under_way.remote().result()
