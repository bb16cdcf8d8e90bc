"""End-to-end losslessness: ``speculant.generate`` with a draft model samples exactly the target's distribution.

A tiny random target over a 5-token vocabulary (flat enough that most joint outcomes have mass, context-dependent
enough that a corrupted KV cache shows) and a perturbed copy as the draft (it agrees about half the time, so
drafts are both accepted and rejected). Sequences of ``k + 1`` new tokens are sampled thousands of times with
different seeds and their empirical joint distribution is compared with the EXACT target joint, computed by
enumeration (one target forward per prefix, warped with the same settings), by chi-square goodness-of-fit tests:
the full joint, every pair of positions and the first token. Seeds are fixed, so the outcome is deterministic; a
correct engine passes with p > 1e-4, the negative controls (a biased verifier, a stale KV cache) must give
p < 1e-6.

The engine drafts at most ``remaining - 1`` tokens, so a chain of ``k`` drafts needs ``max_new_tokens >= k + 1``:
generating exactly ``k + 1`` tokens covers a full first step (all accepted + bonus, or a rejection with its
correction) and the later steps that follow a rejection (draft cache crop, target cache compaction).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import speculant
import speculant.core.sequence
from helpers import N_FAST, chisq_pvalue, detectable_tv, sizes
from speculant.core.cache import SpecCache
from speculant.core.sampling import sample, uniform, warp
from speculant.tiny_models import perturbed, tiny_model
from speculant.core.types import SamplingParams, Verdict

VOCAB = 5
PROMPT = [0, 3, 1, 2]
PASS_P = 1e-4
FAIL_P = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = perturbed(target, scale=0.3, seed=5)
    return target, draft


# ----------------------------------------------------------------------------------------------- helpers


_chisq_pvalue = chisq_pvalue


def _check_margins(logits: torch.Tensor, params: SamplingParams) -> None:
    """Refuse settings where a top-k / top-p cut is a near-tie: float noise between the engine's cached
    forwards and the enumeration's full forwards must not be able to move a token across the cut."""
    scaled = logits.double() / params.temperature
    s = scaled.sort(-1, descending=True).values  # [R, V]
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        gap = (s[:, params.top_k - 1] - s[:, params.top_k]).min()
        assert gap > 1e-3, f"top-k near-tie (gap {float(gap):.2e}): pick another prompt/model"
    if params.top_p is not None and params.top_p < 1.0:
        probs = s.softmax(-1)
        before = probs.cumsum(-1) - probs
        gap = (before[:, 1:] - params.top_p).abs().min()
        assert gap > 1e-4, f"top-p near-tie (gap {float(gap):.2e}): pick another prompt/model"


def exact_joint(target, params: SamplingParams, depth: int) -> np.ndarray:
    """The target's exact distribution of the first ``depth`` new tokens, shape ``[VOCAB] * depth``."""
    joint = np.ones(())
    prefixes = [[]]
    with torch.no_grad():
        for _ in range(depth):
            ids = torch.tensor([PROMPT + pre for pre in prefixes])  # all prefixes have the same length
            logits = target(input_ids=ids).logits[:, -1].float()  # [P, V]
            _check_margins(logits, params)
            q = warp(logits, params).double().numpy()  # [P, V]
            joint = (joint.reshape(-1, 1) * q).reshape([VOCAB] * (len(prefixes[0]) + 1))
            prefixes = [pre + [t] for pre in prefixes for t in range(VOCAB)]
    assert np.isclose(joint.sum(), 1.0)
    return joint


BATCH = 50
"""Seeded generations per batch in :func:`sample_counts` (one verification forward per step for all of them)."""


def sample_counts(target, make_drafter, params: SamplingParams, n_tokens: int, n: int, seed0: int,
                  batch: int = BATCH):
    """Empirical counts ``[VOCAB] * n_tokens`` of the ``n_tokens`` new tokens of ``n`` seeded generations, each
    with its own drafter ``make_drafter()`` (a zero-argument function; a drafter keeps per-generation state), the
    pooled accepted-length histogram (steps that accepted m drafts) and the number of draft tokens proposed.

    Generation ``i`` has seed ``seed0 + i``; they run ``batch`` at a time through :func:`speculant.generate_batch`
    (each sequence keeps its own generator, so it draws what it draws alone, up to the float rounding of a
    batched row), or one by one through :func:`speculant.generate` with ``batch=1``."""
    counts = np.zeros([VOCAB] * n_tokens)
    hist = np.zeros(n_tokens + 1)
    drafted = 0
    kwargs = dict(max_new_tokens=n_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                  eos_token_id=[])
    for start in range(0, n, batch):
        seeds = list(range(seed0 + start, seed0 + min(n, start + batch)))
        if batch == 1:
            gens = [speculant.generate(target, PROMPT, drafter=make_drafter(), seed=seeds[0], **kwargs)]
        else:
            gens = speculant.generate_batch(target, [PROMPT] * len(seeds), [make_drafter() for _ in seeds],
                                            seed=seeds, **kwargs)
        for gen in gens:
            assert len(gen.token_ids) == n_tokens
            counts[tuple(gen.token_ids)] += 1
            hist[: len(gen.stats.accepted_hist)] += gen.stats.accepted_hist
            drafted += gen.stats.draft_tokens
    return counts, hist, drafted


