"""The bounded buffer of verified positions an online drafter trains and validates on.

Holds :class:`~.observed.Observation` s (one per finished request), oldest evicted first once
their tensors exceed ``max_bytes``. Every ``holdout_every``-th request is held back: updates train on the others and
are checked on these (an update that lowers agreement on held-back traffic is rolled back), so the check never
sees data the update was fitted to.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .observed import Observation

__all__ = ["OnlineBuffer"]

_FIELDS = ("ids", "positions", "top_ids", "top_p", "rejected")


class OnlineBuffer:
    """Observations in arrival order, bounded by ``max_bytes`` (their tensors); one in ``holdout_every`` held
    back for validation."""

    def __init__(self, max_bytes: int = 32 << 20, holdout_every: int = 5) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if holdout_every < 2:
            raise ValueError(f"holdout_every must be >= 2 (one request in N is held back), got {holdout_every}")
        self.max_bytes, self.holdout_every = max_bytes, holdout_every
        self._items: deque[tuple[bool, Observation]] = deque()  # (held back, observation)
        self._bytes = 0
        self.added = 0  # observations ever added (the hold-out counter; survives eviction and restarts)

    def add(self, observation: Observation) -> None:
        """Keep ``observation`` (evicting the oldest beyond the bound; one larger than the bound alone is cut to
        its last positions)."""
        observation = _fit(observation, self.max_bytes)
        held = self.added % self.holdout_every == self.holdout_every - 1
        self.added += 1
        self._items.append((held, observation))
        self._bytes += observation.nbytes
        while self._bytes > self.max_bytes and self._items:
            self._bytes -= self._items.popleft()[1].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the observations held (at most ``max_bytes``)."""
        return self._bytes

    def train(self) -> list[Observation]:
        """The observations updates train on, oldest first."""
        return [o for held, o in self._items if not held]

    def held(self) -> list[Observation]:
        """The held-back observations, oldest first."""
        return [o for held, o in self._items if held]

    def positions(self, rejected_only: bool = False, held: bool = False) -> int:
        """How many positions the training (or held-back) observations hold (refused ones only)."""
        return sum(int(o.rejected.sum()) if rejected_only else len(o) for h, o in self._items if h == held)

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> dict[str, Any]:
        """Everything to rebuild the buffer (``torch.save``-able)."""
        return {"max_bytes": self.max_bytes, "holdout_every": self.holdout_every, "added": self.added,
                "items": [(held, {f: getattr(o, f) for f in _FIELDS}) for held, o in self._items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s contents (this buffer's bound applies)."""
        self._items.clear()
        self._bytes = 0
        for held, fields in state["items"]:
            o = Observation(**fields)
            self._items.append((bool(held), o))
            self._bytes += o.nbytes
        self.added = int(state["added"])
        while self._bytes > self.max_bytes and self._items:
            self._bytes -= self._items.popleft()[1].nbytes


def _fit(o: Observation, max_bytes: int) -> Observation:
    """``o`` cut to its last positions (and the ids they need) until it fits ``max_bytes``."""
    while o.nbytes > max_bytes and len(o) > 1:
        keep = torch.arange(len(o) // 2, len(o))
        o = Observation(ids=o.ids, positions=o.positions[keep], top_ids=o.top_ids[keep], top_p=o.top_p[keep],
                        rejected=o.rejected[keep])
        if o.nbytes > max_bytes:  # the ids alone: keep the last ones the positions need (start re-based below)
            start = int(o.positions.min()) - 1
            o = Observation(ids=o.ids[start:], positions=o.positions - start, top_ids=o.top_ids, top_p=o.top_p,
                            rejected=o.rejected)
    return o
