"""Baselines that run transformers' own ``generate`` on the same models, prompts and settings as ours.

``hf-ar``
    plain greedy decoding or sampling.
``hf-assisted[:k=N]``
    assisted generation with the draft model (``assistant_model=draft``), N assistant tokens per step, constant
    schedule, no confidence threshold: the same algorithm as our ``chain:k=N``.
``hf-prompt-lookup[:k=N][:ngram=M]``
    prompt-lookup decoding (``prompt_lookup_num_tokens=N``, ``max_matching_ngram_size=M``).

The baseline table also lists ``llamacpp-ar``, ``llamacpp-lookup`` and ``llamacpp-draft``, which run the target's
GGUF file (and the draft's) through llama.cpp's own programs instead (:mod:`speculant.bench.llamacpp`).

Specs use the registry's syntax (``NAME:key=value``). A forward probe on the target counts its calls (the first
one also processes the prompt) and recovers, from the cache length and the number of tokens each call is fed, how
many tokens each step drafted and emitted: τ, the accepted-length histogram and per-position acceptance are
reported for baselines as for our methods. The time split: ``prefill_s`` = the first target call, target forward
= the other target calls, draft forward = the assistant's calls, overhead = the rest of ``generate``.

transformers 5.23 reads ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and
``assistant_confidence_threshold`` from the *assistant's* ``generation_config`` (``AssistedCandidateGenerator``),
not from ``generate``'s arguments; its default threshold 0.4 stops drafting early. They are therefore set on the
assistant's config for the duration of the call (and passed to ``generate`` too), then restored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.checks import resolve_eos
from ..drafters.registry import Key, split_spec
from ..core.types import GenerationStats
from .llamacpp import DEFAULT_DRAFT_K
from .probe import ForwardProbe, peak_kv_bytes, probing

__all__ = ["BASELINES", "Baseline", "describe_baselines", "hf_generate", "parse_baseline", "stats_from_calls"]


@dataclass(frozen=True)
class Baseline:
    """A transformers ``generate`` configuration to compare against: its spec keys and whether it needs a draft."""

    name: str
    doc: str
    needs_draft: bool = False
    keys: Mapping[str, Key] = field(default_factory=dict)
    runtime: str = "transformers"  # "llama.cpp": runs the target's GGUF file (speculant.bench.llamacpp)


BASELINES: dict[str, Baseline] = {
    b.name: b
    for b in (
        Baseline("hf-ar", "transformers generate(), plain decoding"),
        Baseline(
            "hf-assisted",
            "transformers assisted generation with the draft (Leviathan et al. 2023): constant schedule, no "
            "confidence threshold",
            needs_draft=True,
            keys={"k": Key(int, "assistant tokens per step (num_assistant_tokens); default: the k of the first "
                               "chain method, else the chain drafter's default")},
        ),
        Baseline(
            "hf-prompt-lookup",
            "transformers prompt-lookup decoding (Saxena 2023)",
            keys={
                "k": Key(int, "candidate tokens per step (prompt_lookup_num_tokens); default: as hf-assisted"),
                "ngram": Key(int, "max_matching_ngram_size", default=2),
            },
        ),
        Baseline("llamacpp-ar", "llama.cpp plain decoding of the target's GGUF file (llama-lookup with no draft "
                 "tokens; its quantized weights; needs `make llamacpp`)", runtime="llama.cpp"),
        Baseline(
            "llamacpp-lookup",
            "llama.cpp lookup decoding (llama-lookup: its 1- to 4-gram cache of the prompt and output) of the "
            "target's GGUF file",
            keys={"k": Key(int, "draft tokens per round at most (--spec-draft-n-max); default: as hf-assisted")},
            runtime="llama.cpp",
        ),
        Baseline(
            "llamacpp-draft",
            "llama.cpp draft-model speculation (llama-speculative-simple) with the draft's GGUF file (Leviathan et "
            "al. 2023)",
            needs_draft=True,
            keys={"k": Key(int, "draft tokens per round (--spec-draft-n-max)", default=DEFAULT_DRAFT_K)},
            runtime="llama.cpp",
        ),
    )
}


def parse_baseline(spec: str) -> tuple[str, dict[str, Any]]:
    """Parse ``NAME[:key=value...]`` for a baseline of :data:`BASELINES`; a one-line ValueError otherwise."""
    name, raw = split_spec(spec, "baseline", list(BASELINES))
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known baselines: {', '.join(BASELINES)}")
    base = BASELINES[name]
    options: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in base.keys:
            known = ", ".join(base.keys) or "none"
            raise ValueError(f"unknown option {key!r} for baseline {name!r}; its options: {known}")
        options[key] = base.keys[key].convert(name, key, value, kind="baseline")
        if isinstance(options[key], int) and options[key] < 1:
            raise ValueError(f"option {key!r} of baseline {name!r} must be >= 1, got {options[key]}")
    return name, options


def describe_baselines() -> str:
    """Help text: one line per baseline with its keys."""
    lines = []
    for b in BASELINES.values():
        line = f"  {b.name}: {b.doc}" + (" [needs --draft]" if b.needs_draft else "")
        for key, spec in b.keys.items():
            line += f"\n      {key} ({spec.type_name()}): {spec.doc}"
        lines.append(line)
    return "\n".join(lines)


def stats_from_calls(probe: ForwardProbe, prompt_len: int, new_tokens: int) -> GenerationStats:
    """Per-step accounting of a transformers generation from the target's forward calls.

    Before call j > 0 the cache holds every committed token but the last (so ``committed = past + 1``); call 0
    starts from the prompt. A call feeds the uncommitted root plus the step's draft, so ``drafted = past + inputs
    - committed``; a step emitted what the next call (or the end) finds committed beyond it.
    """
    stats = GenerationStats()
    calls = probe.calls
    committed = [prompt_len] + [c.past + 1 for c in calls[1:]] + [prompt_len + new_tokens]
    for j, c in enumerate(calls):
        drafted = max(0, c.past + c.inputs - committed[j])
        emitted = max(0, committed[j + 1] - committed[j])
        accepted = max(0, min(emitted - 1, drafted))
        stats.record_step(drafted, accepted + (1 if drafted > accepted else 0), accepted, emitted)
        stats.draft_tokens += drafted
    stats.new_tokens = new_tokens  # the emitted counts telescope to this; set it exactly all the same
    if calls:
        stats.prefill_s = calls[0].seconds
        stats.target_forward_s = sum(c.seconds for c in calls[1:])
    return stats


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own logging at ERROR while ``generate`` runs: its assisted-generation internals warn about
    their own argument passing on first use (a deprecation notice meant for transformers' developers)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


_ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@contextmanager
def _assistant_config(draft: torch.nn.Module, k: int) -> Iterator[dict]:
    """Set the assistant's generation config to k tokens, constant schedule, no confidence threshold; restore."""
    cfg = draft.generation_config
    saved = {name: getattr(cfg, name, None) for name in _ASSISTANT_FIELDS}
    wanted = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
              "assistant_confidence_threshold": 0.0}
    for name, value in wanted.items():
        setattr(cfg, name, value)
    try:
        yield wanted
    finally:
        for name, value in saved.items():
            setattr(cfg, name, value)


