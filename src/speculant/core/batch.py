"""Many sequences decoded together: one verification forward per step for all of them.

A :class:`Batch` holds :class:`~speculant.core.sequence.Sequence` objects of one target model, each with its own
prompt length, cache, drafter (chain, tree, lookup ... or none), sampling settings, generator, stop tokens and
budget. Sequences join (:meth:`Batch.add`: the prompt is prefilled then, alone, or chunk by chunk: see below) and
leave (finished, or :meth:`Batch.cancel`) between steps. :meth:`Batch.step` drafts for every active sequence, runs *one* target
forward over all their ``[root] + tree`` rows (:func:`speculant.core.target_forward.batched_logits`: the matrix
products, LM head included, take every sequence's rows at once, so the weights are read once per step for the whole
batch; attention runs per sequence over its own cache) and verifies each sequence with the one verifier. Ragged
acceptance needs no padding: each sequence keeps only its accepted path in its own cache.

Exactness: with quantized weights (int8, int4, q4, q8) and row-by-row attention a row is the same bits in a batch as
alone, so a batch's greedy output equals each prompt decoded alone, token for token; with float weights torch's
dense products may round a batched row differently (not row independent), which can flip a near-tie.

Chunked prefill (``prefill_chunk``): a prompt joining running sequences would stall all of them for its whole
prefill (a 2,000-token prompt on a 1.5B model on two cores: seconds without a token for anyone). With
``prefill_chunk=N`` such a sequence joins *prefilling*: its prompt (after any reused prefix) enters the cache N tokens
a time, each chunk folded into a step's one forward as a segment that wants no logits (the chunk's rows share the
weight reads with the verification rows: cheaper on a CPU than a forward of its own), and it drafts and verifies only
once the prompt is in. A step with no sequence decoding takes the rest of every prompt at once (nobody to protect),
and so does a sequence joining an empty batch. A KV policy's cache (block-wise prefill with its own scoring) and an
image prompt prefill at once as before. The draft model reads the context at the sequence's first proposal, as
before (a small model's prefill). Exactness: a chunk of at most
:data:`~speculant.core.attention.MAX_ROWS` rows attends row by row, so with quantized weights a chunked prompt's
keys and values are the bits of a whole prefill that also attends row by row (a prompt of at most that many tokens);
a longer whole prefill takes SDPA's kernels, whose last bits may differ (as a reused prefix's rest does), which can
flip a near-tie, never the losslessness of the speculation that follows.

The engine's entry points (:func:`speculant.core.engine.generate`, ``generate_steps``, ``generate_batch``) are
built on this class; a server keeps one Batch and feeds it requests.
"""

from __future__ import annotations

import logging
import time

import torch

from .checks import (
    as_id_list,
    check_fits_context,
    check_logprobs,
    check_positive_int,
    check_token_ids,
    num_layers,
    resolve_eos,
    vocab_size,
    warn_once,
)
from .constraint import Constraint
from .draft_batch import plan_together
from .drafting import Drafter, capability, sync
from .eviction import BudgetedKV, EvictionPolicy
from .prefix_cache import PrefixCache
from .sequence import Sequence
from .speculation import MODES, Speculation, draft_model_id
from .target_forward import FORWARDS, TargetForward, batched_logits
from .types import Generation, PromptEmbeds, SamplingParams, StepEvent

__all__ = ["Batch"]

log = logging.getLogger(__name__)


