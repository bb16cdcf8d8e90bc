"""Getting the target's answers: the stages of ``speculant train draft`` before any training.

1. **prompts**: instruction prompts (:mod:`speculant.data.instructions`, or the user's ``--prompts FILE.jsonl``),
   and optionally more written by the target itself (:mod:`.self_prompts`), saved as ``RUN/prompts.jsonl``;
2. **answers**: the target answers them through its chat template at several temperatures, and its top-k
   distribution at every answer token is kept (:mod:`.answers`, ``RUN/answers/``); or (``answers="dataset"``) the
   target reads the prompts' own answers (ShareGPT's replies) in one forward each, for its top-k and states
   (:mod:`.forced_answers`);
3. **states** (feature drafters): the target's hidden states over every answer (``RUN/features/``,
   :mod:`.features`), unless they were written while answering.

Every stage writes its result before the next starts and is skipped when that result exists; a run whose prompts
grow answers only its new rows.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .checks import ANSWERS, ENGINES, FEATURE_KINDS, DraftRunConfig, resolve_kind

__all__ = ["dataset_answer", "has_answer", "run_answers", "run_features", "tokenize_prompts"]

log = logging.getLogger(__name__)


def tokenize_prompts(tokenizer, rows: list[dict], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of each prompt record (chat template for ``messages`` rows,
    :func:`speculant.data.prompts.prompt_ids`) and the indices of the rows kept (at most ``max_tokens``)."""
    from ...data.prompts import prompt_ids

    ids, kept = [], []
    for i, row in enumerate(rows):
        t = prompt_ids(row, tokenizer)
        if len(t) <= max_tokens:
            ids.append(t)
            kept.append(i)
    return ids, kept


def _self_prompt_rows(cfg: DraftRunConfig, run: Path) -> list[dict]:
    """``cfg.self_prompts`` requests written by the target (``RUN/self_prompts.jsonl``, resumable; the target is
    loaded only when some are still missing). Its time is added up in ``RUN/self_prompts.json``."""
    from .self_prompts import generate_self_prompts, read_self_prompts

    path = run / "self_prompts.jsonl"
    rows = read_self_prompts(path)
    if len(rows) >= cfg.self_prompts:
        return rows[:cfg.self_prompts]
    from ...models.chat import stop_ids
    from ...models.loading import load_pretrained

    model, tokenizer = load_pretrained(cfg.target, dtype=cfg.gen_dtype)
    info_path = run / "self_prompts.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {"seconds": 0.0}
    start = time.perf_counter()
    rows = generate_self_prompts(model, tokenizer, cfg.self_prompts, path, stop_ids=stop_ids(tokenizer, model),
                                 batch_size=cfg.gen_batch, max_new_tokens=cfg.self_prompt_tokens, seed=cfg.seed)
    info = {"rows": len(rows), "seconds": info["seconds"] + time.perf_counter() - start}
    info_path.write_text(json.dumps(info))
    return rows


def _prompt_rows(cfg: DraftRunConfig, run: Path) -> list[dict]:
    """The run's prompts (``RUN/prompts.jsonl``, written from ``cfg.prompts`` or the built-in set once, then
    ``cfg.self_prompts`` written by the target). A run grows when the configured prompts extend the saved ones
    (more ``--num-prompts`` of the same seed, a prompts file whose first rows are the saved ones, or self-written
    prompts added): the new rows are appended and answered next."""
    from ...data.prompts import load_prompts

    path = run / "prompts.jsonl"
    saved = load_prompts(path) if path.exists() else None
    if cfg.prompts:  # one source or several, comma-separated, concatenated
        rows = [r for source in cfg.prompts.split(",") for r in load_prompts(source)]
    else:
        from ...data.instructions import instruction_prompts

        rows = instruction_prompts(cfg.num_prompts, seed=cfg.prompt_seed)
    if cfg.self_prompts:
        rows = rows + [{"messages": r["messages"], "kind": r["kind"]} for r in _self_prompt_rows(cfg, run)]
    if saved is not None:
        n = min(len(rows), len(saved))
        if _content(rows[:n]) != _content(saved[:n]):
            log.warning("%s differs from the configured prompts; the run keeps its own (use a new --out to change "
                        "them)", path)
        if len(rows) <= len(saved) or _content(rows[:n]) != _content(saved[:n]):
            return saved
        log.info("the run grows from %d to %d prompts", len(saved), len(rows))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return load_prompts(path)


