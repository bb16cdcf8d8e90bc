"""``run_bench``: our methods and transformers' baselines on one prompt set, side by side, with a report.

One call loads the models (or takes loaded ones), builds every method from the ONE registry
(:mod:`speculant.drafters.registry`) and every baseline from :mod:`speculant.bench.hf`, runs them interleaved per
prompt after a warm-up (:func:`speculant.bench.speed.run_side_by_side`), and summarises. ``ar`` (plain decoding
through our engine) always runs: it is the reference for speed-ups and, at temperature 0, for token identity.

Per method (see :data:`DEFINITIONS`, also written into results.json): τ, accepted-length histogram, per-position
acceptance, target calls, median tokens/s, speed-up vs ``ar``, MBSU, peak memory, time split, identity with ``ar``;
and when the prompts carry a ``category`` (MT-Bench does), τ and speed-up per category.

Chat prompts (``messages``) are tokenised with the target tokenizer's chat template and, unless stop tokens are
given, every method and baseline stops at the end of the assistant's turn (:func:`speculant.models.chat.stop_ids`).
Fill-in-the-middle prompts (``prefix`` and ``suffix``, ``builtin:fim``) are built in the target's own FIM tokens
and every method and baseline stops at the model's FIM end tokens (:func:`speculant.models.fim.fim_stop_ids`).
Structured prompts (a ``response_format``, or ``tools`` and ``tool_choice``: ``builtin:json-extract``,
``builtin:tools``) run every method under their constraint (:mod:`speculant.bench.structured`; the tools rendered by
the chat template) and each answer is checked: per method, the share valid and exact, the constraint's mask time
per step and as a share of decoding, and the share of forced tokens (``structured``). transformers and llama.cpp
baselines cannot decode under a constraint: such prompts run our methods only.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.chat import stop_ids
from ..models.fim import fim_stop_ids
from ..core.checks import check_fits_context, check_positive_int, resolve_device, resolve_eos, warn_once
from ..core.quant import quantization_of
from ..drafters.registry import NO_DEFAULT, get_method, split_spec
from ..core.types import SamplingParams
from ..plan import ParsedMethod, default_method
from ..session import Session
from .matched_specs import matched_specs, shape
from .cost import (
    drafter_models,
    drafter_params_per_forward,
    mbsu,
    param_bytes,
    params_per_forward,
)
from . import llamacpp
from .hf import BASELINES, hf_runner, parse_baseline
from .models import BenchModels, plan_bench_models
from .probe import peak_kv_bytes, probing
from ..data.prompts import check_record, is_chat, is_fim, load_prompts, prompt_ids
from .speed import MethodRun, machine_info, run_side_by_side, summarise, summarise_by
from .structured import DEFINITIONS as STRUCTURED_DEFINITIONS
from .structured import StructuredPrompt, check_run, prepare, summarise_structured
from ..data.answers import is_structured

__all__ = ["DEFAULT", "DEFAULT_FAMILIES", "DEFAULT_METHODS", "DEFINITIONS", "REFERENCE", "check_out_dir",
           "method_specs", "run_bench", "split_specs"]

log = logging.getLogger(__name__)

REFERENCE = "ar"
"""The method every speed-up and identity check is measured against."""

DEFAULT = "default"
"""In a method list: the target's packaged default method (:func:`speculant.plan.default_method`: the method
measured fastest for a packaged target with its shipped drafter), else the registry's ``DEFAULT_METHOD``."""

DEFAULT_METHODS = ("chain:k=4",)
"""The methods :func:`run_bench` compares with the reference when none are given and the target has no packaged
default method (a packaged target with one runs :data:`DEFAULT`)."""

DEFAULT_FAMILIES = ("chain",)
"""The same for a budget-matched comparison (families, sized by the budgets and depths)."""

