"""The check of an online update: does the trained copy agree with the target more often than the serving drafter?

Agreement at a drafted position: the model's greedy token is the target's most probable one there (the acceptance of
a greedy draft). The two drafters are compared on the same held-back positions, and the copy passes only if it
gained more positions than it lost by more than noise: McNemar's test over the paired positions,
``z = (gained - lost) / sqrt(gained + lost)``.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from .observed import Observation
from .window import window_logits

__all__ = ["agreement_hits", "mcnemar_z", "share"]


def agreement_hits(model: torch.nn.Module, observations: list[Observation], window: int
                   ) -> Generator[None, None, torch.Tensor]:
    """Generator (yields after each forward) returning ``[N]`` bool over the drafted positions of ``observations``
    (those inside the context ``window``), in order: ``model``'s greedy token is the target's."""
    hits = []
    for o in observations:
        with torch.no_grad():
            logits, selected, _ = window_logits(model, o, torch.ones_like(o.rejected), window)  # [P, V]
        hits.append(logits.argmax(-1) == o.top_ids[selected, 0].long())  # [P]
        yield
    return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)


def share(hits: torch.Tensor) -> float:
    """The share of True in ``hits`` ``[N]`` (nan when empty)."""
    return float(hits.float().mean()) if hits.numel() else float("nan")


def mcnemar_z(was: torch.Tensor, now: torch.Tensor) -> tuple[int, int, float]:
    """``(gained, lost, z)`` between the paired hits ``was`` and ``now`` ``[N]`` bool: positions only ``now`` agrees
    at, positions only ``was`` agrees at, and McNemar's z (0 when no position changed)."""
    gained, lost = int((now & ~was).sum()), int((was & ~now).sum())
    z = (gained - lost) / (gained + lost) ** 0.5 if gained + lost else 0.0
    return gained, lost, z
