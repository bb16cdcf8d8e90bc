"""``speculant generate PROMPT --target DIR [--draft DIR --method SPEC ...]``: one generation, streamed.

Output conventions:
  * stdout carries only the generated text, streamed as tokens are committed and followed by one newline; with
    ``--json`` it carries exactly one JSON object ``{"text", "token_ids", "stats"}`` and nothing else.
  * stderr carries the one-line statistics summary (not printed with ``--json``: the stats are in the JSON),
    library warnings, and errors.
  * Every bad input raises ValueError before any model is loaded where it can be, reported by
    :func:`speculant.cli.main` as one line ``speculant: error: <message>`` with exit code 2.

Defaults are read from the library (``generate``'s signature, the method registry), never restated here; the
models, method and KV policy are resolved by :mod:`speculant.plan` (the rules every front-end shares) and loaded
by :mod:`speculant.session`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from . import common
from .common import PROG

if TYPE_CHECKING:
    from ..core.types import GenerationStats

__all__ = ["DESCRIPTION", "add_arguments", "epilog", "run"]

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Generate a continuation of PROMPT with the target model, losslessly accelerated by the drafting method. The "
    "text streams to stdout; a one-line summary (τ = tokens per target call, tokens, tokens/s, target calls, "
    "engine overhead share) goes to stderr. Generated text is shown with special tokens removed; --json gives the "
    "raw token ids."
)


def epilog() -> str:
    """The help epilog: the drafting methods of the registry, then the environment variables."""
    from ..drafters.registry import describe_methods

    return "methods:\n" + describe_methods() + "\n\n" + ENVIRONMENT


ENVIRONMENT = """environment:
  SPECULANT_CACHE  where models converted from GGUF are cached (default: $XDG_CACHE_HOME/speculant, else
                   ~/.cache/speculant)
  SPECULANT_PACK   auto|1|0: on a CPU, reorder the weight matrices once for oneDNN's matmul kernels (a copy as
                   large as the weights; bf16 results unchanged bit for bit). auto (default): when the matrices
                   take at least 1 MiB and the copy fits in a quarter of the available memory"""


def _methods_with_k() -> str:
    """The methods that take a k, with their default k (for the help of ``--k`` and its error)."""
    from ..drafters.registry import NO_DEFAULT, methods

    return ", ".join(
        f"{m.name}: {m.keys['k'].default}" if m.keys["k"].default is not NO_DEFAULT else m.name
        for m in methods().values()
        if "k" in m.keys
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``speculant generate``'s options on ``p``."""
    from ..plan import generate_defaults

    d = generate_defaults()
    p.add_argument(
        "prompt",
        metavar="PROMPT",
        help="the message, or '-' to read it from stdin. When the target's tokenizer has a chat template "
        "(instruct models), it is sent as the user's turn through that template and generation stops at the "
        "template's end-of-turn token; with --raw, or for a tokenizer without a template, it is plain text "
        "tokenized with the tokenizer's defaults (e.g. a BOS token)",
    )
    p.add_argument(
        "--system",
        metavar="TEXT",
        default=None,
        help="a system message put before PROMPT in the chat template (not with --raw)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="treat PROMPT as plain text to continue, even when the tokenizer has a chat template",
    )
    p.add_argument(
        "--image",
        dest="images",
        action="append",
        metavar="PATH",
        default=None,
        help="an image file PROMPT is about (repeat for several; they come before the text in the user's turn), for "
        "a vision-language target (LLaVA, Idefics3/SmolVLM, ...): the target reads it, the drafter sees the text "
        "only",
    )
    common.add_model_arguments(p)
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft tokens per step; overrides the k of --method (default: the method's own, "
        + _methods_with_k()
        + ")",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        default=d["max_new_tokens"],
        help="at most this many new tokens (fewer if an end-of-sequence token comes first); default: %(default)s",
    )
    p.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        default=d["temperature"],
        help="sampling temperature, 0 for greedy decoding; the output distribution is exactly the target's "
        "(lossless); default: %(default)s",
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        default=d["top_k"],
        help="sample among the K most likely tokens only (applied to target and draft alike); default: no top-k "
        "filter",
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        default=d["top_p"],
        help="nucleus sampling: keep the most likely tokens up to probability mass P, 0 < P <= 1; default: no "
        "top-p filter",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="S",
        default=d["seed"],
        help="random seed for reproducible sampling; default: none (different samples on every run)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to JSON valid against the JSON Schema in FILE (structured outputs; speculation "
        "stays exact under the constraint)",
    )
    fmt.add_argument(
        "--json-object",
        action="store_true",
        help="constrain the output to a JSON object (JSON mode)",
    )
    fmt.add_argument(
        "--regex",
        metavar="PATTERN",
        help="constrain the output to text matching the regular expression PATTERN (whole)",
    )
    fmt.add_argument(
        "--grammar",
        metavar="FILE",
        help="constrain the output to the llguidance Lark grammar in FILE (a start rule; JSON Schemas inline as "
        "%%json{...})",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object {text, token_ids, stats} to stdout instead of streaming the text and "
        "a summary",
    )


