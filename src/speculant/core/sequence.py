"""One generation's state and the two halves of its decoding step, around a verification forward it does not run.

A :class:`Sequence` holds what one request needs between steps: its committed ids (:class:`DecodeState`), its
target cache (possibly evicting), its drafter, sampling settings and generator, stop tokens, budget, statistics and
logprobs. A step is split where the forward is, so that a batch (:class:`speculant.core.batch.Batch`) can verify
many sequences in one forward:

1. :meth:`Sequence.plan` drafts the tree and returns the verification inputs (a :class:`Segment`: ``[root] + tree``,
   its positions and tree mask, probe slots, a KV policy's query capture);
2. the caller runs the forward (one sequence alone, or many at once:
   :func:`speculant.core.target_forward.batched_logits`);
3. :meth:`Sequence.absorb` verifies the logits, keeps the root and the accepted path in the cache (rejected slots are
   dropped from it, never zeroed), commits the accepted tokens and the bonus, cuts at a stop token or the budget,
   records the statistics and tells the drafter; it returns the step's :class:`StepEvent`.

A sequence joining a batch of running ones may instead prefill chunk by chunk (:meth:`Sequence.prefill` with
``chunk``): each step's forward then carries one chunk of its prompt (:meth:`Sequence.chunk_segment`, no logits) and
:meth:`Sequence.absorb_chunk` takes it in; it drafts and verifies once the whole prompt is in.

Invariant (as before the split): the cache holds every committed token except the last one, the *root*. Plain
decoding (no drafter) is the same step with an empty tree, so it is the fair baseline.
"""

from __future__ import annotations

import logging
import time

import torch

from .cache import SpecCache
from .checks import num_layers, vocab_size, warn_once
from .constraint import Constraint
from .drafting import DecodeState, Drafter, capability, sync
from .eviction import BudgetedKV
from .logprobs import emission_rows, token_logprobs
from .prefix_cache import PrefixCache
from .sampling import make_generator
from .target_forward import Segment, TargetForward
from .tree import TreeAttention
from .types import DraftTree, Generation, GenerationStats, PromptEmbeds, SamplingParams, StepEvent, TokenLogprob
from .verification import verify

__all__ = ["Sequence"]

log = logging.getLogger(__name__)

_EMPTY = DraftTree.empty()


