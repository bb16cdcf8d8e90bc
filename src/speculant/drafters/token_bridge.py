"""Translating between two tokenizations of the same text: a draft model's tokens into the target's.

A drafter with another tokenizer (OmniDraft, Ramakrishnan et al. 2025; transformers' universal assisted generation)
drafts *text*; the target verifies its own tokens. :class:`TokenBridge` turns drafted draft tokens into target
tokens:

* **text level** (the reference): the text the draft tokens add, encoded by the target's tokenizer;
* **an n-gram cache that grows online**: runs of up to ``max_ngram`` draft tokens whose text the target's
  tokenizer covers with a run of its own tokens that starts and ends at the same characters (an *aligned*
  segment), learned from every text the bridge sees (the committed text as it grows, and each translation). A
  drafted sequence whose runs are all cached is translated run by run without touching the tokenizers; otherwise
  by text, and the segments of that translation are learned. One draft run may map to one target token (an
  n-to-one merge, the case OmniDraft learns), to several, or several draft runs to one.

Only proposals come out of here: the target verifies whatever is proposed, so a translation that differs from how
the target would tokenize the same text (tokenizers split text differently in different contexts) costs acceptance,
never exactness. Tokenizers are used through ``encode(text, add_special_tokens=False)`` and
``decode(ids, skip_special_tokens=False)`` only (any object with those two methods works).
"""

from __future__ import annotations

__all__ = ["TokenBridge", "aligned_segments", "char_boundaries"]


def char_boundaries(tokenizer, ids: list[int], text: str | None = None) -> list[int | None]:
    """``[len(ids) + 1]``: the character offset in ``decode(ids)`` where each token starts (and the end), or None
    where a token boundary falls inside a character (byte-level tokenizers split multi-byte characters)."""
    text = tokenizer.decode(ids, skip_special_tokens=False) if text is None else text
    out: list[int | None] = [0]
    for i in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:i], skip_special_tokens=False)
        out.append(len(prefix) if text.startswith(prefix) and "\ufffd" not in prefix[-1:] else None)
    out[-1] = len(text)
    return out


def aligned_segments(a: list[int], a_bounds: list[int | None], b: list[int], b_bounds: list[int | None],
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The segments where two tokenizations of one text share a start and an end character: ``(run of a, run of
    b)`` pairs between consecutive common boundaries, in text order."""
    common = sorted({x for x in a_bounds if x is not None} & {x for x in b_bounds if x is not None})
    index_a = {x: i for i, x in enumerate(a_bounds) if x is not None}
    index_b = {x: i for i, x in enumerate(b_bounds) if x is not None}
    out = []
    for start, end in zip(common, common[1:]):
        ra = tuple(a[index_a[start]:index_a[end]])
        rb = tuple(b[index_b[start]:index_b[end]])
        if ra and rb:
            out.append((ra, rb))
    return out


class TokenBridge:
    """Draft tokens -> target tokens (module doc). ``max_ngram``: the longest draft run the cache keys;
    ``max_entries``: the cache's bound (the oldest learned entries go first)."""

    def __init__(self, draft_tokenizer, target_tokenizer, max_ngram: int = 4, max_entries: int = 200_000) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.max_ngram = max_ngram
        self.max_entries = max_entries
        self.cache: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.hits = 0  # translations served by the cache
        self.misses = 0  # translations by text

    def __len__(self) -> int:
        return len(self.cache)

    def learn(self, text: str, draft_ids: list[int] | None = None, target_ids: list[int] | None = None) -> int:
        """Learn the aligned segments of ``text`` (tokenized by each side unless given); returns how many new
        entries the cache gained."""
        if not text:
            return 0
        d = self.draft_tokenizer.encode(text, add_special_tokens=False) if draft_ids is None else list(draft_ids)
        t = self.target_tokenizer.encode(text, add_special_tokens=False) if target_ids is None else list(target_ids)
        new = 0
        segments = aligned_segments(d, char_boundaries(self.draft_tokenizer, d, text), t,
                                    char_boundaries(self.target_tokenizer, t, text))
        for run, target_run in segments:
            if len(run) <= self.max_ngram and run not in self.cache:
                self.cache[run] = target_run
                new += 1
        while len(self.cache) > self.max_entries:
            del self.cache[next(iter(self.cache))]
        return new

    def _cached(self, draft_ids: list[int]) -> list[int] | None:
        """Greedy longest match over cached runs; None unless every draft token is covered."""
        out: list[int] = []
        i = 0
        while i < len(draft_ids):
            for n in range(min(self.max_ngram, len(draft_ids) - i), 0, -1):
                hit = self.cache.get(tuple(draft_ids[i:i + n]))
                if hit is not None:
                    out.extend(hit)
                    i += n
                    break
            else:
                return None
        return out

    def translate(self, draft_ids: list[int], text: str) -> list[int]:
        """The target tokens for the drafted ``draft_ids``, whose text (in context) is ``text``: run by run from
        the cache when it covers them all, else ``text`` encoded by the target's tokenizer (then learned)."""
        if not draft_ids or not text:
            return []
        cached = self._cached(draft_ids)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        target = self.target_tokenizer.encode(text, add_special_tokens=False)
        self.learn(text, target_ids=target)
        return target
