"""Training: the bundled toy pair (:mod:`.bundled`), drafters for any target (:mod:`.drafter`), distillation
losses, VocabTrim calibration, model cards and the training precision."""
