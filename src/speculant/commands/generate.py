"""``speculant generate PROMPT --target DIR [--draft DIR --method SPEC ...]``: one generation, streamed.

Output conventions:
  * stdout carries only the generated text, streamed as tokens are committed and followed by one newline; with
    ``--json`` it carries exactly one JSON object ``{"text", "token_ids", "stats"}`` and nothing else.
  * stderr carries the one-line statistics summary (not printed with ``--json``: the stats are in the JSON),
    library warnings, and errors.
  * Every bad input raises ValueError before any model is loaded where it can be, reported by
    :func:`speculant.cli.main` as one line ``speculant: error: <message>`` with exit code 2.

Defaults are read from the library (``generate``'s signature, the method registry), never restated here.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, TextIO

from . import common
from .common import PROG, add_device_argument, add_threads_argument, positive_int, set_threads

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


@functools.cache
def _gen_defaults() -> dict[str, Any]:
    """generate()'s defaults: the single definition of max_new_tokens, temperature, top_k, top_p, seed, kv_block."""
    from ..core.engine import generate

    return {name: p.default for name, p in inspect.signature(generate).parameters.items()}


def _methods_with_k() -> str:
    """The methods that take a k, with their default k (for the help of ``--k`` and its error)."""
    from ..drafters.registry import NO_DEFAULT, methods

    return ", ".join(
        f"{m.name}: {m.keys['k'].default}" if m.keys["k"].default is not NO_DEFAULT else m.name
        for m in methods().values()
        if "k" in m.keys
    )


