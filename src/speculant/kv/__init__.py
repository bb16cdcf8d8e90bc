"""KV-cache eviction under a memory budget: score policies, a bounded cache and block-wise prefill.

Typical use::

    from speculant.kv import BudgetCache, parse_policy, prefill_blockwise, evict
    policy = parse_policy("caote:keydiff")
    cache = BudgetCache(num_layers, capacity=budget + block)
    last_logits = prefill_blockwise(model, input_ids, cache, policy, budget, block)

In the speculative decoding loop (after ``cache.keep(...)`` of the accepted path; the cache then holds only
verified tokens): position ids are ``cache.position_ids(Q)`` for a chain and the tree's positions shifted by
``cache.next_position - cache.length`` for a tree; attention policies wrap the target forward in
``QueryCapture(target)``, then ``cap.keep_rows([0] + [1 + n for n in accepted])`` and ``attn = observe(cache, cap)``;
finally ``evict(cache, policy, budget, attn=attn)``. The engine does all of this through one object,
``resolve_eviction(policy).budgeted(num_layers, budget, block)`` (:class:`Eviction` makes a :class:`BudgetedKV`,
the interfaces :mod:`speculant.core.eviction` declares), after ``bind_draft(drafter_model)``; a policy shapes
prefill through its hooks (:meth:`ScorePolicy.prefill_passes`, :meth:`ScorePolicy.prefill_observers`).
"""

from .attention import QueryCapture, attention_probs
from .budget import BudgetCache, BudgetedKV, BudgetLayer, Eviction, evict, observe, prefill_blockwise
from .caote import CAOTE, caote_scores, warn_nesting
from .policies import (
    H2O,
    TOVA,
    KeyDiff,
    KeyNorm,
    MassPolicy,
    Protect,
    RandomScore,
    ScoreContext,
    ScorePolicy,
    SnapKV,
    Streaming,
    pin_window,
)
from .registry import POLICIES, WRAPPERS, parse_policy, policy_names, resolve_eviction
from .speckv import SpecKV

__all__ = [
    "warn_nesting",
    "CAOTE",
    "H2O",
    "POLICIES",
    "TOVA",
    "WRAPPERS",
    "BudgetCache",
    "BudgetedKV",
    "BudgetLayer",
    "Eviction",
    "KeyDiff",
    "KeyNorm",
    "MassPolicy",
    "Protect",
    "QueryCapture",
    "RandomScore",
    "ScoreContext",
    "ScorePolicy",
    "SnapKV",
    "SpecKV",
    "Streaming",
    "attention_probs",
    "caote_scores",
    "evict",
    "observe",
    "parse_policy",
    "pin_window",
    "policy_names",
    "prefill_blockwise",
    "resolve_eviction",
]
