"""Exactness of speculative decoding under an output constraint (:mod:`speculant.core.constraint`), independent of
any grammar engine: a stub constraint forbids tokens depending on the previous one, and sampled generations must
follow the *constrained* target distribution (the target's logits masked before warping) exactly, by chi-square
against the distribution enumerated from full forwards. SpecInfer's i.i.d. tree, with its ``drafts_constrained``
capability hidden (:class:`Unconstrained`), drafts forbidden tokens from its unconstrained ``p``: those nodes are
not fed to the target but stay in the verifier's tree; the negative control deletes them from the tree instead,
which biases the output, and the test sees it. The draft-model drafters as they are draft under the constraint
(their ``p`` masked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import N_FAST, chisq_pvalue, sizes
from speculant.core import engine
from speculant.core.constraint import Constraint
from speculant.core.sampling import warp
from speculant.core.types import DraftTree, SamplingParams
from speculant.drafters.base import Drafter, DrafterWrapper
from speculant.drafters.model import DraftModelDrafter
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 5
PROMPT = [0, 3, 1, 2]
N_TOKENS = 3
PASS_P = 1e-4
FAIL_P = 1e-6
BATCH = 50


def forbidden(history: list[int]) -> set[int]:
    """The stub's rule over the new tokens so far: the first may not be 2, 3 or 4; after a 0 neither 1 nor 2;
    otherwise not 4."""
    if not history:
        return {2, 3, 4}
    return {1, 2} if history[-1] == 0 else {4}


class Stub(Constraint):
    """A :class:`Constraint` by :func:`forbidden`; never finished, forces nothing unless ``force``."""

    def __init__(self, force: bool = False) -> None:
        self.history: list[int] = []
        self.force = force
        self.vocab = VOCAB
        self.proposed = 0  # forced tokens proposed

    def begin(self, vocab: int, stops: set[int]) -> None:
        self.vocab = vocab

    def _mask(self, path: list[int]) -> torch.Tensor:
        self.masks += 1
        mask = torch.ones(self.vocab, dtype=torch.bool)
        mask[sorted(forbidden(self.history + path))] = False
        return mask

    def tree_masks(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        rows = torch.ones((len(tree) + 1, self.vocab), dtype=torch.bool)
        rows[0] = self._mask([])
        allowed, paths = [], []
        for tok, par in zip(tree.tokens, tree.parents):
            ok = (par < 0 or allowed[par]) and bool(rows[par + 1, tok])
            path = (paths[par] if par >= 0 else []) + [tok]
            allowed.append(ok)
            paths.append(path)
            if ok:
                rows[len(allowed)] = self._mask(path)
        return rows, allowed

    def mask_after(self, path: list[int]) -> torch.Tensor | None:
        hist = self.history
        for i, t in enumerate(path):
            if t in forbidden(hist + path[:i]):
                return None
        return self._mask(list(path))

    def commit(self, tokens: list[int]) -> int:
        for i, t in enumerate(tokens):
            assert t not in forbidden(self.history), "a forbidden token was committed"
            self.history.append(t)
        return len(tokens)

    def forced(self, limit: int) -> list[int]:
        # after a 0 the stub "forces" a 3 (not truly forced: a deterministic draft the verifier checks as any other)
        chain = [3][:limit] if self.force and self.history and self.history[-1] == 0 else []
        self.proposed += len(chain)
        return chain

    @property
    def finished(self) -> bool:
        return False


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    return target, perturbed(target, scale=0.3, seed=5)


def constrained_joint(target, params: SamplingParams) -> np.ndarray:
    """The exact distribution ``[VOCAB] * N_TOKENS`` of constrained sampling: each prefix's logits masked by the
    stub, then warped."""
    joint = np.zeros([VOCAB] * N_TOKENS)
    with torch.no_grad():
        def walk(prefix: list[int], mass: float) -> None:
            if len(prefix) == N_TOKENS:
                joint[tuple(prefix)] = mass
                return
            logits = target(input_ids=torch.tensor([PROMPT + prefix])).logits[0, -1].float()
            logits[sorted(forbidden(prefix))] = float("-inf")
            q = warp(logits, params).double().numpy()
            for t in range(VOCAB):
                if q[t] > 0:
                    walk(prefix + [t], mass * q[t])
        walk([], 1.0)
    assert np.isclose(joint.sum(), 1.0)
    return joint


class Unconstrained(DrafterWrapper):
    """``inner`` without its ``drafts_constrained`` capability: it drafts from its own ``p``, forbidden tokens
    included."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.drafts_constrained = False