def hf_generate(
    target: torch.nn.Module,
    ids: list[int],
    max_new_tokens: int,
    stops: list[int],
    pad_token_id: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    draft: torch.nn.Module | None = None,
    assistant_tokens: int | None = None,
    lookup_tokens: int | None = None,
    lookup_ngram: int | None = None,
) -> dict:
    """One transformers ``generate`` call, probed; returns a row like the engine's: ``token_ids`` (new tokens) and
    the :class:`GenerationStats` fields, plus ``depth_reached``/``depth_accepted`` and ``kv_cache_peak_bytes``.

    ``stops`` are the stop tokens (``[]``: never stop early), ``pad_token_id`` is passed so transformers does not
    guess it. ``draft`` with ``assistant_tokens`` is assisted generation; ``lookup_tokens`` is prompt lookup.
    Sampling (``temperature > 0``) seeds torch's global generator with ``seed`` (transformers samples from it).
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": 0,
        "num_beams": 1,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "eos_token_id": list(stops),
        "pad_token_id": pad_token_id,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        kwargs.update(temperature=float(temperature), top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    if lookup_tokens is not None:
        kwargs.update(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=lookup_ngram or 2)
    if draft is not None:
        kwargs.update(num_assistant_tokens=assistant_tokens, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    device = target.device
    input_ids = torch.tensor([ids], device=device)
    attention_mask = torch.ones_like(input_ids)
    assistant = _assistant_config(draft, assistant_tokens) if draft is not None else nullcontext()
    with _quiet_transformers(), assistant, probing(target, draft) as (t_probe, d_probe):
        if temperature > 0 and seed is not None:
            torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(input_ids, attention_mask=attention_mask, assistant_model=draft, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    stats = stats_from_calls(t_probe, len(ids), len(new))
    stats.wall_s, stats.target_forward = wall, "transformers"
    if d_probe is not None:
        stats.draft_calls = len(d_probe.calls)
        stats.draft_forward_s = d_probe.seconds
    return {
        "token_ids": new,
        **stats.as_dict(),
        "depth_reached": list(stats.depth_reached),
        "depth_accepted": list(stats.depth_accepted),
        "kv_cache_peak_bytes": peak_kv_bytes(t_probe, d_probe),
    }


def hf_runner(
    name: str,
    options: Mapping[str, Any],
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    default_k: int,
    stops: list[int],
    pad_token_id: int,
) -> Callable[..., dict]:
    """A ``run(ids, max_new_tokens, **sampling) -> row`` callable for baseline ``name`` (parsed ``options``),
    stopping at ``stops`` and padding with ``pad_token_id``; ``default_k`` is the k when the spec sets none."""
    k = int(options.get("k", default_k))
    extra: dict[str, Any] = {}
    if name == "hf-assisted":
        if draft is None:
            raise ValueError("baseline 'hf-assisted' needs a draft model (--draft DIR)")
        extra = {"draft": draft, "assistant_tokens": k}
    elif name == "hf-prompt-lookup":
        ngram = options.get("ngram", BASELINES[name].keys["ngram"].default)
        extra = {"lookup_tokens": k, "lookup_ngram": int(ngram)}
    elif name != "hf-ar":
        raise ValueError(f"unknown baseline {name!r}; known baselines: {', '.join(BASELINES)}")

    def run(ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, eos_token_id=None) -> dict:
        """``eos_token_id`` (as :func:`speculant.generate` takes it) overrides ``stops`` when given."""
        stop_ids = stops if eos_token_id is None else sorted(resolve_eos(target, eos_token_id))
        return hf_generate(target, ids, max_new_tokens, stop_ids, pad_token_id, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, **extra)

    return run
