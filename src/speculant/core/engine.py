"""``generate()``, ``generate_steps()`` and ``generate_batch()``: the speculative decoding loop. It knows no method
names (../shared/DESIGN.md, The flow).

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
from .checks import (
    as_id_list,
    check_fits_context,
    check_logprobs,
    check_positive_int,
    check_stream,
    check_token_ids,
    num_layers,
    resolve_eos,
    vocab_size,
    warn_once,
)
from .drafting import Drafter, capability
from .eviction import BudgetedKV, EvictionPolicy
from .forward import FORWARDS
from .types import Generation, SamplingParams, StepEvent

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
) -> Generation:
    """The decoding loop behind :func:`speculant.generate` (see it for every argument), on resolved objects only.

    ``drafter`` is a :class:`~speculant.core.drafting.Drafter` (any object with ``begin``/``propose``/``commit``)
    or None for plain decoding; ``kv_policy`` a ``speculant.kv.ScorePolicy`` (:class:`EvictionPolicy`) or None.
    Method names, draft models and policy names are resolved by :func:`speculant.generate` (``speculant.api``),
    not here: the engine knows no method or policy by name. The engine reads only the drafter's declared
    capabilities (:func:`~speculant.core.drafting.capability`) and the policy's interface.

    ``stream(ids)`` (``stream(ids, logprobs)`` when ``logprobs`` is asked for) is called with each step's committed
    tokens. Built on :func:`generate_steps`.
    """
    check_stream(stream)
    steps = generate_steps(target, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed,
                           eos_token_id, kv_policy, kv_budget, kv_block, forward, logprobs)
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
) -> Steps:
    """:func:`generate` as an iterator of steps (:class:`Steps`): the arguments are checked and the prompt is
    prefilled at once, then each ``next()`` runs one decoding step and returns its
    :class:`~speculant.core.types.StepEvent`; :meth:`Steps.close` stops early (e.g. a client that went away)."""
    batch = Batch(target, _check_forward(forward))
    request = _request(target, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                       kv_policy, kv_budget, kv_block, logprobs)
    return Steps(batch, batch.add(**request))


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
    forward: str = "auto",
    logprobs: int | None = None,
) -> list[Generation]:
    """Decode several prompts together (:class:`~speculant.core.batch.Batch`): one verification forward per step
    for every unfinished sequence, each with its own drafter (``drafters[i]``, a distinct object per prompt, or
    None for plain decoding; None: plain decoding for all) and cache. ``seed``: one for all or one per prompt;
    the other settings apply to every prompt (see :func:`speculant.generate`). Returns one
    :class:`~speculant.core.types.Generation` per prompt, in order; each equals what :func:`generate` gives the
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
    batch = Batch(target, _check_forward(forward))
    requests = [_request(target, ids, d, max_new_tokens, temperature, top_k, top_p, s, eos_token_id, None, None,
                         128, logprobs) for ids, d, s in zip(prompts, drafters, seeds)]
    indices = [batch.add(**r) for r in requests]
    while len(batch):
        batch.step()
    return [batch.result(i) for i in indices]


def _check_forward(forward: str) -> str:
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    return forward


def _request(target, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, kv_policy,
             kv_budget, kv_block, logprobs) -> dict:
    """One generation's arguments checked (one-line ValueErrors) and resolved into :meth:`Batch.add`'s."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if params.greedy and (top_k is not None or top_p not in (None, 1.0)):
        warn_once(log, "top_k / top_p have no effect with greedy decoding (temperature 0)")
    ids = as_id_list(input_ids)
    vocab = vocab_size(target)
    check_token_ids(ids, vocab, "input_ids")
    check_positive_int("max_new_tokens", max_new_tokens)
    check_logprobs(logprobs)
    check_fits_context(target, len(ids), max_new_tokens)
    stops = resolve_eos(target, eos_token_id)
    if eos_token_id is not None:
        check_token_ids(sorted(stops), vocab, "eos_token_id")
    _check_drafter(drafter)
    if target.training:
        log.warning("target model was in training mode (dropout active); switching it to eval mode")
        target.eval()
    _check_kv(kv_policy, kv_budget, kv_block)
    kv: BudgetedKV | None = None
    if kv_policy is not None:
        kv_policy.bind_draft(capability(drafter, "model"))  # SpecKV drafts with the drafter's model
        kv = kv_policy.budgeted(num_layers(target), kv_budget, kv_block)
    return {"ids": ids, "drafter": drafter, "max_new_tokens": max_new_tokens, "params": params, "stops": stops,
            "kv": kv, "logprobs": logprobs}


_RESOLVE = "use speculant.generate, which resolves names and models, or pass the resolved object"


def _check_drafter(drafter) -> None:
    """A one-line ValueError unless ``drafter`` is None or a Drafter (a name or a model belongs to the wrapper)."""
    if drafter is None or isinstance(drafter, Drafter):
        return
    got = repr(drafter) if isinstance(drafter, str) else type(drafter).__name__
    raise ValueError(f"drafter: speculant.core.engine.generate takes a Drafter or None, got {got:.80}; {_RESOLVE} "
                     "(speculant.build_drafter)")


def _check_kv(kv_policy, kv_budget, kv_block) -> None:
    """One-line errors for inconsistent KV settings (eviction needs a policy object and a budget)."""
    check_positive_int("kv_block", kv_block)  # checked even unused: a wrong type is a mistake either way
    if kv_policy is None and kv_budget is None:
        return None
    if kv_policy is None or kv_budget is None:
        raise ValueError("KV eviction needs both kv_policy and kv_budget (e.g. kv_policy='keydiff', kv_budget=256)")
    if not isinstance(kv_policy, EvictionPolicy):
        got = repr(kv_policy) if isinstance(kv_policy, str) else type(kv_policy).__name__
        raise ValueError(f"kv_policy: speculant.core.engine.generate takes a ScorePolicy or None, got {got:.80}; "
                         f"{_RESOLVE} (speculant.kv.parse_policy)")
    check_positive_int("kv_budget", kv_budget)