DEFINITIONS = {
    "acceptance_length": "τ: new tokens / target forward calls, pooled over all runs (bonus token included; for "
    "transformers baselines the first call also processes the prompt, our prefill is not a call)",
    "accepted_hist": "[m] = verification steps that accepted exactly m draft tokens, pooled over runs",
    "position_acceptance": "[i] = P(draft at depth i+1 accepted | depth i accepted and depth i+1 drafted), pooled",
    "tokens_per_second": "median over runs of new tokens / wall time of the whole generation (prefill included)",
    "speedup_vs_ar": "median over prompts of (tokens/s of the method / tokens/s of ar on the same prompt and "
    "repeat), methods interleaved per prompt after a warm-up; equals the wall-time ratio when both produced the "
    "same number of tokens",
    "mbsu": "memory-bound speed-up τ / (c·γ + 1): c = draft_cost_ratio, γ = draft_calls_per_step",
    "draft_cost_ratio": "c: parameters one draft forward reads / parameters one target forward reads (input "
    "embedding tables excluded unless tied to the LM head: a forward reads only its tokens' rows)",
    "draft_calls_per_step": "γ: draft forwards / target forwards, measured",
    "tree_nodes": "the most tree tokens one target call verifies (the root excluded), from the spec; None for "
    "methods without a fixed tree",
    "tree_depth": "draft levels per step (draft forwards of a tree drafter), from the spec",
    "tree_tokens_per_call": "draft tokens / target calls, measured (merged duplicates and shortened drafts near "
    "the end make it smaller than tree_nodes)",
    "peak_memory_bytes": "param_bytes + kv_cache_peak_bytes. param_bytes: parameters and buffers of the models the "
    "method runs (target, plus the draft if it drafts with one). kv_cache_peak_bytes: the largest total, over "
    "the run, of the storage held by the KV caches passed to those models, sampled after every forward "
    "(preallocated capacity counts in full). Activations, logits, allocator slack and transient copies are NOT "
    "included: it is the model-state footprint, not the process's peak RSS; the maximum over runs is reported",
    "overhead_share": "time outside target and draft forwards / decoding time (wall minus prefill), pooled; "
    "target_forward_share and draft_forward_share likewise. transformers baselines: prefill = the first target "
    "call, measured with forward hooks",
    "speedup_vs_hf_assisted": "our methods, when hf-assisted ran: median over prompts of (tokens/s of the method / "
    "tokens/s of hf-assisted on the same prompt and repeat)",
    "identical_to_ar": "temperature 0 only: fraction of runs whose tokens equal ar's; mismatches lists "
    "{prompt, repeat, first_diff} of every other run (first_diff = first differing position)",
    "categories": "when prompts carry a 'category': per category and method, acceptance_length (τ pooled over "
    "the category's runs) and speedup_vs_ar (median over the category's runs of per-run tokens/s ratios, the "
    "statistic of speedup_vs_ar above); the overall figures are the methods' own",
}


