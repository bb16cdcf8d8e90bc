"""The drafter interface the engine drives: :class:`Drafter` (protocol + declared capabilities) and
:class:`DecodeState` (what a drafter may read during one generation).

A drafter proposes a :class:`~speculant.core.types.DraftTree` each step and is told what was committed; it never
verifies. The engine knows no drafter by name and reads nothing from a drafter but the three protocol methods and
the capabilities declared here (:func:`capability`), so everything method-specific lives behind this interface.
The implementations are in :mod:`speculant.drafters` (``speculant.drafters.base`` re-exports these names); the
interface lives in ``core`` so that the engine imports nothing from the layers above it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .types import DraftTree, GenerationStats, SamplingParams

__all__ = ["CAPABILITIES", "DecodeState", "Drafter", "capability", "sync"]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA), so that wall-clock timings cover them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeState:
    """What a drafter may read during one generation.

    ``ids`` are all committed token ids (prompt + new); the last one is the root of the next tree (not yet in
    the target's cache). ``remaining`` is how many tokens may still be committed; ``max_draft`` a cap the engine
    may set for the next step (speculation that adapts to load: :mod:`speculant.core.speculation`; None: none). A
    drafter drafts at most :attr:`draft_limit` levels deep.
    """

    target: torch.nn.Module
    ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_length: int  # prompt + max_new_tokens: no position at or past it is ever needed
    remaining: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    # the last verification forward: its logits [Q (+ P probe slots), V] and the accepted node indices
    last_logits: torch.Tensor | None = None
    last_accepted: list[int] = field(default_factory=list)
    # for a drafter declaring ``uses_target_hidden = True`` only: the target's states ([N, F] blocks, in order) of
    # the tokens that entered its cache since the drafter last took them (it clears the list): the outputs of the
    # layers the drafter's ``target_taps`` names, then the final-normed hidden state (F = (taps + 1) H)
    target_hidden: list[torch.Tensor] = field(default_factory=list)
    # with ``uses_target_hidden``, after a verification forward that carried probe slots (types.Probes): their
    # states [P, F] in slot order (ConFu reads its contemplate tokens' final states here), else None
    probe_hidden: torch.Tensor | None = None
    max_draft: int | None = None
    # keys/values of prompt prefixes computed by earlier generations (speculant.core.prefix_cache.PrefixCache), which
    # a drafter with a model of its own may restore into its cache and extend; None: no reuse
    prefixes: Any = None
    # the generation's output constraint (speculant.core.constraint.Constraint), for a drafter declaring
    # ``drafts_constrained = True`` only (None otherwise, or when the output is unconstrained): it drafts under it
    constraint: Any = None

    @property
    def draft_limit(self) -> int:
        """The deepest draft worth proposing this step: ``remaining - 1`` (the step also emits a bonus token, so
        deeper tokens could never be committed), and at most ``max_draft`` when the engine set one."""
        limit = self.remaining - 1
        return limit if self.max_draft is None else min(limit, self.max_draft)

    @contextmanager
    def draft_forward(self, device: torch.device) -> Iterator[None]:
        """Wrap one draft-model forward: counts it and adds its time to ``stats.draft_forward_s``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(device)
            self.stats.draft_forward_s += time.perf_counter() - start
            self.stats.draft_calls += 1


class Drafter(abc.ABC):
    """Proposes draft trees for the one verifier (``speculant.core.verification``); base of every drafter.

    The protocol is :meth:`begin`, :meth:`propose` and :meth:`commit` (and the optional :meth:`prefill`). The
    class attributes below are the
    drafter's *capabilities*, declared with their defaults; a subclass overrides what it has. Subclassing is
    optional: any object with ``begin``/``propose``/``commit`` counts as a Drafter (``isinstance`` checks the
    three methods), and :func:`capability` gives such a third-party drafter the defaults declared here.
    """

    uses_target_hidden: bool = False
    """The drafter reads the target's hidden states (EAGLE-style feature drafters): the engine then collects
    them into :attr:`DecodeState.target_hidden` (prefill and every verified step)."""

    target_taps: Sequence[int] = ()
    """Target layers whose outputs the drafter reads besides the final hidden state (EAGLE-3 style), in the
    order they are concatenated in :attr:`DecodeState.target_hidden`; only with ``uses_target_hidden``."""

    model: torch.nn.Module | None = None
    """The drafter's own draft model, or None (prompt lookup, mask probing). Other components may run it: a
    draft-guided KV policy (SpecKV) drafts its provisional answer with it."""

    drafts_constrained: bool = False
    """The drafter drafts under the generation's output constraint (:attr:`DecodeState.constraint`, which the
    engine sets for such a drafter only): it masks its own draft distribution ``p`` with
    :meth:`~speculant.core.constraint.Constraint.mask_after`, so its drafts are allowed and accepted more often. Exact
    either way (``p`` is whatever it drew from); a drafter without it drafts as usual and its forbidden nodes are
    cut before the target sees them."""

    def params_per_forward(self) -> int | None:
        """Parameters one draft forward reads, for MBSU's cost ratio (``speculant.bench.cost``); None (the
        default): not declared, the bench counts the ``nn.Module``s the drafter holds (0 if none)."""
        return None

    def begin(self, state: DecodeState) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Start a generation: validate against ``state.target`` and reset per-generation state (caches)."""

    @abc.abstractmethod
    def propose(self, state: DecodeState) -> DraftTree:
        """Draft the tree for the next step, rooted at ``state.ids[-1]``."""

    def commit(self, state: DecodeState, accepted: list[int]) -> None:  # noqa: B027 (optional hook)
        """Called after verification with the accepted draft tokens (bonus excluded); ``state.ids`` already
        holds them and the bonus."""

    def prefill(self, state: DecodeState, stop: int) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Read the committed context ``state.ids[:stop]`` ahead of the first proposal (``stop`` < ``len(ids)``).

        A sequence calls it once the target has read the prompt (its time counts as the prompt's prefill, not as
        draft calls), and, when its prompt joins a running batch chunk by chunk, after each chunk, so that a drafter
        with a model of its own reads the prompt at the same pace as the target instead of all at once in its first
        proposal (which would stall every running stream for that whole prefill). A drafter without it reads its
        context in its first proposal."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        # structural: a third-party class with the three protocol methods is a Drafter without subclassing
        if cls is Drafter:
            return all(callable(getattr(other, m, None)) for m in ("begin", "propose", "commit")) or NotImplemented
        return NotImplemented


CAPABILITIES = ("uses_target_hidden", "target_taps", "model", "params_per_forward", "drafts_constrained")
"""The capabilities :class:`Drafter` declares (what :func:`capability` reads)."""

def capability(drafter: Any, name: str) -> Any:
    """The capability ``name`` (one of :data:`CAPABILITIES`) of ``drafter``: its declared value, or the default
    :class:`Drafter` declares when ``drafter`` (a third-party drafter not subclassing it, or None) lacks it;
    ``params_per_forward`` is called. The one place the engine and the bench read a drafter's capabilities."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown drafter capability {name!r}; declared: {', '.join(CAPABILITIES)}")
    declared = drafter is not None and hasattr(drafter, name)
    if name == "params_per_forward":
        own = getattr(drafter, name) if declared else None
        return own() if callable(own) else own  # a plain attribute is accepted too
    return getattr(drafter if declared else Drafter, name)
