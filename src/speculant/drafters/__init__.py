"""Drafters: everything that proposes draft trees for the one verifier."""

from .base import DecodeState, Drafter
from .model import DraftModelDrafter

__all__ = ["Drafter", "DecodeState", "DraftModelDrafter"]
