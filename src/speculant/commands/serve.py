"""``speculant serve [--target MODEL] [--method SPEC] [--port N] ...``: the OpenAI-compatible server.

Output conventions: stderr carries one line when the server listens (``speculant: serving MODEL ... at
http://HOST:PORT/v1``), one when the model is loaded, warnings, and with ``-v`` uvicorn's access log; stdout
stays empty. Bad input (a method, model, device or KV option that is wrong, a port that is taken) is one line
``speculant: error: ...`` and exit code 2 before anything is loaded; a model that fails to load after the
server started listening ends it the same way. SIGTERM or Ctrl-C stops the server gracefully
(:mod:`speculant.serve.shutdown`): new requests get 503 while the running and queued ones finish, for up to
``--shutdown-grace`` seconds; streams still running then end with ``finish_reason`` ``abort`` and ``[DONE]``; a
second signal ends them at once. Exit code 0. With ``--ray`` the one line comes once every
replica has loaded its model, and Ctrl-C or SIGTERM shuts Ray Serve (and a local Ray cluster) down.

Defaults are read from :class:`speculant.serve.settings.ServeSettings`, never restated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys

from . import common
from .common import dataclass_defaults, nonnegative_int, positive_int

__all__ = ["API_KEY_ENV", "DESCRIPTION", "add_arguments", "epilog", "run"]

log = logging.getLogger(__name__)

API_KEY_ENV = "SPECULANT_API_KEY"
"""The environment variable ``--api-key`` defaults to."""

DESCRIPTION = (
    "Serve the target model over HTTP with OpenAI's API (POST /v1/chat/completions, POST /v1/completions, GET "
    "/v1/models), losslessly accelerated by the drafting method, plus GET /health (200 once the model is loaded, "
    "503 before) and GET /metrics (Prometheus, vLLM's metric names). One model per process; requests are queued "
    "(--max-queue) and decoded together, up to --max-batch at once (continuous batching: each joins at the next "
    "step and leaves when done, cancelled or its client goes away). Needs the serve extra: pip install "
    "'speculant[serve]'."
)


def _defaults() -> dict:
    from ..serve.settings import ServeSettings

    return dataclass_defaults(ServeSettings)


def epilog() -> str:
    from ..drafters.registry import describe_methods

    return (
        "example:\n"
        "  speculant serve --target smollm2-135m-instruct --port 8000\n"
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "      -d '{\"model\": \"smollm2-135m-instruct\", \"messages\": [{\"role\": \"user\", \"content\": "
        "\"Hi!\"}]}'\n"
        "  speculant bench serve --url http://127.0.0.1:8000 --concurrency 1,2,4   # load-test it\n\n"
        "methods:\n" + describe_methods()
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``speculant serve``'s options on ``p``."""
    from ..serve.settings import DEFAULT_TARGET, TRAFFIC_SCORINGS

    d = _defaults()
    common.add_model_arguments(p, target_default=d["target"],
                               target_note=f"default: {DEFAULT_TARGET} (a packaged chat model) when it is "
                               "installed, else required")
    p.add_argument("--host", metavar="HOST", default=d["host"],
                   help="listen on this address (0.0.0.0: every interface); default: %(default)s")
    p.add_argument("--port", type=_port, metavar="N", default=d["port"],
                   help="listen on this port (0: a free one, printed on stderr); default: %(default)s")
    p.add_argument("--max-batch", type=positive_int, metavar="N", default=d["max_batch"],
                   help="decode up to N requests together, one target forward per step for all of them (on a CPU "
                   "a forward over several rows costs little more than over one, since it reads every weight once); "
                   "1: one request at a time; default: %(default)s")
    p.add_argument("--prefill-chunk", type=nonnegative_int, metavar="N", default=d["prefill_chunk"],
                   help="a request joining running ones enters its prompt N tokens per step, folded into the running "
                   "requests' forward, so that a long prompt does not stall their tokens (chunked prefill); 0: the "
                   "whole prompt at once; default: %(default)s")
    p.add_argument("--prefix-cache-mb", type=_nonnegative("a number of MiB"), metavar="MB",
                   default=d["prefix_cache_mb"],
                   help="keep the keys/values of computed prompt prefixes (the target's and the draft model's), up to "
                   "MB MiB, least recently used evicted first: a request that starts as an earlier one did (the "
                   "same conversation one turn later, a shared system prompt, the same file) computes only the tokens "
                   "after its longest cached prefix, in blocks of 16 tokens; the answer is the same either way. 0: "
                   "no reuse; default: %(default)g")
    p.add_argument("--speculation", choices=["auto", "on", "off"], default=d["speculation"],
                   help="how deep each request drafts per step: auto (the depth that maximises tokens per second "
                   "for the batch, from each request's measured acceptance and the measured cost of a forward over "
                   "the batch's rows: at low load the method's full depth, at high load less or none, so "
                   "speculation never costs throughput), on (always the method's depth), off (plain decoding); "
                   "output is the same either way; default: %(default)s")
    p.add_argument("--online", action="store_true",
                   help="adapt the draft model to the traffic (online speculative decoding): the target's verdicts "
                   "on each request's drafts are kept, and every --online-every requests a copy of the draft is "
                   "distilled on them while no request waits, then swapped in only if its agreement with the target "
                   "on held-back requests rose beyond noise (--online-min-z). Output is unchanged (the target "
                   "verifies every draft); needs a float draft model")
    p.add_argument("--online-every", type=positive_int, metavar="N", default=d["online_every"],
                   help="finished requests between two online updates; default: %(default)s")
    p.add_argument("--online-min-held", type=positive_int, metavar="N", default=d["online_min_held"],
                   help="requests held back (one in 5) before the first online update is checked on them: "
                   "acceptance varies between requests, and on one or two a worse drafter can pass; default: "
                   "%(default)s")
    p.add_argument("--online-min-z", type=_nonnegative("a number"), metavar="Z", default=d["online_min_z"],
                   help="how sure the check must be that an update agrees more with the target: McNemar's z over "
                   "the held-back positions where exactly one of the old and the new drafter agrees; 0: swap in "
                   "whenever agreement did not drop, which a few requests' noise often passes; default: %(default)s")
    p.add_argument("--online-traffic", type=nonnegative_int, metavar="N", default=d["online_traffic"],
                   help="with --online: also draft up to N tokens per step (a chain, or the depth of "
                   "--online-traffic-tree) from the tokens of earlier requests (a "
                   "bounded memory looked up like prompt lookup: repeated instructions and answer phrasing are "
                   "drafted again, with no training). Output is unchanged, but the memory is shared: a response's "
                   "accepted-token count tells whether its continuation followed the same context in an earlier "
                   "request, so use it where users may learn that of each other; 0: none; default: %(default)s")
    p.add_argument("--online-traffic-min-ngram", type=int, choices=(1, 2, 3), metavar="N",
                   default=d["online_traffic_min_ngram"],
                   help="with --online-traffic: draft from the memory only where the context's last N tokens (1-3) "
                   "occurred before; 2 drafts fewer rows per step for slightly fewer accepted tokens, for CPUs where "
                   "every row costs; default: %(default)s")
    p.add_argument("--online-traffic-scoring", choices=TRAFFIC_SCORINGS, default=d["online_traffic_scoring"],
                   help="with --online-traffic: continue the context with what most often followed it in earlier "
                   "requests (frequent: n-gram counts, which sharpen as the traffic grows) or with what followed its "
                   "latest occurrence (recent); replayed on a 400-request code stream, frequent had 4%% more tokens "
                   "accepted per step by the last 50 requests, from 25-33%% fewer drafted; default: %(default)s")
    p.add_argument("--online-traffic-min-score", type=float, metavar="P", default=d["online_traffic_min_score"],
                   help="with frequent scoring: end the memory's chain where its estimated chance of being right (the "
                   "product of each token's count over all that followed its context, plus one) falls below P; "
                   "raise it where verifying a row costs more (a quantized 1.5B on a CPU), 0 for no bound; "
                   "default: %(default)s")
    p.add_argument("--online-traffic-tree", type=nonnegative_int, metavar="N", default=d["online_traffic_tree"],
                   help="with frequent scoring: draft the memory's tree of up to N nodes, --online-traffic tokens "
                   "deep (its likeliest continuations side by side, grown best first) instead of one chain: more "
                   "tokens accepted per step as the traffic grows, for more rows verified per step; pair it with a "
                   "lower --online-traffic-min-score (0.05 for 16 nodes, 0.01 for 64). On 2 CPU cores a 64-node "
                   "tree cost more than it gained; it should pay where a row costs little; 0: the chain; "
                   "default: %(default)s")
    p.add_argument("--online-distill", action=argparse.BooleanOptionalAction, default=d["online_distill"],
                   help="with --online: distil the draft model on the traffic (needs a float draft model); "
                   "--no-online-distill keeps only the traffic memory (--online-traffic N), for any method and any "
                   "draft, quantized or none; default: on")
    p.add_argument("--online-state", metavar="DIR", default=d["online_state"],
                   help="with --online: save the adapted drafter, its buffer and history to DIR on shutdown, and "
                   "resume from them on start; default: none (adaptation starts afresh)")
    p.add_argument("--max-queue", type=nonnegative_int, metavar="N", default=d["max_queue"],
                   help="requests that may wait behind a full batch; one more is answered 429 at once; "
                   "default: %(default)s")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV, d["api_key"]),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (401 otherwise); GET /metrics and GET "
                   "/health stay open without the key unless --metrics-need-key is given (then /metrics needs it); "
                   f"default: ${API_KEY_ENV} if set (keeps the key out of the process list), else none")
    p.add_argument("--metrics-need-key", action="store_true",
                   help="with --api-key: GET /metrics needs the key too (401 without it). Default: /metrics and "
                   "/health are open without the key, as vLLM serves them (for scrapers and load balancers); "
                   "/health stays open either way")
    p.add_argument("--allow-origin", dest="allow_origin", action="append", metavar="ORIGIN", default=None,
                   help="let web pages from ORIGIN (e.g. http://localhost:3000; * for any) call the server, with "
                   "CORS; repeat for several. Default: none: without --api-key, requests from other origins and "
                   "with a Host that is not this server's address are refused (a web page cannot drive the "
                   "server); with --api-key, Origin is checked only when this is given")
    p.add_argument("--max-body-bytes", type=positive_int, metavar="N", default=d["max_body_bytes"],
                   help="answer a request body larger than N bytes with 413, before reading it; default: "
                   "%(default)s (4 MiB: far above the text of the longest context)")
    p.add_argument("--shutdown-grace", type=_seconds, metavar="S", default=d["shutdown_grace"],
                   help="on SIGTERM or Ctrl-C, let running and queued requests finish for up to S seconds while "
                   "new ones get 503; streams still running then end with finish_reason 'abort' and [DONE]. A "
                   "second signal ends them at once. Default: %(default)s")
    p.add_argument("--served-model-name", dest="model_name", metavar="NAME", default=d["model_name"],
                   help="the model id clients send in 'model' and GET /v1/models lists; default: --target as "
                   "given")
    p.add_argument("--ray", action="store_true",
                   help="run on Ray Serve (pip install 'speculant[ray]'): --replicas copies of the app, one "
                   "process and one model each, behind Ray's proxy")
    p.add_argument("--replicas", type=positive_int, metavar="N", default=None,
                   help="with --ray: the number of replicas; default: 1")
    p.add_argument("--ray-address", metavar="ADDRESS", default=None,
                   help="with --ray: join this Ray cluster (e.g. auto, or HEAD:6379); default: $RAY_ADDRESS, else a "
                   "new local cluster")
    p.add_argument("--ray-routing", choices=("prefix", "default"), default=None,
                   help="with --ray and 2+ replicas: 'prefix' (default) sends a request to the replica that "
                   "already holds the longest prefix of its prompt (its prefix cache then reuses it), else to the "
                   "least busy one; 'default': Ray's own router, regardless of prompts")