class _Writer:
    """Writes each step's new text to ``out`` as it comes (:class:`~speculant.models.text.Detokenizer`'s rule)."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        from ..models.text import Detokenizer

        self.detok = Detokenizer(tokenizer)
        self.out = out

    def _write(self, piece: str) -> None:
        if piece:
            self.out.write(piece)
            self.out.flush()

    def __call__(self, new_ids: list[int]) -> None:
        self._write(self.detok.push(new_ids))

    def finish(self) -> None:
        """Write what was held back (an invalid trailing byte sequence stays U+FFFD) and the final newline."""
        self._write(self.detok.finish() + "\n")


def _summary(method: str, stats: GenerationStats) -> str:
    """The one-line statistics summary written to stderr after the text."""
    return (
        f"{PROG}: method={method} τ={stats.acceptance_length:.2f} tokens={stats.new_tokens} "
        f"tokens/s={stats.tokens_per_second:.1f} target_calls={stats.target_calls} "
        f"overhead={100 * stats.overhead_share:.1f}% forward={stats.target_forward} "
        "(one cold run: `speculant bench` times methods properly)"
    )


def response_format(args: argparse.Namespace) -> dict | None:
    """The ``response_format`` of ``--json-schema``, ``--json-object``, ``--regex`` or ``--grammar`` (None: none);
    a one-line ValueError for a file that cannot be read or a schema that is not JSON."""
    if getattr(args, "json_object", False):
        return {"type": "json_object"}
    if getattr(args, "regex", None) is not None:
        return {"type": "regex", "pattern": args.regex}
    for flag, name in (("--json-schema", "json_schema"), ("--grammar", "grammar")):
        path = getattr(args, name, None)
        if path is None:
            continue
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag}: cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None
        if name == "grammar":
            return {"type": "grammar", "grammar": text}
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: {path!r} is not JSON: {e}") from None
        return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema, "strict": True}}
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``speculant generate``; returns the exit code (bad input raises ValueError)."""
    import dataclasses

    from ..core.checks import check_positive_int
    from ..core.types import SamplingParams
    from ..drafters.registry import get_method
    from ..plan import resolve
    from ..session import load_plan

    # validate everything cheap before loading any model
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template: drop --raw")
    if args.images and args.raw:
        raise ValueError("--image goes through the chat template: drop --raw")
    for path in args.images or ():
        if not Path(path).expanduser().is_file():
            raise ValueError(f"--image: {path!r} is not a file")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    check_positive_int("max_new_tokens", args.max_new_tokens)
    fmt = response_format(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ValueError("the prompt is empty: give some text")
    plan = resolve(**common.session_arguments(args))
    if args.k is not None:
        if "k" not in get_method(plan.method.name).keys:
            raise ValueError(f"--k: method {plan.method.name!r} takes no k (methods with k: {_methods_with_k()})")
        plan = dataclasses.replace(plan, method=plan.method.with_options(k=args.k))

    session = load_plan(plan)
    if fmt is not None:  # compiled (and checked) before any token is generated
        from ..structured import compile_response_format

        compile_response_format(fmt, session.tokenizer)
    stream = None if args.json else _Writer(session.tokenizer, sys.stdout)
    gen = session.generate(prompt, raw=args.raw, system=args.system, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stream=stream, images=args.images, response_format=fmt)
    if args.json:
        text = session.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": gen.token_ids, "stats": gen.stats.as_dict()}))
    else:
        stream.finish()
        print(_summary(plan.method.spec, gen.stats), file=sys.stderr)
    return 0
