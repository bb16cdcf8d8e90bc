"""The models a benchmark runs, resolved by :mod:`speculant.plan` and loaded by :mod:`speculant.session`: one
target with its tokenizer, the draft the methods share, and the draft of each method that names its own
(``chain:draft=DIR``).

Names are anything :func:`speculant.models.loading.resolve_model` takes (model directories, bundled and packaged
names, ``.gguf`` files, cached Hub ids), or loaded modules (left on their device). A draft is loaded with
:func:`speculant.models.loading.load_draft`, so an attached drafter (:mod:`speculant.models.attached`: no
tokenizer, the target's embedding and LM head) works like any other. The session holds the models; the harness
builds a fresh drafter per method spec and generation from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import Model, SessionPlan, resolve
from ..session import Session

__all__ = ["BenchModels", "plan_bench_models"]


def plan_bench_models(target: Model, draft: Model | None, tokenizer: Any, dtype: torch.dtype | str | None,
                      device: torch.device | str | None, draft_for: list[str],
                      quantization: str | None = None) -> SessionPlan:
    """The session plan of a benchmark (nothing loaded): its method is the reference ``ar``; the draft is resolved
    (the drafter speculant ships for the target when none is given) and loaded when ``draft_for`` (the method
    specs and baselines that draft with the shared draft) is not empty, else a one-line ValueError as
    everywhere (:func:`speculant.plan.resolve`). ``device`` None: the CPU; ``quantization``: as ``resolve``'s.
    No prefix cache: every request of a benchmark is measured as a new one, prefill included (methods take turns
    on the same prompts, which would otherwise read each other's prefixes)."""
    return resolve(target, draft, "ar", tokenizer=tokenizer, dtype=dtype, quantization=quantization,
                   device=device if device is not None else "cpu", draft_for=draft_for,
                   threads=None,  # the caller's (speculant bench: --threads), not auto's
                   prefix_cache_mb=0)


@dataclass
class BenchModels:
    """The loaded models: ``session`` (target, tokenizer and the shared draft, None when no method uses it) and
    ``own`` (a method's own ``draft=`` name -> a session over the same target with that draft)."""

    session: Session
    own: dict[str, Session] = field(default_factory=dict)

    @classmethod
    def load(cls, plan: SessionPlan, own_drafts: list[str]) -> BenchModels:
        """Load the plan's models, then each own draft next to the same target."""
        from ..session import load_plan  # looked up at the call: a caller may wrap it

        session = load_plan(plan)
        return cls(session, {name: session.with_draft(name) for name in own_drafts})

    def for_draft(self, own: str | None) -> Session:
        """The session a method runs in: its own draft's, or the shared one."""
        return self.own[own] if own else self.session

    @property
    def models(self) -> list[torch.nn.Module]:
        """Every draft model loaded (for context checks)."""
        return [s.draft for s in (self.session, *self.own.values()) if s.draft is not None]
