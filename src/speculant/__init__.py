"""speculant: lossless speculative decoding for Hugging Face causal LMs on a single constrained machine.

>>> gen = speculant.generate(target, input_ids, drafter=speculant.DraftModelDrafter(draft, k=4))
>>> gen.token_ids, gen.stats.acceptance_length
"""

from .drafters import (
    DecodeState,
    Drafter,
    DraftModelDrafter,
    DynamicTreeDrafter,
    RSDCDrafter,
    RSDSDrafter,
    SpecInferDrafter,
    SpecTrDrafter,
)
from .engine import generate
from .loading import load_pretrained
from .types import DraftTree, Generation, GenerationStats, SamplingParams, Verdict
from .verify import verify

__version__ = "0.1.0"

__all__ = [
    "DecodeState",
    "DraftModelDrafter",
    "DraftTree",
    "Drafter",
    "DynamicTreeDrafter",
    "Generation",
    "GenerationStats",
    "RSDCDrafter",
    "RSDSDrafter",
    "SamplingParams",
    "SpecInferDrafter",
    "SpecTrDrafter",
    "Verdict",
    "__version__",
    "generate",
    "load_pretrained",
    "verify",
]
