"""Drafters: everything that proposes draft trees for the one verifier."""

from .base import DecodeState, Drafter
from .feature import FeatureDrafter
from .model import DraftModelBase, DraftModelDrafter
from .trees import (
    DynamicTreeDrafter,
    RSDCDrafter,
    RSDSDrafter,
    SpecInferDrafter,
    SpecTrDrafter,
    TreeDrafterBase,
)

__all__ = [
    "DecodeState",
    "DraftModelBase",
    "DraftModelDrafter",
    "Drafter",
    "DynamicTreeDrafter",
    "FeatureDrafter",
    "RSDCDrafter",
    "RSDSDrafter",
    "SpecInferDrafter",
    "SpecTrDrafter",
    "TreeDrafterBase",
]
