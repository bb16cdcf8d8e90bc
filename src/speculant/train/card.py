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


def write_model_card(run_dir: str | Path, model_dir: str | Path, name: str, command: str) -> Path:
    """Write ``model_dir/MODEL_CARD.md`` from ``run_dir``'s config, metrics and the data split listing."""
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
    text = f"""# {name}

A Llama-architecture causal LM trained from scratch by speculant's training pipeline on Python code.

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
