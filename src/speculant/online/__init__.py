"""Online speculative decoding: the served drafter adapts to its traffic.

:class:`~.adapter.OnlineAdapter` is the way in (``speculant serve --online``, or Python). The package, one idea a
module: :mod:`.config` (the settings and their checks), :mod:`.observed` (the drafter wrapper that keeps the target's
verdicts), :mod:`.buffer` (the bounded store of those observations, with held-back requests), :mod:`.traffic` (the
memory of earlier requests' tokens, drafted from with no training), :mod:`.window` (a draft model's logits over an
observation's context window), :mod:`.trainer` (the trainable copy and one optimizer step), :mod:`.evaluation` (the
check of an update against held-back requests), :mod:`.scheduler` (when a round's steps run), :mod:`.state` (the
saved state) and :mod:`.adapter` (the glue).

It sits above the engine: it imports ``core``, ``models``, ``drafters`` and ``train``, and none of them imports it.
"""

from .adapter import OnlineAdapter
from .buffer import OnlineBuffer
from .config import OnlineConfig

__all__ = ["OnlineAdapter", "OnlineBuffer", "OnlineConfig"]
