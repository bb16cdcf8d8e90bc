"""``speculant serve --ray --replicas N``: the same FastAPI app as a Ray Serve deployment of N replicas.

Each replica is a Ray actor (its own process) that builds :func:`speculant.serve.app.create_app` at start-up
and loads its model there (a replica is ready only once its model is), so every replica holds one model and
decodes up to ``max_batch`` requests at once behind its own queue, with its own prefix cache. A replica takes
up to ``max_queue + max_batch`` requests (Ray's ``max_ongoing_requests``); Ray holds the rest until one has
room. ``/metrics`` answers from the replica the request reaches (each replica counts its own requests).

Routing (``routing``): with ``"prefix"`` (the default, for two or more replicas) a light ingress deployment
(:class:`speculant.serve.ray_ingress.PrefixRouterIngress`: no model, no CPU reserved) takes every HTTP request,
renders its prompt as a routing key (:func:`routing_key`) and hands the request to the model deployment through a
handle whose request router is Ray's ``PrefixCacheAffinityRouter``. That router keeps an approximate prefix
tree of the keys it sent to each replica (least recently used keys dropped past :data:`TREE_EVICT_CHARS`) and
sends a request to the replica holding the longest prefix of its key; when no replica holds
:data:`MATCH_RATE_THRESHOLD` of the key, to the replica holding the least (the least busy of those); when the
replicas' queues differ by more than ``max_batch`` requests, to the less busy of two random replicas (Ray's
default). The replica that answered is named in the :data:`REPLICA_HEADER` response header. With
``"default"`` (and always with one replica) Ray's proxy sends requests straight to the replicas with Ray's
default router.

Without ``--ray-address`` (or ``RAY_ADDRESS``) a local Ray cluster is started, and token authentication is left
off unless ``RAY_AUTH_MODE`` says otherwise: recent Ray versions turn it on for new local clusters and write a
token to ``~/.ray/auth_token``, which a loopback-only server does not need. With an address the cluster's own
settings apply (every node needs the model files at the same paths, and speculant installed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import ServeSettings

__all__ = ["MATCH_RATE_THRESHOLD", "REPLICA_HEADER", "ROUTINGS", "RoutedReplica", "RoutedRequest",
           "build_deployment", "prefix_router_class", "routing_key", "run_ray"]

log = logging.getLogger(__name__)

ROUTINGS = ("prefix", "default")
"""The values of ``--ray-routing``."""
REPLICA_HEADER = "x-speculant-replica"
"""The response header naming the replica that answered (with prefix routing)."""
MATCH_RATE_THRESHOLD = 0.1
"""The share of a request's routing key that a replica must already hold for the request to follow it."""
TREE_EVICT_CHARS = 400_000
"""When the routing keys held in the prefix tree pass this many characters, the least recently used are
dropped down to :data:`TREE_TARGET_CHARS` (checked every 10 s)."""
TREE_TARGET_CHARS = 360_000


def routing_key(body: bytes) -> str:
    """The text a request is routed by: the prompt as the server renders it, in order, so a conversation's next
    turn (its earlier messages, the answer, a new message) starts with the key of the turn before, and requests
    that share a system prompt share a key prefix. Chat: each message's text then its role
    (``content\\n<|role|>\\n``: the role after the text, so two conversations do not match on a role name
    alone); completions and infill: the prompt text (token ids as decimal numbers, one space after each). A body
    that is not JSON or names no prompt gives ``""`` (the request is then load-balanced, and the replica it
    reaches answers any error)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(f"{_content_text(m.get('content'))}\n<|{m.get('role', '')}|>\n"
                       for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t} " for t in prompt)
    return ""


def _content_text(content: Any) -> str:
    """A message's text: a string as it is, a list of parts as their texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass
class RoutedRequest:
    """One HTTP request as the ingress hands it to a model replica. ``prompt``: its routing key (the attribute
    Ray's prefix-aware router reads); the rest rebuilds the ASGI request in the replica."""

    prompt: str
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    scheme: str = "http"
    server: tuple[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class SpeculantReplica:
    """A replica of the deployment: its HTTP app is built by the ingress builder (below) when the replica
    starts, so the model is loaded in the replica's own process, not pickled from the driver."""


class RoutedReplica:
    """A model replica behind the prefix-routing ingress: builds the app and loads the model when it starts,
    then answers each :class:`RoutedRequest` by running it through the app, yielding the response head (a dict
    with ``status`` and ``headers``, this replica named in :data:`REPLICA_HEADER`) and then the body's chunks
    as the app sends them (streams stay streams)."""

    async def __init__(self, settings: ServeSettings) -> None:
        from uvicorn.config import Config
        from uvicorn.lifespan.on import LifespanOn

        from speculant.serve.app import create_app

        logging.getLogger("speculant").setLevel(logging.INFO)
        self._app = create_app(settings, load="startup")
        self._lifespan = LifespanOn(Config(self._app, lifespan="on"))
        await self._lifespan.startup()  # loads the model; a failure fails the replica
        if self._lifespan.should_exit:
            raise RuntimeError("the app did not start (see the replica's log)")
        self._name = _replica_name()

    async def __call__(self, req: RoutedRequest) -> AsyncIterator[dict | bytes]:
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await disconnected.wait()  # the client went away (the generator was closed)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": req.scheme, "path": req.path, "raw_path": req.path.encode(),
                 "query_string": req.query_string, "root_path": "", "headers": req.headers,
                 "client": req.client, "server": req.server, "state": {}}
        task = asyncio.create_task(self._app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        started = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                    yield {"status": message["status"], "headers": [*headers, (REPLICA_HEADER.encode(),
                                                                                self._name.encode())]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if not started:
                yield {"status": 500, "headers": [(b"content-type", b"application/json")]}
                yield json.dumps({"error": {"message": "the replica gave no response", "type": "server_error",
                                            "param": None, "code": None}}).encode()
        finally:
            disconnected.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout=5)
                except BaseException:  # noqa: BLE001: the app did not end after the disconnect: stop it
                    task.cancel()

    async def __del__(self) -> None:  # Ray Serve awaits it when the replica stops: close the worker
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()

    def check_health(self) -> None:
        """Ray's health check: the replica is healthy while its app has not been told to exit."""
        if self._lifespan.should_exit:
            raise RuntimeError("the app has stopped")


def _replica_name() -> str:
    """This replica's id in Ray Serve (``""`` outside a replica)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001
        return ""


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