def split_specs(specs: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]``, stripped; ``""``/None -> ``[]``. An empty entry or a spec
    given twice raises a ValueError."""
    if specs is None:
        return []
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    if isinstance(specs, str) and not specs.strip():
        return []
    out: list[str] = []
    for s in items:
        if not isinstance(s, str) or not s.strip():
            raise ValueError(f"empty spec in {specs!r}")
        if s.strip() in out:
            raise ValueError(f"{s.strip()!r} is given twice")
        out.append(s.strip())
    return out


def check_out_dir(out: str | Path | None) -> None:
    """A one-line ValueError when ``out`` cannot be the output directory: it, or the nearest existing folder
    above it, is not a directory. Called before any model is loaded."""
    if out is None:
        return
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a file: give a directory (it is created if missing)")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {str(path)!r} cannot be created: {str(parent)!r} is a file")
            return


def _prompt_records(prompts, num_prompts: int | None) -> tuple[str, list[dict]]:
    if isinstance(prompts, (str, Path)):
        return str(prompts), load_prompts(prompts, num_prompts)
    records = []
    for i, p in enumerate(prompts):
        p = {"prompt": p} if isinstance(p, str) else p
        records.append({"id": str(i), **check_record(p, f"prompt {i}", allow_ids=True)})
    records = records if num_prompts is None else records[:num_prompts]
    if not records:
        raise ValueError("no prompts given")
    return "<in-process list>", records


class _EngineMethod:
    """``run(ids, max_new_tokens, **sampling)`` for one of our methods: a fresh drafter per generation (drafters
    hold per-generation caches) built by the session that holds its models, every model it runs probed for
    KV-cache bytes. ``last_drafter`` is kept for the cost figures (a drafter may size itself in ``begin``, e.g. a
    trimmed LM head)."""

    def __init__(self, session: Session, method: ParsedMethod, stops: list[int]) -> None:
        self.session, self.method, self.stops = session, method, stops
        self.last_drafter = session.drafter(method)
        self.models = drafter_models(self.last_drafter, session.target)
        self.embeds: dict[tuple[int, ...], torch.Tensor] = {}  # image prompts' embeddings, by their ids
        self.structured: dict[tuple[int, ...], StructuredPrompt] = {}  # structured prompts, by their ids

    def __call__(self, ids: list[int], max_new_tokens: int, **sampling) -> dict:
        drafter = self.session.drafter(self.method)
        structured = self.structured.get(tuple(ids))
        # drafters may call a model's base (e.g. a VocabTrim head skips the full LM head): probe the bases, which
        # see every forward either way
        with probing(self.session.target, *(getattr(m, "base_model", m) for m in self.models)) as probes:
            gen = self.session.generate(ids, method=self.method, drafter=drafter, max_new_tokens=max_new_tokens,
                                        eos_token_id=self.stops, prompt_embeds=self.embeds.get(tuple(ids)),
                                        **(structured.kwargs if structured else {}), **sampling)
        self.last_drafter = drafter
        checked = {} if structured is None else check_run(structured, gen.token_ids, self.session.tokenizer)
        return {"token_ids": gen.token_ids, **gen.stats.as_dict(), "depth_reached": list(gen.stats.depth_reached),
                "depth_accepted": list(gen.stats.depth_accepted), "kv_cache_peak_bytes": peak_kv_bytes(*probes),
                **checked}


def _with_images(record: Mapping, n: int) -> str | list[dict]:
    """A prompt record as the text or chat :meth:`Session.encode_images` takes, ``n`` image parts opening its first
    user turn."""
    if "prompt" in record:
        return record["prompt"]
    if "messages" not in record:
        raise ValueError("image prompts are text: records with 'prompt' or 'messages', not 'input_ids'")
    out, placed = [], False
    for m in record["messages"]:
        if m["role"] == "user" and not placed:
            m = {"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": m["content"]}]}
            placed = True
        out.append(m)
    return out


def _stops(model: torch.nn.Module, tokenizer: Any, eos_token_id, chat: bool, fim: bool = False) -> list[int]:
    """The stop tokens of every method: ``eos_token_id`` when given (``[]``: none), else the model's EOS, plus
    for chat prompts the end-of-turn tokens (the tokenizer's and the generation config's EOS) and for
    fill-in-the-middle prompts the model's FIM end tokens (:func:`speculant.models.fim.fim_stop_ids`)."""
    stops = set(resolve_eos(model, eos_token_id))
    if eos_token_id is None and chat and tokenizer is not None:
        stops.update(stop_ids(tokenizer, model))
    if eos_token_id is None and fim and tokenizer is not None:
        stops.update(fim_stop_ids(tokenizer, model))
    return sorted(stops)