def _packaged_methods() -> str:
    """``name: method`` for each packaged model with a default method (for the help of ``--method``)."""
    from ..models.sources import PACKAGED

    return ", ".join(f"{m.name}: {m.default_method}" for m in PACKAGED.values() if m.default_method)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``speculant generate``'s options on ``p``."""
    from ..drafters.registry import DEFAULT_METHOD
    from ..models.loading import DTYPES
    from ..models.sources import PACKAGED

    target_default = common.default_model_dir("target")
    d = _gen_defaults()
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
        "--target",
        metavar="MODEL",
        required=target_default is None,
        default=target_default,
        help="target model: a packaged model name (" + ", ".join(PACKAGED) + "), a bundled name (default-target), "
        "a model directory (save_pretrained output), a .gguf file (converted once into a cache, see README) or "
        "a Hugging Face Hub id already in the local HF cache; "
        + ("required" if target_default is None else "default: the bundled default-target"),
    )
    p.add_argument(
        "--draft",
        metavar="MODEL",
        default=None,
        help="draft model, same tokenizer as the target: a directory, a bundled name, or an attached drafter "
        "(sharing the target's embedding); needed by methods that draft with a model (chain, trees); default: "
        "the drafter speculant ships for the target (default-target: default-draft; smollm2-135m-instruct: "
        "smollm2-135m-instruct-draft), else none",
    )
    p.add_argument(
        "--method",
        metavar="SPEC",
        default=None,
        help="drafting method: NAME or NAME:key=value[:key=value...] (list values separated by '/'), e.g. ar, "
        "chain, chain:k=8; the methods are listed below; default: the method measured fastest for a packaged "
        "target with its shipped drafter (" + _packaged_methods() + f"), else {DEFAULT_METHOD}",
    )
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
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default=None,
        help="load the models in this dtype ('auto': the one in config.json); default: float32 (exact: greedy "
        "output token-identical to plain greedy decoding). bfloat16 is faster on CPUs with native bf16 "
        "(benchmarks/results/forward_cost.json) but can round near-ties differently between a verification "
        "forward and a one-token forward",
    )
    add_threads_argument(p)
    add_device_argument(p, "the target and draft models")
    p.add_argument(
        "--kv-policy",
        metavar="POLICY",
        default=None,
        help="evict the target's KV cache with this policy (keydiff, keydiff-raw, streaming, h2o, h2o-acc, tova, "
        "snapkv, knorm, random, speckv (scored by the draft's provisional answer: needs a draft-model method), "
        "wrappers caote:/fastcaote:/protect:, e.g. caote:h2o; options after the name set its fields, e.g. "
        "snapkv:window=32, snapkv:passes=2 or speckv:passes=2 (prefill twice: the second pass keeps what the "
        "question at the end of the prompt, and for speckv the draft's provisional answer, attends to)); needs "
        "--kv-budget",
    )
    p.add_argument(
        "--kv-budget",
        type=positive_int,
        metavar="N",
        default=None,
        help="keep at most N tokens per layer in the target's KV cache (block-wise prefill, then eviction after "
        "each verified step); needs --kv-policy",
    )
    p.add_argument(
        "--kv-block",
        type=positive_int,
        metavar="B",
        default=None,  # None: not given (generate()'s default applies; given without eviction it is a no-op)
        help=f"prefill block size with --kv-budget (peak KV: N + B tokens per layer); default: {d['kv_block']}",
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


def run(args: argparse.Namespace) -> int:
    """Run ``speculant generate``; returns the exit code (bad input raises ValueError)."""
    import torch

    from ..models.chat import chat_ids, has_chat_template, stop_ids
    from ..core.checks import check_positive_int, resolve_device
    from ..drafters.registry import DEFAULT_METHOD, build_drafter, engine_options, get_method, parse_method
    from ..core.engine import generate
    from ..models.loading import (
        check_model_dir,
        default_draft_for,
        default_method_for,
        draft_context,
        load_draft,
        load_model_dir,
        resolve_model,
    )
    from ..core.types import SamplingParams

    # validate everything cheap before loading any model
    if args.method is None:
        args.method = default_method_for(args.target, args.draft) or DEFAULT_METHOD
        log.info("method %s (pass --method to choose another)", args.method)
    name, options = parse_method(args.method)
    if (args.kv_policy is None) != (args.kv_budget is None):
        raise ValueError("--kv-policy and --kv-budget go together (e.g. --kv-policy keydiff --kv-budget 256)")
    if args.kv_policy is not None:
        from ..kv import parse_policy

        parse_policy(args.kv_policy)
    elif args.kv_block is not None:
        log.warning("--kv-block has no effect without eviction (--kv-policy and --kv-budget)")
    method = get_method(name)
    if args.k is not None:
        if "k" not in method.keys:
            raise ValueError(f"--k: method {name!r} takes no k (methods with k: {_methods_with_k()})")
        options["k"] = args.k
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template: drop --raw")
    if method.needs_draft and args.draft is None:
        args.draft = default_draft_for(args.target)
    if method.needs_draft and args.draft is None:
        raise ValueError(f"method {name!r} needs a draft model: pass --draft DIR (or --method ar for plain decoding)")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    check_positive_int("max_new_tokens", args.max_new_tokens)
    device = resolve_device(args.device)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ValueError("the prompt is empty: give some text")
    args.target = check_model_dir(resolve_model(args.target))
    if method.needs_draft:
        args.draft = check_model_dir(resolve_model(args.draft))
    set_threads(args.threads)

    dtype = args.dtype if args.dtype is not None else torch.float32
    target, tokenizer = load_model_dir(args.target, dtype)
    target.to(device)
    draft_model, context = None, {}
    if method.needs_draft:
        draft_model = load_draft(args.draft, target, dtype).to(device)
        context = draft_context(args.draft, tokenizer)
    drafter = build_drafter((name, options), draft_model, **context)
    _, engine = engine_options(options)  # e.g. forward=model
    if args.draft is not None and not method.needs_draft:
        if drafter is None:  # plain decoding: passing --draft to switch methods back and forth is fine
            log.info("method %r drafts nothing: --draft is not used", name)
        else:
            log.warning("method %r drafts without a model: --draft is not used", name)

    chat = has_chat_template(tokenizer) and not args.raw
    if args.system is not None and not chat:
        raise ValueError("--system: the target's tokenizer has no chat template")
    ids = chat_ids(tokenizer, prompt, system=args.system) if chat else tokenizer(prompt)["input_ids"]
    stream = None if args.json else _Writer(tokenizer, sys.stdout)
    kv_block = {} if args.kv_block is None else {"kv_block": args.kv_block}
    gen = generate(
        target,
        ids,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=stop_ids(tokenizer, target) if chat else None,
        stream=stream,
        kv_policy=args.kv_policy,
        kv_budget=args.kv_budget,
        **kv_block,
        **engine,
    )
    if args.json:
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": gen.token_ids, "stats": gen.stats.as_dict()}))
    else:
        stream.finish()
        spec = name + "".join(f":{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in options.items())
        print(_summary(spec, gen.stats), file=sys.stderr)
    return 0
