"""``generate()``: the speculative decoding loop. It knows no method names (../shared/DESIGN.md, The flow).

Invariant: the target's cache holds every committed token except the last one, the *root*. Each step feeds
``[root] + draft tree`` in one forward (tree mask + position ids), verifies, keeps the root and the accepted path
in the cache and makes the bonus token the next root. Plain decoding (``drafter=None``) is the same loop with
an empty tree, so it is the fair baseline: same model-call code, same cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .cache import SpecCache
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
from .drafting import DecodeState, Drafter, capability, sync
from .eviction import BudgetedKV, EvictionPolicy
from .forward import FORWARDS, TargetForward
from .logprobs import emission_rows, token_logprobs
from .sampling import make_generator
from .tree import TreeAttention
from .types import DraftTree, Generation, GenerationStats, SamplingParams, TokenLogprob
from .verification import verify

__all__ = ["generate"]

log = logging.getLogger(__name__)
_EMPTY = DraftTree.empty()


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
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if params.greedy and (top_k is not None or top_p not in (None, 1.0)):
        warn_once(log, "top_k / top_p have no effect with greedy decoding (temperature 0)")
    ids = as_id_list(input_ids)
    vocab = vocab_size(target)
    check_token_ids(ids, vocab, "input_ids")
    check_positive_int("max_new_tokens", max_new_tokens)
    check_stream(stream)
    check_logprobs(logprobs)
    check_fits_context(target, len(ids), max_new_tokens)
    stops = resolve_eos(target, eos_token_id)
    if eos_token_id is not None:
        check_token_ids(sorted(stops), vocab, "eos_token_id")
    _check_drafter(drafter)
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    if target.training:
        log.warning("target model was in training mode (dropout active); switching it to eval mode")
        target.eval()
    device = target.device
    _check_kv(kv_policy, kv_budget, kv_block)
    kv: BudgetedKV | None = None
    if kv_policy is not None:
        kv_policy.bind_draft(capability(drafter, "model"))  # SpecKV drafts with the drafter's model
        kv = kv_policy.budgeted(num_layers(target), kv_budget, kv_block)
    with torch.inference_mode():
        fwd = TargetForward(target, forward, max_length=len(ids) + max_new_tokens,
                            taps=capability(drafter, "target_taps"))
        return _run(target, fwd, ids, drafter, max_new_tokens, params, stops, stream, device, kv, logprobs)


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


def _with_probes(target, inputs: torch.Tensor, probes) -> torch.Tensor:
    """``[1, Q + P, H]``: the embeddings of ``inputs`` ``[1, Q]`` followed by the probe embeddings ``[P, H]``."""
    embeds = target.get_input_embeddings()(inputs)  # [1, Q, H]
    return torch.cat([embeds, probes.embeds.to(embeds.dtype).unsqueeze(0)], dim=1)


def _run(target, fwd: TargetForward, ids, drafter, max_new_tokens, params, stops, stream, device,
         kv: BudgetedKV | None, logprobs: int | None) -> Generation:
    stats = GenerationStats(target_forward=fwd.kind)
    state = DecodeState(
        target=target,
        ids=list(ids),
        params=params,
        generator=make_generator(params.seed, device),
        max_length=len(ids) + max_new_tokens,
        remaining=max_new_tokens,
        stats=stats,
    )
    prompt_len = len(ids)
    t_start = time.perf_counter()
    if drafter is not None:
        drafter.begin(state)
    tree_attn = TreeAttention(target.dtype, device)
    # a drafter declaring uses_target_hidden reads the target's hidden states of every token entering its cache
    hidden = [] if capability(drafter, "uses_target_hidden") else None
    if kv is None:
        cache = SpecCache(num_layers(target), capacity=state.max_length + 64)
        if prompt_len > 1:  # prefill everything but the root; its logits are not needed, so skip the LM head
            fwd.prefill(cache, torch.tensor([ids[:-1]], device=device), hidden_out=hidden)
    else:
        cache = kv.cache  # block-wise prefill: at most kv_budget + kv_block tokens per layer at any time
        if prompt_len > 1:
            kv.prefill(target, torch.tensor([ids[:-1]], device=device), following=ids[-1:], forward=fwd,
                       hidden_out=hidden)
    if hidden:
        state.target_hidden.extend(h[0] for h in hidden)  # [T_i, F] blocks
        hidden.clear()
    sync(device)
    stats.prefill_s = time.perf_counter() - t_start

    new: list[int] = []
    new_logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
    done = False
    while not done:
        tree = drafter.propose(state) if drafter is not None and state.remaining > 1 else _EMPTY
        cache_len = cache.length
        inputs = torch.tensor([[state.ids[-1], *tree.tokens]], device=device)  # [1, Q]
        embeds = None
        if tree.probes is not None:  # probe slots after the tree: one forward, see types.Probes
            embeds = _with_probes(target, inputs, tree.probes)  # [1, Q + P, H]
            extended = DraftTree(tokens=[0] * (len(tree) + len(tree.probes.embeds)),
                                 parents=tree.parents + tree.probes.parents(len(tree)))
            mask, positions = tree_attn.build(extended, cache_len)  # [1, 1, Q + P, L + Q + P], [1, Q + P]
        elif tree.is_chain():  # the causal mask is the tree mask: the forward builds it (fast kernels)
            mask = positions = None
        else:
            mask, positions = tree_attn.build(tree, cache_len)  # [1, 1, Q, L + Q], [1, Q]
        capture = None
        if kv is not None:  # evicted caches: positions are the original ones, not the cache length
            if positions is None:
                positions = torch.arange(cache_len, cache_len + len(tree) + 1, device=device).unsqueeze(0)  # [1, Q]
            positions = positions + (kv.next_position - cache_len)
            capture = kv.capture(target)
        t0 = time.perf_counter()
        out = fwd(cache, input_ids=None if embeds is not None else inputs, inputs_embeds=embeds,
                  positions=positions, mask=mask, capture=capture, hidden_out=hidden)  # [1, Q (+ P), V]
        sync(device)
        stats.target_forward_s += time.perf_counter() - t0
        logits = out[0]  # [Q (+ P), V]
        verdict = verify(tree, logits[: len(tree) + 1], params, state.generator)
        state.last_logits, state.last_accepted = logits, verdict.accepted
        if hidden is not None:  # the root's and the accepted nodes' states: the rows the cache keeps
            state.target_hidden.append(hidden.pop()[0, [0] + [1 + n for n in verdict.accepted]])  # [1 + a, F]

        cache.keep(cache_len, [cache_len] + [cache_len + 1 + n for n in verdict.accepted])
        if kv is not None:  # only verified tokens are in the cache now
            kv.after_step(capture, [0] + [1 + n for n in verdict.accepted])
        accepted = [tree.tokens[n] for n in verdict.accepted]
        emitted = accepted + [verdict.bonus]
        if len(emitted) > state.remaining:
            emitted = emitted[: state.remaining]
        for i, tok in enumerate(emitted):
            if tok in stops:
                emitted = emitted[: i + 1]
                done = True
                break
        last = verdict.accepted[-1] if verdict.accepted else -1
        offered = len(verdict.accepted) + (1 if tree.children[last + 1] else 0)
        stats.record_step(tree.max_depth, offered, len(verdict.accepted), len(emitted))
        stats.draft_tokens += len(tree)
        state.ids.extend(emitted)
        new.extend(emitted)
        state.remaining -= len(emitted)
        if state.remaining <= 0:
            done = True
        step_logprobs = None
        if new_logprobs is not None:  # the rows the emitted tokens came from: no extra forward (core.logprobs)
            rows = emission_rows(verdict.accepted)[: len(emitted)]
            step_logprobs = token_logprobs(logits[rows], emitted, logprobs)
            new_logprobs.extend(step_logprobs)
        if stream is not None:
            if step_logprobs is None:
                stream(emitted)
            else:  # asked for: the stream takes the step's logprobs too (stream(ids) callers never see them)
                stream(emitted, step_logprobs)
        if drafter is not None and not done:
            drafter.commit(state, accepted)

    stats.wall_s = time.perf_counter() - t_start
    # a full cache only grows (a tree's rejected slots are dropped again, not counted); a budget cache keeps its peak
    stats.kv_peak_bytes = kv.peak_nbytes if kv is not None else cache.nbytes()
    return Generation(token_ids=new, stats=stats, logprobs=new_logprobs)
