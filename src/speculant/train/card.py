"""MODEL_CARD.md for a trained model: architecture, data, steps, validation loss/perplexity, a sample completion
and the exact command that reproduces it. Every figure in it is read from the run's own files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = ["SAMPLE_PROMPT", "write_model_card"]

SAMPLE_PROMPT = 'def read_lines(path):\n    """Return the lines of the text file at *path*, without newlines."""\n'


def _distill_section(data: Path, split: str) -> str:
    """What the training stream was when it is not the corpus itself (the target's completions)."""
    if split == "train":
        return ""
    info_path = data / f"{split}.json"
    if not info_path.exists():
        return f"\nTrained on the `{split}` token stream of the data directory.\n"
    info = json.loads(info_path.read_text())
    c = info["config"]
    temps = "/".join(str(t) for t in c["temperatures"])
    return (f"\nThe training stream (`{split}`, {info['tokens']:,} tokens) is the TARGET's own text: "
            f"{info['samples']:,} train-split prompts (half a function's signature + docstring, half random "
            f"windows of {c['min_prompt_tokens']}-{c['max_prompt_tokens']} tokens) completed by the target with up "
            f"to {c['max_new_tokens']} new tokens each ({info['generated_tokens']:,} generated tokens; "
            f"temperatures {temps} cycled per batch), the teacher re-run on the same windows for the distillation "
            "loss (Direct Alignment, Goel et al. 2024).\n")


def _vocab_trim_section(model_dir: Path) -> str:
    path = model_dir / "vocab_trim.json"
    if not path.exists():
        return ""
    cal = json.loads(path.read_text())
    cover = ", ".join(f"top {n}: {float(v):.1%}" for n, v in cal["coverage"].items())
    default = (f"Drafters use the {cal['default_size']:,} most frequent tokens by default (`chain:trim=N` picks "
               "another size, `trim=0` the full head)." if cal.get("default_size") else "")
    if "default_size_sampling" in cal:
        n = cal["default_size_sampling"]
        default += (f" When sampling they use {f'the {n:,} most frequent' if n else 'all'} tokens: a sampled draft "
                    "token is accepted with probability sum(min(p, q)), and the target's mass outside the kept set "
                    "is lost to it.")
    return (f"\n## VocabTrim calibration\n`vocab_trim.json` ranks the {cal['calibration']['distinct']:,} token ids "
            f"seen in the `{cal['calibration']['split']}` stream ({cal['calibration']['tokens']:,} tokens) by "
            f"frequency; coverage of that stream: {cover}. {default}\n")


def write_model_card(run_dir: str | Path, model_dir: str | Path, name: str, command: str,
                     origin: str | None = None) -> Path:
    """Write ``model_dir/MODEL_CARD.md`` from ``run_dir``'s config, metrics and the data split listing.

    ``command`` is quoted under "Reproduce" (several lines for a multi-stage recipe); ``origin`` replaces the
    "trained from scratch" / "fine-tuned from INIT" phrase of the first line."""
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    cfg = json.loads((run_dir / "train_config.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    splits = json.loads((Path(cfg["data"]) / "splits.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok(SAMPLE_PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    sample = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    c = model.config
    held_out = lambda s: ", ".join(m for m in splits[s]["modules"] if not m.startswith("pydoc:"))
    kd = f"distilled from `{cfg['teacher']}` ({cfg['kd_loss']}, weight {cfg['kd_weight']}) + " if cfg.get("teacher") else ""
    split = cfg.get("train_split", "train")
    if origin is None:
        origin = "trained from scratch" if not cfg.get("init") else f"fine-tuned from `{cfg['init']}`"
    text = f"""# {name}

A Llama-architecture causal LM {origin} by speculant's training pipeline on Python code.

| | |
|---|---|
| architecture | LlamaForCausalLM: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} KV), MLP {c.intermediate_size}, tied embeddings |
| parameters | {metrics['parameters']:,} |
| vocabulary | {c.vocab_size:,} (byte-level BPE trained on the train split) |
| context | {c.max_position_embeddings} positions; trained on windows of {cfg['seq_len']} tokens |
| weights | safetensors, bfloat16 |
| objective | {kd}next-token cross-entropy |
| optimiser | AdamW (β 0.9/0.95, weight decay {cfg['weight_decay']}), peak lr {cfg['lr']}, {cfg['warmup']} warm-up steps, cosine to {cfg['min_lr_ratio']}× |
| steps | {metrics['steps']:,} × batch {cfg['batch_size']} × {cfg['seq_len']} tokens = {metrics['tokens_seen']:,} tokens |
| device | {metrics['device']}, {metrics['precision']} |
| validation loss | {metrics['validation_loss']:.3f} nats/token (perplexity {math.exp(metrics['validation_loss']):.1f}) |

## Data
The Python {'.'.join(map(str, __import__('sys').version_info[:2]))} standard library sources (test suites excluded)
and the pydoc topics, split deterministically by top-level module (sha-256 of the name):
train {splits['train']['tokens']:,} tokens, validation {splits['validation']['tokens']:,}, test {splits['test']['tokens']:,}.

- validation modules: {held_out('validation')}
- test modules (held out for benchmarks): {held_out('test')}
{_distill_section(Path(cfg['data']), split)}{_vocab_trim_section(model_dir)}

## Sample (greedy, 64 tokens)
```python
{SAMPLE_PROMPT}{sample}
```

## Reproduce
```
{command}
```
"""
    path = model_dir / "MODEL_CARD.md"
    path.write_text(text)
    return path
