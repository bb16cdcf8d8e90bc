"""VocabTrim: a drafter whose LM head covers only some tokens stays lossless, and its calibration plumbing works.

(The sampling-distribution test with a trimmed drafter, and its negative control, are in
core/test_sampling_distribution.py next to the other distribution tests.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_greedy import hf_greedy, prompts

import speculant
from speculant.core.llama_forward import LlamaForward
from speculant.core.quant import QuantMatrix, quantize_model
from speculant.drafters.registry import build_drafter
from speculant.drafters.vocab_trim import CALIBRATION_FILE, TrimmedHead, trimmed_head
from speculant.tiny_models import perturbed, tiny_model
from speculant.train.calibrate import token_ranking, write_calibration

VOCAB = 96


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # base_model: .model and .transformer
@pytest.mark.parametrize("kept", [VOCAB - 1, 48, 12])
def test_trimmed_greedy_matches_transformers(arch, kept):
    """Greedy output is identical whatever the kept set; a smaller set only lowers τ."""
    target = tiny_model(arch, seed=0, vocab_size=VOCAB)
    draft = perturbed(target, scale=0.08, seed=7)
    rng = np.random.default_rng(kept)
    keep = rng.permutation(VOCAB)[:kept].tolist()
    for k, prompt in zip((2, 4), prompts(seed=3)):
        ref = hf_greedy(target, prompt, 30)
        gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(draft, k=k, vocab_trim=keep),
                                 max_new_tokens=30, eos_token_id=[])
        assert gen.token_ids == ref, f"{arch} kept={kept} k={k}"
        if kept == VOCAB - 1:
            # the target as its own trimmed drafter, missing a token it never emits: every draft is accepted,
            # so the trimmed head and the index mapping are right (not merely harmless)
            unused = min(set(range(VOCAB)) - set(ref))
            own = [t for t in range(VOCAB) if t != unused]
            gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(target, k=k, vocab_trim=own),
                                     max_new_tokens=30, eos_token_id=[])
            assert gen.token_ids == ref and gen.stats.acceptance_length >= 0.85 * (k + 1), gen.stats


def test_trimmed_drafts_only_kept_tokens():
    """Every proposed token is in the kept set, and the lifted draft distribution is zero elsewhere."""
    from speculant.drafters.base import DecodeState  # noqa: F401 (documents what propose receives)

    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    keep = list(range(0, VOCAB, 3))
    drafter = speculant.DraftModelDrafter(perturbed(target, 0.3, seed=2), k=3, vocab_trim=keep)
    seen = []
    original = drafter.propose

    def spy(state):
        tree = original(state)
        seen.append(tree)
        return tree

    drafter.propose = spy
    speculant.generate(target, [5, 7, 9], drafter=drafter, max_new_tokens=20, temperature=1.0, seed=0,
                       eos_token_id=[])
    assert seen
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    for tree in seen:
        assert all(t in keep for t in tree.tokens)
        rows = tree.draft_probs[: len(tree.tokens)]  # [k, V]
        assert torch.all(rows[:, outside] == 0)
        assert torch.allclose(rows.sum(-1), torch.ones(len(tree.tokens)), atol=1e-5)


def test_trimmed_head_logits_are_rows_of_the_full_head():
    model = tiny_model("gpt2", seed=1, vocab_size=VOCAB)
    keep = [5, 1, 90, 33]
    head = TrimmedHead(model.get_output_embeddings(), keep)
    hidden = torch.randn(3, model.config.n_embd)
    full = model.get_output_embeddings()(hidden)  # [3, V]
    assert torch.allclose(head.logits(hidden), full[:, keep], atol=1e-6)
    lifted = head.lift(torch.tensor([0.1, 0.2, 0.3, 0.4]), VOCAB)
    assert lifted[90] == pytest.approx(0.3) and lifted.sum() == pytest.approx(1.0) and head.token(2) == 90


@pytest.mark.parametrize("kind", ["q4", "int8", "int4"])
def test_a_quantized_head_is_trimmed_to_its_own_quantized_rows(kind):
    """A quantized draft's trimmed head multiplies by the kept rows of its quantized matrix (the same codes): the
    same bits as those columns of the full quantized head, not a float copy of them."""
    model = tiny_model("qwen2", seed=1, vocab_size=VOCAB, hidden=64)
    quantize_model(model, kind)
    keep = [5, 1, 90, 33, 64]
    head = TrimmedHead(model.get_output_embeddings(), keep)
    assert isinstance(head._matrix, QuantMatrix) and head._matrix.kind == kind
    hidden = torch.randn(3, 64)
    full = LlamaForward(model).logits(hidden)  # [3, V] through the quantized head
    assert torch.equal(head.logits(hidden), full[:, keep])


def test_drafters_over_one_model_share_its_trimmed_head():
    """A server makes a drafter per request: the kept rows are built once per head, setting and weights, and again
    when the weights change (an update in place) or the kept set does."""
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(target, scale=0.08, seed=7)
    keep = [3, 9, 40, 41, 70]
    runs = []
    for _ in range(2):
        drafter = speculant.DraftModelDrafter(draft, k=2, vocab_trim=keep)
        speculant.generate(target, prompts(seed=3)[0], drafter=drafter, max_new_tokens=4, eos_token_id=[])
        runs.append(drafter._head)
    assert runs[0] is runs[1] and runs[0].size == len(keep)
    assert trimmed_head(draft, torch.tensor(keep), VOCAB) is runs[0]  # the same ids in another container
    assert trimmed_head(draft, keep[:3], VOCAB) is not runs[0]
    assert trimmed_head(draft, 0, VOCAB) is None  # 0: the full head
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(2.0)  # its version moves: the cached rows are stale
    fresh = trimmed_head(draft, keep, VOCAB)
    assert fresh is not runs[0]
    hidden = torch.randn(2, draft.config.hidden_size)
    assert torch.allclose(fresh.logits(hidden), draft.get_output_embeddings()(hidden)[:, keep], atol=1e-5)


def test_calibration_ranking_and_default_size(tmp_path):
    ranking, counts = token_ranking(np.array([3, 3, 3, 1, 1, 7, 2, 2], dtype=np.uint16), vocab=10)
    assert ranking == [3, 1, 2, 7] and counts[3] == 3

    # a draft directory with a calibration recommending 40 tokens: the drafter uses it unless told otherwise
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft_dir = tmp_path / "draft"
    perturbed(target, 0.08, seed=7).save_pretrained(draft_dir)
    data = tmp_path / "data"
    data.mkdir()
    stream = np.random.default_rng(0).zipf(1.3, 5000) % VOCAB
    np.save(data / "distill.npy", stream.astype(np.uint16))
    write_calibration(draft_dir, data, "distill", default_size=40)
    saved = json.loads((draft_dir / CALIBRATION_FILE).read_text())
    assert saved["token_ids"][:40] == token_ranking(stream, VOCAB)[0][:40] and saved["default_size"] == 40
    draft = type(target).from_pretrained(draft_dir).eval()

    for spec, size in [("chain:k=3", 40), ("chain:k=3:trim=10", 10), ("chain:k=3:trim=0", None)]:
        drafter = build_drafter(spec, draft)
        gen = speculant.generate(target, [4, 5, 6], drafter=drafter, max_new_tokens=12, eos_token_id=[])
        assert gen.token_ids == hf_greedy(target, [4, 5, 6], 12)
        assert (drafter._head.size if drafter._head is not None else None) == size, spec

    # a separate recommendation for sampling: 60 kept tokens at temperature > 0, 40 when greedy, on one drafter
    write_calibration(draft_dir, data, "distill", default_size=40, default_size_sampling=60)
    drafter = build_drafter("chain:k=3", draft)
    for temperature, size in [(0.8, 60), (0.0, 40), (0.8, 60)]:
        speculant.generate(target, [4, 5, 6], drafter=drafter, max_new_tokens=6, temperature=temperature, seed=0)
        assert drafter._head.size == size, temperature
    write_calibration(draft_dir, data, "distill", default_size=40, default_size_sampling=0)  # 0: the full head
    drafter = build_drafter("chain:k=3", draft)
    speculant.generate(target, [4, 5, 6], drafter=drafter, max_new_tokens=6, temperature=0.8, seed=0)
    assert drafter._head is None
    with pytest.raises(ValueError, match="default_size_sampling"):
        write_calibration(draft_dir, data, "distill", default_size=40, default_size_sampling=10**6)


def test_vocab_trim_errors():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(target, 0.1)  # built in memory: no directory, so no calibration
    cases = [
        ({"vocab_trim": 16}, "vocab_trim.json"),
        ({"vocab_trim": -1}, "vocab_trim must be >= 0"),
        ({"vocab_trim": [1, 2, 2]}, "distinct"),
        ({"vocab_trim": [1, VOCAB]}, "below the vocabulary size"),
        ({"vocab_trim": []}, "keeps no tokens"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            speculant.generate(target, [1, 2], drafter=speculant.DraftModelDrafter(draft, **options),
                               max_new_tokens=4)
    # no calibration and no explicit size: the full head, no error
    speculant.generate(target, [1, 2], drafter=speculant.DraftModelDrafter(draft), max_new_tokens=4)
