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
    check_positive_int,
    check_token_ids,
    num_layers,
    resolve_eos,
    vocab_size,
    warn_once,
)
from ..drafters.base import DecodeState, Drafter, _sync
from ..drafters.registry import resolve_drafter
from .forward import FORWARDS, TargetForward
from ..kv import (
    warn_nesting,
    BudgetCache,
    QueryCapture,
    ScorePolicy,
    evict,
    find_speckv,
    observe,
    prefill_blockwise,
)
from .sampling import make_generator
from .tree import TreeAttention
from .types import DraftTree, Generation, GenerationStats, SamplingParams
from .verification import verify

__all__ = ["generate"]

log = logging.getLogger(__name__)
_EMPTY = DraftTree.empty()


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
    stream: Callable[[list[int]], None] | None = None,
    kv_policy: str | ScorePolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int = 128,
    forward: str = "auto",
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` with ``target``, losslessly accelerated.

    Args:
        target: any transformers causal LM (``AutoModelForCausalLM``).
        input_ids: the prompt: a list of ints, a 1-D or a ``[1, T]`` LongTensor (one sequence).
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
        stream: called with each list of newly committed token ids as soon as they are committed.
        kv_policy, kv_budget: KV-cache eviction (:mod:`speculant.kv`): the target's cache keeps at most
            ``kv_budget`` tokens per layer, chosen by the policy (a name such as ``"keydiff"`` or
            ``"caote:h2o"``, or a policy object). The prompt is prefilled in blocks of ``kv_block`` tokens,
            evicting back to the budget after each (peak ``kv_budget + kv_block`` tokens), and committed tokens
            are evicted after every verification step (draft tokens are never evicted before they are
            verified). The output is then exact given the evicted cache, not equal to full-cache decoding.
        forward: the target forward (:mod:`speculant.core.forward`): ``"auto"`` the lean forward
            (:class:`speculant.core.lean.LeanForward`) where it reproduces the model, else the model's own;
            ``"lean"`` requires it; ``"model"`` always uses the model's own (transformers) forward.

    Returns:
        :class:`speculant.core.types.Generation` with ``token_ids`` (new tokens only) and ``stats``.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if params.greedy and (top_k is not None or top_p not in (None, 1.0)):
        warn_once(log, "top_k / top_p have no effect with greedy decoding (temperature 0)")
    ids = as_id_list(input_ids)
    vocab = vocab_size(target)
    check_token_ids(ids, vocab, "input_ids")
    check_positive_int("max_new_tokens", max_new_tokens)
    check_fits_context(target, len(ids), max_new_tokens)
    stops = resolve_eos(target, eos_token_id)
    if eos_token_id is not None:
        check_token_ids(sorted(stops), vocab, "eos_token_id")
    drafter = resolve_drafter(drafter)
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    if target.training:
        log.warning("target model was in training mode (dropout active); switching it to eval mode")
        target.eval()
    device = target.device
    budget = _check_kv(kv_policy, kv_budget, kv_block, drafter)
    with torch.inference_mode():
        fwd = TargetForward(target, forward, max_length=len(ids) + max_new_tokens,
                            taps=getattr(drafter, "target_taps", ()))
        return _run(target, fwd, ids, drafter, max_new_tokens, params, stops, stream, device, budget)


def _check_kv(kv_policy, kv_budget, kv_block, drafter=None) -> tuple[ScorePolicy, int, int] | None:
    """``(policy, budget, block)`` or None (no eviction); one-line errors for inconsistent settings. A SpecKV
    policy given by name drafts its provisional answer with the drafter's model."""
    if kv_policy is None and kv_budget is None:
        return None
    if kv_policy is None or kv_budget is None:
        raise ValueError("KV eviction needs both kv_policy and kv_budget (e.g. kv_policy='keydiff', kv_budget=256)")
    from ..kv import parse_policy

    policy = parse_policy(kv_policy) if isinstance(kv_policy, str) else kv_policy
    warn_nesting(policy)
    spec = find_speckv(policy)
    if spec is not None and spec.draft is None:
        spec.draft = getattr(drafter, "model", None)
        spec._need_draft()  # a one-line error when there is none
    check_positive_int("kv_budget", kv_budget)
    check_positive_int("kv_block", kv_block)
    return policy, kv_budget, kv_block


def _with_probes(target, inputs: torch.Tensor, probes) -> torch.Tensor:
    """``[1, Q + P, H]``: the embeddings of ``inputs`` ``[1, Q]`` followed by the probe embeddings ``[P, H]``."""
    embeds = target.get_input_embeddings()(inputs)  # [1, Q, H]
    return torch.cat([embeds, probes.embeds.to(embeds.dtype).unsqueeze(0)], dim=1)


def _run(target, fwd: TargetForward, ids, drafter, max_new_tokens, params, stops, stream, device,
         budget) -> Generation:
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
    # a feature drafter reads the target's final hidden states of every token entering its cache
    hidden = [] if getattr(drafter, "uses_target_hidden", False) else None
    if budget is None:
        cache = SpecCache(num_layers(target), capacity=state.max_length + 64)
        if prompt_len > 1:  # prefill everything but the root; its logits are not needed, so skip the LM head
            fwd.prefill(cache, torch.tensor([ids[:-1]], device=device), hidden_out=hidden)
    else:
        policy, kv_budget, kv_block = budget
        cache = BudgetCache(num_layers(target), capacity=kv_budget + kv_block + 64)
        if prompt_len > 1:  # block-wise: at most kv_budget + kv_block tokens per layer at any time
            prefill_blockwise(target, torch.tensor([ids[:-1]], device=device), cache, policy, kv_budget, kv_block,
                              following=ids[-1:], forward=fwd, hidden_out=hidden)
    if hidden:
        state.target_hidden.extend(h[0] for h in hidden)  # [T_i, F] blocks
        hidden.clear()
    _sync(device)
    stats.prefill_s = time.perf_counter() - t_start

    new: list[int] = []
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
        if budget is not None:  # evicted caches: positions are the original ones, not the cache length
            positions = (cache.position_ids(len(tree) + 1, device) if positions is None
                         else positions + (cache.next_position - cache_len))
            if policy.needs_attention:
                capture = QueryCapture(target)
        t0 = time.perf_counter()
        out = fwd(cache, input_ids=None if embeds is not None else inputs, inputs_embeds=embeds,
                  positions=positions, mask=mask, capture=capture, hidden_out=hidden)  # [1, Q (+ P), V]
        _sync(device)
        stats.target_forward_s += time.perf_counter() - t0
        logits = out[0]  # [Q (+ P), V]
        verdict = verify(tree, logits[: len(tree) + 1], params, state.generator)
        state.last_logits, state.last_accepted = logits, verdict.accepted
        if hidden is not None:  # the root's and the accepted nodes' states: the rows the cache keeps
            state.target_hidden.append(hidden.pop()[0, [0] + [1 + n for n in verdict.accepted]])  # [1 + a, F]

        cache.keep(cache_len, [cache_len] + [cache_len + 1 + n for n in verdict.accepted])
        if budget is not None:  # only verified tokens are in the cache now
            attn = None
            if capture is not None:
                capture.keep_rows([0] + [1 + n for n in verdict.accepted])
                attn = observe(cache, capture)
            evict(cache, policy, kv_budget, attn=attn)
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
        if stream is not None:
            stream(emitted)
        if drafter is not None and not done:
            drafter.commit(state, accepted)

    stats.wall_s = time.perf_counter() - t_start
    # a full cache only grows (a tree's rejected slots are dropped again, not counted); a budget cache keeps its peak
    stats.kv_peak_bytes = cache.peak_nbytes if budget is not None else cache.nbytes()
    return Generation(token_ids=new, stats=stats)