class Deleting(Drafter):
    """The negative control: deletes the forbidden nodes of ``inner``'s tree (and their draft rows) before the
    verifier sees it, which changes the rejection-sampling rule (the residual update of a drafted token)."""

    def __init__(self, inner: Drafter, constraint: Stub) -> None:
        self.inner, self.constraint = inner, constraint
        self.model = getattr(inner, "model", None)

    def begin(self, state):
        self.inner.begin(state)

    def commit(self, state, accepted):
        self.inner.commit(state, accepted)

    def propose(self, state) -> DraftTree:
        tree = self.inner.propose(state)
        _, allowed = self.constraint.tree_masks(tree)
        keep = [i for i, ok in enumerate(allowed) if ok]
        where = {n: i for i, n in enumerate(keep)}
        order = None
        if tree.draw_order is not None:
            order = [[where[c] for c in tree.draw_order[r] if c in where] for r in [0] + [1 + n for n in keep]]
        probs = None if tree.draft_probs is None else tree.draft_probs[[0] + [1 + n for n in keep]]
        return DraftTree(tokens=[tree.tokens[n] for n in keep],
                         parents=[-1 if tree.parents[n] < 0 else where[tree.parents[n]] for n in keep],
                         draft_probs=probs, replacement=tree.replacement, draw_order=order, coupling=tree.coupling)


def sample(target, make_drafter, params: SamplingParams, n: int, seed0: int, force: bool = False,
           deleting: bool = False) -> tuple[np.ndarray, dict]:
    counts = np.zeros([VOCAB] * N_TOKENS)
    seen = {"forced": 0, "accepted_forced": 0}
    for start in range(0, n, BATCH):
        seeds = list(range(seed0 + start, seed0 + min(n, start + BATCH)))
        constraints = [Stub(force) for _ in seeds]
        drafters = [make_drafter() for _ in seeds]
        if deleting:
            drafters = [Deleting(d, c) for d, c in zip(drafters, constraints)]
        gens = engine.generate_batch(target, [PROMPT] * len(seeds), drafters, max_new_tokens=N_TOKENS,
                                     temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                     seed=seeds, eos_token_id=[], constraints=constraints)
        for gen in gens:
            assert len(gen.token_ids) == N_TOKENS
            counts[tuple(gen.token_ids)] += 1
            seen["accepted_forced"] += gen.stats.forced_tokens
        seen["forced"] += sum(c.proposed for c in constraints)
    return counts, seen


SETTINGS = [
    *sizes(3000, "unconstrained specinfer:width=3:depth=2", SamplingParams(temperature=1.0), id="specinfer-cut"),
    *sizes(3000, "unconstrained specinfer:width=3:depth=2", SamplingParams(temperature=0.8, top_k=3),
           id="specinfer-cut-topk3"),
    *sizes(3000, "specinfer:width=3:depth=2", SamplingParams(temperature=1.0), id="specinfer"),
    *sizes(3000, "chain:k=2", SamplingParams(temperature=1.0), id="chain"),
    *sizes(3000, "chain-trim", SamplingParams(temperature=1.0), id="chain-vocab-trim"),
    *sizes(3000, "rsd-s:width=2:depth=2", SamplingParams(temperature=1.0, top_p=0.9), id="rsd-s-topp0.9",
           fast=False),
]


