"""Training pipeline: corpus, tokenizer, data preparation, pretraining and distillation losses."""