def _content(rows: list[dict]) -> list[tuple]:
    """What a prompt row asks (its ``messages``, ``prompt`` or FIM ``prefix`` and ``suffix``), without the ids
    ``load_prompts`` adds."""
    return [(r.get("messages"), r.get("prompt"), r.get("prefix"), r.get("suffix")) for r in rows]


def _answer_parts(folder: Path) -> list[dict]:
    """``answers/PARTS.json``: the ranges of prompt rows answered so far, each ``{"rows": [a, b], "first_shard",
    "seconds"}`` (``seconds`` None while that part is being written). A run with a ``DONE`` but no ``PARTS.json`` is
    one complete part covering the rows its ``DONE`` counts."""
    parts_file, done = folder / "PARTS.json", folder / "DONE"
    if parts_file.exists():
        return json.loads(parts_file.read_text())
    if done.exists():
        info = json.loads(done.read_text())
        return [{"rows": [0, info.get("rows", info["prompts"])], "first_shard": 0,
                 "seconds": info.get("seconds", info.get("seconds_this_session"))}]
    return []


def run_answers(cfg: DraftRunConfig, progress: bool = True) -> Path:
    """Stages 1 and 2: ``RUN/prompts.jsonl`` and the target's answers in ``RUN/answers`` (resumable; a grown run
    answers only its new rows, in shards numbered after the existing ones)."""
    from ...models.chat import stop_ids
    from .answers import generate_answers, shard_paths

    resolve_kind(cfg)
    if cfg.answers not in ANSWERS:
        raise ValueError(f"answers must be one of {', '.join(ANSWERS)}, got {cfg.answers!r}")
    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)
    saved = run / "run_config.json"
    if not saved.exists():
        saved.write_text(json.dumps(asdict(cfg), indent=1))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = _prompt_rows(cfg, run)
    folder = run / "answers"
    folder.mkdir(parents=True, exist_ok=True)
    parts = _answer_parts(folder)
    if parts and parts[-1]["seconds"] is not None:
        last = parts[-1]
        if last.get("batches") is not None and (cfg.answer_batches is None or cfg.answer_batches > last["batches"]):
            last["earlier_seconds"], last["seconds"] = last["seconds"], None  # more of its batches: continue it
        elif last["rows"][1] >= len(rows):
            return folder
        else:
            parts.append({"rows": [last["rows"][1], len(rows)], "first_shard": len(shard_paths(folder)),
                          "seconds": None})
    elif not parts:
        parts = [{"rows": [0, len(rows)], "first_shard": 0, "seconds": None}]
    part = parts[-1]  # the part to write (new, or interrupted earlier)
    (folder / "PARTS.json").write_text(json.dumps(parts, indent=1))
    (folder / "DONE").unlink(missing_ok=True)
    a, b = part["rows"]
    model, tokenizer, engine = _answer_model(cfg)
    prompts, kept = tokenize_prompts(tokenizer, rows[a:b], cfg.max_prompt_tokens)
    start = time.perf_counter()
    if cfg.answers == "dataset":
        from .features import features_dir
        from .forced_answers import forced_answers

        stops = stop_ids(tokenizer, model)
        given = [(p, dataset_answer(tokenizer, rows[a + i], cfg.max_new_tokens, stops[0]), a + i)
                 for p, i in zip(prompts, kept)]
        given = [g for g in given if g[1]]
        if not given:
            raise ValueError("--answers dataset: none of the prompts carries an answer (builtin:sharegpt's rows do: "
                             "the chat model's reply)")
        features = features_dir(run, cfg.taps) if cfg.kind in FEATURE_KINDS else None
        forced_answers(model, [g[0] for g in given], [g[1] for g in given], folder, shard_size=cfg.gen_batch,
                       topk=cfg.topk, seed=cfg.seed, max_batches=cfg.answer_batches, first_shard=part["first_shard"],
                       prompt_rows=[g[2] for g in given], features=features, taps=cfg.taps, progress=progress)
        return _finish_answers(folder, parts, part, start, cfg, b, "forced")
    common = dict(stop_ids=stop_ids(tokenizer, model), max_new_tokens=cfg.max_new_tokens,
                  temperatures=tuple(cfg.temperatures), topk=cfg.topk, seed=cfg.seed, max_batches=cfg.answer_batches,
                  first_shard=part["first_shard"], prompt_rows=[a + i for i in kept], progress=progress)
    if engine == "speculant":
        from .batch_answers import engine_answers
        from .features import features_dir

        features = features_dir(run, cfg.taps) if cfg.kind in FEATURE_KINDS else None
        engine_answers(model, prompts, folder, shard_size=cfg.gen_batch, batch=cfg.gen_batch, features=features,
                       taps=cfg.taps, **common)
    else:
        generate_answers(model, prompts, folder, batch_size=cfg.gen_batch, **common)
    return _finish_answers(folder, parts, part, start, cfg, b, engine)


