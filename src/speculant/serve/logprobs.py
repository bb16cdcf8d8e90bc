"""Log-probabilities in OpenAI's shapes: the engine's :class:`~speculant.core.types.TokenLogprob` per emitted
token, as chat's ``choices[].logprobs.content[]`` and completions' ``logprobs.tokens/token_logprobs/top_logprobs/
text_offset``.

The worker thread turns each step's logprobs into token entries (:func:`token_entries`: the tokenizer is needed
for the token strings) in chat's shape ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``;
:class:`LogprobShape` gives a response's (or a chunk's) ``logprobs`` object from them, in the shape of its
endpoint. Tokens trimmed by a stop string never get here (the worker hands out only the tokens of returned text).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..core.types import TokenLogprob

__all__ = ["LogprobShape", "token_entries"]


def _token(tokenizer, token_id: int, lock: threading.Lock) -> dict[str, Any]:
    with lock:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
    # bytes: of the token's text (a token holding part of a multi-byte character decodes to U+FFFD)
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def token_entries(tokenizer, logprobs: Sequence[TokenLogprob], lock: threading.Lock | None = None) -> list[dict]:
    """Chat's ``logprobs.content`` entries of ``logprobs`` (one per emitted token, in order)."""
    lock = lock or threading.Lock()
    out = []
    for lp in logprobs:
        entry = {**_token(tokenizer, lp.token, lock), "logprob": lp.logprob}
        entry["top_logprobs"] = [{**_token(tokenizer, t, lock), "logprob": v} for t, v in lp.top]
        out.append(entry)
    return out


class LogprobShape:
    """The ``logprobs`` object of one response, chat or completions; streamed chunks keep the completions'
    ``text_offset`` running across chunks (the first token's offset is 0: the prompt is not echoed)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.offset = 0  # characters of token text before the next entry (completions' text_offset)

    def __call__(self, entries: Sequence[dict]) -> dict:
        """The ``logprobs`` object of ``entries`` (the next tokens of the response, in order)."""
        if self.chat:
            return {"content": list(entries), "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        tops = [_top_dict(e) for e in entries]
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


def _top_dict(entry: dict) -> dict[str, float]:
    """Completions' ``{token: logprob}`` of one token: the emitted token's own logprob is always there (OpenAI: up to
    ``logprobs + 1`` of them), then the alternatives, most likely first; two ids with the same text (parts of one
    multi-byte character) keep the emitted token's value, else the likelier one's."""
    out = {entry["token"]: entry["logprob"]}
    for t in entry["top_logprobs"]:
        out.setdefault(t["token"], t["logprob"])
    return out