def sample_joint(target, draft, params: SamplingParams, k: int, n: int, seed0: int, batch: int = BATCH,
                 **drafter_options):
    """Empirical counts of the ``k + 1`` tokens of ``n`` seeded generations (:func:`sample_counts`), and the draft
    acceptance rate."""
    counts, hist, drafted = sample_counts(target, lambda: speculant.DraftModelDrafter(draft, k=k, **drafter_options),
                                          params, k + 1, n, seed0, batch)
    accepted = float((hist * np.arange(len(hist))).sum())
    return counts, accepted / max(drafted, 1)


def pvalues(counts: np.ndarray, expected: np.ndarray) -> dict[str, float]:
    """Goodness of fit of the full joint, of every pair of positions and of the first token."""
    out = {"joint": _chisq_pvalue(counts, expected)}
    axes = range(counts.ndim)
    for pair in itertools.combinations(axes, 2):
        rest = tuple(a for a in axes if a not in pair)
        out[f"tokens{pair}"] = _chisq_pvalue(counts.sum(rest), expected.sum(rest)) if rest else out["joint"]
    rest = tuple(axes)[1:]
    out["first"] = _chisq_pvalue(counts.sum(rest), expected.sum(rest))
    return out


# ----------------------------------------------------------------------------------------------- tests

def test_sample_sizes_have_the_stated_power():
    """The power argument of :data:`helpers.N_FAST`: first-token errors of TV 0.10 (default suite) and 0.06
    (full-size runs) are detected with probability >= 0.99 at the tests' level."""
    assert detectable_tv(N_FAST) <= 0.10 and detectable_tv(3500) <= 0.06
    assert detectable_tv(N_FAST, alpha=PASS_P, power=0.5) < detectable_tv(N_FAST)


SETTINGS = [
    # (sampling params, draft tokens per step k, generations per batch, samples); each sample is a sequence of
    # k + 1 tokens; N_FAST samples in the default suite, the full size in the slow one (power: helpers.N_FAST).
    # plain-k2 runs its generations one by one through speculant.generate, the rest in batches of BATCH; a
    # temperature below 1 runs in the default suite through the batch of two temperatures and VocabTrim's case.
    *sizes(3500, SamplingParams(temperature=1.0), 2, 1, id="plain-k2"),
    *sizes(3000, SamplingParams(temperature=0.7), 3, BATCH, id="temp0.7-k3", fast=False),
    *sizes(3500, SamplingParams(temperature=1.0, top_k=3), 2, BATCH, id="topk3-k2"),
    *sizes(3000, SamplingParams(temperature=1.0, top_p=0.8), 3, BATCH, id="topp0.8-k3"),
]


@pytest.mark.parametrize("params,k,batch,n", SETTINGS)
def test_generate_matches_target_distribution(models, params, k, batch, n):
    target, draft = models
    expected = exact_joint(target, params, k + 1)
    counts, acceptance = sample_joint(target, draft, params, k, n, seed0=10_000 * k, batch=batch)
    # the draft must be neither useless nor perfect, otherwise the rejection paths are not exercised
    assert 0.15 < acceptance < 0.9, acceptance
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


@pytest.mark.parametrize("temperature,top_p,n", [*sizes(3000, 1.0, None, id="temp1"),
                                                 *sizes(3000, 0.7, 0.8, id="temp0.7-topp0.8")])
def test_vocab_trimmed_draft_matches_target_distribution(models, temperature, top_p, n):
    """VocabTrim: the draft proposes only 3 of the 5 tokens (q = 0 elsewhere); the output is still the target's."""
    target, draft = models
    params = SamplingParams(temperature=temperature, top_p=top_p)
    expected = exact_joint(target, params, 3)
    counts, acceptance = sample_joint(target, draft, params, k=2, n=n, seed0=555, vocab_trim=[3, 0, 2])
    assert 0.15 < acceptance < 0.9, acceptance
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


@pytest.mark.parametrize("temperature,n", [*sizes(3000, 1.0, id="temp1"),  # T=0.7: the slow suite only
                                           pytest.param(0.7, 3000, id="temp0.7-full", marks=pytest.mark.slow)])
