"""``speculant train draft``: drafters for any target, the Direct Alignment way (answers, features, fitting, model card)."""
