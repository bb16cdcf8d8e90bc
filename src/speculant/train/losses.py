"""Distillation losses between the target (teacher, ``q``) and the draft (student, ``p_θ``).

Direct Alignment (Goel et al. 2024): forward KL, and total variation distance, whose minimisation is what
speculative decoding rewards (acceptance rate = 1 - TVD). TVD's gradient is a policy gradient with reward
``r(x) = 1[q(x) > p_θ(x)]``, taken exactly over the vocabulary; TVD++ replaces ``r`` by its normalised advantage
``(r - mean r) / std r`` with statistics over the batch's tokens (the paper's exact normalisation is not
confirmed: the three share one interface and block efficiency decides).
"""

from __future__ import annotations

import torch

__all__ = ["distill_loss", "distill_loss_probs", "LOSSES"]

LOSSES = ("fkl", "tvd", "tvd++")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "fkl") -> torch.Tensor:
    """Mean per-token loss; logits ``[..., V]`` (the teacher's are treated as constants)."""
    return distill_loss_probs(student_logits, teacher_logits.detach().float().softmax(-1), kind)


def distill_loss_probs(student_logits: torch.Tensor, q: torch.Tensor, kind: str = "fkl") -> torch.Tensor:
    """Mean per-token loss from the teacher's probabilities ``q`` ``[..., V]`` (constants).

    ``q`` may be known on part of the vocabulary only (zeros elsewhere, e.g. the teacher's top-k restricted to
    the drafter's VocabTrim set): each loss then uses ``q``'s exact values where known, which is what the
    acceptance rate ``Σ min(p_θ, q)`` of the deployed (trimmed) drafter depends on."""
    logp = student_logits.float().log_softmax(-1)  # [..., V]
    q = q.detach().float()
    if kind == "fkl":  # Σ q log(q / p_θ), up to the teacher's entropy (a constant)
        return -(q * logp).sum(-1).mean()
    p = logp.exp()
    if kind == "tvd":
        reward = (q > p).float()
    elif kind == "tvd++":
        r = (q > p).float()
        reward = (r - r.mean()) / r.std().clamp_min(1e-6)
    else:
        raise ValueError(f"unknown distillation loss {kind!r}; known: {', '.join(LOSSES)}")
    # surrogate whose gradient is -Σ_x p_θ(x) r(x) ∇log p_θ(x) (the exact TVD policy gradient)
    return -((p * reward).detach() * logp).sum(-1).mean()