def has_answer(row: dict) -> bool:
    """Whether a prompt row carries its own answer (``"answer"``: a text that is not blank; ShareGPT's replies)."""
    text = row.get("answer")
    return isinstance(text, str) and bool(text.strip())


def dataset_answer(tokenizer, row: dict, max_tokens: int, stop: int) -> list[int]:
    """A prompt row's own ``answer`` as target tokens: the text's tokens then the chat's stop token, cut to
    ``max_tokens`` (a cut answer has no stop token, as a generation cut there); ``[]`` when the row has none."""
    if not has_answer(row):
        return []
    return (tokenizer.encode(row["answer"], add_special_tokens=False) + [stop])[:max_tokens]


def _finish_answers(folder: Path, parts: list[dict], part: dict, start: float, cfg: DraftRunConfig, rows: int,
                    engine: str) -> Path:
    """Close the answering part: its seconds in ``PARTS.json`` and the run's totals in ``DONE``."""
    from .answers import shard_totals

    part["seconds"] = time.perf_counter() - start + part.pop("earlier_seconds", 0.0)
    part["batches"] = cfg.answer_batches
    (folder / "PARTS.json").write_text(json.dumps(parts, indent=1))
    seconds = sum(p["seconds"] for p in parts)
    runs = folder / "RUNS.json"  # the batched engines' record of every answering run, shard by shard: it keeps the
    if runs.exists():  # answering time of an interrupted run (to its last shard), which its part lost
        seconds = max(seconds, sum(r["seconds"] for r in json.loads(runs.read_text())))
    tokens = shard_totals(folder)[1]
    (folder / "DONE").write_text(json.dumps({"rows": rows, "seconds": seconds, "answer_tokens": tokens,
                                             "answer_tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
                                             "engine": engine}))
    return folder


def _answer_model(cfg: DraftRunConfig):
    """``(model, tokenizer, engine)`` that answer the prompts: speculant's batched engine over the target in its
    deployed weights (``cfg.quantization``, else its packaged default; float32 activations), or transformers in
    ``cfg.gen_dtype``. ``auto``: speculant when the target loads quantized, else transformers."""
    from ...models.loading import check_quantization, default_quantization_for, load_pretrained

    if cfg.engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {cfg.engine!r}")
    quantization = check_quantization(cfg.quantization or default_quantization_for(cfg.target))
    engine = cfg.engine if cfg.engine != "auto" else ("speculant" if quantization != "none" else "transformers")
    if engine == "speculant":
        model, tokenizer = load_pretrained(cfg.target, dtype="float32", quantization=quantization)
    else:
        model, tokenizer = load_pretrained(cfg.target, dtype=cfg.gen_dtype)
    return model, tokenizer, engine


def run_features(cfg: DraftRunConfig, progress: bool = True) -> Path:
    """Feature drafters: the target's final hidden states over every answer, ``RUN/features`` (resumable)."""
    from .answers import shard_paths
    from .features import extract_features, features_dir

    resolve_kind(cfg)
    folder = features_dir(cfg.out, cfg.taps)
    done = folder / "DONE"
    missing = [p for p in shard_paths(Path(cfg.out) / "answers") if not (folder / (p.stem + ".npy")).exists()]
    if missing:  # features not written while answering, or the run grew after its features were made
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model, _, engine = _answer_model(cfg)  # the weights that answered
        start = time.perf_counter()
        extract_features(model, Path(cfg.out) / "answers", folder, taps=cfg.taps, progress=progress)
        done.write_text(json.dumps({"dtype": str(next(model.parameters()).dtype), "engine": engine,
                                    "taps": cfg.taps, "seconds_this_session": time.perf_counter() - start}))
    elif not done.exists():
        done.write_text(json.dumps({"taps": cfg.taps, "written_while_answering": True}))
    return folder
