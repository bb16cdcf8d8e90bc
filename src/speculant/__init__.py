"""speculant: lossless speculative decoding for Hugging Face causal LMs on a single constrained machine.

>>> session = speculant.load("default-target")       # resolves its draft and method, loads both (one way in)
>>> session.generate("def fibonacci(n):", max_new_tokens=64).token_ids

>>> gen = speculant.generate(target, input_ids, drafter=speculant.DraftModelDrafter(draft, k=4))
>>> gen.token_ids, gen.stats.acceptance_length
>>> speculant.generate_batch(target, [ids_a, ids_b], drafter=draft)   # one verification forward per step for both

Every drafting method of the registry (``speculant generate --method``) has a Python entry point:
``speculant.build_drafter(spec, draft_model)`` builds any of them from its spec, and each has its class here
(chain: :class:`DraftModelDrafter`, specinfer / spectr / rsd-c / rsd-s / tree: the tree drafters, lookup:
:class:`PromptLookupDrafter`, mask-probe: :class:`MaskProbeDrafter`, hybrid: :class:`LookupProbeDrafter`; ar is
``drafter=None``).

The public names are imported on first use (PEP 562), so ``import speculant`` and ``speculant --help`` do not
import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    "DecodeState": ".drafters.base",
    "Drafter": ".drafters.base",
    "DraftModelDrafter": ".drafters.model",
    "DynamicTreeDrafter": ".drafters.trees",
    "FeatureDrafter": ".drafters.feature",
    "FeatureTreeDrafter": ".drafters.feature",
    "ConFuDrafter": ".drafters.confu",
    "ConFuTreeDrafter": ".drafters.confu",
    "CrossVocabDrafter": ".drafters.cross_vocab",
    "RSDCDrafter": ".drafters.trees",
    "RSDSDrafter": ".drafters.trees",
    "SpecInferDrafter": ".drafters.trees",
    "SpecTrDrafter": ".drafters.trees",
    "PromptLookupDrafter": ".drafters.lookup",
    "MaskProbeDrafter": ".drafters.mask_probe",
    "LookupProbeDrafter": ".drafters.lookup_probe",
    "ObservedDrafter": ".online.observed",
    "TextOnlyDrafter": ".drafters.text_only",
    "OnlineAdapter": ".online",
    "OnlineConfig": ".online",
    "Session": ".session",
    "SessionPlan": ".plan",
    "load": ".session",
    "load_plan": ".session",
    "resolve": ".plan",
    "build_drafter": ".drafters.registry",
    "generate": ".api",
    "generate_batch": ".api",
    "generate_steps": ".api",
    "StepEvent": ".core.types",
    "load_pretrained": ".models.loading",
    "load_draft": ".models.loading",
    "chat_ids": ".models.chat",
    "stop_ids": ".models.chat",
    "DraftTree": ".core.types",
    "Generation": ".core.types",
    "GenerationStats": ".core.types",
    "SamplingParams": ".core.types",
    "TokenLogprob": ".core.types",
    "Verdict": ".core.types",
    "verify": ".core.verification",
}

# a literal list, as static type checkers read it (this package ships py.typed); the same names as _EXPORTS
__all__ = [
    "CrossVocabDrafter",
    "DecodeState",
    "DraftModelDrafter",
    "DraftTree",
    "Drafter",
    "DynamicTreeDrafter",
    "FeatureDrafter",
    "FeatureTreeDrafter",
    "ConFuDrafter",
    "ConFuTreeDrafter",
    "Generation",
    "GenerationStats",
    "MaskProbeDrafter",
    "LookupProbeDrafter",
    "ObservedDrafter",
    "OnlineAdapter",
    "OnlineConfig",
    "PromptLookupDrafter",
    "RSDCDrafter",
    "RSDSDrafter",
    "SamplingParams",
    "Session",
    "SessionPlan",
    "SpecInferDrafter",
    "SpecTrDrafter",
    "TextOnlyDrafter",
    "StepEvent",
    "TokenLogprob",
    "Verdict",
    "__version__",
    "build_drafter",
    "chat_ids",
    "generate",
    "generate_batch",
    "generate_steps",
    "load",
    "load_draft",
    "load_plan",
    "load_pretrained",
    "resolve",
    "stop_ids",
    "verify",
]


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule such as ``speculant.core.engine``) on first access."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

if TYPE_CHECKING:  # what static type checkers and IDEs see
    from .drafters.base import DecodeState, Drafter
    from .drafters.cross_vocab import CrossVocabDrafter
    from .drafters.confu import ConFuDrafter, ConFuTreeDrafter
    from .drafters.feature import FeatureDrafter, FeatureTreeDrafter
    from .drafters.lookup_probe import LookupProbeDrafter
    from .drafters.lookup import PromptLookupDrafter
    from .drafters.mask_probe import MaskProbeDrafter
    from .drafters.model import DraftModelDrafter
    from .drafters.registry import build_drafter
    from .drafters.trees import DynamicTreeDrafter, RSDCDrafter, RSDSDrafter, SpecInferDrafter, SpecTrDrafter
    from .models.chat import chat_ids, stop_ids
    from .api import generate
    from .models.loading import load_draft, load_pretrained
    from .core.types import DraftTree, Generation, GenerationStats, SamplingParams, TokenLogprob, Verdict
    from .core.verification import verify
    from .plan import SessionPlan, resolve
    from .session import Session, load, load_plan
