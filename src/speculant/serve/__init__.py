"""``speculant serve``: an OpenAI-compatible HTTP server for one model with speculative decoding.

One process serves one model: requests are queued (bounded) and decoded one at a time, in arrival order, by a
worker thread (:mod:`.worker`); the HTTP API (:mod:`.app`, FastAPI + uvicorn) checks requests field by field
(:mod:`.protocol`), streams text as server-sent events (:mod:`speculant.models.text`: incremental detokenisation and stop
strings) and exposes Prometheus metrics named as vLLM names them (:mod:`.metrics`). :mod:`.ray_app` runs the same
app as a Ray Serve deployment with several replicas; :mod:`speculant.bench.serve_load` is the load generator of
``speculant bench serve``.

Needs the ``serve`` extra (``pip install "speculant[serve]"``; ``speculant[ray]`` for Ray Serve).
"""

from __future__ import annotations

__all__ = ["ServeSettings", "check_settings", "create_app"]


def __getattr__(name: str):
    # lazy: `speculant.bench.serve_load` (the load generator) must not import FastAPI or torch
    if name == "create_app":
        from .app import create_app

        return create_app
    if name in ("ServeSettings", "check_settings"):
        from . import settings

        return getattr(settings, name)
    raise AttributeError(name)