@pytest.mark.parametrize("spec,params,n", SETTINGS)
def test_constrained_speculative_sampling_keeps_the_constrained_distribution(models, spec, params, n):
    target, draft = models
    expected = constrained_joint(target, params)
    def make():
        if spec == "chain-trim":  # VocabTrim: the chain drafts over 3 of the 5 tokens, masked on the kept ids
            return DraftModelDrafter(draft, k=2, vocab_trim=[3, 0, 2])
        if spec.startswith("unconstrained "):
            return Unconstrained(build_drafter(spec.split()[1], draft, tokenizers_match=True))
        return build_drafter(spec, draft, tokenizers_match=True)

    counts, _ = sample(target, make, params, n, seed0=1000, force=True)
    p = chisq_pvalue(counts, expected)
    assert p > PASS_P, f"constrained output differs from the constrained target distribution (p = {p:.3g})"
    first = chisq_pvalue(counts.sum((1, 2)), expected.sum((1, 2)))
    assert first > PASS_P, first


def test_specinfer_drafts_forbidden_tokens_and_the_chain_does_not(models):
    """The premise of the tests above: unconstrained SpecInfer's tree holds forbidden nodes (left out of the
    forward); the constrained chain and SpecInfer never draft one; forced tokens are used."""
    target, draft = models
    import speculant.core.sequence as sequence

    pruned = []
    real = sequence._fed_tree

    def spy(tree, fed):
        pruned.append(fed is not None)
        return real(tree, fed)

    sequence._fed_tree = spy
    try:
        _, seen = sample(target, lambda: Unconstrained(build_drafter("specinfer:width=3:depth=2", draft)),
                         SamplingParams(temperature=1.0), 50, seed0=1, force=True)
        assert any(pruned) and seen["forced"] > seen["accepted_forced"] > 0  # accepted only where q allows
        pruned.clear()
        for make in (lambda: DraftModelDrafter(draft, k=2), lambda: build_drafter("specinfer:width=3:depth=2", draft)):
            pruned.clear()
            sample(target, make, SamplingParams(temperature=1.0), 50, seed0=1)
            assert pruned and not any(pruned)
    finally:
        sequence._fed_tree = real


def test_negative_control_deleting_forbidden_nodes_is_detected(models):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    counts, _ = sample(target, lambda: Unconstrained(build_drafter("specinfer:width=3:depth=2", draft)), params, 1500,
                       seed0=1000, deleting=True)
    p = chisq_pvalue(counts, constrained_joint(target, params))
    assert p < FAIL_P, f"the bias went undetected (p = {p:.3g})"


def test_greedy_under_the_stub_is_plain_constrained_greedy(models):
    target, draft = models
    plain = engine.generate(target, PROMPT, max_new_tokens=12, eos_token_id=[], constraint=Stub())
    for make in (lambda: build_drafter("specinfer:width=3:depth=2", draft), lambda: DraftModelDrafter(draft, k=3),
                 lambda: build_drafter("lookup"), lambda: Unconstrained(build_drafter("tree", draft))):
        gen = engine.generate(target, PROMPT, drafter=make(), max_new_tokens=12, eos_token_id=[],
                              constraint=Stub(force=True))
        assert gen.token_ids == plain.token_ids
    history: list[int] = []
    for t in plain.token_ids:
        assert t not in forbidden(history)
        history.append(t)


class Every3rd(Stub):
    """The stub, "forcing" a 7 at every third position (mostly rejected: the drafter's state must survive steps it
    did not draft)."""

    def forced(self, limit: int) -> list[int]:
        chain = [7][:limit] if len(self.history) % 3 == 0 else []
        self.proposed += len(chain)
        return chain


@pytest.mark.parametrize("spec", ["chain", "tree:budget=6:topk=2:depth=3"])
def test_feature_drafters_under_a_constraint_equal_constrained_greedy(spec):
    """EAGLE-style drafters (they read the target's states, which forced steps add too) under the stub: greedy
    output equals plain constrained greedy decoding."""
    from speculant.models.attached import build_attached

    target = tiny_model("llama", seed=2)
    draft = perturbed(build_attached(target, [1], features=True, taps=[0]), scale=0.05, seed=3)
    prompt = list(range(3, 20))
    plain = engine.generate(target, prompt, max_new_tokens=30, eos_token_id=[], constraint=Stub())
    constraint = Every3rd()
    gen = engine.generate(target, prompt, drafter=build_drafter(spec, draft), max_new_tokens=30, eos_token_id=[],
                          constraint=constraint)
    assert gen.token_ids == plain.token_ids and constraint.proposed > 0
