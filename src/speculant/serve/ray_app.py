"""``speculant serve --ray --replicas N``: the same FastAPI app as a Ray Serve deployment of N replicas.

Each replica is a Ray actor (its own process) that builds :func:`speculant.serve.app.create_app` at start-up
and loads its model there (a replica is ready only once its model is), so every replica holds one model and
decodes up to ``max_batch`` requests at once behind its own queue, with its own prefix cache. A replica takes
up to ``max_queue + max_batch`` requests (Ray's ``max_ongoing_requests``); Ray holds the rest until one has
room. ``/metrics`` answers from the replica the request reaches (each replica counts its own requests).

Routing (``routing``): with ``"prefix"`` (the default, for two or more replicas) a light ingress deployment
(:class:`speculant.serve.ray_ingress.PrefixRouterIngress`: no model, no CPU reserved) takes every HTTP request,
renders its prompt as a routing key (:func:`speculant.serve.ray_routing.routing_key`) and hands the request to
the model deployment (:class:`~speculant.serve.ray_routing.RoutedReplica`) through a handle whose request
router is Ray's ``PrefixCacheAffinityRouter``. That router keeps an approximate prefix tree of the keys it sent
to each replica (the least recently used dropped past ``TREE_EVICT_CHARS`` characters) and sends a request to
the replica holding the longest prefix of its key; when no replica holds ``MATCH_RATE_THRESHOLD`` of the key,
to the replica holding the least (the least busy of those); when the replicas' queues differ by more than
``max_batch`` requests, to the less busy of two random replicas (Ray's default). The replica that answered is
named in the ``REPLICA_HEADER`` response header (constants of :mod:`speculant.serve.ray_routing`). With
``"default"`` (and always with one replica) Ray's proxy sends requests straight to the replicas with Ray's
default router.

Without ``--ray-address`` (or ``RAY_ADDRESS``) a local Ray cluster is started, and token authentication is left
off unless ``RAY_AUTH_MODE`` says otherwise: recent Ray versions turn it on for new local clusters and write a
token to ``~/.ray/auth_token``, which a loopback-only server does not need. With an address the cluster's own
settings apply (every node needs the model files at the same paths, and speculant installed).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from .ray_routing import MATCH_RATE_THRESHOLD, ROUTINGS, TREE_EVICT_CHARS, TREE_TARGET_CHARS, RoutedReplica
from .settings import ServeSettings

__all__ = ["build_deployment", "prefix_router_class", "run_ray"]

log = logging.getLogger(__name__)


class SpeculantReplica:
    """A replica of the deployment: its HTTP app is built by the ingress builder (below) when the replica
    starts, so the model is loaded in the replica's own process, not pickled from the driver."""


def prefix_router_class() -> str:
    """The import path of Ray's prefix-aware request router: its public name (``ray.serve.llm``, which needs
    ``ray[llm]``), else the module that defines it (``ray[serve]`` is enough). Raises ValueError when this Ray
    has none (before 2.49)."""
    import importlib

    for module in ("ray.serve.llm.request_router",
                   "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"):
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        return f"{module}.PrefixCacheAffinityRouter"
    raise ValueError("prefix routing needs Ray >= 2.49 (its PrefixCacheAffinityRouter): upgrade Ray, or use "
                     "--ray-routing default")


def build_deployment(settings: ServeSettings, replicas: int, cpus_per_replica: float, routing: str = "prefix"):
    """The bound Ray Serve application: ``replicas`` replicas of the app, behind the prefix-routing ingress
    when ``routing`` is ``"prefix"`` and there are two or more replicas (see the module's docstring)."""
    from ray import serve

    if routing not in ROUTINGS:
        raise ValueError(f"--ray-routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    per_replica = settings.max_queue + settings.max_batch
    if routing == "default" or replicas < 2:
        def build_app():  # Ray Serve calls the ingress builder in each replica (a closure: it carries settings)
            from speculant.serve.app import create_app

            logging.getLogger("speculant").setLevel(logging.INFO)
            return create_app(settings, load="startup")

        deployment = serve.deployment(
            serve.ingress(build_app)(SpeculantReplica), name="speculant", num_replicas=replicas,
            max_ongoing_requests=per_replica, ray_actor_options={"num_cpus": cpus_per_replica},
            health_check_period_s=10)
        return deployment.bind()
    from ray.serve.config import RequestRouterConfig

    router = RequestRouterConfig(
        request_router_class=prefix_router_class(),
        request_router_kwargs={"imbalanced_threshold": settings.max_batch,
                               "match_rate_threshold": MATCH_RATE_THRESHOLD, "do_eviction": True,
                               "eviction_threshold_chars": TREE_EVICT_CHARS,
                               "eviction_target_chars": TREE_TARGET_CHARS})
    model = serve.deployment(
        RoutedReplica, name="speculant-model", num_replicas=replicas, max_ongoing_requests=per_replica,
        ray_actor_options={"num_cpus": cpus_per_replica}, health_check_period_s=10,
        request_router_config=router).bind(settings)
    from .ray_ingress import PrefixRouterIngress

    ingress = serve.deployment(
        PrefixRouterIngress, name="speculant", num_replicas=1, max_ongoing_requests=replicas * per_replica,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(model, settings.max_body_bytes)


def run_ray(settings: ServeSettings, replicas: int, address: str | None = None,
            cpus_per_replica: float | None = None, on_ready: Callable[[], None] | None = None,
            routing: str = "prefix") -> int:
    """Start (or join) Ray, run the deployment on ``settings.host:settings.port`` (``on_ready()`` once every
    replica has loaded its model) and block until interrupted (Ctrl-C or SIGTERM); returns 0. ``routing``: one
    of :data:`ROUTINGS` (see the module's docstring)."""
    if routing not in ROUTINGS:
        raise ValueError(f"--ray-routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'speculant[ray]'") from None
    if routing == "prefix" and replicas > 1:
        prefix_router_class()  # a Ray without it is one line before any cluster starts
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    threads = settings.threads if isinstance(settings.threads, int) else 1  # auto / None: at least one core
    cpus = cpus_per_replica if cpus_per_replica is not None else float(threads)
    if address:
        init: dict[str, Any] = {"address": address}
    else:  # one logical CPU over the replicas' for Ray's own actors (the prefix router's tree), which need one
        init = {"include_dashboard": False, "object_store_memory": 256 * 2**20,
                "num_cpus": max(os.cpu_count() or 1, int(replicas * cpus + 0.999) + 1)}
    ray.init(**init, logging_level=logging.WARNING, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    def interrupt(signum, frame):  # SIGTERM as Ctrl-C: shut Serve and the local cluster down, not leave them
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # after ray.init, which installs its own
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(build_deployment(settings, replicas, cpus, routing), name="speculant", route_prefix="/")
        except Exception as exc:  # noqa: BLE001: e.g. a replica whose model fails to load
            raise ValueError(f"Ray Serve could not start the deployment: {exc}") from None
        if on_ready is not None:
            on_ready()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
