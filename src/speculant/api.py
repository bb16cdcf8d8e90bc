"""``speculant.generate`` (and ``generate_steps``, ``generate_batch``): the public entry points, which resolve names
and models, then run the engine.

The engine (:func:`speculant.core.engine.generate`) takes resolved objects only (a Drafter or None, a KV policy
object or None) and knows no method or policy by name; this wrapper is the edge where a method spec string, a draft
model or a policy name becomes one, through the registries (:mod:`speculant.drafters.registry`,
:mod:`speculant.kv.registry`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .core import engine
from .core.checks import as_id_list, check_stream
from .core.constraint import Constraint
from .core.prefix_cache import PrefixCache
from .core.types import Generation
from .drafters.base import Drafter
from .drafters.registry import resolve_drafter
from .kv.policies import ScorePolicy
from .kv.registry import resolve_eviction
from .structured import compile_response_format

__all__ = ["constraint_for", "generate", "generate_batch", "generate_steps"]


def constraint_for(response_format: dict | None, tokenizer) -> Constraint | None:
    """One generation's output constraint for ``response_format`` (None: none), compiled for ``tokenizer``
    (:func:`speculant.structured.compile_response_format`, cached); a one-line ValueError for a bad format or a
    missing tokenizer."""
    if response_format is None:
        return None
    if tokenizer is None:
        raise ValueError("response_format needs the target's tokenizer: pass tokenizer= (a Session has its own)")
    return compile_response_format(response_format, tokenizer).constraint()


def generate(
    target: torch.nn.Module,
    input_ids,
    drafter: Drafter | torch.nn.Module | str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    stream: Callable[..., None] | None = None,
    kv_policy: str | ScorePolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    prompt_embeds: torch.Tensor | None = None,
    prefix_cache: PrefixCache | None = None,
    response_format: dict | None = None,
    tokenizer=None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` with ``target``, losslessly accelerated.

    Args:
        target: any transformers causal LM (``AutoModelForCausalLM``).
        input_ids: the prompt, one sequence: a list of ints, a 1-D or ``[1, T]`` tensor or numpy array of
            integers, or a tokenizer's output (``BatchEncoding`` or a dict with ``input_ids``); batches of more
            than one sequence are refused (:func:`speculant.core.checks.as_id_list`).
        drafter: proposes draft tokens (e.g. :class:`speculant.DraftModelDrafter`); ``None`` is plain
            autoregressive decoding through the same model-call code. A draft model (``torch.nn.Module``) gets
            the default chain drafter; a method spec string (``"lookup"``, ``"mask-probe:masks=3"``) builds that
            method (:func:`speculant.build_drafter`; methods that draft with a model need it built with the model).
        temperature: 0 for greedy decoding (output token-identical to plain greedy); > 0 samples, and the
            output distribution is exactly the target's under the same temperature/top-k/top-p.
        top_k, top_p: filters applied identically to target and draft.
        seed: makes sampling reproducible.
        eos_token_id: stop token(s); ``None`` takes them from the model's generation config. The stop token
            is included in the output. Token ids (prompt and stop tokens) must be in ``[0, vocab)``.
        stream: called with each list of newly committed token ids as soon as they are committed; with
            ``logprobs`` set it is called as ``stream(ids, logprobs)`` (the step's
            :class:`~speculant.core.types.TokenLogprob` list), so a ``stream(ids)`` callback is unaffected
            unless logprobs are asked for.
        kv_policy, kv_budget: KV-cache eviction (:mod:`speculant.kv`): the target's cache keeps at most
            ``kv_budget`` tokens per layer, chosen by the policy (a name such as ``"keydiff"`` or
            ``"caote:h2o"``, or a policy object). The prompt is prefilled in blocks of ``kv_block`` tokens,
            evicting back to the budget after each (peak ``kv_budget + kv_block`` tokens); while decoding,
            committed tokens are evicted back to the budget once they fill the block's room (after every
            verification step for blocks of up to 64 tokens, :class:`speculant.kv.budget.BudgetedKV`; draft tokens
            are never evicted before they are verified). The output is then exact given the evicted cache, not
            equal to full-cache decoding.
        forward: the target forward (:mod:`speculant.core.target_forward`): ``"auto"`` the lean forward
            (:class:`speculant.core.llama_forward.LlamaForward`) where it reproduces the model, else the model's own;
            ``"lean"`` requires it; ``"model"`` always uses the model's own (transformers) forward.
        logprobs: None (default: nothing is computed) or K >= 0: record, for every new token, the target's
            log-probability of it under its raw distribution (before temperature/top-k/top-p) and the K most
            likely alternatives of the same row, in ``Generation.logprobs``. They come from the verification
            forward's logits (no extra forward); the tokens are unchanged.
        prompt_embeds: ``[1, T, H]`` input embeddings of the prompt's ``T`` tokens to prefill with instead of the
            ids' own: a vision-language prompt, its image features in place of its image tokens
            (:func:`speculant.models.vlm.prompt_embeds`, with ``target`` the model's
            :func:`~speculant.models.vlm.text_view`; a drafter then should see the text only:
            :class:`speculant.drafters.text_only.TextOnlyDrafter`). :meth:`speculant.Session.generate` with
            ``images=`` does all of this.
        prefix_cache: a :class:`speculant.core.prefix_cache.PrefixCache` (one per process, shared by the calls):
            the longest prefix of the prompt an earlier call computed is reused instead of computed again (the
            target's keys/values and a draft model's), and this call's blocks are kept for later ones; the output
            is the same. None (default): every call computes its whole prompt. A session keeps one for its
            generations (:attr:`speculant.Session.prefix_cache`).
        response_format: constrain the output (structured outputs, :mod:`speculant.structured`):
            ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
            ``{"type": "regex", "pattern": ...}``, ``{"type": "grammar", "grammar": <Lark>}`` or ``{"type": "text"}``
            (none). The target's distribution is masked to what the format allows, and speculation stays exact
            under it; a bad format is a ValueError naming the problem. Needs ``tokenizer``.
        tokenizer: the target's (fast) Hugging Face tokenizer, for ``response_format``.

    Returns:
        :class:`speculant.core.types.Generation` with ``token_ids`` (new tokens only), ``stats`` and
        ``logprobs`` (None unless asked for).
    """
    ids = as_id_list(input_ids)  # before resolving anything: a bad prompt is the first error a caller sees
    check_stream(stream)
    constraint = constraint_for(response_format, tokenizer)
    if kv_policy is not None:
        kv_policy = resolve_eviction(kv_policy)
    return engine.generate(target, ids, drafter=resolve_drafter(drafter), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                           stream=stream, kv_policy=kv_policy, kv_budget=kv_budget, kv_block=kv_block,
                           forward=forward, logprobs=logprobs, prompt_embeds=prompt_embeds, prefix_cache=prefix_cache,
                           constraint=constraint)


