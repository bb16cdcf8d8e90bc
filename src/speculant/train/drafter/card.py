"""MODEL_CARD.md of a drafter made by ``speculant train draft``; every figure is read from the run's files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...models.attached import stored_parameters
from .answers import run_list, shard_totals
from .run import DRAFT_MODEL_FILE
from ..card import _vocab_trim_section

__all__ = ["write_drafter_card"]


def _history_table(history: list[dict]) -> str:
    deep = "greedy_agreement_d2" in history[-1]
    head = "| step | loss | greedy agreement | α (T=1) |" + (" agreement, 2nd token | α, 2nd token |" if deep else "")
    rows = [head, "|---" * (6 if deep else 4) + "|"]
    for h in history:
        loss = f"{h['loss']:.4f}" if "loss" in h else "–"
        row = f"| {h['step']} | {loss} | {h['greedy_agreement']:.3f} | {h['alpha_t1']:.3f} |"
        if deep:
            row += f" {h.get('greedy_agreement_d2', float('nan')):.3f} | {h.get('alpha_t1_d2', float('nan')):.3f} |"
        rows.append(row)
    return "\n".join(rows)


def _kind_paragraph(meta: dict, cfg: dict) -> str:
    """What kind of drafter this is (token-level, or a feature drafter and how it was trained)."""
    kind = meta.get("kind", "token")
    if kind not in ("feature", "eagle3", "confu"):
        return ""
    name = {"eagle3": "An **EAGLE-3 drafter** (Li et al. 2025)",
            "confu": "A **ConFu drafter** (Qin, Goel, Gagrani et al. 2026) over an EAGLE-3 drafter"}.get(
        kind, "A **feature drafter** (EAGLE, Li et al. 2024)")
    where = (f"answered and recorded by speculant's batched engine over the {cfg.get('quantization') or 'packaged'} "
             "target" if cfg.get("engine", "transformers") != "transformers" else f"extracted in {cfg['gen_dtype']}")
    classes = "ConFuDrafter` / `ConFuTreeDrafter" if kind == "confu" else "FeatureDrafter` / `FeatureTreeDrafter"
    return (f"\n{name}, `speculant.{classes}`: each input row is "
            "`feature_fc([emb(x_{t+1}) ; f_t])`, with `f_t` the target's final-normed hidden state"
            + (f" preceded by the outputs of its layers {cfg['taps']} (zeros on draft rows)" if cfg.get("taps") else "")
            + ", and its output state is read by the target's LM head. It was trained on the target's states over "
            f"the same answers ({where})"
            + (f", with EAGLE's hidden-state regression (smooth L1, weight {cfg['regression']})" if cfg.get("regression")
               else "")
            + (f", with the training-time test over {cfg['unroll']} draft depths (pass d reads the drafter's own "
               "states and attends as its (d+1)-th draft token does)" if cfg.get("unroll", 1) > 1 else "")
            + (f". ConFu: {cfg.get('soft')} soft-prompt entries per target layer and {cfg.get('mixture')} contemplate "
               "embedding(s) feed a contemplate token in each verification forward (masked: the target's output is "
               "unchanged); its final state, the future vector, enters every drafter row through `future_fc`; trained "
               f"through the frozen target with one sampled anchor per {cfg.get('window')} rows, each anchor's vector "
               "serving the rows after it (`speculant.train.drafter.confu_training`)" if kind == "confu" else "")
            + ". Drafting: `chain` or any tree method over it (`tree`: EAGLE-2's dynamic tree"
            + ("; `confu`: the same tree with contemplation" if kind == "confu" else "") + ").\n")


def ablation_section(run: str | Path) -> str:
    """A table of every drafter trained in ``run`` (one row per loss folder): its final validation figures."""
    rows = []
    for history_path in sorted(Path(run).glob("*/history.json")):
        meta = _meta(history_path.parent / "draft")
        if meta is None:
            continue
        last = json.loads(history_path.read_text())[-1]
        rows.append(f"| {meta.get('kind', 'token')} | `{meta['loss']}` | {meta['steps']} | {last['greedy_agreement']:.3f} "
                    f"| {last['alpha_t1']:.3f} |")
    if not rows:
        return ""
    return ("\n## Loss ablation (same data and learning rate per kind; held-out answers)\n"
            "| kind | loss | steps | greedy agreement | α (T=1) |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def _meta(export: Path) -> dict | None:
    """What an exported drafter records of itself: ``attached.json`` (built from the target's layers) or
    ``draft_model.json`` (a draft model of its own, ``--kind model``); None when there is neither."""
    for name in ("attached.json", DRAFT_MODEL_FILE):
        if (export / name).exists():
            return json.loads((export / name).read_text())
    return None


def _origin(meta: dict, cfg: dict) -> str:
    """The card's opening sentence on what the drafter was made from."""
    if meta.get("kind") == "model":
        trained = ("untrained: exported as it loads, the baseline of its fine-tuned exports" if meta["loss"] == "none"
                   else f"its last {meta['train_last']} decoder layers and final norm trained, the rest frozen"
                   if meta.get("train_last") else "its own embedding and LM head frozen, the rest trained")
        return f"the draft model `{meta['draft']}` ({trained})"
    return (f"{len(meta['layers_from_target'])} transformer layers initialised from the target's layers "
            f"{meta['layers_from_target']}\nand its final norm"
            + (f" (continued from the drafter in `{cfg['init']}`, --init)" if cfg.get('init') else "")
            + ", sharing the target's token embedding and LM head (not stored here: they are the target's own\n"
            "tensors when loaded, see `speculant.models.attached`)")


def _extra_summary(extra_data: str | None) -> str:
    """``N answers (M tokens) of RUN, ...`` for the runs of ``--extra-data`` (empty without any)."""
    parts = []
    for run in run_list(extra_data):
        n, tokens, forced = shard_totals(run / "answers")
        kind = "read by the target, teacher forcing" if forced else "of the target"
        parts.append(f"{n:,} answers of `{run}` ({kind}; {tokens:,} answer tokens)")
    return ", ".join(parts)


def write_drafter_card(run: str | Path, export: str | Path, command: str, name: str | None = None,
                       extra: str = "") -> Path:
    """Write ``export/MODEL_CARD.md`` for the attached drafter in ``export`` made by run ``run``; ``command``
    is quoted under "Reproduce"; ``extra`` (Markdown) is appended before it."""
    run, export = Path(run), Path(export)
    own_cfg = export.parent / "run_config.json"  # the training stage's settings (the run's first call saved its own)
    cfg = json.loads((own_cfg if own_cfg.exists() else run / "run_config.json").read_text())
    meta = _meta(export)
    if meta is None:
        raise ValueError(f"{export} is not an exported drafter (no attached.json or {DRAFT_MODEL_FILE})")
    config = json.loads((export / "config.json").read_text())
    history = json.loads((export.parent / "history.json").read_text())
    answers = run / "answers"
    done = json.loads((answers / "DONE").read_text()) if (answers / "DONE").exists() else None
    # forced: the prompts' own answers read by the target (--answers dataset), told by the shards themselves
    n_answers, n_tokens, forced = shard_totals(answers)
    size_mb = (export / "model.safetensors").stat().st_size / 2**20
    if meta.get("kind") == "model":
        from safetensors import safe_open

        with safe_open(str(export / "model.safetensors"), "pt") as f:
            total = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
        params = (f"{total:,} in all ({size_mb:.1f} MB in bfloat16; the validation below is of the trained float32 "
                  "weights before that rounding); embedding and LM head its own, frozen")
    else:
        own, storages = stored_parameters(export)
        stored = ("matrices in 4 bits with a float16 scale and minimum per 32 inputs (q4)"
                  + (", those of other input sizes int8 with a float32 scale per row" if "int8" in storages else "")
                  if "q4" in storages else "matrices int8 with a float32 scale per row")
        params = (f"{own:,} ({size_mb:.1f} MB: {stored}, norms bfloat16; the validation below is of the trained "
                  "weights before that rounding); embedding and LM head shared with the target")
    temps = "/".join(str(t) for t in cfg["temperatures"])
    machine = meta.get("machine") or "machine not recorded"
    prompts_file = run / "prompts.jsonl"  # a grown run holds more rows than its first --num-prompts
    n_rows = len(prompts_file.read_text().splitlines()) if prompts_file.exists() else cfg["num_prompts"]
    n_self = cfg.get("self_prompts", 0)
    prompts = cfg["prompts"] or f"{n_rows - n_self:,} built-in instruction prompts (speculant.data.instructions)"
    self_info = run / "self_prompts.json"
    self_seconds = json.loads(self_info.read_text())["seconds"] if n_self and self_info.exists() else None
    if n_self:
        prompts += (f" and {n_self:,} requests the target wrote itself (Magpie: its chat template up to a user's "
                    f"message, sampled at temperature 1, at most {cfg['self_prompt_tokens']} tokens; "
                    "speculant.train.drafter.self_prompts)")
    if forced:
        data = (f"{n_answers:,} of the prompts' own answers ({n_tokens:,} answer tokens, the dataset's replies to "
                f"{prompts}, chat template applied, cut at {cfg['max_new_tokens']} tokens) read by the target in one "
                f"forward each (teacher forcing), its top-{cfg['topk']} log-probabilities kept at every answer token")
    else:
        data = (f"{n_answers:,} answers of the target ({n_tokens:,} answer tokens) to {prompts}, chat template "
                f"applied, up to {cfg['max_new_tokens']} new tokens, temperatures {temps} cycled per batch, the "
                f"target's top-{cfg['topk']} log-probabilities kept at every answer token")
    more = _extra_summary(cfg.get("extra_data"))
    if more:
        data += f"; for training also {more} (--extra-data; held-out requests left out of them)"
    text = f"""# {name or export.name}

A drafter for `{meta['target']}`, made by `speculant train draft` the Direct Alignment way (Goel et al. 2024):
{_origin(meta, cfg)}, fine-tuned on {"text the target read" if forced else "the target's own answers"}{" and more runs' answers" if more else ""} with the `{meta['loss']}`
loss.
{_kind_paragraph(meta, cfg)}
| | |
|---|---|
| architecture | {config['model_type']}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {config['num_attention_heads']} heads ({config['num_key_value_heads']} KV), MLP {config['intermediate_size']} |
| {"parameters" if meta.get("kind") == "model" else "own parameters"} | {params} |
| distillation data | {data} |
| objective | `{meta['loss']}` between the target's top-{cfg['topk']} and the drafter over the {cfg['keep']:,} most frequent answer tokens (the VocabTrim set it drafts from) |
| steps | {meta['steps']} × {cfg['batch_size']} answers (each with its prompt's last 96 tokens), AdamW, peak lr {cfg['lr']}, {cfg['warmup']} warm-up steps, cosine to 0.1× |
| training time | {meta['train_seconds'] / 60:.1f} min fine-tuning{f", {done.get('seconds', done.get('seconds_this_session', 0)) / 60:.1f} min {'reading' if forced else 'generating'} the answers" if done else ""}{f", {self_seconds / 60:.1f} min writing the self prompts" if self_seconds is not None else ""} ({machine}) |

## Validation (held-out {cfg['validation_fraction']:.0%} of the answers)
Greedy agreement: the drafter's top token is the target's. α = Σ min(p, q) over the kept set: the probability that
one sampled draft token is accepted at T=1 (a lower bound: q is known on its top-{cfg['topk']} only).

{_history_table(history)}
{_vocab_trim_section(export)}
{ablation_section(run)}
{extra}
## Reproduce
```
{command}
```
"""
    path = export / "MODEL_CARD.md"
    path.write_text(text)
    return path

