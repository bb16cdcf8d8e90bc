"""Plain data shared by every part of speculant: sampling settings, draft trees, verdicts and statistics.

Notation follows the speculative decoding papers (Leviathan et al. 2023, Chen et al. 2023): ``q`` is the target
distribution, ``p`` the draft distribution (both after the same warping), τ the mean acceptance length (tokens
emitted per target forward, bonus included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["FINISH_REASONS", "MIN_TEMPERATURE", "SamplingParams", "Probes", "DraftTree", "Verdict", "GenerationStats",
           "TokenLogprob", "Generation", "StepEvent", "PromptEmbeds"]


_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts

MIN_TEMPERATURE = 1e-5
"""The smallest temperature that samples; a positive one below it is greedy (see :class:`SamplingParams`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; applied identically to target and draft.

    ``temperature == 0`` is greedy decoding (``top_k``/``top_p`` are then irrelevant). ``top_k=None`` and
    ``top_p=None`` (or 1.0) disable the respective filter. ``seed`` makes sampling reproducible.

    A positive temperature below :data:`MIN_TEMPERATURE` (1e-5) is greedy: it is stored as 0.0. Why greedy
    rather than an error: dividing float32 logits by a tiny temperature overflows to inf and softmax turns that
    into NaN ("probability tensor contains inf/nan"), while what a caller means by ``1e-38`` is "as good as
    argmax", which is what such a temperature gives wherever it is computable (the two differ only between
    logits tied to within ~1e-4, drawn at random there, the first one by greedy). OpenAI clients send such
    values, so refusing them would break working clients; vLLM draws the same line (its ``_SAMPLING_EPS``).
    This is the one place the rule lives: the Python API, the CLI and the server all build a SamplingParams.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or math.isnan(t) or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t}")
        if t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy: see the class docstring
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None:
            p = self.top_p
            if not isinstance(p, (int, float)) or isinstance(p, bool) or math.isnan(p) or not (0.0 < p <= 1.0):
                raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed {self.seed} is out of range: torch takes seeds from -2**63 to 2**64 - 1")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature == 0.0


@dataclass
class PromptEmbeds:
    """A prompt's input embeddings with the positions the model gives them, for targets whose positions are not
    the token index: Qwen2-VL's M-RoPE gives each token 3 positions (time, height, width), an image's tokens those
    of its grid (:func:`speculant.models.vlm.prompt_embeds`). The tokens after the prompt are text: their 3
    positions are equal, the last prompt token's plus one onwards, which is ordinary RoPE at ``index +``
    :attr:`offset`."""

    embeds: torch.Tensor  # [1, T, H]
    positions: torch.Tensor  # [3, 1, T] M-RoPE positions (time, height, width)

    @property
    def offset(self) -> int:
        """What the positions after the prompt add to the token index (:meth:`offset_of` its positions)."""
        return self.offset_of(self.positions)

    @staticmethod
    def offset_of(positions: torch.Tensor) -> int:
        """The offset of a prompt's M-RoPE ``positions [3, 1, T]``: its last token's position minus its index (0
        when no image shortened the positions)."""
        return int(positions[0, 0, -1]) - (positions.shape[-1] - 1)


@dataclass
class Probes:
    """Extra inputs a drafter attaches to the target's verification forward (ESP mask tokens, Goel et al. 2026).

    After the rows of ``anchors`` (0 = the root, ``n + 1`` = tree node n) the forward carries a chain of
    ``length`` probe slots each, fed as input embeddings: probe j (1-based) of anchor a has position id
    ``pos(a) + j`` and sees the cache, the path to a (a included) and the probes of a before it; tree nodes never
    see probes, so verification is unaffected, and probes never stay in the cache. Their output logits are
    handed back to the drafter (``DecodeState.last_logits``) in slot order: anchor 0's j = 1..length, then
    anchor 1's, ... (unless ``logits`` is False); to a drafter that reads the target's states, their states too
    (``DecodeState.probe_hidden``).
    """

    anchors: list[int]
    length: int
    embeds: torch.Tensor  # [len(anchors) * length, H], in slot order
    # key/value entries only the probe slots attend to, per layer (ConFu's soft prompt, Qin et al. 2026): the
    # engine puts them in the cache for this forward alone, before the new rows, and masks them for everyone else
    soft_keys: torch.Tensor | None = None  # [layers, H_kv, S, D] (as the cache stores keys: after RoPE)
    soft_values: torch.Tensor | None = None  # [layers, H_kv, S, D]
    logits: bool = True  # the drafter reads the probe slots' logits; False: their states only (no LM head rows)

    def parents(self, num_nodes: int) -> list[int]:
        """Parent indices of the probe slots as extra tree nodes numbered after the ``num_nodes`` tree nodes
        (the same convention as ``DraftTree.parents``: -1 is the root): each anchor's probes form a chain under
        it, which gives exactly the visibility and position ids above."""
        out: list[int] = []
        for a in self.anchors:
            out.append(a - 1)
            out.extend(num_nodes + len(out) - 1 for _ in range(self.length - 1))
        return out


