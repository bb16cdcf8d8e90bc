"""Chat messages to token ids through the tokenizer's own chat template, and the tokens that end a turn.

The engine works on token ids; instruct models expect their conversation format. :func:`chat_ids` applies the
template that ships with the tokenizer (``tokenizer.chat_template``, e.g. SmolLM2's ``<|im_start|>role ...
<|im_end|>``) with the generation prompt appended, so the model writes the assistant's turn. Message content is
text, never control tokens: ``<|im_end|><|im_start|>system`` typed into a message stays those characters. :func:`stop_ids` is
what ends that turn: the tokenizer's EOS plus the model's generation-config EOS ids (``<|im_end|>`` for ChatML
models, ``<|eot_id|>`` for Llama 3).

>>> ids = speculant.chat_ids(tokenizer, "Name three prime numbers.", system="Be brief.")
>>> gen = speculant.generate(target, ids, drafter=..., eos_token_id=speculant.stop_ids(tokenizer, target))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["chat_ids", "check_messages", "has_chat_template", "special_texts", "stop_ids", "user_turn_prefix_ids",
           "Message"]

Message = Mapping[str, str]
"""``{"role": "system" | "user" | "assistant", "content": str}``, as in the OpenAI and transformers APIs."""

_ROLES = ("system", "user", "assistant", "tool", "developer")


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer ships a chat template (instruct/chat models do, base models usually do not)."""
    return bool(getattr(tokenizer, "chat_template", None))


_PASSED = ("tool_calls", "tool_call_id", "name")
"""Message fields passed on to the template beside role and content: an assistant's tool calls, a tool result's
call id, a name."""


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages as plain ``{"role", "content"}`` dicts (with ``tool_calls``, ``tool_call_id`` and ``name``
    where given), or a one-line ValueError naming the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role', 'content'} dicts")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}] has role {m['role']!r}; known roles: {', '.join(_ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
        out.append({"role": m["role"], "content": m["content"], **{k: m[k] for k in _PASSED if k in m}})
    return out


def chat_ids(tokenizer, messages: str | Sequence[Message], system: str | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ending with the assistant's turn prompt.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: one user message (a string) or a list of ``{"role", "content"}`` dicts.
        system: a system message put first (only with a string ``messages`` or a list without one).
        tools: OpenAI function tools, rendered by the template itself (``apply_chat_template(tools=...)``).

    Raises:
        ValueError: the tokenizer has no chat template (use plain ``tokenizer(text)`` ids then), or the messages
            are malformed.
    """
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template: tokenize plain text instead (the CLI's --raw)")
    msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else check_messages(messages)
    if system is not None:
        if msgs[0]["role"] == "system":
            raise ValueError("system is given twice: as an argument and as the first message")
        msgs.insert(0, {"role": "system", "content": system})
    specials = special_texts(tokenizer)
    extra = {"tools": list(tools)} if tools else {}
    if any(sp in m["content"] for m in msgs for sp in specials):
        return _ids_with_literal_content(tokenizer, msgs, extra)
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def special_texts(tokenizer) -> list[str]:
    """The text of every special token of ``tokenizer`` (``<|im_start|>``, ``</s>`` ...): what a message must not
    turn into control tokens."""
    found = list(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.append(str(token))
    return [t for t in dict.fromkeys(found) if t]


def _mark(i: int) -> str:
    return f"\u2063speculant-content-{i}\u2063"  # text no template alters (invisible separators around a name)


_MARKS = re.compile("\u2063speculant-content-(\\d+)\u2063")


def _ids_with_literal_content(tokenizer, msgs: list[dict[str, Any]], extra: Mapping[str, Any] | None = None
                              ) -> list[int]:
    """The ids of ``msgs`` in the chat template with each message's content tokenised as text: special-token text
    in it (``<|im_end|><|im_start|>system``) becomes the ordinary tokens that spell it, never control tokens, so
    a user cannot inject a turn. The template is rendered with a placeholder per content; the template's own text
    is tokenised as usual and each content with ``split_special_tokens=True``. Only used when some content holds
    special-token text (ordinary conversations take the template's own tokenisation, unchanged).

    Raises:
        ValueError: the template changes contents in a way other than trimming whitespace (then the pieces cannot
            be told apart).
    """
    extra = dict(extra or {})  # the template's other inputs (tools)
    real = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra)
    marked = [{**m, "content": _mark(i) if m["content"] else ""} for i, m in enumerate(msgs)]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **extra)
    parts = _MARKS.split(text)  # template text, content index, template text, ...
    for edit in (lambda c: c, str.strip):  # as written, or trimmed (Llama 3's template trims contents)
        contents = [edit(m["content"]) for m in msgs]
        if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(parts)) == real:
            break
    else:
        raise ValueError("this chat template changes message contents, so special-token text in them cannot be "
                         "kept as text: remove the special-token text from the messages")
    ids: list[int] = []
    for k, part in enumerate(parts):
        if k % 2:
            ids += tokenizer(contents[int(part)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif part:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


_SENTINEL = "\u2063speculant-user-turn\u2063"  # text no template alters (invisible separators around a name)


def user_turn_prefix_ids(tokenizer) -> list[int]:
    """Token ids of a conversation in the chat template up to where the user's first message begins (the
    template's default system turn included, if it adds one): what a chat model sees before a user writes.

    A chat model continuing these ids writes a user's request (Magpie, Xu et al. 2024), which is how
    :mod:`speculant.train.drafter.self_prompts` makes instruction prompts from the target itself.

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not put the user's message
            verbatim into the text.
    """
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template, so there is no user turn to begin")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False,
                                         tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not copy the user's message verbatim: cannot find where it begins")
    ids = tokenizer(text[:text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


def stop_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a generated turn: the tokenizer's EOS and the model's generation-config EOS id(s)."""
    found: list[int] = []
    candidates: list = [getattr(tokenizer, "eos_token_id", None)]
    config = getattr(model, "generation_config", None)
    if config is not None:
        candidates.append(getattr(config, "eos_token_id", None))
    for c in candidates:
        for t in c if isinstance(c, (list, tuple)) else [c]:
            if t is not None and int(t) not in found:
                found.append(int(t))
    return found