def _port(text: str) -> int:
    """An argparse type for a TCP port (0: a free one)."""
    from ..serve.settings import MAX_PORT

    value = nonnegative_int(text)
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a port in [0, {MAX_PORT}], got {value}")
    return value


def _nonnegative(what: str):
    """An argparse type for a finite number >= 0 (``what``: how the error names it, e.g. "a number of seconds")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what} >= 0, got {text!r}")
        return value

    return parse


_seconds = _nonnegative("a number of seconds")


def _check_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ValueError(f"speculant serve needs {', '.join(missing)}: pip install 'speculant[serve]'")


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it), or a one-line ValueError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(args: argparse.Namespace) -> int:
    """Run ``speculant serve`` until interrupted; returns the exit code (bad input raises ValueError)."""
    from ..serve.settings import ServeSettings, check_settings

    if args.replicas is not None and not args.ray:
        raise ValueError("--replicas needs --ray (without Ray one process serves one model)")
    if args.ray_address is not None and not args.ray:
        raise ValueError("--ray-address needs --ray")
    if args.ray_routing is not None and not args.ray:
        raise ValueError("--ray-routing needs --ray")
    _check_extra()
    names = {f.name for f in dataclasses.fields(ServeSettings)}
    given = {k: v for k, v in vars(args).items() if k in names}
    given["allow_origin"] = tuple(given.get("allow_origin") or ())
    settings = ServeSettings(**given)
    if args.ray:
        from ..serve.ray_app import run_ray

        if settings.port:
            _bind(settings.host, settings.port).close()  # a taken port is one line, before Ray starts
        settings = check_settings(settings)
        replicas = args.replicas or 1

        def announce() -> None:
            print(f"speculant: serving {settings.served_name} (method {settings.method}) on Ray Serve, {replicas} "
                  f"replica(s), at {_url(settings.host, settings.port)}/v1", file=sys.stderr, flush=True)

        return run_ray(settings, replicas, args.ray_address, on_ready=announce,
                       routing=args.ray_routing or "prefix")
    sock = _bind(settings.host, settings.port)
    try:
        settings = check_settings(settings)
        return _serve(settings, sock, verbose=bool(getattr(args, "verbose", False)))
    finally:
        sock.close()


def _serve(settings, sock: socket.socket, verbose: bool) -> int:
    import uvicorn

    from ..serve.app import create_app
    from ..serve.shutdown import DrainingServer

    fatal: list[str] = []
    server: uvicorn.Server | None = None
    url = _url(settings.host, sock.getsockname()[1])

    def on_ready() -> None:
        print(f"speculant: model loaded; ready at {url}/v1", file=sys.stderr, flush=True)

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    if settings.api_key is None and not _loopback(settings.host):
        log.warning("listening on %s without --api-key: anyone who reaches this address can use the model",
                    settings.host)
    app = create_app(settings, load="background", on_ready=on_ready, on_fatal=on_fatal)
    # the drain (on the first signal) ends every generation; uvicorn's own grace is then only for the last
    # responses to go out
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=3, lifespan="on")
    server = DrainingServer(config, app.state.drain)
    print(f"speculant: serving {settings.served_name} (method {settings.method}) at {url}/v1; loading the model "
          "(GET /health answers 200 once it is loaded)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a third Ctrl-C: uvicorn raises the SIGINT it captured again
        pass
    if fatal:
        raise ValueError(f"the model failed to load: {fatal[0]}")
    return 0
