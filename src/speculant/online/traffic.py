"""Drafting from what a deployment has seen before: a bounded memory of earlier requests' tokens, looked up like prompt
lookup (model-free, as SuffixDecoding, Oliaro et al. 2024, drafts from earlier outputs).

Requests a deployment serves repeat each other: the same instruction templates, the same answer phrasing ("Here is
the function with type hints ..."), the same code idioms. Prompt lookup (:mod:`speculant.drafters.lookup`) finds only
what the current request's own text repeats; :class:`TrafficMemory` keeps the token ids of earlier requests (prompt
and answer, oldest evicted past ``max_tokens``) indexed by their n-grams, and :class:`WithTraffic` merges into each
draft up to ``k`` tokens the memory predicts after the context's longest suffix it knows (``ngram`` down to
``min_ngram`` tokens). ``scoring="frequent"`` (the default) counts what followed every n-gram and walks those counts,
each drafted token the most frequent continuation of the context so far (SuffixDecoding's frequency scoring, as a
chain), a prediction that sharpens as the traffic grows; ``"recent"`` copies what followed the context's most recent
occurrence, up to that request's end. With a node budget (``WithTraffic(tree=N)``) the memory drafts a tree instead
of its one chain (:meth:`TrafficMemory.tree`, SuffixDecoding's tree speculation): the best-scoring continuations side
by side, grown best first, so that where several continuations followed a context the likely ones are all verified;
the memory's counts cover more of the traffic as it grows, and a tree turns more of that coverage into accepted
tokens, for more verified rows per step. The memory grows as requests finish (:class:`~.adapter.OnlineAdapter` adds
each one), so the drafter improves with its traffic, at no training cost.

The merged draft is deterministic (``draft_probs`` None) and is verified like prompt lookup's (greedy rule, or the
deterministic-draft rule when sampling): exact whatever the memory holds. A memory holding other users' requests
changes which tokens are proposed, never which are emitted; but it is shared: how many drafted tokens a response
reports accepted (and its latency) tells whether what followed its context had followed the same context in an
earlier request, so one memory should serve users who may learn that much of each other's traffic (and its saved
state holds their prompts).

Thread use: :meth:`TrafficMemory.add` and the lookups run on the thread that decodes (a server's decoding thread). A
lookup from another thread stays safe: ``"frequent"`` reads one dict whose entries are replaced whole (a walk keeps
the dict it started with; a tree copies each count dict it reads, which the GIL makes atomic), ``"recent"`` reads the
index, the ids and the request starts with bounds-safe slicing; the eviction swaps its rebuilt structures in
together, so such a lookup sees the old or the new memory, or entries of both, which could only draft other tokens,
never emit one.

Memory: the ids (a Python list) and, per distinct n-gram (at most ``ngram`` per token), an index entry (``"recent"``)
or a small dict of continuation counts and the best continuation (``"frequent"``), a few hundred bytes per token held
with ``"frequent"`` scoring and less with ``"recent"``. :attr:`TrafficMemory.max_tokens` bounds them: past it the
oldest requests are dropped until the new one fits in half the bound, and the index or counts are rebuilt (once per
``max_tokens / 2`` tokens added; a Python loop over what is kept).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence

import torch

from ..core.checks import check_positive_int
from ..drafters.base import DecodeState
from ..drafters.merged_chain import MergedChain

__all__ = ["MIN_SCORE", "SCORINGS", "TrafficMemory", "WithTraffic"]


SCORINGS = ("frequent", "recent")
"""How :meth:`TrafficMemory.continuation` picks among earlier occurrences of the context (module doc)."""

MIN_SCORE = 0.1
""":class:`TrafficMemory`'s default ``min_score``: a chain ends where its estimate says it is right less than one
time in ten, which drafts markedly fewer tokens per step than no bound for a slightly lower τ (every verified row
costs on a CPU)."""


class TrafficMemory:
    """The token ids of earlier requests, indexed for lookup (see the module doc).

    Args:
        ngram: the longest context suffix looked up.
        min_ngram: the shortest (1: what followed a single token when nothing longer matches).
        max_tokens: the bound on the tokens held (module doc).
        scoring: ``"frequent"``: walk the memory's n-gram counts, each token the one that most often followed the
            context's longest known suffix (SuffixDecoding's frequency scoring; ties: the one that reached the
            count last);
            ``"recent"``: copy what followed the context's most recent occurrence.
        min_score: ``"frequent"`` only: end the chain before a token where the product of the chain's shares,
            ``count / (total + 1)`` each (what followed the suffix that often, against everything that did plus one
            unseen outcome: a continuation seen once scores 1/2, twice in a row 2/3), falls below this; 0: up to
            ``k`` tokens while any suffix is known. Each verified row costs, most on a CPU: the default stops a
            chain whose estimate says it is right less than one time in ten.
    """

    def __init__(self, ngram: int = 3, max_tokens: int = 1 << 17, min_ngram: int = 1, scoring: str = "frequent",
                 min_score: float = MIN_SCORE) -> None:
        self.ngram = check_positive_int("ngram", ngram)
        self.min_ngram = check_positive_int("min_ngram", min_ngram)
        if self.min_ngram > self.ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= ngram ({ngram})")
        self.max_tokens = check_positive_int("max_tokens", max_tokens)
        if scoring not in SCORINGS:
            raise ValueError(f"traffic memory scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
        self.scoring = scoring
        if not (isinstance(min_score, (int, float)) and not isinstance(min_score, bool) and 0 <= min_score < 1):
            raise ValueError(f"traffic memory min_score must be a probability in [0, 1), got {min_score!r}")
        self.min_score = float(min_score)
        self._tokens: list[int] = []
        self._starts: list[int] = []  # index in _tokens where each request begins (increasing)
        self._index: dict[tuple[int, ...], int] = {}  # "recent": n-gram -> index of the token after its last occurrence
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}  # "frequent": n-gram -> {next token: occurrences}
        self._best: dict[tuple[int, ...], tuple[int, int, int]] = {}  # "frequent": n-gram -> (token, its count, total)

    def __len__(self) -> int:
        """Tokens held."""
        return len(self._tokens)

    @property
    def requests(self) -> int:
        """Requests held."""
        return len(self._starts)

    def add(self, ids: Sequence[int]) -> None:
        """Remember one finished request's token ids (prompt + answer); a request longer than the bound keeps its
        last ``max_tokens`` tokens."""
        ids = [int(t) for t in ids][-self.max_tokens :]
        if not ids:
            return
        if len(self._tokens) + len(ids) > self.max_tokens:
            self._evict(self.max_tokens // 2 - len(ids))
        start = len(self._tokens)
        self._starts.append(start)
        self._tokens.extend(ids)
        self._index_request(self._tokens, start, len(self._tokens), self._index, self._counts, self._best)

    def continuation(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens the memory predicts after ``ids``; ``[]`` when no suffix of ``ids`` (``ngram`` ..
        ``min_ngram`` tokens) occurred in an earlier request. ``"recent"``: what followed the most recent occurrence
        of the longest such suffix, up to that request's end; ``"frequent"``: :meth:`_frequent`."""
        if k < 1 or not self._tokens:
            return []
        if self.scoring == "frequent":
            return self._frequent(ids, k)
        for n in range(min(self.ngram, len(ids)), self.min_ngram - 1, -1):
            after = self._index.get(tuple(ids[len(ids) - n :]))
            if after is not None:
                r = bisect.bisect_right(self._starts, after - 1)  # the request holding the n-gram
                end = self._starts[r] if r < len(self._starts) else len(self._tokens)
                follow = self._tokens[after : min(end, after + k)]
                if follow:
                    return follow
        return []

    def _frequent(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens, each the one that most often followed the longest known suffix (``ngram`` ..
        ``min_ngram`` tokens) of the context extended by the tokens before it (ties: the one that reached the count
        last), while the chain's score stays at least ``min_score`` (the class doc). Reads one dict of the memory
        (``_best``, its entries replaced whole), so a lookup beside :meth:`add` on another thread sees old or new
        entries, never a torn one."""
        best = self._best  # one generation for the whole walk (an eviction swaps in a new dict)
        context, out, score = [int(t) for t in ids[max(0, len(ids) - self.ngram) :]], [], 1.0
        while len(out) < k:
            for n in range(min(self.ngram, len(context)), self.min_ngram - 1, -1):
                entry = best.get(tuple(context[len(context) - n :]))
                if entry is not None:
                    token, count, total = entry
                    score *= count / (total + 1)
                    break
            else:
                break
            if score < self.min_score:
                break
            out.append(token)
            context = (context + [token])[-self.ngram :]
        return out

    def tree(self, ids: Sequence[int], k: int, budget: int) -> list[list[int]]:
        """The memory's draft tree after ``ids``, as its root-to-leaf paths: at most ``budget`` nodes, at most ``k``
        deep, grown best first (SuffixDecoding's tree speculation). A node's score is its path's product of
        ``count / (total + 1)`` (what followed the longest known suffix of the context extended by the path, as
        :meth:`continuation` scores its chain); the tree holds the ``budget`` best-scoring nodes whose score is at
        least ``min_score`` (a child scores less than its parent, so they form a tree), so where the memory has seen
        several continuations of a context it proposes the likely ones side by side instead of the most frequent
        alone. The chain is the path of each node's best child; a budget too small for it keeps its likelier
        prefix. ``[]`` when no suffix is known; ``"recent"`` scoring: :meth:`continuation`'s chain as the one path.
        Each count dict read is copied first (``add`` updates them in place; a dict copy of int keys and values is
        atomic under CPython's GIL), so a lookup beside :meth:`add` on another thread stays safe: an eviction between
        its reads of the counts and of the best continuations can only reorder tied tokens."""
        check_positive_int("budget", budget)
        if self.scoring != "frequent" or k < 1 or not self._tokens:
            chain = self.continuation(ids, k)
            return [chain] if chain else []
        counts, best = self._counts, self._best  # one generation (an eviction swaps in new dicts)
        context = [int(t) for t in ids[max(0, len(ids) - self.ngram) :]]
        heap: list[tuple[float, int, list[int]]] = []  # (-score, order pushed, path)
        order = itertools.count()

        def grow(path: list[int], score: float, room: int) -> None:
            """Push ``path``'s children that score at least ``min_score``, the ``room`` best (no others could be
            taken)."""
            if len(path) >= k:
                return
            ctx = (context + path)[-self.ngram :]
            for n in range(min(self.ngram, len(ctx)), self.min_ngram - 1, -1):
                key = tuple(ctx[len(ctx) - n :])
                follow = counts.get(key)
                if follow:
                    break
            else:
                return
            follow = dict(follow)  # a snapshot
            total = sum(follow.values())
            top = best.get(key, (None,))[0]  # ties between counts: the chain's pick first
            for token, count in heapq.nsmallest(room, follow.items(), key=lambda tc: (-tc[1], tc[0] != top)):
                child = score * (count / (total + 1))  # as the chain multiplies its shares
                if child < self.min_score:
                    break
                heapq.heappush(heap, (-child, next(order), path + [token]))

        grow([], 1.0, budget)
        nodes: list[list[int]] = []
        while heap and len(nodes) < budget:
            score, _, path = heapq.heappop(heap)
            nodes.append(path)
            grow(path, -score, budget - len(nodes))
        inner = {tuple(p[:-1]) for p in nodes}
        return [p for p in nodes if tuple(p) not in inner]

    def _index_request(self, tokens: list[int], start: int, end: int, index: dict, counts: dict, best: dict) -> None:
        """Index the n-grams of the request ``tokens[start:end]`` (within it only): ``"recent"``: into ``index``,
        later occurrences winning; ``"frequent"``: their continuations counted into ``counts``, each n-gram's most
        frequent one (ties: the one that reached the count last) with its count and the total in ``best``."""
        frequent = self.scoring == "frequent"
        for j in range(start + 1, end):  # the token at j follows n-grams ending at j - 1
            token = tokens[j]
            for n in range(self.min_ngram, min(self.ngram, j - start) + 1):
                key = tuple(tokens[j - n : j])
                if not frequent:
                    index[key] = j
                    continue
                follow = counts.setdefault(key, {})
                count = follow[token] = follow.get(token, 0) + 1
                top, top_count, total = best.get(key, (token, 0, 0))
                best[key] = (token, count, total + 1) if count >= top_count else (top, top_count, total + 1)

    def _evict(self, keep: int) -> None:
        """Drop the oldest requests until at most ``keep`` tokens are left (>= 0), then rebuild the index (or the
        counts)."""
        cut = len(self._tokens) - max(0, keep)
        r = bisect.bisect_left(self._starts, cut)  # the first request starting at or after the cut survives
        drop = self._starts[r] if r < len(self._starts) else len(self._tokens)
        tokens, starts, index, counts, best = self._tokens[drop:], [s - drop for s in self._starts[r:]], {}, {}, {}
        for a, b in _spans(starts, len(tokens)):
            self._index_request(tokens, a, b, index, counts, best)
        # swapped in together (module doc): a lookup reads one of index or best, each whole
        self._tokens, self._starts, self._index, self._counts, self._best = tokens, starts, index, counts, best

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """The memory as tensors, ``tokens`` [T] int32 and ``starts`` [R] int64 (the index or counts are rebuilt on
        load)."""
        return {"tokens": torch.tensor(self._tokens, dtype=torch.int32),
                "starts": torch.tensor(self._starts, dtype=torch.int64), "ngram": self.ngram,
                "max_tokens": self.max_tokens}

    def load_state_dict(self, state: dict, vocab_size: int | None = None) -> None:
        """Restore :meth:`state_dict` (this memory's ``ngram`` and bound apply; the oldest requests past the bound
        are dropped); ``vocab_size``: refuse token ids outside it (a state saved for another model). A bad state is
        a ValueError and changes nothing."""
        if not isinstance(state, dict) or not all(
                isinstance(state.get(k), torch.Tensor) and state[k].dim() == 1 and not state[k].is_floating_point()
                for k in ("tokens", "starts")):
            raise ValueError("the traffic memory's state is incomplete (tokens and starts, 1-D integer tensors)")
        tokens, starts = state["tokens"].tolist(), state["starts"].tolist()
        if starts != sorted(starts) or bool(tokens) != bool(starts) or (
                starts and (starts[0] != 0 or starts[-1] >= len(tokens))):
            raise ValueError("the traffic memory's state is inconsistent (request starts)")
        if tokens and (min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size)):
            raise ValueError("the traffic memory's state holds token ids outside this model's vocabulary (saved "
                             "for another model?)")
        self._tokens, self._starts, self._index, self._counts, self._best = [], [], {}, {}, {}
        for a, b in _spans(starts, len(tokens)):
            self.add(tokens[a:b])


def _spans(starts: list[int], total: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each request, from the requests' ``starts`` and the ``total`` tokens held."""
    return list(zip(starts, starts[1:] + [total]))


class WithTraffic(MergedChain):
    """``inner``'s draft tree plus the ``k`` tokens ``memory`` says followed the context's suffix in earlier
    requests (:meth:`TrafficMemory.continuation`), merged as a deterministic chain; with ``tree`` > 0 the memory's
    tree of at most that many nodes, ``k`` deep, instead (:meth:`TrafficMemory.tree`). A tree whose nodes carry
    probes (mask probing, ConFu with ``contemplate=all``) is proposed without it."""

    option = "traffic"
    optional = True

    def __init__(self, inner, memory: TrafficMemory, k: int = 8, tree: int = 0) -> None:
        super().__init__(inner, k)
        self.memory = memory
        if not (isinstance(tree, int) and not isinstance(tree, bool) and tree >= 0):
            raise ValueError(f"the traffic tree's node budget must be an integer >= 0 (0: a chain), got {tree!r}")
        self.tree = tree

    def chain(self, state: DecodeState, k: int) -> list[int]:
        return self.memory.continuation(state.ids, k)

    def chains(self, state: DecodeState, k: int) -> list[list[int]]:
        return self.memory.tree(state.ids, k, self.tree) if self.tree else [self.chain(state, k)]