@dataclass
class DraftTree:
    """A flattened draft tree proposed by a drafter for one verification step.

    Node ``n`` holds ``tokens[n]``; ``parents[n]`` is the index of its parent node, or -1 when its parent is the
    root (the last committed token, not part of the arrays). ``depths[n]`` is 1 for children of the root.
    Nodes are topologically ordered (a parent precedes its children) and the children of a node are in
    verification order (the order they were drafted in). A chain of k tokens is the tree with parents
    ``[-1, 0, 1, ..., k-2]``.

    ``draft_probs`` is ``None`` for a deterministic draft (prompt lookup, mask probing, top-k trees), which is
    verified by the deterministic-draft rule. Otherwise it is ``[N + 1, V]``: row 0 is ``p(·|root)``, row
    ``n + 1`` is ``p(·|path to node n)``, the draft's full warped distribution at that node (rows of leaves may
    be anything; they are not read). ``replacement`` says how siblings were drawn: ``False`` sequentially
    without replacement (Gumbel-top-k, RSD) or a single child (chains), ``True`` i.i.d. (SpecInfer).
    ``draw_order`` (with-replacement rule only) lists, per row (0 = root, n+1 = node n), the child node indices
    in the order their i.i.d. draws came, duplicates repeated (a later duplicate is certainly rejected but still
    updates the residual, so order and count matter); by default each child once, in ``children`` order.
    ``coupling`` picks the rule for i.i.d. siblings: ``"recursive"`` (recursive rejection sampling with
    replacement, SpecInfer) or ``"kseq"`` (SpecTr's K-SEQ over the node's draws; needs ``replacement``).
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None  # [N + 1, V] float
    replacement: bool = False
    draw_order: list[list[int]] | None = None
    coupling: str = "recursive"  # "recursive" | "kseq"
    probes: Probes | None = None  # extra probe inputs for the same target forward (mask-token drafting)
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)  # [N + 1]: row 0 = root's children

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"DraftTree: {n} tokens but {len(self.parents)} parents")
        depths: list[int] = []
        children: list[list[int]] = [[] for _ in range(n + 1)]
        for i, par in enumerate(self.parents):
            if not -1 <= par < i:
                raise ValueError(f"DraftTree: node {i} has parent {par}; parents must precede their children")
            depths.append(1 if par < 0 else depths[par] + 1)
            children[par + 1].append(i)
        self.depths = depths
        self.children = children
        if self.coupling not in ("recursive", "kseq"):
            raise ValueError(f"DraftTree: coupling must be 'recursive' or 'kseq', got {self.coupling!r}")
        if self.coupling == "kseq" and not self.replacement:
            raise ValueError("DraftTree: the K-SEQ coupling is for i.i.d. siblings (replacement=True)")
        if self.draw_order is not None and len(self.draw_order) != n + 1:
            raise ValueError("DraftTree: draw_order must have one list per node plus one for the root")

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A linear draft: token i is the child of token i-1 (and token 0 of the root)."""
        return cls(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), draft_probs=draft_probs)

    @classmethod
    def empty(cls) -> "DraftTree":
        """No draft: the step degenerates to one plain autoregressive target forward."""
        return cls(tokens=[], parents=[])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def is_chain(self) -> bool:
        """True when every node's parent is the node just before it (so the causal mask is the tree mask)."""
        return all(par == i - 1 for i, par in enumerate(self.parents))


@dataclass
class Verdict:
    """The outcome of verifying one draft tree.

    ``accepted`` lists the accepted node indices from the root downwards (a path in the tree);
    ``bonus`` is the token the target emits after them (a correction on rejection, a bonus when a leaf was
    accepted). The committed tokens are ``[tree.tokens[n] for n in accepted] + [bonus]``.
    """

    accepted: list[int]
    bonus: int


