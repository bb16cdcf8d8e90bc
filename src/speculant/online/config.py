"""The settings of online adaptation (:class:`OnlineConfig`, ``speculant serve --online-*``) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..train.losses import LOSSES
from .traffic import MIN_SCORE, SCORINGS

__all__ = ["OnlineConfig"]


@dataclass
class OnlineConfig:
    """Settings of online adaptation (``speculant serve --online-*``); a bad value is a ValueError at once."""

    update_every: int = 16
    """Finished requests between two updates."""
    steps: int = 16
    """Optimizer steps per update."""
    batch: int = 4
    """Observations (requests) per step."""
    lr: float = 2e-4
    """AdamW learning rate."""
    loss: str = "fkl"
    """Distillation loss: ``fkl`` (the paper's), ``tvd`` or ``tvd++`` (:mod:`speculant.train.losses`)."""
    positions: str = "rejected"
    """Positions a step trains on: ``rejected`` (where the draft was refused, as the paper) or ``all`` drafted."""
    top_k: int = 32
    """Target probabilities kept per position."""
    max_bytes: int = 32 << 20
    """Bound of the buffer's tensors."""
    holdout_every: int = 5
    """One request in this many is held back for the check."""
    window: int = 512
    """Context tokens a training forward reads before the positions it trains."""
    prompt_weight: float = 0.0
    """Weight of a next-token loss on each request's own text before its first drafted position (its prompt, within
    the ``window`` a training forward reads), added to the distillation loss: the traffic's text itself, with the
    token that follows as the label (no target distribution is known there); 0: off."""
    min_positions: int = 16
    """Refused positions the buffer must hold before an update."""
    min_held: int = 4
    """Held-back requests the buffer must hold before an update: the check compares two drafters' agreement on them,
    and acceptance varies more between requests than within one, so a single request cannot tell a better drafter
    from noise (a copy that passes on one held-back request by a position or two can draft worse than the drafter it
    replaces on most of the requests it then serves)."""
    min_z: float = 1.64
    """How sure the check must be that the copy agrees more: McNemar's z over the held-back positions where exactly
    one of the two drafters agrees with the target, ``(gained - lost) / sqrt(gained + lost)``; the copy is swapped
    in only if ``z >= min_z`` (1.64: one-sided 5% were positions independent; 0: only "agreement did not drop").
    A copy distilled a few steps on a few requests often moves agreement by noise alone, and "did not drop" then
    passes about half the time, swapping in copies that draft no better or worse."""
    distill: bool = True
    """Distil the draft model on the traffic (the updates above); False: the traffic memory only (``traffic`` > 0),
    for any method, with or without a draft model, quantized or not."""
    traffic: int = 0
    """Tokens per step drafted from the traffic memory (:mod:`speculant.online.traffic`: every finished request's
    tokens, looked up like prompt lookup and merged into each draft as one more chain, or with ``traffic_tree`` a
    tree this deep); 0: none. The memory is shared by every request (its module doc says what a response's
    acceptance then tells of earlier ones). Where its chain is accepted the position counts as not refused, so with
    ``positions="rejected"`` the draft model does not train there (as with ``lookup=N``)."""
    traffic_min_ngram: int = 1
    """The shortest context suffix (tokens, 1-3) the traffic memory drafts from; 2 drops the chains a single token's
    continuation offers: fewer draft nodes per step for slightly less τ, for CPUs where every verified row costs."""
    traffic_scoring: str = "frequent"
    """How the traffic memory picks among earlier occurrences of the context
    (:data:`~speculant.online.traffic.SCORINGS`): ``"frequent"`` walks its n-gram counts (what most often followed),
    which sharpen as the traffic grows, and with the default ``traffic_min_score`` drafts fewer tokens per step than
    ``"recent"``, which copies what followed the most recent occurrence."""
    traffic_min_score: float = MIN_SCORE
    """``"frequent"`` scoring: end the memory's chain where its estimated chance of being right falls below this
    (:class:`~speculant.online.traffic.TrafficMemory`'s ``min_score``); 0: no bound. Raise it where a verified row
    costs more (a quantized 1.5B target on a CPU), lower it where rows are nearly free."""
    traffic_tree: int = 0
    """``"frequent"`` scoring: draft the memory's tree of at most this many nodes instead of its one chain
    (:meth:`~speculant.online.traffic.TrafficMemory.tree`: the best-scoring continuations side by side, each down to
    ``traffic_min_score``); 0: the chain. The memory's counts cover more of the traffic as it grows, while a chain
    proposes only the most frequent continuation; a tree proposes the others too, for more verified rows per step.
    Pair it with a lower ``traffic_min_score`` (a tree of 64 nodes grows little above 0.1). Where verified rows cost
    much (a small CPU) a large tree's rows can cost more than its τ gains; where rows cost little it should pay."""
    traffic_tokens: int = 1 << 17
    """Bound of the traffic memory, in tokens (a few hundred bytes each with ``"frequent"`` scoring, fewer with
    ``"recent"``'s index; more where the traffic repeats few n-grams)."""
    quiet_s: float = 0.25
    """In a server, the idle time before training steps: under steady load (no idle gap that long) updates wait, so
    requests never queue behind training; a request that arrives meanwhile waits for one step at most."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"online loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.positions not in ("rejected", "all"):
            raise ValueError(f"online positions must be 'rejected' or 'all', got {self.positions!r}")
        if not self.prompt_weight >= 0:  # also refuses nan
            raise ValueError(f"online prompt_weight must be >= 0, got {self.prompt_weight}")
        if not self.min_z >= 0:  # also refuses nan
            raise ValueError(f"online min_z must be >= 0, got {self.min_z}")
        if self.traffic < 0:
            raise ValueError(f"online traffic must be >= 0 tokens (0: no traffic memory), got {self.traffic}")
        if not 1 <= self.traffic_min_ngram <= 3:
            raise ValueError(f"online traffic_min_ngram must be 1, 2 or 3 (the memory matches suffixes of at most 3 "
                             f"tokens), got {self.traffic_min_ngram}")
        if self.traffic_scoring not in SCORINGS:
            raise ValueError(f"online traffic_scoring must be one of {', '.join(SCORINGS)}, got "
                             f"{self.traffic_scoring!r}")
        if not 0 <= self.traffic_min_score < 1:  # also refuses nan
            raise ValueError(f"online traffic_min_score must be in [0, 1), got {self.traffic_min_score}")
        if not (isinstance(self.traffic_tree, int) and not isinstance(self.traffic_tree, bool)
                and self.traffic_tree >= 0):
            raise ValueError(f"online traffic_tree must be an integer >= 0 nodes (0: a chain), got "
                             f"{self.traffic_tree!r}")
        if self.traffic_tree and not self.traffic:
            raise ValueError("online traffic_tree needs traffic > 0 (the tree's depth, in tokens)")
        if self.traffic_tree and self.traffic_scoring != "frequent":
            raise ValueError("online traffic_tree needs frequent traffic scoring (a tree walks the memory's counts)")
        if not self.distill and not self.traffic:
            raise ValueError("online adaptation without distillation adapts nothing: give traffic > 0 (the traffic "
                             "memory's tokens per step)")
        for name in ("update_every", "steps", "batch", "top_k", "window", "max_bytes", "min_held", "traffic_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"online {name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"online lr must be positive, got {self.lr}")
        if not self.quiet_s >= 0:
            raise ValueError(f"online quiet_s must be >= 0 seconds, got {self.quiet_s}")
