"""``generate()``, ``generate_steps()`` and ``generate_batch()``: the speculative decoding loop. It knows no method
names: a drafter proposes a tree (:class:`~speculant.core.drafting.Drafter`), the one verifier decides.

Invariant: the target's cache holds every committed token except the last one, the *root*. Each step feeds
``[root] + draft tree`` in one forward (tree mask + position ids), verifies, keeps the root and the accepted path
in the cache and makes the bonus token the next root (:class:`~speculant.core.sequence.Sequence`). Plain decoding
(``drafter=None``) is the same loop with an empty tree, so it is the fair baseline: same model-call code, same
cache. All three entry points run a :class:`~speculant.core.batch.Batch` (one sequence for :func:`generate` and
:func:`generate_steps`): one code path whether one sequence decodes or many.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .batch import Batch
from .checks import check_stream
from .constraint import Constraint
from .drafting import Drafter
from .eviction import EvictionPolicy
from .prefix_cache import PrefixCache
from .types import Generation, StepEvent

__all__ = ["Steps", "generate", "generate_batch", "generate_steps"]

log = logging.getLogger(__name__)


def generate(
    target: torch.nn.Module,
    input_ids,
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    stream: Callable[..., None] | None = None,
    kv_policy: EvictionPolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    prompt_embeds: torch.Tensor | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Constraint | None = None,
) -> Generation:
    """The decoding loop behind :func:`speculant.generate` (see it for every argument), on resolved objects only.

    ``drafter`` is a :class:`~speculant.core.drafting.Drafter` (any object with ``begin``/``propose``/``commit``)
    or None for plain decoding; ``kv_policy`` an :class:`EvictionPolicy` (``speculant.kv.resolve_eviction``) or None.
    Method names, draft models and policy names are resolved by :func:`speculant.generate` (``speculant.api``),
    not here: the engine knows no method or policy by name. The engine reads only the drafter's declared
    capabilities (:func:`~speculant.core.drafting.capability`) and the policy's interface.

    ``stream(ids)`` (``stream(ids, logprobs)`` when ``logprobs`` is asked for) is called with each step's committed
    tokens. ``prompt_embeds [1, T, H]``: the prompt's embeddings to prefill with (a vision-language prompt, see
    :meth:`speculant.core.batch.Batch.add`). ``prefix_cache``: keys/values of prompt prefixes earlier generations
    computed (:class:`~speculant.core.prefix_cache.PrefixCache`), reused and extended by this one (target and draft
    model); None: the whole prompt is computed. ``constraint``: the output constraint to decode under
    (:mod:`speculant.core.constraint`; a fresh one per generation); None: unconstrained. Built on
    :func:`generate_steps`.
    """
    check_stream(stream)
    steps = generate_steps(target, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed,
                           eos_token_id, kv_policy, kv_budget, kv_block, forward, logprobs, prompt_embeds,
                           prefix_cache, constraint)
    for event in steps:
        if stream is not None:
            if event.logprobs is None:
                stream(event.tokens)
            else:  # asked for: the stream takes the step's logprobs too (stream(ids) callers never see them)
                stream(event.tokens, event.logprobs)
    return steps.result


class Steps:
    """An iterator over one generation's steps (:func:`generate_steps`): each item is a
    :class:`~speculant.core.types.StepEvent` (the tokens committed, what was accepted of what was drafted);
    :attr:`result` is the :class:`~speculant.core.types.Generation` once the iteration ended (the last event has
    ``done``), or the generation so far after :meth:`close` (finish reason ``"cancelled"``)."""

    def __init__(self, batch: Batch, index: int) -> None:
        self._batch, self._index = batch, index
        self._result: Generation | None = None

    def __iter__(self) -> Steps:
        return self

    def __next__(self) -> StepEvent:
        if self._result is not None:
            raise StopIteration
        event = self._batch.step()[0]
        if event.done:
            self._result = self._batch.result(self._index)
            self._batch.release(self._index)
        return event

    def close(self) -> Generation:
        """Stop decoding now; returns (and :attr:`result` holds) the generation so far."""
        if self._result is None:
            self._result = self._batch.cancel(self._index)
            self._batch.release(self._index)
        return self._result

    @property
    def result(self) -> Generation:
        """The generation; a ValueError while steps remain (iterate to the end, or :meth:`close`)."""
        if self._result is None:
            raise ValueError("the generation is not finished: iterate over its steps to the end, or close() it")
        return self._result


def generate_steps(
    target: torch.nn.Module,
    input_ids,
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    kv_policy: EvictionPolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    prompt_embeds: torch.Tensor | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Constraint | None = None,
) -> Steps:
    """:func:`generate` as an iterator of steps (:class:`Steps`): the arguments are checked and the prompt is
    prefilled at once, then each ``next()`` runs one decoding step and returns its
    :class:`~speculant.core.types.StepEvent`; :meth:`Steps.close` stops early (e.g. a client that went away)."""
    batch = Batch(target, forward, prefixes=prefix_cache)
    index = batch.add(input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, kv_policy,
                      kv_budget, kv_block, logprobs, prompt_embeds=prompt_embeds, constraint=constraint)
    return Steps(batch, index)


def generate_batch(
    target: torch.nn.Module,
    prompts: list,
    drafters: list[Drafter | None] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | list[int | None] | None = None,
    eos_token_id: int | list[int] | None = None,
    kv_policy: EvictionPolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    speculation: str = "on",
    prefix_cache: PrefixCache | None = None,
    constraints: list[Constraint | None] | None = None,
) -> list[Generation]:
    """Decode several prompts together (:class:`~speculant.core.batch.Batch`): one verification forward per step
    for every unfinished sequence, each with its own drafter (``drafters[i]``, a distinct object per prompt, or
    None for plain decoding; None: plain decoding for all) and cache. ``seed``: one for all or one per prompt;
    the other settings apply to every prompt (see :func:`speculant.generate`); ``speculation``: ``"on"`` (each
    drafter as deep as it likes), ``"off"`` or ``"auto"`` (depths chosen per step by goodput,
    :mod:`speculant.core.speculation`); ``prefix_cache`` as in :func:`generate`. Returns one
    :class:`~speculant.core.types.Generation` per prompt, in order (``constraints``: one output constraint, or None,
    per prompt; None: all unconstrained); each equals what :func:`generate` gives the
    prompt alone, token for token, greedy, with quantized weights (see the batch module on float weights)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id sequences")
    if drafters is None:
        drafters = [None] * len(prompts)
    if not isinstance(drafters, (list, tuple)) or len(drafters) != len(prompts):
        raise ValueError(f"drafters must be a list with one drafter (or None) per prompt: got "
                         f"{len(drafters) if isinstance(drafters, (list, tuple)) else type(drafters).__name__} for "
                         f"{len(prompts)} prompts")
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seed: give one seed, or one per prompt ({len(prompts)}), got {len(seeds)}")
    if constraints is None:
        constraints = [None] * len(prompts)
    if not isinstance(constraints, (list, tuple)) or len(constraints) != len(prompts):
        raise ValueError(f"constraints must be a list with one constraint (or None) per prompt ({len(prompts)})")
    batch = Batch(target, forward, speculation, prefix_cache)
    kv = {"kv_policy": kv_policy, "kv_budget": kv_budget, "kv_block": kv_block}  # each sequence its own budget
    ids = [batch.check(p, d, max_new_tokens, temperature, top_k, top_p, s, eos_token_id, logprobs=logprobs, **kv)
           for p, d, s in zip(prompts, drafters, seeds)]  # every prompt checked before any is prefilled
    if len({id(d) for d in drafters if d is not None}) < sum(d is not None for d in drafters):
        raise ValueError("a drafter object serves one sequence at a time: give each prompt its own drafter")
    indices = [batch.add(p, d, max_new_tokens, temperature, top_k, top_p, s, eos_token_id, logprobs=logprobs,
                         constraint=c, **kv) for p, d, s, c in zip(ids, drafters, seeds, constraints)]
    while len(batch):
        batch.step()
    return [batch.result(i) for i in indices]
