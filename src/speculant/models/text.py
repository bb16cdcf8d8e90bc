"""The text a client sees: incremental detokenisation and stop strings matched across token boundaries.

Generation commits token ids a step at a time; a response carries text. :class:`Detokenizer` turns each step's
ids into the new text (the same rule as ``speculant generate``'s ``TextStream``: decode all ids so far, hand out
the new suffix, hold back a trailing U+FFFD, an incomplete multi-byte character whose remaining bytes come with
the next token). :class:`StopMatcher` then holds back any tail of the text that could still be the start of a
stop string, so a stop string split over several tokens (or steps) is found and trimmed, and nothing of it was
sent before it was recognised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

__all__ = ["Detokenizer", "StopMatcher"]

log = logging.getLogger(__name__)


class Detokenizer:
    """Token ids in, new text out: ``push(ids)`` returns what the ids added to the text; ``finish()`` what was
    held back (an invalid trailing byte sequence then stays U+FFFD). ``lock`` guards the tokenizer when another
    thread uses it too. Decoding skips special tokens (an end-of-turn token is not text)."""

    def __init__(self, tokenizer, lock: threading.Lock | None = None) -> None:
        self.tokenizer = tokenizer
        self.lock = lock or threading.Lock()
        self.ids: list[int] = []
        self.sent = ""

    def _decode(self) -> str:
        with self.lock:
            return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _upto(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding changed text already sent (rare, tokenizer-specific)
            log.debug("detokenisation changed text already sent; continuing after it")
        piece = text[len(self.sent):]
        if piece:
            self.sent = text
        return piece

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        return self._upto(self._decode().rstrip("\ufffd"))

    def finish(self) -> str:
        return self._upto(self._decode())


class StopMatcher:
    """Finds the first stop string in a text that arrives piece by piece.

    ``feed(piece)`` returns the text that is safe to send: everything before the earliest stop string once one is
    complete (then ``hit`` is True and later pieces return ""), else everything but the longest tail that is a
    prefix of some stop string. ``flush()`` returns that held tail when the generation ends without a stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = False

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that a stop string starts with (shorter than that stop)."""
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(len(text), longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self.pending + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.pending = ""
            return text[: min(found)]
        keep = self._held(text)
        self.pending = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.hit else out
