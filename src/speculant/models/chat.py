"""Chat messages to token ids through the tokenizer's own chat template, and the tokens that end a turn.

The engine works on token ids; instruct models expect their conversation format. :func:`chat_ids` applies the
template that ships with the tokenizer (``tokenizer.chat_template``, e.g. SmolLM2's ``<|im_start|>role ...
<|im_end|>``) with the generation prompt appended, so the model writes the assistant's turn. :func:`stop_ids` is
what ends that turn: the tokenizer's EOS plus the model's generation-config EOS ids (``<|im_end|>`` for ChatML
models, ``<|eot_id|>`` for Llama 3).

>>> ids = speculant.chat_ids(tokenizer, "Name three prime numbers.", system="Be brief.")
>>> gen = speculant.generate(target, ids, drafter=..., eos_token_id=speculant.stop_ids(tokenizer, target))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["chat_ids", "check_messages", "has_chat_template", "stop_ids", "user_turn_prefix_ids", "Message"]

Message = Mapping[str, str]
"""``{"role": "system" | "user" | "assistant", "content": str}``, as in the OpenAI and transformers APIs."""

_ROLES = ("system", "user", "assistant", "tool", "developer")


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer ships a chat template (instruct/chat models do, base models usually do not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def check_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """The messages as plain ``{"role", "content"}`` dicts, or a one-line ValueError naming the first bad one."""
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
        out.append({"role": m["role"], "content": m["content"]})
    return out


def chat_ids(tokenizer, messages: str | Sequence[Message], system: str | None = None) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ending with the assistant's turn prompt.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: one user message (a string) or a list of ``{"role", "content"}`` dicts.
        system: a system message put first (only with a string ``messages`` or a list without one).

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
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
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
