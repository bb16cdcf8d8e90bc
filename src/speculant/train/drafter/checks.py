"""The options of a ``speculant train draft`` run (:class:`DraftRunConfig`) and their checks, made before any work.

:func:`resolve_kind` fills in what a drafter kind implies and refuses options that do not fit it; the other
checks read what the run is given besides its options: the runs of ``--extra-data`` (:func:`check_extra_data`),
the drafter ``--init`` continues (:func:`check_init`) and the model ``--kind model`` fine-tunes
(:func:`check_draft`). Each raises a one-line ValueError naming the option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...models.attached import EXPORT_STORAGES

__all__ = ["ANSWERS", "ENGINES", "FEATURE_KINDS", "KINDS", "MODEL_LR", "DraftRunConfig", "check_draft",
           "check_extra_data", "check_init", "resolve_kind"]


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


KINDS = ("token", "feature", "eagle3", "confu", "model")
FEATURE_KINDS = ("feature", "eagle3", "confu")
"""The kinds that read the target's states: ``feature`` (EAGLE: the final state, optional taps, hidden-state
regression), ``eagle3`` (EAGLE-3, Li et al. 2025: the outputs of a low, a middle and a high layer plus the
final state, no regression, training-time test over at least 3 draft depths) and ``confu`` (ConFu, Qin et al.
2026: EAGLE-3 plus the target's contemplation, :mod:`.confu_training`; it can start from an EAGLE-3 drafter)."""


ENGINES = ("auto", "speculant", "transformers")
ANSWERS = ("target", "dataset")
"""Who writes the answers a drafter learns from: the target (Direct Alignment), or the prompt rows' own answers
(ShareGPT's replies) read by the target in one forward each (:mod:`.forced_answers`)."""


MODEL_LR = 3e-5
"""The default peak learning rate of ``--kind model``: a pretrained model fine-tuned whole (2e-3, the other kinds',
is for layers that start as copies of the target's and learn a new role)."""

_NOT_FOR_MODEL = ("layers", "regression", "unroll", "soft", "mixture", "window", "store")


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
