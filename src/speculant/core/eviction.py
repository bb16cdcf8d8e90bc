"""The KV-eviction interface the engine drives: what it asks of a KV policy and of a budgeted cache.

The policies, the bounded cache and block-wise prefill are in :mod:`speculant.kv`: ``speculant.kv.Eviction`` (a
score policy paired with the budgeted cache) implements :class:`EvictionPolicy` and
``speculant.kv.budget.BudgetedKV`` implements :class:`BudgetedKV`. The interface lives in ``core`` so that the
engine imports nothing from the layers above it and knows no policy by type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .cache import SpecCache

__all__ = ["BudgetedKV", "EvictionPolicy"]


class BudgetedKV(Protocol):
    """One generation's target KV cache, kept to at most ``budget`` tokens per layer.

    The engine prefills through it, asks it before each verification forward for a query capture (None when
    the policy reads no attention) and tells it after verification which of the forward's rows were kept (the
    cache then holds only verified tokens, which it may evict). Slots are not positions once it has evicted:
    the engine shifts its position ids by ``next_position - cache.length``.
    """

    cache: SpecCache

    @property
    def next_position(self) -> int:
        """Original position of the next token to append (= tokens ever committed)."""

    @property
    def peak_nbytes(self) -> int:
        """Largest live key/value bytes seen."""

    def prefill(self, target: torch.nn.Module, input_ids: torch.Tensor, following: Sequence[int], forward: Any,
                hidden_out: list | None) -> None:
        """Feed ``input_ids [1, T]`` (block-wise, evicting to the budget); ``following``: the tokens known to come
        next (the root); ``forward``: the engine's target forward; ``hidden_out`` as the forward takes it."""

    def capture(self, target: torch.nn.Module) -> Any | None:
        """A query capture (a context manager the target forward enters) for the next forward, or None."""

    def after_step(self, capture: Any | None, rows: list[int]) -> None:
        """After ``cache.keep``: ``rows`` of the last forward's inputs were kept; evict back to the budget."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the engine reads of a KV policy (``speculant.kv.Eviction`` implements it for a ``ScorePolicy``)."""

    def bind_draft(self, model: torch.nn.Module | None) -> None:
        """Receive the drafter's own model (``Drafter.model``) before prefill; see
        ``speculant.kv.ScorePolicy.bind_draft``."""

    def budgeted(self, num_layers: int, budget: int, block: int) -> BudgetedKV:
        """A fresh budgeted cache evicting with this policy (prefill blocks of ``block`` tokens)."""
