"""Online speculative decoding: the served drafter adapts to its traffic (:class:`OnlineAdapter`)."""

from .adapter import OnlineAdapter, OnlineConfig
from .buffer import OnlineBuffer

__all__ = ["OnlineAdapter", "OnlineBuffer", "OnlineConfig"]