class Batch:
    """Sequences of ``target`` decoded together (see the module doc). ``forward``: ``"auto"``, ``"lean"`` or
    ``"model"`` (:class:`~speculant.core.target_forward.TargetForward`), for every sequence. ``speculation``: how deep
    the sequences draft each step (:class:`~speculant.core.speculation.Speculation` or its mode: ``"on"``, each drafter
    as deep as it likes; ``"off"``; ``"auto"``, by goodput from the measured acceptance and forward cost).
    ``prefixes``: a :class:`~speculant.core.prefix_cache.PrefixCache` every sequence reuses prompt prefixes from and
    stores its blocks in (the target's and its draft model's; None: no reuse). ``prefill_chunk``: prompt tokens per
    step of a sequence joining running ones (chunked prefill, see the module doc; 0: the whole prompt at once, the
    default: an entry point decoding its own sequences has no running streams to protect)."""

    def __init__(self, target: torch.nn.Module, forward: str = "auto", speculation: Speculation | str = "on",
                 prefixes: PrefixCache | None = None, prefill_chunk: int = 0) -> None:
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
        _check_chunk(prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.speculation = speculation if isinstance(speculation, Speculation) else Speculation(speculation)
        self.target = target
        self.forward_mode = forward
        self.prefixes = prefixes
        self._sequences: dict[int, Sequence] = {}  # active
        self._finished: dict[int, Sequence] = {}  # finished or cancelled, until released
        self._next = 0
        self.steps = 0  # batched steps run
        self.rows = 0  # verification rows of the last step (sum over sequences of 1 + draft tokens)
        self.prefill_rows = 0  # prompt-chunk rows of the last step (chunked prefill)
        # prompt chunks ride in the step's verification forward (one weight read for both); False: a forward of
        # their own before it (measured slower on a CPU: benchmarks/chunked_prefill.py)
        self.fold_chunks = True
        self.batch_drafts = True  # several sequences' draft forwards as one (core.draft_batch)
        self.draft_forwards = 0  # shared draft forwards run, and the sequences' forwards they served
        self.draft_segments = 0
        self.step_draft_forwards = 0  # the same, of the last step
        self.step_draft_segments = 0

    def __len__(self) -> int:
        """Active (unfinished) sequences."""
        return len(self._sequences)

    @property
    def active(self) -> list[int]:
        """Indices of the active sequences, in the order they joined."""
        return list(self._sequences)

    def check(self, input_ids, drafter: Drafter | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
              eos_token_id: int | list[int] | None = None, kv_policy: EvictionPolicy | None = None,
              kv_budget: int | None = None, kv_block: int = 128, logprobs: int | None = None) -> list[int]:
        """Check one generation's arguments as :meth:`add` takes them (one-line ValueErrors, nothing loaded or
        prefilled); returns the prompt's ids."""
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = as_id_list(input_ids)
        vocab = vocab_size(self.target)
        check_token_ids(ids, vocab, "input_ids")
        check_positive_int("max_new_tokens", max_new_tokens)
        check_logprobs(logprobs)
        check_fits_context(self.target, len(ids), max_new_tokens)
        if eos_token_id is not None:
            check_token_ids(sorted(resolve_eos(self.target, eos_token_id)), vocab, "eos_token_id")
        _check_drafter(drafter)
        _check_kv(kv_policy, kv_budget, kv_block)
        return ids

    def add(self, input_ids, drafter: Drafter | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
            top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
            eos_token_id: int | list[int] | None = None, kv_policy: EvictionPolicy | None = None,
            kv_budget: int | None = None, kv_block: int = 128, logprobs: int | None = None,
            speculation: str | None = None, prompt_embeds: torch.Tensor | PromptEmbeds | None = None,
            prefill_chunk: int | None = None, constraint: Constraint | None = None) -> int:
        """Add a generation (the arguments of :func:`speculant.core.engine.generate`, checked: :meth:`check`) and
        prefill its prompt; returns its index (``StepEvent.sequence``). A drafter object serves one sequence at a
        time (it keeps per-generation state). ``speculation``: this sequence's own mode (``auto``, ``on``,
        ``off``), over the batch's (None). ``prompt_embeds [1, len(input_ids), H]``: the prompt's embeddings to
        prefill with (a vision-language prompt: :mod:`speculant.models.vlm`), or a :class:`PromptEmbeds` with their
        positions too (M-RoPE); its last token, the root, goes in as an id, so it must be a text token.
        ``prefill_chunk``: this sequence's chunk size, over the batch's (None); it applies when other sequences are
        active (else the prompt goes in at once), without a KV policy or image prompt. ``constraint``: the output
        constraint the sequence decodes under (:class:`~speculant.core.constraint.Constraint`, one per sequence,
        e.g. :meth:`speculant.structured.CompiledFormat.constraint`); None: unconstrained."""
        if prefill_chunk is not None:
            _check_chunk(prefill_chunk)
        ids = self.check(input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                         kv_policy, kv_budget, kv_block, logprobs)
        positions = None
        if isinstance(prompt_embeds, PromptEmbeds):
            positions, prompt_embeds = prompt_embeds.positions, prompt_embeds.embeds
            if positions.dim() != 3 or tuple(positions.shape[1:]) != (1, len(ids)):
                raise ValueError(f"prompt positions must be [3, 1, {len(ids)}] (M-RoPE: 3 per prompt token), got "
                                 f"{list(positions.shape)}")
        if prompt_embeds is not None:
            width = self.target.get_input_embeddings().weight.shape[1]
            if prompt_embeds.dim() == 2:
                prompt_embeds = prompt_embeds.unsqueeze(0)
            if tuple(prompt_embeds.shape) != (1, len(ids), width):
                raise ValueError(f"prompt_embeds must be [1, {len(ids)}, {width}] (one row per prompt token), got "
                                 f"{list(prompt_embeds.shape)}")
            if kv_policy is not None:
                raise ValueError("a KV policy prefills block by block from token ids: it does not take prompt "
                                 "embeddings (an image prompt)")
            prompt_embeds = prompt_embeds.to(device=self.target.device, dtype=self.target.dtype)
        if speculation is not None and speculation not in MODES:
            raise ValueError(f"speculation must be one of {', '.join(MODES)}, got {speculation!r}")
        if constraint is not None and not isinstance(constraint, Constraint):
            raise ValueError(f"constraint must be a speculant Constraint (e.g. from speculant.structured."
                             f"compile_response_format(...).constraint()), got {type(constraint).__name__}")
        if constraint is not None and any(s.constraint is constraint for s in self._sequences.values()):
            raise ValueError("a constraint serves one sequence: give each sequence its own (CompiledFormat.constraint)")
        if drafter is not None and any(s.drafter is drafter for s in self._sequences.values()):
            raise ValueError("a drafter object serves one sequence at a time: give each sequence its own drafter")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if params.greedy and (top_k is not None or top_p not in (None, 1.0)):
            warn_once(log, "top_k / top_p have no effect with greedy decoding (temperature 0)")
        if self.target.training:
            log.warning("target model was in training mode (dropout active); switching it to eval mode")
            self.target.eval()
        kv: BudgetedKV | None = None
        if kv_policy is not None:
            kv_policy.bind_draft(capability(drafter, "model"))  # SpecKV drafts with the drafter's model
            kv = kv_policy.budgeted(num_layers(self.target), kv_budget, kv_block)
        forward = TargetForward(self.target, self.forward_mode, max_length=len(ids) + max_new_tokens,
                                taps=capability(drafter, "target_taps"))
        index, self._next = self._next, self._next + 1
        seq = Sequence(index, self.target, forward, ids, drafter, max_new_tokens, params,
                       resolve_eos(self.target, eos_token_id), kv, logprobs, prompt_embeds,
                       None if positions is None else positions.to(self.target.device), self.prefixes, constraint)
        seq.speculation = speculation
        chunk = self.prefill_chunk if prefill_chunk is None else prefill_chunk
        if not self._sequences:
            chunk = 0  # nobody to protect (KV-policy and image prompts prefill whole: Sequence.prefill)
        with torch.inference_mode():
            seq.prefill(chunk)
        self._sequences[index] = seq
        return index

    def step(self) -> list[StepEvent]:
        """One decoding step for every active sequence: draft, one verification forward for all, verify, commit;
        the same forward carries the next chunk of every prefilling sequence's prompt (see the module doc).
        Returns one event per decoding sequence (finished ones leave the batch; :meth:`result` still has them); a
        prefilling one has none until it decodes."""
        ended = [s for s in self._sequences.values() if s.done]  # finished on admission (a constraint's end)
        for s in ended:
            self._finished[s.index] = self._sequences.pop(s.index)
        if ended:
            return [StepEvent(s.index, [], 0, 0, 0, [] if s.logprobs is not None else None, True, s.finish_reason)
                    for s in ended]
        every = list(self._sequences.values())
        if not every:
            return []
        seqs = [s for s in every if not s.prefilling]
        filling = [s for s in every if s.prefilling]
        self.speculation.plan(seqs, shared_drafts=self.batch_drafts)
        modeled = sum(1 for s in seqs if s.drafter is not None and s.state.draft_limit > 0
                      and draft_model_id(s) is not None)
        with torch.inference_mode():
            self.step_draft_forwards = self.step_draft_segments = 0
            if self.batch_drafts and modeled > 1:  # their draft forwards run together (core.draft_batch)
                fresh = [s for s in seqs if s.draft_start is None]
                segments, batcher = plan_together([s.plan for s in seqs])
                self.step_draft_forwards, self.step_draft_segments = batcher.forwards, batcher.segments
                self.draft_forwards += batcher.forwards
                self.draft_segments += batcher.segments
                _share_first_proposals([s for s in fresh if s.draft_start is not None])
            else:
                segments = [s.plan() for s in seqs]
            chunks = [s.chunk_segment(rest=not seqs) for s in filling]
            self.rows = sum(_rows(seg) for seg in segments)
            self.prefill_rows = sum(_rows(seg) for seg in chunks)
            if chunks and seqs and not self.fold_chunks:  # the chunks in a forward of their own, first
                start = time.perf_counter()
                batched_logits([s.forward for s in filling], chunks, [s.hidden for s in filling])
                sync(every[0].device)
                elapsed = time.perf_counter() - start
                for s, seg in zip(filling, chunks):
                    s.absorb_chunk(elapsed * _rows(seg) / self.prefill_rows)
                filling, chunks = [], []
            start = time.perf_counter()
            order = seqs + filling
            logits = batched_logits([s.forward for s in order], segments + chunks, [s.hidden for s in order])
            sync(every[0].device)
            elapsed = time.perf_counter() - start
            total = self.rows + (self.prefill_rows if chunks else 0)  # the rows of this forward
            if seqs:  # what a forward of that many rows costs
                self.speculation.cost.observe(total, elapsed)
            events = [s.absorb(out[0], elapsed) for s, out in zip(seqs, logits)]
            for s, seg in zip(filling, chunks):  # each chunk's share of the forward, by rows
                s.absorb_chunk(elapsed * _rows(seg) / total)
        self.steps += 1
        done = [seq for seq in seqs if seq.done]
        self.speculation.observe(done)  # their last step and their lengths count too
        for seq in done:
            self._finished[seq.index] = self._sequences.pop(seq.index)
        return events

    def cancel(self, index: int) -> Generation:
        """Stop sequence ``index`` now (finish reason ``"cancelled"``, unless it had finished) and return its
        generation so far."""
        seq = self._sequences.pop(index, None) or self._finished.get(index)
        if seq is None:
            raise ValueError(f"no sequence {index} in this batch")
        seq.cancel()
        self._finished[index] = seq
        return seq.result()

    def result(self, index: int) -> Generation:
        """Sequence ``index``'s generation (complete once it finished); a finished sequence's result is kept until
        :meth:`release`."""
        seq = self._sequences.get(index) or self._finished.get(index)
        if seq is None:
            raise ValueError(f"no sequence {index} in this batch")
        return seq.result()

    def release(self, index: int) -> None:
        """Forget finished sequence ``index`` (its cache and result)."""
        self._finished.pop(index, None)


def _rows(seg) -> int:
    """A segment's new rows."""
    return seg.input_ids.shape[1] if seg.input_ids is not None else seg.inputs_embeds.shape[1]


def _check_chunk(chunk) -> None:
    """A one-line ValueError unless ``chunk`` is a whole number >= 0."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"prefill_chunk must be a whole number of tokens >= 0 (0: the whole prompt at once), got "
                         f"{chunk!r:.40}")


def _share_first_proposals(started: list[Sequence]) -> None:
    """Sequences of one draft model whose first proposals (each feeding its whole context to the draft model) ran in
    the same shared draft forwards each timed the whole planning, everybody's prefills included: each records the
    tokens all of them fed, which its time is then divided by (:meth:`~.speculation.Speculation.observe`). (Divided by
    its own tokens, the draft's prefill read several times dearer per token than its forward alone is, and under
    load the start rule turned down sequences whose drafting paid.) Drafters without a model (lookup) share no
    forward and keep their own figures. With several draft models in one step a proposal's time also holds the
    other models' forwards (an overestimate; one model per server is the usual case)."""
    groups: dict[int, list[Sequence]] = {}
    for s in started:
        model = draft_model_id(s)
        if model is not None:
            groups.setdefault(model, []).append(s)
    for group in groups.values():
        fed = sum(s.draft_start[1] for s in group)
        for s in group:
            seconds, own, depth, _ = s.draft_start
            s.draft_start = (seconds, own, depth, fed)


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
        raise ValueError(f"kv_policy: speculant.core.engine.generate takes an EvictionPolicy or None, got "
                         f"{got:.80}; {_RESOLVE} (speculant.kv.resolve_eviction)")
    check_positive_int("kv_budget", kv_budget)