class Sequence:
    """One generation: prompt ``ids`` (checked by the caller), its drafter (None: plain decoding) and settings.
    ``forward`` is its target forward (:class:`TargetForward`), ``kv`` its evicting cache (None: a full one);
    ``logprobs``: the number of alternatives per token to report (None: no logprobs); ``prompt_embeds``: the
    prompt's input embeddings ``[1, len(ids), H]`` to prefill with instead of the ids' own (a vision-language
    target's prompt, image features in place of its image tokens; the root, the last token, is fed as an id);
    ``prompt_positions``: the prompt's M-RoPE positions ``[3, 1, len(ids)]`` (None: the token index), which the
    prompt is prefilled at, every later token at its index plus their offset (:meth:`PromptEmbeds.offset_of`).
    ``prefixes``: a :class:`~speculant.core.prefix_cache.PrefixCache` to reuse the prompt's longest computed prefix
    from and to store this generation's blocks in (None: no reuse; see :meth:`prefill` for when it cannot apply).
    ``constraint``: the output constraint it decodes under (:mod:`speculant.core.constraint`: masked target rows,
    forbidden draft nodes never fed, forced tokens proposed as a chain; None: none)."""

    def __init__(self, index: int, target: torch.nn.Module, forward: TargetForward, ids: list[int],
                 drafter: Drafter | None, max_new_tokens: int, params: SamplingParams, stops: set[int],
                 kv: BudgetedKV | None = None, logprobs: int | None = None,
                 prompt_embeds: torch.Tensor | None = None, prompt_positions: torch.Tensor | None = None,
                 prefixes: PrefixCache | None = None, constraint: Constraint | None = None) -> None:
        self.index = index
        self.prompt_embeds = prompt_embeds  # [1, len(ids), H] or None: the prompt's embeddings (image features)
        self.prompt_positions = prompt_positions  # [3, 1, len(ids)] or None: its M-RoPE positions
        self.position_offset = 0 if prompt_positions is None else PromptEmbeds.offset_of(prompt_positions)
        self.target, self.forward, self.drafter, self.kv = target, forward, drafter, kv
        self.device = target.device
        self.stops = stops
        self.logprobs = logprobs
        self.state = DecodeState(target=target, ids=list(ids), params=params,
                                 generator=make_generator(params.seed, self.device),
                                 max_length=len(ids) + max_new_tokens, remaining=max_new_tokens,
                                 stats=GenerationStats(target_forward=forward.kind))
        self.prefixes = prefixes if prefixes is not None and self._reusable(prefixes, drafter, kv,
                                                                            prompt_embeds) else None
        self.state.prefixes = self.prefixes
        self.constraint = constraint
        if constraint is not None:
            constraint.begin(vocab_size(target), stops)
            if capability(drafter, "drafts_constrained"):  # it masks its own draft distribution with it
                self.state.constraint = constraint
        self._stored = 0  # the cache length when its blocks were last stored in the prefix cache
        self._fed: int | None = None  # prompt tokens in the cache while prefilling chunk by chunk (None: not)
        self._chunk = 0  # tokens per chunk
        self._pending = 0  # the cache length once the chunk in flight is in
        self._prefill_s = 0.0  # the chunked prefill's seconds so far
        self.new: list[int] = []
        self.new_logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.done = False
        self.finish_reason: str | None = None
        # a drafter declaring uses_target_hidden reads the target's hidden states of every token entering its cache
        self.hidden: list | None = [] if capability(drafter, "uses_target_hidden") else None
        self._tree_attn = TreeAttention(target.dtype, self.device)
        self._cache: SpecCache | None = None
        self._step: tuple[DraftTree, int, object] | None = None  # plan()'s tree, cache length and capture
        self._start = 0.0
        self.natural_depth = 0  # the deepest draft the drafter proposed uncapped (0: not seen yet)
        self.probed_at: int | None = None  # target calls when it last probed (core.speculation)
        self.draft_s_per_level: float | None = None  # measured drafting seconds per level (moving average)
        # the first proposal's (seconds, context tokens fed, depth drafted, tokens fed by every first proposal that
        # shared its draft forwards, its own when alone: core.batch): it fills the draft cache; None: not yet
        self.draft_start: tuple[float, int, int, int] | None = None
        self.speculation: str | None = None  # this sequence's own mode (auto, on, off), over its batch's
        self.rows_per_level = 1.0  # draft tokens per level of its last uncapped tree (a chain: 1)

    @property
    def stats(self) -> GenerationStats:
        return self.state.stats

    @property
    def cache(self) -> SpecCache:
        """The target's cache (made by :meth:`prefill`)."""
        return self._cache

    # ------------------------------------------------------------------------------------------------ prefill

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is still entering the cache chunk by chunk (:meth:`prefill` with ``chunk``); such a
        sequence neither drafts nor verifies yet."""
        return self._fed is not None

    def prefill(self, chunk: int = 0) -> None:
        """Start the clock, begin the drafter and feed the prompt (all but the root) into a new cache.

        ``chunk > 0``: only start (the clock, the drafter, the prefix cache's restore) when more than ``chunk``
        prompt tokens are left to compute; the rest then enters ``chunk`` tokens at a time through
        :meth:`chunk_segment` and :meth:`absorb_chunk` (a batch folds each chunk into a step's forward, so that the
        running sequences are not stalled by a long prompt) and :attr:`prefilling` holds until it is in. A KV policy's
        cache (block-wise prefill with its own scoring) and an image prompt (embeddings, M-RoPE positions) always
        prefill at once."""
        state, ids = self.state, self.state.ids
        self._start = time.perf_counter()
        if self.drafter is not None:
            self.drafter.begin(state)
        if self.kv is None:
            self._cache = SpecCache(num_layers(self.target), capacity=state.max_length + 64)
            reused = 0
            if self.prefixes is not None:  # the longest prefix an earlier generation computed: copied, not fed
                reused = self.prefixes.restore(self.target, ids[:-1], self._cache)
                self.stats.prompt_cached_tokens = reused
            if chunk > 0 and self.prompt_embeds is None and len(ids) - 1 - reused > chunk:
                self._fed, self._chunk = reused, chunk
                self._prefill_s = time.perf_counter() - self._start
                return
            if len(ids) - 1 > reused:  # prefill the rest but the root; its logits are not needed: no LM head
                embeds = None if self.prompt_embeds is None else self.prompt_embeds[:, reused: len(ids) - 1]
                positions = None if self.prompt_positions is None else (
                    self.prompt_positions[:, :, reused: len(ids) - 1])
                self.forward.prefill(self._cache, torch.tensor([ids[reused:-1]], device=self.device),
                                     hidden_out=self.hidden, inputs_embeds=embeds, positions=positions)
            self.prompt_embeds = self.prompt_positions = None  # read once
            self._store()
        else:
            self._cache = self.kv.cache  # block-wise prefill: at most kv_budget + kv_block tokens per layer
            if len(ids) > 1:
                self.kv.prefill(self.target, torch.tensor([ids[:-1]], device=self.device), following=ids[-1:],
                                forward=self.forward, hidden_out=self.hidden)
        if self.hidden:
            state.target_hidden.extend(h[0] for h in self.hidden)  # [T_i, F] blocks
            self.hidden.clear()
        self._draft_reads(len(ids) - 1)  # a draft model reads the prompt now (in chunks), not in its first proposal
        sync(self.device)
        self.stats.prefill_s = time.perf_counter() - self._start
        self._check_constraint()

    def _draft_reads(self, stop: int) -> bool:
        """The drafter reads the committed prompt ``state.ids[:stop]`` (:meth:`Drafter.prefill`, part of the
        prefill); False when it has no such hook."""
        hook = getattr(self.drafter, "prefill", None)
        if hook is None:
            return False
        hook(self.state, stop)
        return True

    def _check_constraint(self) -> None:
        """Finish now (reason ``"stop"``, nothing more emitted) when the constraint allows nothing but a stop token:
        a grammar that can only end."""
        if self.constraint is not None and not self.done and self.constraint.finished:
            self._record_constraint()
            self._finish("stop")

    def _record_constraint(self) -> None:
        self.stats.constraint_mask_s = self.constraint.mask_s
        self.stats.constraint_masks = self.constraint.masks

    def chunk_segment(self, rest: bool = False) -> Segment:
        """The next prompt chunk's forward inputs while :attr:`prefilling`: ``chunk`` tokens (``rest``: every token
        left) after those in the cache, at their own positions (a chain from the cache length), no logits wanted
        (``head_rows=0``: the cache and, for a drafter reading the target's states, :attr:`hidden` receive them)."""
        ids = self.state.ids
        start = self._fed
        stop = len(ids) - 1 if rest else min(start + self._chunk, len(ids) - 1)
        self._pending = stop
        return Segment(self._cache, torch.tensor([ids[start:stop]], device=self.device), head_rows=0)  # [1, T]

    def absorb_chunk(self, forward_s: float) -> bool:
        """After :meth:`chunk_segment`'s forward (``forward_s``: this chunk's share of its seconds): the chunk is in
        the cache; its target states join the drafter's (in prompt order, as one prefill gives them) and completed
        blocks go to the prefix cache. Returns True once the whole prompt is in (:attr:`prefilling` ends;
        ``stats.prefill_s`` is then the start's seconds plus every chunk's share)."""
        state = self.state
        self._fed = self._pending
        self._prefill_s += forward_s
        if self.hidden:
            state.target_hidden.extend(h[0] for h in self.hidden)  # [T_i, F] blocks
            self.hidden.clear()
        self._store()
        start = time.perf_counter()
        if self._draft_reads(self._fed):  # at the target's pace, not all at once in its first step
            sync(self.device)
            self._prefill_s += time.perf_counter() - start
        if self._fed < len(state.ids) - 1:
            return False
        self._fed = None
        self.stats.prefill_s = self._prefill_s
        self._check_constraint()
        return True

    # ------------------------------------------------------------------------------------------------ a step

    def plan(self) -> Segment:
        """Draft this step's tree and return the verification forward's inputs for this sequence."""
        state, device = self.state, self.device
        tree = _EMPTY
        forced = False
        if self.constraint is not None and self.drafter is not None and state.draft_limit > 0:
            chain = self.constraint.forced(state.draft_limit)  # the only continuation: no draft forward needed
            if chain:
                tree, forced = DraftTree.chain(chain), True
        if not forced and self.drafter is not None and state.draft_limit > 0:
            start = time.perf_counter()
            fed = len(state.ids)
            tree = self.drafter.propose(state)
            seconds = time.perf_counter() - start
            if self.draft_start is None:  # the first proposal also feeds the whole context to the drafter
                self.draft_start = (seconds, fed, tree.max_depth, fed)  # the last: tokens fed in its step (Batch)
            elif tree.max_depth:  # seconds per draft level
                per = seconds / tree.max_depth
                self.draft_s_per_level = per if self.draft_s_per_level is None else (
                    0.7 * self.draft_s_per_level + 0.3 * per)
        if state.max_draft is None and self.drafter is not None and not forced:  # its own depth and width
            self.probed_at = self.stats.target_calls
            if tree.max_depth:
                self.natural_depth = max(self.natural_depth, tree.max_depth)
                self.rows_per_level = len(tree) / tree.max_depth
        cache_len = self._cache.length
        masks, fed = None, None
        if self.constraint is not None:
            masks, allowed = self.constraint.tree_masks(tree)  # [N + 1, V] bool, [N]
            masks = masks.to(device)
            if not all(allowed) and tree.probes is None:  # forbidden nodes are not fed (see core.constraint)
                fed = [i for i in range(len(tree)) if allowed[i]]
        verified, tree = tree, _fed_tree(tree, fed)  # the verifier's tree; the tree the forward carries
        inputs = torch.tensor([[state.ids[-1], *tree.tokens]], device=device)  # [1, Q]
        embeds = None
        soft = 0  # key/value slots only the probes see, between the cache and the new rows (types.Probes)
        if tree.probes is not None:  # probe slots after the tree: one forward, see types.Probes
            embeds = _with_probes(self.target, inputs, tree.probes)  # [1, Q + P, H]
            extended = DraftTree(tokens=[0] * (len(tree) + len(tree.probes.embeds)),
                                 parents=tree.parents + tree.probes.parents(len(tree)))
            if tree.probes.soft_keys is not None:  # seen by the probe rows only
                soft = _add_soft_entries(self._cache, tree.probes, self.kv, self.target.dtype)
            # [1, 1, Q + P, L + S + Q + P], [1, Q + P]
            mask, positions = self._tree_attn.build(extended, cache_len, soft=soft, soft_from=len(tree) + 1)
        elif tree.is_chain():  # the causal mask is the tree mask: the forward builds it (fast kernels)
            mask = positions = None
        else:
            mask, positions = self._tree_attn.build(tree, cache_len)  # [1, 1, Q, L + Q], [1, Q]
        capture = None
        shift = self.position_offset + (self.kv.next_position - cache_len if self.kv is not None else 0)
        if shift:  # evicted caches: the original positions, not the cache length; after an M-RoPE prompt: its offset
            if positions is None:
                positions = torch.arange(cache_len, cache_len + len(tree) + 1, device=device).unsqueeze(0)  # [1, Q]
            positions = positions + shift
        if self.kv is not None:
            capture = self.kv.capture(self.target)
        self._step = (verified, cache_len, soft, capture, masks, fed, forced)
        head = len(tree) + 1 if tree.probes is not None and not tree.probes.logits else None  # probes: states only
        return Segment(self._cache, None if embeds is not None else inputs, embeds, positions, mask, capture, head)

    def absorb(self, logits: torch.Tensor, forward_s: float) -> StepEvent:
        """Verify this step's ``logits [Q (+ P), V]`` (``[Q, V]`` when the probes want no logits; the forward of
        :meth:`plan`'s inputs, which took ``forward_s`` seconds), commit what is accepted and the bonus, and return
        the step's event."""
        tree, cache_len, soft, capture, masks, fed, forced = self._step
        self._step = None
        state, stats = self.state, self.stats
        stats.target_forward_s += forward_s
        if fed is not None:  # the verifier's rows: the fed nodes' logits, dummy (zero) rows for the forbidden ones
            full = logits.new_zeros((len(tree) + 1, logits.shape[-1]))  # [N + 1, V]
            full[[0] + [1 + i for i in fed]] = logits[: len(fed) + 1]
            logits = full
        rows = logits[: len(tree) + 1]  # [N + 1, V]
        if masks is not None:  # the constrained distribution: forbidden tokens out before any warping
            rows = rows.masked_fill(~masks, float("-inf"))
        verdict = verify(tree, rows, state.params, state.generator)
        state.last_logits, state.last_accepted = logits, verdict.accepted
        # the cache's rows of the accepted nodes: their index among the fed nodes
        kept = verdict.accepted if fed is None else [fed.index(n) for n in verdict.accepted]
        if self.hidden is not None:  # the root's and the accepted nodes' states: the rows the cache keeps
            hidden = self.hidden.pop()[0]  # [Q (+ P), F]
            state.target_hidden.append(hidden[[0] + [1 + n for n in kept]])  # [1 + a, F]
            state.probe_hidden = hidden[len(tree) + 1:] if tree.probes is not None else None  # [P, F]
        first = cache_len + soft  # the root's slot (after the soft entries, which go with the rejected rows)
        self._cache.keep(cache_len, [first] + [first + 1 + n for n in kept])
        self._store()
        if self.kv is not None:  # only verified tokens are in the cache now
            self.kv.after_step(capture, [0] + [1 + n for n in kept])
        accepted = [tree.tokens[n] for n in verdict.accepted]
        emitted = accepted + [verdict.bonus]
        if len(emitted) > state.remaining:
            emitted = emitted[: state.remaining]
        reason = None
        for i, tok in enumerate(emitted):
            if tok in self.stops:
                emitted, reason = emitted[: i + 1], "stop"
                break
        if self.constraint is not None:
            within = self.constraint.commit(emitted)
            if self.constraint.finished:  # nothing but a stop token may follow: it ends here
                emitted, reason = emitted[:within], "stop"
            self._record_constraint()
            if forced:
                stats.forced_tokens += min(len(verdict.accepted), len(emitted))
        last = verdict.accepted[-1] if verdict.accepted else -1
        offered = len(verdict.accepted) + (1 if tree.children[last + 1] else 0)
        stats.record_step(tree.max_depth, offered, len(verdict.accepted), len(emitted))
        stats.draft_tokens += 0 if forced else len(tree)
        state.ids.extend(emitted)
        self.new.extend(emitted)
        state.remaining -= len(emitted)
        if reason is None and state.remaining <= 0:
            reason = "length"
        step_logprobs = None
        if self.new_logprobs is not None:  # the rows the emitted tokens came from: no extra forward (core.logprobs)
            rows = emission_rows(verdict.accepted)[: len(emitted)]
            step_logprobs = token_logprobs(logits[rows], emitted, self.logprobs)
            self.new_logprobs.extend(step_logprobs)
        if reason is not None:
            self._finish(reason)
        elif self.drafter is not None and not forced:  # a forced chain was not the drafter's proposal
            self.drafter.commit(state, accepted)
        # as stats.record_step counts a step cut short inside its accepted block: its last token is the bonus
        taken = len(verdict.accepted) if len(emitted) > len(verdict.accepted) else len(emitted) - 1
        return StepEvent(self.index, emitted, taken, offered, len(tree), step_logprobs, self.done, self.finish_reason)

    # ------------------------------------------------------------------------------------------------ reuse

    @staticmethod
    def _reusable(prefixes: PrefixCache, drafter: Drafter | None, kv: BudgetedKV | None,
                  prompt_embeds: torch.Tensor | None) -> bool:
        """Whether this generation can reuse and store prompt prefixes; says once in the log why not."""
        why = ("a KV eviction policy keeps its own cache" if kv is not None else
               "an image prompt's embeddings are not token ids" if prompt_embeds is not None else
               "the drafter reads the target's hidden states, which are not cached" if capability(
                   drafter, "uses_target_hidden") else None)
        if why is None:
            return prefixes.budget_bytes > 0
        warn_once(log, f"prompt prefixes are not reused for this generation: {why}; it computes its whole prompt")
        return False

    def _store(self) -> None:
        """Store the blocks of committed tokens the target's cache completed since the last call (after the
        prefill, then after each step): the cache holds ``ids[:length]``, every committed token but the root."""
        length = self._cache.length
        if self.prefixes is None or length // self.prefixes.block == self._stored // self.prefixes.block:
            return
        self.prefixes.store(self.target, self.state.ids[:length], self._cache)
        self._stored = length  # tried once per completed block, whether the budget kept it or not

    # ------------------------------------------------------------------------------------------------ the end

    def cancel(self) -> None:
        """Stop here (finish reason ``"cancelled"``); what was committed stays the result."""
        if not self.done:
            self._step = None
            self._finish("cancelled")

    def _finish(self, reason: str) -> None:
        self.done, self.finish_reason = True, reason
        stats = self.stats
        stats.wall_s = time.perf_counter() - self._start
        # a full cache only grows (a tree's rejected slots are dropped again, not counted); a budget cache keeps its
        # peak
        stats.kv_peak_bytes = self.kv.peak_nbytes if self.kv is not None else (
            self._cache.nbytes() if self._cache is not None else 0)

    def result(self) -> Generation:
        """The generation so far (complete once :attr:`done`)."""
        return Generation(token_ids=list(self.new), stats=self.stats, logprobs=self.new_logprobs,
                          finish_reason=self.finish_reason)


def _fed_tree(tree: DraftTree, fed: list[int] | None) -> DraftTree:
    """The tree of ``tree``'s nodes ``fed`` (each one's parent among them; None: all of them), renumbered in order:
    what the target's forward carries when forbidden nodes are left out."""
    if fed is None:
        return tree
    where = {n: i for i, n in enumerate(fed)}
    return DraftTree(tokens=[tree.tokens[n] for n in fed],
                     parents=[-1 if tree.parents[n] < 0 else where[tree.parents[n]] for n in fed])


def _add_soft_entries(cache: SpecCache, probes, kv: BudgetedKV | None, dtype: torch.dtype) -> int:
    """Append the probes' soft key/value entries (``[layers, H_kv, S, D]``) to every layer of ``cache`` for one
    forward, in the cache's dtype (``dtype``, the target's, for a cache still empty); returns ``S``.
    :meth:`Sequence.absorb` drops them with the rejected rows."""
    if kv is not None:
        raise ValueError("probe key/values (ConFu's soft prompt) cannot ride in a KV-budget cache: decode without "
                         "kv_budget, or with a drafter that needs none")
    keys, values = probes.soft_keys, probes.soft_values
    if keys.shape[0] != len(cache.layers):
        raise ValueError(f"the probes carry soft key/values for {keys.shape[0]} layers; the target has "
                         f"{len(cache.layers)}")
    for layer, k, v in zip(cache.layers, keys, values):
        kind = layer.dtype if layer.is_initialized else dtype
        layer.update(k[None].to(kind), v[None].to(kind))  # [1, H_kv, S, D]
    return keys.shape[2]


def _with_probes(target, inputs: torch.Tensor, probes) -> torch.Tensor:
    """``[1, Q + P, H]``: the embeddings of ``inputs`` ``[1, Q]`` followed by the probe embeddings ``[P, H]``."""
    embeds = target.get_input_embeddings()(inputs)  # [1, Q, H]
    return torch.cat([embeds, probes.embeds.to(embeds.dtype).unsqueeze(0)], dim=1)
