"""Pretraining the bundled toy pair on the standard-library corpus: tokenizer, data splits, pretraining, distillation data."""