def _pad_id(model, stops: list[int]) -> int:
    for source in (getattr(model, "generation_config", None), model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
    return stops[0] if stops else 0


_FALLBACK_K = 4  # only if the registry states no default k for chain


def _default_k(parsed: list[tuple[str, ParsedMethod]]) -> int:
    """The k of the first method that drafts with a model and has a k; else the chain drafter's default."""
    for _, m in parsed:
        method = get_method(m.name)
        if method.needs_draft and "k" in method.keys:
            k = m.options.get("k", method.keys["k"].default)
            if k is not NO_DEFAULT:
                return int(k)
    k = get_method("chain").keys["k"].default
    return _FALLBACK_K if k is NO_DEFAULT else int(k)


def run_bench(
    prompts: str | Path | Sequence[str | dict] = "builtin:code",
    methods: str | Sequence[str] | None = None,
    baselines: str | Sequence[str] = ("hf-ar", "hf-assisted"),
    target: str | Path | torch.nn.Module = "default-target",
    draft: str | Path | torch.nn.Module | None = None,
    tokenizer: Any = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    repeats: int = 1,
    warmup: int = 1,
    eos_token_id: int | list[int] | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    device: str | torch.device | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    budgets: Sequence[int] | None = None,
    depths: Sequence[int] | None = None,
    profile: bool = False,
    images: Sequence[str | Path] | None = None,
) -> dict:
    """Benchmark drafting methods and transformers baselines on one prompt set; optionally write a report.

    Args:
        prompts: ``builtin:code``, ``builtin:grounded``, ``builtin:mt-bench``, the path of a JSONL file (one
            ``{"prompt": TEXT}`` or ``{"messages": [...]}`` per line, other fields kept), or a list of strings /
            dicts with ``prompt`` (text), ``messages`` (a chat: the target tokenizer's chat template is applied)
            or ``input_ids``. Records with a ``category`` get a per-category table; records with a
            ``response_format`` or ``tools`` (``builtin:json-extract``, ``builtin:tools``) are decoded under that
            constraint and checked (our methods only: ``baselines`` must be empty).
        methods: registry specs (``NAME[:key=value...]``), a list or one comma-separated string; results are
            keyed by the spec exactly as given. ``ar`` is added (first) when missing: it is the reference. A
            ``draft=NAME`` option runs that method with its own draft model (a name or directory, loaded like
            ``draft``), e.g. to compare two drafters in one interleaved run. ``default`` (:data:`DEFAULT`) stands
            for the target's packaged default method, else the registry's ``DEFAULT_METHOD``; results are keyed
            by the spec it stands for, and ``settings["default_method"]`` says which (:func:`method_specs`).
            None: the packaged default of a packaged target, else :data:`DEFAULT_METHODS`, or
            :data:`DEFAULT_FAMILIES` with ``budgets``/``depths``. An empty list is a ValueError.
        baselines: ``hf-ar``, ``hf-assisted[:k=N]``, ``hf-prompt-lookup[:k=N][:ngram=M]`` (list or
            comma-separated; empty for none). The k of ``hf-assisted``/``hf-prompt-lookup`` defaults to the k of
            the first draft-model method (``chain:k=4`` -> 4).
        target, draft: anything :func:`speculant.models.loading.resolve_model` takes (a model directory, a bundled
            or packaged name, a ``.gguf`` file, a cached Hub id) or a loaded model; the draft may be an attached
            drafter (:func:`speculant.models.loading.load_draft`). Resolved by :mod:`speculant.plan` (its rules)
            and loaded by :mod:`speculant.session`: when a method needs a draft and none is given, the drafter
            speculant ships for the target, and without one a ValueError. Loaded models need ``tokenizer`` for
            text and chat prompts.
        num_prompts: use only N prompts: the first N of a list or file, N stratified picks of a built-in set.
        max_new_tokens, temperature, top_k, top_p, seed: as :func:`speculant.generate`, for every method.
        repeats: rounds over the prompt set; warmup: untimed warm-up rounds (first prompt, <= 32 tokens).
        eos_token_id: stop token(s) for every method (``[]``: never stop early); None: the target's, plus the
            end-of-turn tokens (:func:`speculant.models.chat.stop_ids`) when any prompt is a chat.
        dtype: load dtype for both models (None: float32, as every front-end).
        quantization: weight quantization of the models loaded by name (:func:`speculant.plan.resolve`; None:
            none; the draft takes the target's kind).
        device: move the target and draft loaded by name to this device (checked by
            :func:`speculant.core.checks.resolve_device` before any model loads); None: the CPU. Loaded models
            passed in stay where they are.
        out: directory for results.json, results.md and the plots (an existing file is refused before any
            model is loaded); None writes nothing.
        progress: a tqdm bar on stderr.
        budgets, depths: budget-matched comparison (:mod:`speculant.bench.matched_specs`): every entry of ``methods``
            is then a family (a spec without its size, e.g. ``chain``, ``rsd-s:width=2``) run at each number of
            tree tokens per target call in ``budgets`` and at each draft depth in ``depths``; results are keyed
            by the sized specs, and ``budget_matched`` maps each axis value and family to its spec (None when
            the family has no configuration of that size). ``report.write_results`` adds a table and a plot.
        images: for a vision-language target, image files every prompt is about (before the text of its first
            user turn); the target reads them, drafters see the text only. Our methods only (no baselines).
        profile: also profile the target forward after the runs (:func:`speculant.bench.profile.profile_target`:
            one-token step split into matmul / attention / rest for the lean and the model's own forward, a
            5-token verify forward, bare matmuls and the bandwidth floor of the weights), as ``profile``.

    Returns:
        the results: ``machine``, ``settings``, ``definitions``, ``prompts``, ``methods`` (name -> summary) and
        ``runs`` (name -> per-run rows), plus ``categories`` (category -> method -> τ and speed-up) when the
        prompts carry one, and ``files`` when ``out`` is given.

    Raises:
        ValueError: one line, for any bad input (unknown method or baseline, missing files, a method that needs
            a draft without one, a prompt too long for the context ...), before any generation runs.
    """
    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    _check_run_options(max_new_tokens, repeats, warmup, out)
    if device is not None:
        device = resolve_device(device)  # before the prompts load
    lineup = _lineup(methods, baselines, target, draft, budgets, depths, images)
    source, records = _prompt_records(prompts, num_prompts)
    structured = sum(is_structured(r) for r in records)
    if structured and lineup.baselines:
        raise ValueError("structured prompts (response_format or tools) run our methods only, each under its "
                         "constraint: pass --baselines none")
    if lineup.uses_llamacpp and not llamacpp.available():
        raise ValueError(llamacpp.INSTALL_HINT)
    models = _load_models(lineup, target, draft, tokenizer, dtype, device, quantization)
    ids_per_prompt, embeds = _encode_prompts(models.session, records, images)
    _check_prompts_fit(models, lineup, ids_per_prompt, max_new_tokens)

    target_model = models.session.target
    chats = sum(is_chat(r) for r in records)
    fims = sum(is_fim(r) for r in records)
    stops = _stops(target_model, models.session.tokenizer, eos_token_id, chat=chats > 0, fim=fims > 0)
    pad = _pad_id(target_model, stops)
    k_default = _default_k(lineup.methods)
    ours = {spec: _EngineMethod(models.for_draft(lineup.method_drafts.get(spec)), method, stops)
            for spec, method in lineup.methods}
    prepared = {tuple(ids): prepare(r, models.session.tokenizer) for r, ids in zip(records, ids_per_prompt)
                if is_structured(r)}
    for method in ours.values():
        method.embeds = embeds
        method.structured = prepared
    n_ctx = max(len(ids) for ids in ids_per_prompt) + max_new_tokens + 64
    runs = [MethodRun(spec, run=method) for spec, method in ours.items()]
    runs += _baseline_runs(lineup, models, target, stops, pad, k_default, n_ctx)

    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    rows = run_side_by_side(target_model, runs, ids_per_prompt, max_new_tokens=max_new_tokens, repeats=repeats,
                            warmup=warmup, progress=progress, rotate=True, **sampling)
    summary = _summary(rows, lineup, ours, models, k_default, check_identical=temperature == 0)
    settings = {"prompts": source, "num_prompts": len(records),
                **_model_settings(lineup, models),
                "max_new_tokens": max_new_tokens, **sampling, "repeats": repeats, "warmup": warmup,
                "eos_token_id": stops, "chat_prompts": chats, "fim_prompts": fims, "structured_prompts": structured,
                "pad_token_id": pad,
                "hf_default_k": k_default,
                **({"llamacpp": llamacpp.SETTINGS_NOTE} if lineup.uses_llamacpp else {})}
    results = {
        "benchmark": "speculant bench",
        "machine": machine_info(),
        "settings": settings,
        "definitions": {**DEFINITIONS, **(STRUCTURED_DEFINITIONS if structured else {})},
        "prompts": [{**{k: v for k, v in r.items() if k != "input_ids"}, "tokens": len(ids)}
                    for r, ids in zip(records, ids_per_prompt)],
        "methods": summary,
        "runs": rows,
    }
    if any("category" in r for r in records):
        groups = [str(r.get("category", "other")) for r in records]
        results["categories"] = summarise_by(rows, groups, baseline=REFERENCE)
    if lineup.matched is not None:
        results["budget_matched"] = lineup.matched
    if profile:
        from .profile import profile_target

        results["profile"] = profile_target(target_model, ids_per_prompt[0])
    if out is not None:
        from .report import write_results

        results["files"] = [str(p) for p in write_results(results, out)]
    return results


def _check_run_options(max_new_tokens: int, repeats: int, warmup: int, out: str | Path | None) -> None:
    """One-line ValueErrors for the run's own options, before anything is resolved or loaded."""
    check_positive_int("max_new_tokens", max_new_tokens)
    check_positive_int("repeats", repeats)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    check_out_dir(out)


@dataclass
class _Lineup:
    """What one benchmark runs: ``methods`` (each spec as given and parsed, the reference first), the own draft of
    each method that has one (``method_drafts``), the ``baselines`` (spec, name, options), which default method
    ``DEFAULT`` stood for (``default_note``) and, in a budget-matched run, each axis value's specs (``matched``)."""

    methods: list[tuple[str, ParsedMethod]]
    method_drafts: dict[str, str | None]
    baselines: list[tuple[str, str, dict]]
    default_note: dict | None = None
    matched: dict | None = None

    @property
    def draft_users(self) -> list[str]:
        """The methods and baselines that draft with the shared draft model."""
        return [s for s, m in self.methods if m.needs_draft and not self.method_drafts.get(s)] + [
            s for s, n, _ in self.baselines if BASELINES[n].needs_draft]

    @property
    def own_drafts(self) -> list[str]:
        """The methods' own drafts, each once."""
        return sorted({d for d in self.method_drafts.values() if d})

    @property
    def uses_llamacpp(self) -> bool:
        return any(BASELINES[n].runtime == "llama.cpp" for _, n, _ in self.baselines)


def _lineup(methods, baselines, target, draft, budgets, depths, images) -> _Lineup:
    """The methods and baselines of a run, parsed and checked (see :func:`run_bench`'s arguments); loads nothing."""
    matching = bool(budgets or depths)
    specs, default_note = method_specs(methods, target, draft, matching)
    matched = None
    if matching:
        specs, matched = matched_specs(specs, budgets or [], depths or [], skip=(REFERENCE,))
    # spec -> its own draft (draft=, or the drafter shipped for the target for a method with its own kind), or None
    method_drafts = {spec: _method_draft(spec, target) for spec in specs}
    parsed = [(spec, ParsedMethod.parse(_without_draft(spec))) for spec in specs]  # each spec parsed once
    if not any(spec == REFERENCE for spec, _ in parsed):
        parsed.insert(0, (REFERENCE, ParsedMethod.parse(REFERENCE)))
    else:
        parsed.sort(key=lambda p: p[0] != REFERENCE)  # the reference first, the rest in the given order
    parsed_baselines = [(spec, *parse_baseline(spec)) for spec in split_specs(baselines)]
    if images and parsed_baselines:
        raise ValueError("image prompts run our methods only: pass --baselines none")
    return _Lineup(parsed, method_drafts, parsed_baselines, default_note, matched)


def _load_models(lineup: _Lineup, target, draft, tokenizer, dtype, device, quantization) -> BenchModels:
    """The run's models, resolved (the no-draft rule of every front-end, checked for the methods and baselines
    that draft with the shared draft) and loaded, each method's own draft beside them."""
    plan = plan_bench_models(target, draft, tokenizer, dtype, device, lineup.draft_users, quantization)
    if plan.unused_draft is not None:  # the plan's own method is the reference: say it for the whole run
        warn_once(log, "no method or baseline drafts with the shared draft model: --draft is not used")
        plan = dataclasses.replace(plan, unused_draft=None)
    return BenchModels.load(plan, lineup.own_drafts)


def _encode_prompts(session: Session, records: list[dict],
                    images: Sequence[str | Path] | None) -> tuple[list[list[int]], dict[tuple[int, ...], torch.Tensor]]:
    """Each prompt's token ids and, with ``images``, the prompt embeddings ``[1, T, H]`` of each by its ids."""
    embeds: dict[tuple[int, ...], torch.Tensor] = {}
    if not images:
        return [prompt_ids(r, session.tokenizer) for r in records], embeds
    ids_per_prompt = []
    for r in records:
        ids, _, e = session.encode_images(_with_images(r, len(images)), list(images))
        ids_per_prompt.append(ids)
        embeds[tuple(ids)] = e
    return ids_per_prompt, embeds


def _check_prompts_fit(models: BenchModels, lineup: _Lineup, ids_per_prompt: list[list[int]],
                       max_new_tokens: int) -> None:
    """One-line ValueErrors before any generation: hf-assisted with a draft of another tokenizer, and a prompt
    whose answer would not fit the target's or a draft's context."""
    if models.session.context.get("tokenizers_match") is False and any(
            BASELINES[n].needs_draft for _, n, _ in lineup.baselines):
        raise ValueError("hf-assisted needs a draft with the target's tokenizer (the tokenizers differ)")
    for ids in ids_per_prompt:
        check_fits_context(models.session.target, len(ids), max_new_tokens)
        for model in models.models:
            check_fits_context(model, len(ids), max_new_tokens, role="draft")


def _baseline_runs(lineup: _Lineup, models: BenchModels, target, stops: list[int], pad: int, k_default: int,
                   n_ctx: int) -> list[MethodRun]:
    """The baselines' runners: transformers' over the loaded models, llama.cpp's over the models' GGUF files
    (``n_ctx`` tokens of context)."""
    session = models.session
    runs = []
    for spec, name, options in lineup.baselines:
        if BASELINES[name].runtime == "llama.cpp":
            gguf = llamacpp.gguf_of(None if isinstance(target, torch.nn.Module) else session.plan.target_name)
            draft_gguf = (llamacpp.gguf_of(session.plan.draft_name, role="draft") if BASELINES[name].needs_draft
                          else None)
            runner = llamacpp.llamacpp_runner(name, options, gguf, session.tokenizer, k_default, stops, n_ctx,
                                              torch.get_num_threads(), draft_gguf=draft_gguf)
        else:
            runner = hf_runner(name, options, session.target, session.draft, k_default, stops, pad)
        runs.append(MethodRun(spec, run=runner))
    return runs


def _summary(rows: dict, lineup: _Lineup, ours: dict[str, _EngineMethod], models: BenchModels, k_default: int,
             check_identical: bool) -> dict:
    """Every method's and baseline's summary (:func:`speculant.bench.speed.summarise` against the reference),
    with the comparison to hf-assisted, the cost figures, the tree shapes and the baselines' k."""
    target_model, draft_model = models.session.target, models.session.draft
    summary = summarise(rows, baseline=REFERENCE, check_identical=check_identical)
    _compare_with_assisted(summary, rows, [spec for spec, _ in lineup.methods],
                           [spec for spec, name, _ in lineup.baselines if name == "hf-assisted"])
    target_ppf = params_per_forward(target_model)
    for spec, method in ours.items():
        figures = summarise_structured(rows[spec])
        if figures is not None:
            summary[spec]["structured"] = figures
        _add_costs(summary[spec], rows[spec], "speculant",
                   drafter_params_per_forward(method.last_drafter, target_model), target_ppf,
                   param_bytes(target_model, *method.models))
        _add_shape(summary[spec], rows[spec], _without_draft(spec))
    for spec, name, options in lineup.baselines:
        uses_draft = BASELINES[name].needs_draft
        draft_ppf = params_per_forward(draft_model) if uses_draft else 0
        _add_costs(summary[spec], rows[spec], BASELINES[name].runtime, draft_ppf, target_ppf,
                   param_bytes(target_model, draft_model if uses_draft else None))
        summary[spec]["k"] = (None if name in ("hf-ar", "llamacpp-ar") else int(options["k"]) if "k" in options
                              else llamacpp.DEFAULT_DRAFT_K if name == "llamacpp-draft" else k_default)
        if BASELINES[name].runtime == "llama.cpp":  # llama.cpp's own counts, pooled over runs
            drafted = sum(r["draft_tokens"] for r in rows[spec])
            summary[spec]["draft_acceptance"] = (sum(r["draft_accepted"] for r in rows[spec]) / drafted
                                                 if drafted else None)
    return summary


def _model_settings(lineup: _Lineup, models: BenchModels) -> dict:
    """The settings of the results that say what ran on which models: specs, models, dtypes, kinds, device."""
    plan = models.session.plan
    target_model, draft_model = models.session.target, models.session.draft
    return {
        "methods": [spec for spec, _ in lineup.methods],
        "baselines": [spec for spec, _, _ in lineup.baselines],
        "reference": REFERENCE,
        "target": plan.target_name,
        "draft": plan.draft_name,
        "method_drafts": {spec: models.own[d].plan.draft_name for spec, d in lineup.method_drafts.items() if d},
        **({"default_method": lineup.default_note} if lineup.default_note is not None else {}),
        "target_dtype": str(target_model.dtype),
        "draft_dtype": None if draft_model is None else str(draft_model.dtype),
        "target_quantization": quantization_of(target_model),
        "draft_quantization": None if draft_model is None else quantization_of(draft_model),
        "device": str(target_model.device),
        "target_params_per_forward": params_per_forward(target_model),
        "draft_params_per_forward": None if draft_model is None else params_per_forward(draft_model),
    }


def method_specs(methods: str | Sequence[str] | None, target: Any, draft: Any = None,
                 matching: bool = False) -> tuple[list[str], dict | None]:
    """The method specs a benchmark runs, with :data:`DEFAULT` replaced by the target's default method, and what
    that default was: ``{"spec", "from": "packaged" | "registry"}`` (None when it was not used).

    ``methods`` None: the packaged default of a packaged target, else :data:`DEFAULT_METHODS` (with
    ``matching``, a budget-matched run: :data:`DEFAULT_FAMILIES`). An empty list, or a default that repeats a
    spec given too, is a one-line ValueError."""
    if methods is None:
        if matching:
            return list(DEFAULT_FAMILIES), None
        if default_method(target, draft)[1] != "packaged":
            return list(DEFAULT_METHODS), None
        methods = [DEFAULT]
    specs = split_specs(methods)
    if not specs:
        raise ValueError(f"no methods given in {methods!r}: name at least one (e.g. '{REFERENCE}' or "
                         f"'{DEFAULT}'), or leave the option out for the default")
    if DEFAULT not in specs:
        return specs, None
    spec, source = default_method(target, draft)
    if spec in specs:
        raise ValueError(f"'{DEFAULT}' is {spec!r} here, which is given too: give it once")
    return [spec if s == DEFAULT else s for s in specs], {"spec": spec, "from": source}


def _method_draft(spec: str, target=None) -> str | None:
    """The ``draft=NAME`` option of a method spec (the bench runs that method with its own draft model); without
    one, the drafter speculant ships for ``target`` for a method with its own kind of drafter (``eagle3``), else
    None (the shared draft)."""
    from ..models.loading import default_draft_for
    from ..models.sources import PACKAGED

    name, raw = split_spec(spec, "method", [])
    if raw.get("draft"):
        return raw["draft"]
    model = PACKAGED.get(str(target)) if isinstance(target, (str, Path)) else None
    if model is not None and name in dict(model.method_drafts):
        own = default_draft_for(target, name)
        if own is None:
            raise ValueError(f"method {name!r} needs its own drafter and speculant does not ship it for {target} "
                             f"in this installation: give one with {name}:draft=DIR")
        return own
    return None


def _without_draft(spec: str) -> str:
    """``spec`` without its ``draft=`` option (what the registry parses)."""
    name, raw = split_spec(spec, "method", [])
    return ":".join([name] + [f"{k}={v}" for k, v in raw.items() if k != "draft"])


def _add_shape(s: dict, rows: list[dict], spec: str) -> None:
    """Most tree tokens per call and draft depth of the spec, and the tree tokens per call actually verified."""
    nodes_depth = shape(spec)
    calls = sum(r["target_calls"] for r in rows)
    s.update(tree_nodes=None if nodes_depth is None else nodes_depth[0],
             tree_depth=None if nodes_depth is None else nodes_depth[1],
             tree_tokens_per_call=sum(r.get("draft_tokens", 0) for r in rows) / calls if calls else 0.0)


def _compare_with_assisted(summary: dict, rows: dict, ours: list[str], assisted: list[str]) -> None:
    """``speedup_vs_hf_assisted`` for each of our methods: the median over prompts of tokens/s ratios against the
    first ``hf-assisted`` baseline of the run (same prompts, same round), and which baseline it was."""
    if not assisted:
        return
    ref = {(r["prompt"], r["repeat"]): r["tokens_per_second"] for r in rows[assisted[0]]}
    for spec in ours:
        ratios = [r["tokens_per_second"] / ref[(r["prompt"], r["repeat"])] for r in rows[spec]
                  if ref.get((r["prompt"], r["repeat"]), 0) > 0]
        if ratios:
            summary[spec]["speedup_vs_hf_assisted"] = statistics.median(ratios)
            summary[spec]["hf_assisted_reference"] = assisted[0]


def _add_costs(s: dict, rows: list[dict], kind: str, draft_ppf: int, target_ppf: int, nbytes: int) -> None:
    c = draft_ppf / target_ppf if target_ppf else 0.0
    gamma = s["draft_calls"] / s["target_calls"] if s["target_calls"] else 0.0
    kv = max((r.get("kv_cache_peak_bytes", 0) for r in rows), default=0)
    s.update(
        kind=kind,
        draft_cost_ratio=c,
        draft_calls_per_step=gamma,
        mbsu=mbsu(s["acceptance_length"], c, gamma),
        param_bytes=nbytes,
        kv_cache_peak_bytes=kv,
        peak_memory_bytes=nbytes + kv,
    )
