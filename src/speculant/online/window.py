"""A draft model's logits at an observation's positions, from one forward over the context window before them.

Training and checking both read a model this way: the forward covers at most ``window`` tokens ending at the last
position asked for, and the LM head runs on the rows that predict the asked positions only (most of a small
drafter's cost is its head over the vocabulary). A position whose predicting row lies before the window is left out.
"""

from __future__ import annotations

import torch

from .observed import Observation

__all__ = ["window_logits"]


def window_logits(model: torch.nn.Module, o: Observation, keep: torch.Tensor, window: int, prompt: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [P + R, V], selected [P'] bool, prompt rows [R])``: ``model``'s logits at the positions of ``o``
    picked by ``keep`` ``[P']`` whose predicting row is inside the ``window`` (``selected`` of those picked, ``P`` of
    them kept). ``prompt``: then also at the rows (indices in ``o.ids``, returned) predicting the prompt's tokens
    inside the window, the text before the first drafted position; else R = 0."""
    positions = o.positions[keep]  # [P']
    end = int(positions.max())
    start = max(0, end - window)
    selected = positions - 1 >= start  # [P']
    first = int(o.positions.min()) - 1 if prompt else start  # the prompt's rows end before the first drafted one
    text = torch.arange(start, max(start, first), dtype=torch.int64)  # [R]: none once the window starts later
    rows = torch.cat([positions[selected] - 1, text]) - start  # [P + R]: rows of the window's forward
    logits = model(input_ids=o.ids[start:end].long()[None], logits_to_keep=rows).logits[0]  # [P + R, V]
    return logits, selected, text
