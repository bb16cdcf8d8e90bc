"""The settings of one server (one model per process), and their checks before anything is loaded.

``speculant serve`` reads its defaults from :class:`ServeSettings` (each default is defined here once);
:func:`check_settings` resolves what the command line leaves open (the method, the draft, model names to
directories) and raises a one-line ValueError for anything wrong, before the server listens or loads a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ServeSettings", "check_settings"]


@dataclass(frozen=True)
class ServeSettings:
    """What ``speculant serve`` serves and how.

    ``method`` None: when there is a draft (``draft``, or the drafter speculant ships for the target), the method
    measured fastest for a packaged target with its shipped drafter (:func:`speculant.models.loading.default_method_for`)
    or else ``chain``; without a draft ``ar``. ``model_name`` None: the target as given. ``max_queue``: requests
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


def check_settings(settings: ServeSettings) -> ServeSettings:
    """``settings`` with the method and draft chosen and model names resolved to checked directories; one-line
    ValueErrors for a bad method, KV options, device, or model. May convert a GGUF target once (see README)."""
    from ..core.checks import resolve_device
    from ..drafters.registry import DEFAULT_METHOD, engine_options, get_method, parse_method
    from ..models.loading import check_model_dir, default_draft_for, default_method_for, resolve_model

    target_name = settings.target
    draft = settings.draft
    if draft is None:
        draft = default_draft_for(settings.target)
    spec = settings.method
    if spec is None:
        spec = (default_method_for(settings.target, draft) or DEFAULT_METHOD) if draft is not None else "ar"
    name, options = parse_method(spec)
    engine_options(options)
    method = get_method(name)
    if method.needs_draft and draft is None:
        raise ValueError(f"method {name!r} needs a draft model: pass --draft DIR (or --method ar for plain decoding)")
    if (settings.kv_policy is None) != (settings.kv_budget is None):
        raise ValueError("--kv-policy and --kv-budget go together (e.g. --kv-policy keydiff --kv-budget 256)")
    if settings.kv_policy is not None:
        from ..kv import parse_policy

        parse_policy(settings.kv_policy)
    if settings.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {settings.max_queue}")
    if settings.api_key is not None and not settings.api_key.strip():
        raise ValueError("--api-key is empty")
    resolve_device(settings.device)
    target = str(check_model_dir(resolve_model(settings.target)))
    draft_dir = str(check_model_dir(resolve_model(draft))) if method.needs_draft else None
    return dataclasses.replace(settings, target=target, draft=draft_dir, method=spec,
                               model_name=settings.model_name or target_name)
