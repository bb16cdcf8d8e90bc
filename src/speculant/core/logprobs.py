"""The target's log-probabilities of the tokens it emits, read from the verification forward's own logits.

Every emitted token (an accepted draft token or the bonus) was accepted or drawn at one row of the target's
verification logits: row 0 (after the root) for the first, row ``n + 1`` (after accepted node ``n``) for the
token after node ``n``. Those rows are exactly the target's next-token logits of a plain teacher-forced forward
over the committed sequence (the tree mask gives each node its own path as context), so the log-probabilities come
out of verification with no extra forward. They are of the RAW distribution (log softmax of the logits before
temperature / top-k / top-p): what OpenAI and vLLM report by default.
"""

from __future__ import annotations

import torch

from .types import TokenLogprob

__all__ = ["emission_rows", "token_logprobs"]


def emission_rows(accepted: list[int]) -> list[int]:
    """Row of the verification logits each emitted token comes from: ``[0, 1 + accepted[0], ...]`` (one per
    accepted node, then the bonus's)."""
    return [0] + [1 + n for n in accepted]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``logits [E, V]`` (the rows the ``E`` tokens were emitted from), ``tokens`` ``[E]``: each token's raw
    log-probability and the ``top`` most likely ``(id, logprob)`` of its row (two host transfers in all)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [E, V]
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()  # [E]
    k = min(top, logp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = torch.topk(logp, k, dim=-1)  # [E, k], most likely first
    return [TokenLogprob(t, lp, tuple(zip(i, v)))
            for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
