"""``speculant serve --ray --replicas N``: the same FastAPI app as a Ray Serve deployment of N replicas.

Each replica is a Ray actor (its own process) that builds :func:`speculant.serve.app.create_app` at start-up
(Ray Serve's ingress builder function, Ray >= 2.47) and loads its model there (a replica is ready only once its
model is), so every replica holds one model and decodes up to ``max_batch`` requests at once behind its own
queue; Ray's proxy spreads requests over the replicas and holds them when every replica has ``max_queue +
max_batch`` requests (Ray's ``max_ongoing_requests``). ``/metrics`` answers from the replica the request reaches (each replica counts its own
requests).

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

from .settings import ServeSettings

__all__ = ["build_deployment", "run_ray"]

log = logging.getLogger(__name__)


class SpeculantReplica:
    """A replica of the deployment: its HTTP app is built by the ingress builder (below) when the replica
    starts, so the model is loaded in the replica's own process, not pickled from the driver."""


def build_deployment(settings: ServeSettings, replicas: int, cpus_per_replica: float):
    """The bound Ray Serve application: ``replicas`` replicas of :class:`SpeculantReplica`."""
    from ray import serve

    def build_app():  # Ray Serve calls the ingress builder in each replica (a closure: it carries settings)
        from speculant.serve.app import create_app

        logging.getLogger("speculant").setLevel(logging.INFO)
        return create_app(settings, load="startup")

    deployment = serve.deployment(
        serve.ingress(build_app)(SpeculantReplica),
        name="speculant",
        num_replicas=replicas,
        max_ongoing_requests=settings.max_queue + settings.max_batch,
        ray_actor_options={"num_cpus": cpus_per_replica},
        health_check_period_s=10,
    )
    return deployment.bind()


def run_ray(settings: ServeSettings, replicas: int, address: str | None = None,
            cpus_per_replica: float | None = None, on_ready: Callable[[], None] | None = None) -> int:
    """Start (or join) Ray, run the deployment on ``settings.host:settings.port`` (``on_ready()`` once every
    replica has loaded its model) and block until interrupted (Ctrl-C or SIGTERM); returns 0."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'speculant[ray]'") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    threads = settings.threads if isinstance(settings.threads, int) else 1  # auto / None: at least one core
    cpus = cpus_per_replica if cpus_per_replica is not None else float(threads)
    init = {"address": address} if address else {"include_dashboard": False, "object_store_memory": 256 * 2**20}
    ray.init(**init, logging_level=logging.WARNING, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    def interrupt(signum, frame):  # SIGTERM as Ctrl-C: shut Serve and the local cluster down, not leave them
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # after ray.init, which installs its own
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(build_deployment(settings, replicas, cpus), name="speculant", route_prefix="/")
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
