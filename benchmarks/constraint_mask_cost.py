"""What an output constraint costs per token: the allowed-token mask of llguidance (speculant's engine,
:mod:`speculant.structured`) and of xgrammar (for comparison, skipped with a note when it is not installed), over a
few formats on one tokenizer.

For each format the script compiles it (timed: the first compile, then a cached one where the engine caches), then
walks a valid output token by token, as a decoding loop does: at each token it computes the mask as a bool ``[V]``
tensor (the engine's bitmask unpacked: what speculant applies to the logits) and then advances the matcher by the
token. It reports the per-token mask time (median, p90, max, and the first call apart) for each engine, and
speculant's own path (:meth:`speculant.core.constraint.Constraint.mask_after` on a
:class:`~speculant.structured.GuidanceConstraint`, the unpacking and the stop tokens included). A decoding step of
the packaged 1.5B target takes about 60 ms on this machine's CPU; a mask well under a millisecond is noise beside it.

    python benchmarks/constraint_mask_cost.py --out constraint-mask-cost.json
    python benchmarks/constraint_mask_cost.py --tokenizer tiny --out /tmp/smoke.json        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

FORMATS = {
    "tool-call": (
        {"type": "json_schema", "json_schema": {"name": "call", "schema": {
            "type": "object",
            "properties": {"name": {"enum": ["read_file", "write_file", "run_tests"]},
                           "arguments": {"type": "object",
                                         "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                                         "required": ["path"], "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False}}},
        '{"name": "read_file", "arguments": {"path": "src/speculant/core/engine.py", "line": 42}}',
    ),
    "nested-array": (
        {"type": "json_schema", "json_schema": {"name": "report", "schema": {
            "type": "object",
            "properties": {"title": {"type": "string"},
                           "items": {"type": "array", "items": {
                               "type": "object",
                               "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                              "tags": {"type": "array", "items": {"type": "string"}}},
                               "required": ["id", "ok"]}}},
            "required": ["title", "items"]}}},
        '{"title": "nightly run", "items": [{"id": 1, "ok": true, "tags": ["fast", "cpu"]}, '
        '{"id": 2, "ok": false, "tags": []}, {"id": 3, "ok": true}]}',
    ),
    "json-object": ({"type": "json_object"}, '{"answer": 42, "reason": "the tests pass", "more": [1, 2.5, null]}'),
    "regex-date": ({"type": "regex", "pattern": r"[0-9]{4}-[0-9]{2}-[0-9]{2} (yes|no)"}, "2026-12-07 yes"),
}


def _stats(times: list[float]) -> dict:
    """Median, p90 and max of per-token seconds, in microseconds (the first call reported apart)."""
    rest = times[1:] or times
    us = sorted(t * 1e6 for t in rest)
    return {"first_us": times[0] * 1e6, "median_us": statistics.median(us),
            "p90_us": us[min(len(us) - 1, int(0.9 * len(us)))], "max_us": us[-1], "tokens": len(times)}


def _tokenizer(name: str):
    if name == "tiny":
        from speculant.tiny_models import stdlib_texts, tiny_tokenizer

        return tiny_tokenizer(stdlib_texts(["textwrap.py"]), vocab_size=300)
    from transformers import AutoTokenizer

    from speculant.models.loading import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(name))


def bench_llguidance(tok, fmt: dict, text: str, vocab: int) -> dict:
    """llguidance: compile, then per token the bitmask into a reused buffer, unpacked to bool ``[V]``."""
    from llguidance import LLMatcher

    from speculant.structured import compile_response_format
    from speculant.structured.formats import _compiled, ll_tokenizer

    lt = ll_tokenizer(tok)
    _compiled.clear()
    start = time.perf_counter()
    compiled = compile_response_format(fmt, tok)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    compile_response_format(fmt, tok)
    cached_s = time.perf_counter() - start
    ids = tok(text, add_special_tokens=False)["input_ids"]
    matcher = LLMatcher(lt, compiled.grammar, log_level=0)
    bits = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)
    raw = []
    for t in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        mask = torch.from_numpy(np.unpackbits(bits.view(np.uint8), bitorder="little", count=lt.vocab_size)
                                .view(bool))  # [V_tok]
        raw.append(time.perf_counter() - start)
        assert bool(mask[t]), "the sample output is not valid for its format"
        matcher.consume_token(t)
    constraint = compiled.constraint()
    constraint.begin(vocab, {tok.eos_token_id} if tok.eos_token_id is not None else set())
    ours = []
    for i in range(len(ids)):
        start = time.perf_counter()
        constraint.mask_after([])
        ours.append(time.perf_counter() - start)
        constraint.commit([ids[i]])
    return {"compile_s": compile_s, "cached_compile_s": cached_s, "mask": _stats(raw),
            "speculant_mask": _stats(ours)}


def bench_xgrammar(tok, fmt: dict, text: str, vocab: int) -> dict:
    """xgrammar: compile, then per token ``fill_next_token_bitmask`` unpacked to bool ``[V]``."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    if fmt["type"] == "json_schema":
        compiled = compiler.compile_json_schema(json.dumps(fmt["json_schema"]["schema"]))
    elif fmt["type"] == "json_object":
        compiled = compiler.compile_builtin_json_grammar()
    else:
        compiled = compiler.compile_regex(fmt["pattern"])
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)  # [1, words] int32
    ids = tok(text, add_special_tokens=False)["input_ids"]
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        mask = torch.from_numpy(np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little",
                                              count=info.vocab_size).view(bool))  # [V]
        times.append(time.perf_counter() - start)
        assert bool(mask[t]), "the sample output is not valid for its format"
        matcher.accept_token(t)
    return {"compile_s": compile_s, "mask": _stats(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct",
                    help="a model name speculant resolves (packaged, bundled, a directory, a Hub id in the cache) "
                    "whose tokenizer to use, or 'tiny' (a 300-token test tokenizer, for a smoke run)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="the logits width V (default: the model's padded vocabulary for a model, the tokenizer's "
                    "size for 'tiny')")
    ap.add_argument("--rounds", type=int, default=3, help="walks per format and engine (the times pool)")
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = _tokenizer(args.tokenizer)
    vocab = args.vocab
    if vocab is None:
        vocab = len(tok)
        if args.tokenizer != "tiny":
            from transformers import AutoConfig

            from speculant.models.loading import resolve_model

            vocab = max(vocab, AutoConfig.from_pretrained(resolve_model(args.tokenizer)).vocab_size)
    engines = {"llguidance": bench_llguidance}
    notes = []
    try:
        import xgrammar  # noqa: F401

        engines["xgrammar"] = bench_xgrammar
    except ImportError as e:
        notes.append(f"xgrammar skipped: not importable ({e})")
    results: dict = {}
    for name, (fmt, text) in FORMATS.items():
        for engine, bench in engines.items():
            runs = []
            for _ in range(args.rounds):
                try:
                    runs.append(bench(tok, fmt, text, vocab))
                except Exception as e:  # an engine without this format: noted, the rest goes on
                    notes.append(f"{engine} on {name}: {type(e).__name__}: {e}")
                    break
            if runs:
                results.setdefault(name, {})[engine] = runs[-1] | {
                    "compile_s_min": min(r["compile_s"] for r in runs)}
                print(name, engine, json.dumps(runs[-1]["mask"]), flush=True)
    out = {"tokenizer": args.tokenizer, "tokenizer_size": len(tok), "vocab": vocab, "results": results,
           "notes": notes, "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                       "torch_threads": torch.get_num_threads()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