def test_a_chain_that_stops_on_the_drafts_confidence_matches_target_distribution(models, temperature, n):
    """``stop``: the draft ends its chain after a sampled token it gave less than 0.45 (often, over 5 tokens); the
    length depends on the draft's own draws only, so the output is still the target's."""
    target, draft = models
    params = SamplingParams(temperature=temperature)
    expected = exact_joint(target, params, 4)
    counts, acceptance = sample_joint(target, draft, params, k=3, n=n, seed0=777, stop=0.45)
    _, _, full = sample_counts(target, lambda: speculant.DraftModelDrafter(draft, k=3), params, 4, 200, 777)
    _, _, short = sample_counts(target, lambda: speculant.DraftModelDrafter(draft, k=3, stop=0.45), params, 4, 200,
                                777)
    assert short < 0.9 * full, (short, full)  # the chains did stop early
    assert 0.15 < acceptance < 0.9, acceptance
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_negative_control_trimmed_probs_on_wrong_ids_is_detected(models, monkeypatch):
    """Lifting the trimmed draft distribution onto the wrong ids (so p(x) handed to the verifier is not the
    probability x was drafted with) biases the output, and the test sees it."""
    from speculant.drafters.vocab_trim import TrimmedHead

    def shifted_lift(self, probs, vocab):
        full = probs.new_zeros((*probs.shape[:-1], vocab))
        return full.index_copy_(-1, self.keep.roll(1), probs)

    monkeypatch.setattr(TrimmedHead, "lift", shifted_lift)
    target, draft = models
    params = SamplingParams(temperature=1.0)
    counts, _ = sample_joint(target, draft, params, k=2, n=N_FAST, seed0=77, vocab_trim=[3, 0, 2])
    pvalue = _chisq_pvalue(counts, exact_joint(target, params, 3))
    assert pvalue < FAIL_P, f"the bias went undetected (p = {pvalue:.3g})"


def test_generate_plain_decoding_matches_target_distribution(models):
    """The baseline (no drafter) through the same loop: a sanity check of the enumeration itself."""
    target, _ = models
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(target, params, 3)
    counts = np.zeros([VOCAB] * 3)
    for i in range(N_FAST):
        ids = speculant.generate(target, PROMPT, max_new_tokens=3, temperature=1.0, seed=i, eos_token_id=[]).token_ids
        counts[tuple(ids)] += 1
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, bad


# -------------------------------------------------------------------------------------- negative controls


def _accept_all(tree, target_logits, params, generator=None):
    """Biased: accepts every draft token (the output then follows the draft, not the target)."""
    if len(tree) == 0 or params.greedy:
        return _REAL_VERIFY(tree, target_logits, params, generator)
    assert tree.is_chain()
    return Verdict(list(range(len(tree))), sample(warp(target_logits[len(tree)], params), generator))


def _resample_from_q(tree, target_logits, params, generator=None):
    """Biased: a classic bug, on rejection it samples from q instead of norm((q - p)+)."""
    if len(tree) == 0 or params.greedy or tree.draft_probs is None:
        return _REAL_VERIFY(tree, target_logits, params, generator)
    assert tree.is_chain()
    path = []
    for n, x in enumerate(tree.tokens):
        q = warp(target_logits[n], params)
        p = tree.draft_probs[n]
        if uniform(generator) * float(p[x]) < float(q[x]):
            path.append(n)
            continue
        return Verdict(path, sample(q, generator))
    return Verdict(path, sample(warp(target_logits[len(tree)], params), generator))


_REAL_VERIFY = speculant.core.sequence.verify


def _stale_cache(monkeypatch):
    """Biased engine: rejected drafts are never dropped from the target's KV cache."""
    monkeypatch.setattr(SpecCache, "keep", lambda self, start, slots: None)


@pytest.mark.parametrize("bug", ["accept-all", "resample-from-q", "stale-kv-cache"])
def test_negative_control_bias_is_detected(models, monkeypatch, bug):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(target, params, 3)
    if bug == "stale-kv-cache":
        _stale_cache(monkeypatch)
    else:
        biased = {"accept-all": _accept_all, "resample-from-q": _resample_from_q}[bug]
        monkeypatch.setattr(speculant.core.sequence, "verify", biased)
    counts, _ = sample_joint(target, draft, params, k=2, n=N_FAST, seed0=77)
    pvalue = _chisq_pvalue(counts, expected)
    assert pvalue < FAIL_P, f"the bias went undetected (p = {pvalue:.3g})"


def test_a_batch_of_two_temperatures_samples_each_targets_distribution(models):
    """Two sequences in one batch, at temperatures 1.0 and 0.6, each with its own chain drafter: every step one
    verification forward for both; each sequence's first three tokens follow the target's distribution at its own
    temperature (chi-square over N_FAST pairs, BATCH // 2 pairs per batch)."""
    from speculant.core.batch import Batch

    target, draft = models
    temps = (1.0, 0.6)
    expected = [exact_joint(target, SamplingParams(temperature=t), 3) for t in temps]
    counts = [np.zeros([VOCAB] * 3) for _ in temps]
    for start in range(0, N_FAST, BATCH // 2):  # BATCH // 2 pairs per batch
        batch = Batch(target)
        index = [(j, batch.add(PROMPT, speculant.DraftModelDrafter(draft, k=2), 3, temperature=t,
                               seed=1000 + 2 * i + j, eos_token_id=[]))
                 for i in range(start, min(N_FAST, start + BATCH // 2)) for j, t in enumerate(temps)]
        while len(batch):
            batch.step()
        for j, ix in index:
            counts[j][tuple(batch.result(ix).token_ids)] += 1
    for c, e, t in zip(counts, expected, temps):
        p = pvalues(c, e)
        assert min(p.values()) > PASS_P, (t, p)
