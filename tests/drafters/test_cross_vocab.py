"""Cross-vocabulary drafting (drafters.cross_vocab, drafters.token_bridge): a draft model with another tokenizer
drafts for the target; its text is translated into the target's tokens and verified as a deterministic draft.
Greedy output equals plain decoding, sampling keeps the target's distribution (chi-square), an oracle draft gets
its translated drafts accepted, and the n-gram cache grows from what it sees."""

from __future__ import annotations

import pytest
import torch

import speculant
from helpers import sizes
from speculant.core.types import SamplingParams
from speculant.drafters.cross_vocab import CrossVocabDrafter
from speculant.drafters.token_bridge import TokenBridge, aligned_segments, char_boundaries
from speculant.tiny_models import stdlib_texts, tiny_model, tiny_tokenizer


class CharTokenizer:
    """A tokenizer over a fixed list of pieces: greedy longest match (what encode/decode the drafter uses)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.index = {p: i for i, p in enumerate(pieces)}
        self.longest = max(len(p) for p in pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.longest, len(text) - i), 0, -1):
                if text[i:i + n] in self.index:
                    out.append(self.index[text[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"no piece for {text[i]!r}")
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


TARGET_TOK = CharTokenizer(list("abcde"))  # the 5 ids of test_sampling_distribution's target
DRAFT_TOK = CharTokenizer(["cd", "e", "a", "ab", "d", "b", "c", "bca"])  # other ids, merges the target lacks


def _draft_model(seed: int = 3):
    model = tiny_model("llama", vocab_size=len(DRAFT_TOK.pieces), seed=seed, init_std=0.3)
    model.config.eos_token_id = None
    return model


def _drafter(draft, k: int = 3) -> CrossVocabDrafter:
    return CrossVocabDrafter(draft, DRAFT_TOK, TARGET_TOK, k=k, max_ngram=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_plain_decoding(arch):
    target = tiny_model(arch, vocab_size=5, seed=1, init_std=0.3)
    prompt = [0, 3, 1, 2, 4, 0]
    plain = speculant.generate(target, prompt, max_new_tokens=30, eos_token_id=[])
    for k in (1, 3, 5):
        gen = speculant.generate(target, prompt, drafter=_drafter(_draft_model(), k), max_new_tokens=30,
                                 eos_token_id=[])
        assert gen.token_ids == plain.token_ids, (arch, k)


class _Oracle(CrossVocabDrafter):
    """Drafts, in its own tokens, the text the target will write (its plain greedy continuation)."""

    reference = ""

    def _draft(self, state, feed, k):
        super()._draft(state, feed, 0)  # keep the draft cache in step
        done = TARGET_TOK.decode(state.ids)
        ahead = self.reference[len(done):]
        return DRAFT_TOK.encode(ahead)[:k] if self.reference.startswith(done) else []


def test_translated_drafts_of_the_right_text_are_accepted():
    target = tiny_model("llama", vocab_size=5, seed=1, init_std=0.3)
    prompt = [0, 3, 1, 2]
    plain = speculant.generate(target, prompt, max_new_tokens=24, eos_token_id=[])
    drafter = _Oracle(_draft_model(), DRAFT_TOK, TARGET_TOK, k=4, max_ngram=3)
    drafter.reference = TARGET_TOK.decode(prompt + plain.token_ids)
    gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=24, eos_token_id=[])
    assert gen.token_ids == plain.token_ids
    assert gen.stats.acceptance_length > 2.5  # most of each translated draft is the target's own next tokens
    assert len(drafter.bridge) > 0 and drafter.bridge.hits + drafter.bridge.misses > 0


@pytest.mark.parametrize("temperature,n", [*sizes(3000, 1.0, id="1.0"), *sizes(3000, 0.7, id="0.7")])
def test_sampling_keeps_the_target_distribution(temperature, n):
    from test_sampling_distribution import PROMPT, VOCAB, exact_joint, pvalues, sample_counts

    assert VOCAB == len(TARGET_TOK.pieces)
    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    params = SamplingParams(temperature=temperature)
    model = _draft_model()
    bridge = _drafter(model, 2).bridge  # one n-gram cache for every generation, growing as they go

    def make():
        drafter = _drafter(model, 2)
        drafter.bridge = bridge
        return drafter

    counts, hist, drafted = sample_counts(target, make, params, 3, n, seed0=321)
    assert len(bridge) > 0
    assert drafted > 0 and hist[1:].sum() > 0  # drafts were proposed and some accepted
    bad = {name: p for name, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad} ({PROMPT})"


def test_the_bridge_translates_real_bpe_tokenizers_and_its_cache_grows():
    texts = stdlib_texts()
    draft_tok, target_tok = tiny_tokenizer(texts, vocab_size=300), tiny_tokenizer(texts, vocab_size=420)
    bridge = TokenBridge(draft_tok, target_tok, max_ngram=16)  # long enough for every aligned run here
    text = "def parse(self, value):\n    return value.strip()\n"
    d, t = draft_tok.encode(text), target_tok.encode(text)
    assert d != t
    segments = aligned_segments(d, char_boundaries(draft_tok, d), t, char_boundaries(target_tok, t))
    assert [x for seg in segments for x in seg[0]] == d and [x for seg in segments for x in seg[1]] == t
    assert bridge.translate(d, text) == t and bridge.misses == 1  # by text, then learned
    grown = len(bridge)
    assert grown > 0
    longest = max(len(seg[0]) for seg in segments)
    assert longest <= 16 and bridge.translate(d, text) == t and bridge.hits == 1  # now every run is cached
    short = TokenBridge(draft_tok, target_tok, max_ngram=1)  # runs longer than max_ngram are not cached
    short.learn(text)
    assert len(short) == len({seg[0] for seg in segments if len(seg[0]) == 1})
    bridge.learn("for key in sorted(mapping):\n    yield key\n")
    assert len(bridge) > grown


def test_cross_vocab_needs_both_tokenizers():
    draft = _draft_model()
    with pytest.raises(ValueError, match="needs both tokenizers"):
        speculant.build_drafter("cross-vocab", draft)
    drafter = speculant.build_drafter("cross-vocab:k=4", draft, draft_tokenizer=DRAFT_TOK, target_tokenizer=TARGET_TOK)
    assert isinstance(drafter, CrossVocabDrafter) and drafter.k == 4
    with pytest.raises(ValueError, match="draft_tokenizer"):
        CrossVocabDrafter(draft, object(), TARGET_TOK)
