"""A drafter that sees the text of a vision-language prompt only (Gagrani et al. 2024).

The target reads the image (its features fill the image placeholder tokens of the prompt); the drafter, any text
drafter with the target's tokenizer (a draft model, prompt lookup, trees, the trained drafters), never does:
:class:`TextOnlyDrafter` gives the inner drafter a view of the generation whose ids are the prompt with each run of
image tokens removed (or replaced by a short fixed ``marker`` of text tokens), followed by everything generated.
The draft tree it returns names next tokens only, so the target verifies it as usual, exactly. A feature drafter
(EAGLE-3) gets the target's states of the text positions only, in step with its ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ..core.types import DraftTree
from .base import DecodeState, Drafter, DrafterWrapper

__all__ = ["TextOnlyDrafter", "text_ids"]


def text_ids(ids: Sequence[int], image_ids: Iterable[int], marker: Sequence[int] = ()) -> list[int]:
    """``ids`` with each run of image tokens replaced by ``marker`` (empty: removed)."""
    image = set(image_ids)
    out: list[int] = []
    in_image = False
    for t in ids:
        if t in image:
            if not in_image:
                out.extend(marker)
            in_image = True
        else:
            out.append(t)
            in_image = False
    return out


class TextOnlyDrafter(DrafterWrapper):
    """``inner`` drafting from the text of the prompt only (see the module). ``image_ids``: the image placeholder
    token ids; ``marker``: token ids standing for an image in the drafter's view (default: none). A feature drafter
    (EAGLE-3) reads the target's states of the text positions only, like its ids."""

    def __init__(self, inner: Drafter, image_ids: Iterable[int], marker: Sequence[int] = ()) -> None:
        super().__init__(inner)
        self.image_ids, self.marker = frozenset(image_ids), list(marker)
        if self.image_ids & set(self.marker):
            raise ValueError("the image marker must be text tokens, not image tokens")
        if self.marker and self.uses_target_hidden:
            raise ValueError("a feature drafter reads one target state per token: it takes no image marker")
        self._view: DecodeState | None = None
        self._seen = 0  # ids of the real state already mirrored in the view
        self._image_rows: frozenset[int] = frozenset()  # prompt positions of image tokens
        self._image_end = 0  # one past the last of them: states from there on are all kept
        self._rows = 0  # target states (positions) handed over so far

    def _sync(self, state: DecodeState) -> DecodeState:
        """The view, brought up to ``state`` (new ids appended; the per-step fields copied)."""
        view = self._view
        view.ids.extend(state.ids[self._seen :])  # generated tokens as they are (a sampled image id included)
        self._seen = len(state.ids)
        for block in state.target_hidden:  # [n, F] states of consecutive positions: the image ones dropped
            n = block.shape[0]
            if self._rows < self._image_end:  # (after the prompt's last image token every state is kept)
                keep = [r for r in range(n) if self._rows + r not in self._image_rows]
                block = block if len(keep) == n else block[keep]
            view.target_hidden.append(block)
            self._rows += n
        state.target_hidden.clear()
        view.remaining, view.max_draft = state.remaining, state.max_draft
        view.last_logits, view.last_accepted = state.last_logits, state.last_accepted
        return view

    def begin(self, state: DecodeState) -> None:
        text = text_ids(state.ids, self.image_ids, self.marker)
        removed = len(state.ids) - len(text)
        # the same generator, parameters and statistics; its own ids and length
        self._view = dataclasses.replace(state, ids=text, max_length=state.max_length - removed, target_hidden=[])
        self._seen = len(state.ids)
        self._image_rows = frozenset(i for i, t in enumerate(state.ids) if t in self.image_ids)
        self._image_end = max(self._image_rows, default=-1) + 1
        self._rows = 0
        self.inner.begin(self._view)

    def prefill(self, state: DecodeState, stop: int) -> None:
        """The inner drafter reads the prompt's text (its view's ids) once the whole prompt is in; a part of it
        is not passed on (its image tokens would have to be mapped out of the target's positions)."""
        hook = getattr(self.inner, "prefill", None)
        if hook is not None and stop >= len(state.ids) - 1:
            hook(self._view, len(self._view.ids) - 1)

    def propose(self, state: DecodeState) -> DraftTree:
        return self.inner.propose(self._sync(state))

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        self.inner.commit(self._sync(state), accepted)
