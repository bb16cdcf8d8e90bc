"""``speculant train draft``: a drafter for any Hugging Face or GGUF target, the Direct Alignment way.

Goel et al. 2024, "Direct Alignment of Draft Model for Speculative Decoding with Chat-Fine-Tuned LLMs":

1. **prompts**: instruction prompts (:mod:`speculant.data.instructions`, or the user's ``--prompts FILE.jsonl``), written to
   ``RUN/prompts.jsonl``;
2. **answers**: the target answers them through its chat template at several temperatures, and its top-k
   distribution at every answer token is kept (:mod:`.answers`, ``RUN/answers/``); or (``answers="dataset"``) the
   target reads the prompts' own answers (ShareGPT's replies) in one forward each, for its top-k and states
   (:mod:`.forced_answers`);
3. **fine-tune**: a small drafter, initialised from a few of the target's own layers and sharing its embedding and
   LM head (frozen), learns the target's answers with a distillation loss (FKL, TVD or TVD++,
   :mod:`..losses`) over the VocabTrim kept set it will draft from (:mod:`.draft_train`). ``kind="model"``
   fine-tunes a draft model of its own instead (``draft``: e.g. a smaller sibling sharing the target's tokenizer,
   as the paper does), all of it but its embedding and LM head; ``kind="feature"``
   makes a feature (EAGLE) drafter instead, which also reads the target's hidden states: the target's states
   over the answers are extracted first (``RUN/features/``, :mod:`.features`) and the drafter also regresses
   them (:mod:`.feature_train`);
4. **export**: the drafter's own layers and norm (``model.safetensors``), its config, ``attached.json`` (what
   it shares with which target; a ``model`` drafter: the whole model in bfloat16 with its tokenizer and
   ``draft_model.json``, a directory ``--draft`` takes as it is), ``vocab_trim.json`` from the target's answers,
   the training history and a ``MODEL_CARD.md``.

Every stage writes its result before the next starts and is skipped when that result exists, so an interrupted
run resumes where it stopped (the training stage from its last checkpoint).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...models.attached import EXPORT_STORAGES

__all__ = ["ANSWERS", "DraftRunConfig", "DRAFT_MODEL_FILE", "FEATURE_KINDS", "KINDS", "MODEL_LR", "check_draft",
           "check_extra_data", "check_init", "dataset_answer", "has_answer", "resolve_kind", "tokenize_prompts",
           "run_answers", "run_features", "run_training"]

log = logging.getLogger(__name__)


@dataclass
class DraftRunConfig:
    """Settings of one drafter run (saved as ``RUN/run_config.json``)."""

    target: str  # model name, directory or .gguf file
    out: str  # run directory
    prompts: str | None = None  # JSONL files or builtin:NAME sets, comma-separated; default: built-in instructions
    num_prompts: int = 1600
    prompt_seed: int = 0
    self_prompts: int = 0  # more prompts written by the target itself (Magpie), appended to the others
    self_prompt_tokens: int = 64  # at most this many tokens per self-written prompt
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    gen_batch: int = 32
    answer_batches: int | None = None  # answer only the first N batches (the batch order is shuffled)
    gen_dtype: str = "bfloat16"  # the dtype the target answers in through transformers (speed only)
    engine: str = "auto"  # who answers: transformers, speculant (batched engine, deployed weights) or auto
    answers: str = "target"  # target: the target writes its answers; dataset: it reads the prompts' own (forced)
    quantization: str | None = None  # the target's weights when speculant answers (None: its packaged default)
    topk: int = 32
    kind: str = "token"  # token-level, feature (EAGLE), eagle3 or confu drafter, or model (``draft`` fine-tuned)
    draft: str | None = None  # kind model: the draft model fine-tuned (a name, directory or .gguf; target's tokenizer)
    train_last: int | None = None  # kind model: fine-tune only its last N decoder layers and final norm (None: all)
    layers: list[int] = field(default_factory=lambda: [0, 1])  # target layers the drafter starts from
    taps: list[int] = field(default_factory=list)  # feature drafters: target layers whose outputs they also read
    regression: float = 1.0  # feature drafters: weight of the hidden-state regression loss
    unroll: int = 1  # feature drafters: training passes over the drafter's own states (2: also the 2nd draft token)
    loss: str = "fkl"  # the best of fkl / tvd / tvd++ for a drafter starting far from the target (MODEL_CARD)
    steps: int = 400
    batch_size: int = 16
    lr: float | None = None  # peak learning rate; None: the kind's (2e-3, or 3e-5 for a pretrained model fine-tuned)
    warmup: int = 20
    precision: str = "auto"  # drafter training: auto (bf16 autocast where the CPU has native bf16) | fp32 | bf16
    keep: int = 8192  # VocabTrim kept set trained over (the most frequent tokens of the answers)
    validation_fraction: float = 0.05
    seed: int = 0
    threads: int | None = None
    group_by_length: bool = False  # batches of samples of similar length (less padding) instead of uniform draws
    extra_data: str | None = None  # more run directories (comma-separated) whose answers (and states) also train
    init: str | None = None  # an exported drafter of the same kind to start from instead of the target's layers
    soft: int = 16  # confu: soft-prompt key/value entries per target layer
    mixture: int = 4  # confu: contemplate embeddings in the mixture (routed by the target's last state)
    window: int = 8  # confu: rows one contemplate token serves in training (future-prediction replication)
    store: str = "int8"  # how the exported drafter's matrices are stored: int8 (per-row scale) or q4 (4-bit per 32)


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
    """What a prompt row asks (its ``messages`` or ``prompt``), without the ids ``load_prompts`` adds."""
    return [(r.get("messages"), r.get("prompt")) for r in rows]


def _answer_parts(folder: Path) -> list[dict]:
    """``answers/PARTS.json``: the ranges of prompt rows answered so far, each ``{"rows": [a, b], "first_shard",
    "seconds"}`` (``seconds`` None while that part is being written). A run from before parts existed is one
    complete part covering the rows its ``DONE`` counts."""
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


KINDS = ("token", "feature", "eagle3", "confu", "model")
FEATURE_KINDS = ("feature", "eagle3", "confu")
"""The kinds that read the target's states: ``feature`` (EAGLE: the final state, optional taps, hidden-state
regression), ``eagle3`` (EAGLE-3, Li et al. 2025: the outputs of a low, a middle and a high layer plus the
final state, no regression, training-time test over at least 3 draft depths) and ``confu`` (ConFu, Qin et al.
2026: EAGLE-3 plus the target's contemplation, :mod:`.confu_train`; it can start from an EAGLE-3 drafter)."""


def resolve_kind(cfg: DraftRunConfig) -> DraftRunConfig:
    """``cfg`` with its kind's settings filled in: for ``eagle3``, taps ``2 / L//2 / L-3`` of the target's
    ``L`` layers when none are given, ``unroll`` at least 3 and no regression loss. Returns ``cfg``."""
    if cfg.kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
    if cfg.store not in EXPORT_STORAGES:  # checked before any work (the export stores it)
        raise ValueError(f"store must be one of {', '.join(EXPORT_STORAGES)}, got {cfg.store!r}")
    if (cfg.kind == "model") != bool(cfg.draft):
        raise ValueError("--kind model fine-tunes the draft model --draft names: give both or neither")
    if cfg.lr is None:
        cfg.lr = MODEL_LR if cfg.kind == "model" else 2e-3
    if cfg.kind == "model":  # settings of drafters built from the target's layers: refused rather than ignored
        defaults = DraftRunConfig(target="", out="")
        for name in _NOT_FOR_MODEL:
            if getattr(cfg, name) != getattr(defaults, name):
                raise ValueError(f"--{name.replace('_', '-')} is for drafters built from the target's layers, not "
                                 "--kind model")
    if cfg.train_last is not None and (cfg.kind != "model" or cfg.train_last < 1):
        raise ValueError(f"--train-last: a number of the draft model's last layers (>= 1) for --kind model, got "
                         f"{cfg.train_last} for --kind {cfg.kind}")
    if cfg.kind == "model" and (cfg.init or cfg.taps):
        raise ValueError(f"--kind model: {'--init' if cfg.init else '--taps'} is for drafters built from the target's "
                         "layers (to continue an exported model drafter, give it as --draft)")
    if cfg.kind in ("eagle3", "confu"):
        if not cfg.taps:
            from transformers import AutoConfig

            from ...models.loading import resolve_model

            n = AutoConfig.from_pretrained(str(resolve_model(cfg.target)), local_files_only=True).num_hidden_layers
            cfg.taps = sorted({min(2, n - 1), n // 2, max(n - 3, 0)})
        cfg.unroll = max(cfg.unroll, 3)
        cfg.regression = 0.0
    return cfg
ENGINES = ("auto", "speculant", "transformers")
ANSWERS = ("target", "dataset")
"""Who writes the answers a drafter learns from: the target (Direct Alignment), or the prompt rows' own answers
(ShareGPT's replies) read by the target in one forward each (:mod:`.forced_answers`)."""


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


def _samples(cfg: DraftRunConfig, run: Path) -> list:
    """The training samples of the answers (and, for feature kinds, the states) in ``run``."""
    from .answers import AnswerShard, shard_paths
    from .draft_train import collect_samples

    paths = shard_paths(run / "answers")  # shards finish out of order: pair each with its own features
    if not paths:
        raise ValueError(f"{run} has no answer shards")
    shards = [AnswerShard.load(p) for p in paths]
    if cfg.kind in FEATURE_KINDS:
        from .feature_train import collect_feature_samples
        from .features import features_dir, load_features

        feats = load_features(features_dir(run, cfg.taps), paths)
        return collect_feature_samples(shards, feats, context=_CONTEXT)
    return collect_samples(shards, context=_CONTEXT)


def check_extra_data(cfg: DraftRunConfig) -> None:
    """A one-line ValueError unless every run of ``cfg.extra_data`` can train this drafter: another run directory
    (its ``run_config.json``) of the same target and top-k, with answer shards and, for feature kinds, the states of
    this run's taps for every one of them."""
    from .answers import run_list, shard_paths
    from .features import features_dir

    for extra in run_list(cfg.extra_data):
        saved = extra / "run_config.json"
        if not saved.is_file():
            raise ValueError(f"--extra-data: {extra} is not a drafter run directory (no run_config.json)")
        if extra.resolve() == Path(cfg.out).resolve():
            raise ValueError(f"--extra-data: {extra} is this run itself")
        other = json.loads(saved.read_text())
        for key in ("target", "topk"):
            if other.get(key) != getattr(cfg, key):
                raise ValueError(f"--extra-data: {extra} was made with {key} {other.get(key)!r}, this run with "
                                 f"{getattr(cfg, key)!r}")
        shards = shard_paths(extra / "answers")
        if not shards:
            raise ValueError(f"--extra-data: {extra} has no answer shards yet")
        if cfg.kind in FEATURE_KINDS:
            states = features_dir(extra, cfg.taps)
            missing = [p.name for p in shards if not (states / (p.stem + ".npy")).exists()]
            if missing:
                raise ValueError(f"--extra-data: {extra} lacks the target's states of taps {cfg.taps} for "
                                 f"{len(missing)} of its {len(shards)} answer shards ({states} ; run its data "
                                 "stage with these --taps)")


def check_init(cfg: DraftRunConfig) -> None:
    """A one-line ValueError unless ``cfg.init`` (when given) is an exported drafter this run can continue: an
    attached drafter directory of the same kind, taps and number of layers, made for a target of the same model type,
    hidden size and vocabulary (its embedding's fingerprint is checked again when it loads)."""
    if not cfg.init:
        return
    from ...models.attached import ATTACHED_FILE, is_attached

    path = Path(cfg.init)
    if not is_attached(path):
        raise ValueError(f"--init: {path} is not an exported drafter (no {ATTACHED_FILE}; give RUN/<kind>-<loss>/draft)")
    meta = json.loads((path / ATTACHED_FILE).read_text())
    mine = {"kind": cfg.kind, "taps": list(cfg.taps), "layers": len(cfg.layers)}
    theirs = {"kind": meta.get("kind", "token"), "taps": list(meta.get("taps") or []),
              "layers": len(meta.get("layers_from_target") or [])}
    if cfg.kind == "confu" and theirs["kind"] == "eagle3":  # ConFu grows from an EAGLE-3 drafter
        theirs["kind"] = "confu"
    if cfg.kind == "confu" and meta.get("contemplate"):  # a ConFu drafter keeps its soft prompt and mixture
        mine.update(soft=cfg.soft, mixture=cfg.mixture)
        theirs.update(meta["contemplate"])
    for key in mine:
        if mine[key] != theirs[key]:
            raise ValueError(f"--init: {path} is a drafter with {key} {theirs[key]!r}, this run trains one with "
                             f"{key} {mine[key]!r}")
    from transformers import AutoConfig

    from ...models.loading import resolve_model

    target = AutoConfig.from_pretrained(str(resolve_model(cfg.target)), local_files_only=True)
    draft = json.loads((path / "config.json").read_text())
    for key in ("model_type", "hidden_size", "vocab_size"):
        if draft.get(key) != getattr(target, key, None):
            raise ValueError(f"--init: {path} was made for {meta.get('target')!r} ({key} {draft.get(key)!r}); this "
                             f"run's target has {key} {getattr(target, key, None)!r}")


MODEL_LR = 3e-5
"""The default peak learning rate of ``--kind model``: a pretrained model fine-tuned whole (2e-3, the other kinds',
is for layers that start as copies of the target's and learn a new role)."""

_NOT_FOR_MODEL = ("layers", "regression", "unroll", "soft", "mixture", "window", "store")

DRAFT_MODEL_FILE = "draft_model.json"
"""What an exported ``model`` drafter was made from and how (beside its ``config.json``)."""


def check_draft(cfg: DraftRunConfig) -> tuple:
    """``(target tokenizer, draft tokenizer)`` of a ``model`` run, a one-line ValueError unless ``cfg.draft`` is a
    model whose tokenizer is the target's (it drafts the target's token ids). Checked before any work."""
    from ...models.loading import load_tokenizer, resolve_model, tokenizers_match

    target_tokenizer = load_tokenizer(resolve_model(cfg.target))
    try:
        draft_tokenizer = load_tokenizer(resolve_model(cfg.draft))
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft {cfg.draft}: {e}") from None
    if not tokenizers_match(target_tokenizer, draft_tokenizer):
        raise ValueError(f"--draft {cfg.draft}: its tokenizer is not the target's (a model drafter proposes the "
                         "target's token ids; another vocabulary drafts through cross-vocab)")
    if cfg.train_last is not None:
        from transformers import AutoConfig

        n = AutoConfig.from_pretrained(str(resolve_model(cfg.draft)), local_files_only=True).num_hidden_layers
        if cfg.train_last > n:
            raise ValueError(f"--train-last {cfg.train_last}: the draft model has {n} layers")
    return target_tokenizer, draft_tokenizer


def _draft_model(cfg: DraftRunConfig) -> tuple:
    """``(draft model in float32, its tokenizer, the target's stop ids)`` of a ``model`` run."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from ...models.chat import stop_ids
    from ...models.loading import load_pretrained, resolve_model

    tokenizer, _ = check_draft(cfg)
    target_dir = resolve_model(cfg.target)
    try:  # the target's generation config, as loading it would give: its file, else derived from its config
        generation = GenerationConfig.from_pretrained(str(target_dir), local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(target_dir),
                                                                                   local_files_only=True))
    draft, draft_tokenizer = load_pretrained(cfg.draft, dtype="float32")
    names = {n for n, _ in draft.named_parameters()}
    if not {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= names:
        raise ValueError(f"--draft {cfg.draft}: --kind model fine-tunes Llama-family models (model.embed_tokens, "
                         f"model.layers.N), not {type(draft).__name__}")
    return draft, draft_tokenizer, stop_ids(tokenizer, SimpleNamespace(generation_config=generation))


def _frozen(cfg: DraftRunConfig, draft) -> tuple[str, ...]:
    """Name prefixes of the parameters a ``model`` run keeps as they are: with ``train_last`` N, the decoder layers
    before the last N (their outputs need no gradient, so a step costs their forward only)."""
    if cfg.kind != "model" or cfg.train_last is None:
        return ()
    return tuple(f"model.layers.{i}." for i in range(draft.config.num_hidden_layers - cfg.train_last))


def _save_draft_model(draft, tokenizer, out: Path, meta: dict) -> None:
    """Export a fine-tuned ``model`` drafter (its last use: it is left in bfloat16): the whole model, its tokenizer
    and ``meta``."""
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out, max_shard_size="1000GB")  # one model.safetensors
    tokenizer.save_pretrained(out)
    (out / DRAFT_MODEL_FILE).write_text(json.dumps(meta, indent=1))


def _add_contemplation(cfg: DraftRunConfig, draft, target, samples: list) -> None:
    """Give a drafter that has none ConFu's parameters (:mod:`speculant.models.contemplate`), the soft prompt
    started from the target's own keys and values over the first training answer's tokens."""
    from ...models.contemplate import add_contemplation, contemplation_of

    if contemplation_of(draft) is not None:
        return
    module = add_contemplation(draft, target.config, soft=cfg.soft, mixture=cfg.mixture)
    tokens = np.concatenate([np.concatenate([s.context, s.answer]) for s in samples[:8]])
    if len(tokens) < cfg.soft:
        raise ValueError(f"--soft {cfg.soft}: the training data holds only {len(tokens)} tokens to start the soft "
                         "prompt from")
    module.init_from(target, torch.from_numpy(tokens[: cfg.soft].astype(np.int64)))


def _split_samples(cfg: DraftRunConfig, run: Path):
    """``(train, validation)``: the run's own samples split by prompt row (:func:`split_validation`), then the
    samples of ``cfg.extra_data``'s runs added to training only, less those whose prompt a validation sample has
    (the same request read or answered in another run). The validation stays the run's own answers."""
    from .answers import run_list

    check_extra_data(cfg)
    train, validation = split_validation(_samples(cfg, run), cfg.validation_fraction, cfg.seed)
    held = {_prompt_key(s) for s in validation}
    for extra in run_list(cfg.extra_data):
        train += [s for s in _samples(cfg, extra) if _prompt_key(s) not in held]
    return train, validation


def _prompt_key(sample) -> tuple:
    """What identifies a sample's prompt across runs: its length and its last tokens (the chat template applied)."""
    return sample.start, sample.context.tobytes()


def split_validation(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, validation)``: a sample is held out when a hash of its prompt row (and ``seed``) falls in the
    first ``fraction`` of the hash range, so a run whose data grows keeps its held-out prompts held out (the
    answers of one prompt at several temperatures stay on one side); at least one sample is held out."""
    def unit(row: int) -> float:  # a hash of the row in [0, 1)
        return ((row * 2654435761 + seed * 40503 + 12345) % 2**32) / 2**32

    held = [unit(s.row) < fraction for s in samples]
    if not any(held) and samples:
        held[min(range(len(samples)), key=lambda i: unit(samples[i].row))] = True
    return [s for s, h in zip(samples, held) if not h], [s for s, h in zip(samples, held) if h]


_GREEDY_KEEP = 4096  # VocabTrim size used by default under greedy decoding (the target's top token is rarely rarer)
_CONTEXT = 96  # prompt tokens before each answer seen in training (a 2-layer drafter looks little further back)


def _machine(cfg: DraftRunConfig) -> str:
    """One line on where the drafter was trained (for its model card)."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    threads = torch.get_num_threads()
    return (f"{os.cpu_count()} CPU cores ({cpu}), {threads} torch thread{'s' if threads != 1 else ''}, "
            f"torch {torch.__version__}, no GPU")


def run_training(cfg: DraftRunConfig, loss: str | None = None, progress: bool = True) -> Path:
    """Stage 3: fine-tune the attached drafter with ``loss`` (default ``cfg.loss``; ``"none"`` exports the
    untrained initialisation) and export it to ``RUN/<loss>/draft``; returns that directory."""
    from ...models.attached import build_attached, load_attached, save_attached
    from ...models.chat import stop_ids
    from ...models.loading import load_pretrained
    from ..calibrate import write_calibration_tokens
    from .draft_train import TOKEN, kept_ids, train_attached
    from ..precision import autocast_dtype

    loss = loss or cfg.loss
    resolve_kind(cfg)
    run = Path(cfg.out)
    out = run / (("" if cfg.kind == "token" else cfg.kind + "-") + loss.replace("+", "p"))
    export = out / "draft"
    if (export / "model.safetensors").exists():
        return export
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    earlier = out / "run_config.json"
    if (out / "checkpoint.pt").exists() and earlier.exists():  # resuming: the same start, or the card would lie
        before = json.loads(earlier.read_text())
        started = before.get("init")
        if started != cfg.init:
            raise ValueError(f"{out} holds a checkpoint of a training started from "
                             f"{started or 'the target layers'}; resume it with the same --init (now: "
                             f"{cfg.init or 'none'}), or train into another --out")
        for name in ("draft", "train_last"):  # a model drafter: the same model, the same layers trained
            if before.get(name) != getattr(cfg, name):
                raise ValueError(f"{out} holds a checkpoint of a training with --{name.replace('_', '-')} "
                                 f"{before.get(name)}; resume it with the same (now: {getattr(cfg, name)}), or train "
                                 "into another --out")
    earlier.write_text(json.dumps({**asdict(cfg), "loss": loss}, indent=1))
    if cfg.kind == "model":  # a draft model of its own: the target's answers hold all it teaches, no weights needed
        draft, tokenizer, stops = _draft_model(cfg)  # tokenizer: the draft's own (the target's vocabulary)
        target = None
    else:
        target, tokenizer = load_pretrained(cfg.target, dtype="float32")
        stops = stop_ids(tokenizer, target)
    train, validation = _split_samples(cfg, run)
    vocab = (target if target is not None else draft).get_input_embeddings().weight.shape[0]
    kept = kept_ids(train, vocab, cfg.keep, stops)
    if cfg.init:  # continue an earlier drafter (e.g. the shipped one) on this run's data
        check_init(cfg)
        draft = load_attached(cfg.init, target)
    elif target is not None:
        draft = build_attached(target, cfg.layers, features=cfg.kind in FEATURE_KINDS, taps=cfg.taps)
    objective = TOKEN
    if cfg.kind == "confu":
        from ...confu.training import ConFuObjective

        _add_contemplation(cfg, draft, target, train)
        objective = ConFuObjective(regression=cfg.regression, unroll=cfg.unroll, target=target, window=cfg.window)
    elif cfg.kind in FEATURE_KINDS:
        from .feature_train import FeatureObjective

        objective = FeatureObjective(regression=cfg.regression, unroll=cfg.unroll)
    start = time.perf_counter()
    if loss == "none":
        from .draft_train import batches, evaluate, kept_head

        kept_index, head = kept_head(draft, kept)
        history = [{"step": 0, **evaluate(draft, batches(validation, kept_index, cfg.batch_size, stops[0], objective),
                                          head, objective)}]
        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(json.dumps(history, indent=1))
    else:
        history = train_attached(draft, train, validation, kept, out, loss=loss, steps=cfg.steps,
                                 batch_size=cfg.batch_size, lr=cfg.lr, warmup=cfg.warmup, seed=cfg.seed,
                                 pad=stops[0], amp=autocast_dtype(cfg.precision, torch.device("cpu")),
                                 progress=progress, objective=objective, group_by_length=cfg.group_by_length,
                                 frozen=_frozen(cfg, draft))
    # the training's own clock across resumed runs (the history's last row), else this run's time
    seconds = max(time.perf_counter() - start, float(history[-1].get("seconds") or 0.0))
    tmp = out / "draft.tmp"
    meta = {"kind": cfg.kind, "loss": loss, "steps": cfg.steps if loss != "none" else 0,
            "train_seconds": round(seconds, 1), "validation": history[-1], "machine": _machine(cfg)}
    if target is None:
        _save_draft_model(draft, tokenizer, tmp, {"target": cfg.target, "draft": cfg.draft,
                                                  "train_last": cfg.train_last, **meta})
    else:
        save_attached(draft, target, tmp, target_name=cfg.target, storage=cfg.store, extra={
            **meta, "layers_from_target": cfg.layers, "taps": cfg.taps, "init": cfg.init})
    answers = np.concatenate([s.answer for s in train])
    seen = int((np.bincount(answers.astype(np.int64)) > 0).sum())
    write_calibration_tokens(tmp, answers, "the training answers (distillation data)",
                             default_size=min(cfg.keep, _GREEDY_KEEP, seen), default_size_sampling=min(cfg.keep, seen))
    if export.exists():
        import shutil

        shutil.rmtree(export)
    tmp.rename(export)
    return export
