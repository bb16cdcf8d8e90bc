"""The settings of one server (one model per process), and their checks before anything is loaded.

``speculant serve`` reads its defaults from :class:`ServeSettings` (each default is defined here once);
:func:`check_settings` resolves what the command line leaves open (the method, the draft, model names to
directories) through :func:`speculant.session.resolve`, as every front-end does, and raises a one-line ValueError for anything wrong, before the server listens or loads a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ServeSettings", "check_settings", "plan"]


@dataclass(frozen=True)
class ServeSettings:
    """What ``speculant serve`` serves and how.

    ``target``, ``draft``, ``method``, ``kv_*``, ``dtype``, ``threads``, ``device``: as
    :func:`speculant.session.resolve` (``method`` None: the method measured fastest for a packaged target with its
    shipped drafter, else ``chain``, which needs a draft: ``draft`` or the drafter speculant ships for the target). ``model_name`` None: the target as given. ``max_queue``: requests
    that may wait behind the one being decoded; one more is answered 429. ``api_key`` None: no authentication."""

    target: str
    draft: str | None = None
    method: str | None = None
    kv_policy: str | None = None
    kv_budget: int | None = None
    kv_block: int | None = None
    dtype: str | None = None
    threads: int | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    api_key: str | None = None
    model_name: str | None = None

    @property
    def served_name(self) -> str:
        return self.model_name or self.target


def plan(settings: ServeSettings):
    """The :class:`speculant.session.SessionPlan` of ``settings`` (the one place model options are resolved)."""
    from ..session import resolve

    return resolve(settings.target, settings.draft, settings.method, dtype=settings.dtype, device=settings.device,
                   threads=settings.threads, kv_policy=settings.kv_policy, kv_budget=settings.kv_budget,
                   kv_block=settings.kv_block)


def check_settings(settings: ServeSettings) -> ServeSettings:
    """``settings`` with the method and draft chosen and model names resolved to checked directories
    (:func:`speculant.session.resolve`: the rules of every front-end, so a method that needs a draft when none is
    given and speculant ships none for the target is an error, as for ``generate``); one-line ValueErrors for a
    bad method, KV options, device, or model, and for the server's own options. May convert a GGUF target once
    (see README)."""
    if settings.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {settings.max_queue}")
    if settings.api_key is not None and not settings.api_key.strip():
        raise ValueError("--api-key is empty")
    p = plan(settings)
    return dataclasses.replace(settings, target=p.target, draft=p.draft, method=p.method.spec,
                               model_name=settings.model_name or settings.target)