@dataclass
class GenerationStats:
    """What happened during one generation. Times are seconds of wall clock.

    ``target_calls`` counts target forwards made while decoding (the prefill is separate, ``prefill_s``);
    ``acceptance_length`` (τ) = new tokens / target calls, the bonus token included.
    ``accepted_hist[m]`` counts steps that emitted ``m`` accepted draft tokens and then one more token (the
    bonus), so ``sum((m + 1) * accepted_hist[m]) == new_tokens`` and τ is the histogram's mean ``m + 1``.
    ``position_acceptance[i]`` = P(draft at depth i+1 accepted | depth i accepted and depth i+1 drafted).
    A step cut short inside its accepted block (a stop token, or ``max_new_tokens``) counts only what it emitted:
    its last emitted token takes the bonus's place, and the draft tokens after it count neither as accepted nor
    as offered.
    ``overhead_s`` is everything that is neither a target nor a draft forward (the engine's own cost).
    ``prefill_s``: the prompt's prefill; prefilled in chunks inside a batch's steps (:class:`speculant.core.batch.Batch`
    ``prefill_chunk``), the start (prefix restore, drafter) plus each chunk's share of its step's forward, by rows.
    """

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    depth_reached: list[int] = field(default_factory=list)  # [i]: steps that offered a draft at depth i+1
    depth_accepted: list[int] = field(default_factory=list)  # [i]: steps that accepted a draft at depth i+1
    wall_s: float = 0.0
    prefill_s: float = 0.0
    target_forward_s: float = 0.0
    draft_forward_s: float = 0.0
    draft_tokens: int = 0
    target_forward: str = ""  # "lean" or "model": which target forward ran (speculant.core.target_forward)
    kv_peak_bytes: int = 0  # the target's KV cache at its largest (live keys and values, all layers)
    prompt_cached_tokens: int = 0  # prompt tokens whose keys/values the target reused (core.prefix_cache)
    draft_cached_tokens: int = 0  # context tokens whose keys/values the draft model reused
    forced_tokens: int = 0  # tokens an output constraint forced, committed without a draft forward
    constraint_mask_s: float = 0.0  # seconds spent computing an output constraint's token masks
    constraint_masks: int = 0  # token masks it computed (target rows and the drafter's own)

    @property
    def acceptance_length(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.depth_accepted, self.depth_reached)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.target_forward_s - self.draft_forward_s)

    @property
    def overhead_share(self) -> float:
        """Engine overhead as a fraction of decoding time (prefill excluded)."""
        decode = self.wall_s - self.prefill_s
        return self.overhead_s / decode if decode > 0 else 0.0

    def record_step(self, tree_depth: int, offered_depth: int, accepted: int, emitted: int) -> None:
        """Account one verification step: ``tree_depth`` = the draft tree's depth, ``offered_depth`` = deepest
        level drafted below the accepted path (accepted, +1 if its last node has children), ``accepted`` = draft
        tokens accepted, ``emitted`` = tokens committed (``accepted + 1`` unless the step was cut short)."""
        if emitted <= accepted:  # cut short inside the accepted block: the last emitted token stands for the bonus
            accepted = offered_depth = emitted - 1
        while len(self.accepted_hist) <= accepted:
            self.accepted_hist.append(0)
        self.accepted_hist[accepted] += 1
        while len(self.depth_reached) < tree_depth:
            self.depth_reached.append(0)
            self.depth_accepted.append(0)
        for i in range(min(accepted + 1, offered_depth)):
            self.depth_reached[i] += 1
        for i in range(accepted):
            self.depth_accepted[i] += 1
        self.target_calls += 1
        self.new_tokens += emitted

    def as_dict(self) -> dict:
        """A JSON-ready summary (derived metrics included)."""
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "draft_tokens": self.draft_tokens,
            "acceptance_length": self.acceptance_length,
            "accepted_hist": list(self.accepted_hist),
            "position_acceptance": self.position_acceptance,
            "wall_s": self.wall_s,
            "tokens_per_second": self.tokens_per_second,
            "prefill_s": self.prefill_s,
            "target_forward_s": self.target_forward_s,
            "draft_forward_s": self.draft_forward_s,
            "overhead_s": self.overhead_s,
            "overhead_share": self.overhead_share,
            "target_forward": self.target_forward,
            "kv_peak_bytes": self.kv_peak_bytes,
            "forced_tokens": self.forced_tokens,
            "constraint_mask_s": self.constraint_mask_s,
            "constraint_masks": self.constraint_masks,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """The target's own log-probability of one emitted token, and the ``top`` alternatives of the same row.

    ``logprob`` = log softmax of the target's RAW logits (before temperature, top-k and top-p) at the position the
    token was emitted from (accepted draft or bonus alike), i.e. ``log q_raw(token | prefix)``: what vLLM and
    OpenAI report. ``top``: the K most likely tokens of that row as ``(token id, logprob)``, most likely first
    (K = the ``logprobs`` asked for; empty for 0).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Generation:
    """The result of :func:`speculant.generate`: the new token ids only, and the statistics; ``logprobs`` (one
    :class:`TokenLogprob` per new token) when ``logprobs=`` was asked for, else None."""

    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens) or "cancelled"


FINISH_REASONS = ("stop", "length", "cancelled")
"""Why a generation ended (:attr:`Generation.finish_reason`, :attr:`StepEvent.finish_reason`)."""


@dataclass
class StepEvent:
    """What one decoding step did for one sequence (:func:`speculant.core.engine.generate_steps`,
    :class:`speculant.core.batch.Batch`).

    ``tokens`` were committed (the accepted draft tokens and the bonus, cut at a stop token or at
    ``max_new_tokens``); ``accepted`` draft tokens were accepted of ``drafted`` in the tree, ``offered`` being the
    draft depth along the accepted path (as :meth:`GenerationStats.record_step` counts it); ``logprobs`` per token
    when asked for; ``done`` when the sequence finished with this step, and why (``finish_reason``)."""

    sequence: int
    tokens: list[int]
    accepted: int
    offered: int
    drafted: int
    logprobs: list[TokenLogprob] | None = None
    done: bool = False
    finish_reason: str | None = None