def generate_steps(
    target: torch.nn.Module,
    input_ids,
    drafter: Drafter | torch.nn.Module | str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    kv_policy: str | ScorePolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    prefix_cache: PrefixCache | None = None,
    response_format: dict | None = None,
    tokenizer=None,
) -> engine.Steps:
    """:func:`generate` one step at a time: an iterator of :class:`speculant.core.types.StepEvent` (each step's
    committed tokens, what was accepted of what was drafted); ``.result`` is the :class:`Generation` once it ends,
    and ``.close()`` stops early (e.g. when the reader went away). Same arguments as :func:`generate` but ``stream``.

    >>> steps = speculant.generate_steps(target, ids, drafter="lookup")
    >>> for step in steps:
    ...     print(step.tokens, step.accepted)
    >>> steps.result.stats.acceptance_length
    """
    ids = as_id_list(input_ids)
    constraint = constraint_for(response_format, tokenizer)
    if kv_policy is not None:
        kv_policy = resolve_eviction(kv_policy)
    return engine.generate_steps(target, ids, drafter=resolve_drafter(drafter), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 eos_token_id=eos_token_id, kv_policy=kv_policy, kv_budget=kv_budget,
                                 kv_block=kv_block, forward=forward, logprobs=logprobs, prefix_cache=prefix_cache,
                                 constraint=constraint)


def generate_batch(
    target: torch.nn.Module,
    prompts: list,
    drafter=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | list[int | None] | None = None,
    eos_token_id: int | list[int] | None = None,
    kv_policy: str | ScorePolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
    logprobs: int | None = None,
    speculation: str = "on",
    prefix_cache: PrefixCache | None = None,
    response_format: dict | None = None,
    tokenizer=None,
) -> list[Generation]:
    """Decode several prompts together: one target forward per step verifies every unfinished sequence
    (:class:`speculant.core.batch.Batch`), each with its own drafter, cache and acceptance. Returns one
    :class:`Generation` per prompt, in order.

    Args:
        prompts: a list of prompts, each as :func:`generate`'s ``input_ids``; lengths may differ.
        drafter: for every prompt, a method spec string or a draft model (a drafter of that kind is built per
            prompt), or None (plain decoding); or a list with one of those, or a Drafter object, per prompt (a
            Drafter object serves one prompt: it keeps per-generation state).
        seed: one seed for every prompt, or one per prompt.
        speculation: ``"on"`` (each drafter as deep as it likes), ``"off"``, or ``"auto"`` (each sequence's depth
            chosen per step by goodput, :mod:`speculant.core.speculation`); output does not depend on it.
        response_format, tokenizer: one output format for every prompt (each its own constraint), as :func:`generate`.
        the rest: as :func:`generate`, for every prompt.

    With quantized weights (``int8``/``int4``/``q4``/``file``/``q8``) each sequence's greedy output equals
    :func:`generate` of its prompt alone, token for token (a forward is row independent); with float weights a
    batched row may round differently and flip a near-tie.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (token id sequences)")
    ids = [as_id_list(p) for p in prompts]
    if isinstance(drafter, (list, tuple)):
        drafters = list(drafter)
    elif drafter is None or isinstance(drafter, (str, torch.nn.Module)):
        drafters = [drafter] * len(ids)  # resolved one by one below: a fresh drafter per prompt
    else:
        drafters = [drafter] if len(ids) == 1 else None
        if drafters is None:
            raise ValueError("a Drafter object serves one prompt at a time: pass a method spec or a draft model "
                             "(one drafter is built per prompt), or a list of drafters, one per prompt")
    if len(drafters) != len(ids):
        raise ValueError(f"drafter: give one per prompt ({len(ids)}), got {len(drafters)}")
    constraints = [constraint_for(response_format, tokenizer) for _ in ids]
    if kv_policy is not None:
        kv_policy = resolve_eviction(kv_policy)
    return engine.generate_batch(target, ids, [resolve_drafter(d) for d in drafters], max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 eos_token_id=eos_token_id, kv_policy=kv_policy, kv_budget=kv_budget,
                                 kv_block=kv_block, forward=forward, logprobs=logprobs, speculation=speculation,
                                 prefix_cache=prefix_cache, constraints=constraints)

