"""EAGLE-3's training-time test (train.drafter.feature_train): training pass d computes, at every position, exactly
the draft logits the feature drafter computes at inference for its (d+1)-th draft token, in the lean forward and
in transformers' (the same inputs, the same attention: ttt_mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant.core.drafting import DecodeState
from speculant.core.sampling import make_generator
from speculant.core.types import SamplingParams
from speculant.drafters.feature import FeatureDrafter
from speculant.models.attached import build_attached
from speculant.tiny_models import perturbed, tiny_model
from speculant.train.drafter.feature_train import FeatureObjective, FeatureSample, ttt_mask
from speculant.train.drafter.features import to_tensor

VOCAB = 64


def test_the_mask_shows_each_draft_row_its_chain():
    valid = torch.tensor([[True] * 5 + [False]])
    allowed = ttt_mask(valid, 2, torch.float32)[0, 0] == 0  # [6, 18]
    assert allowed[4, :6].tolist() == [True, True, True, False, False, False]  # real rows 0 .. 4 - 2
    assert allowed[4, 6:12].tolist() == [False, False, False, True, False, False]  # pass 1: row 3
    assert allowed[4, 12:].tolist() == [False, False, False, False, True, False]  # pass 2: itself
    causal = ttt_mask(valid, 0, torch.float32)[0, 0] == 0
    assert causal[5].tolist() == [True] * 5 + [False]  # padding is never a key


@pytest.mark.parametrize("lean, context", [(True, 6), (False, 6), (True, 2)])
def test_each_training_pass_drafts_what_the_drafter_drafts_at_that_depth(lean, context):
    """(Deeper passes compute only the rows answer chains reach: from row a0 - 2 + d with a context of 6, from
    row 0 with a context of 2.)"""
    target = tiny_model("qwen2", seed=3, layers=3, vocab_size=VOCAB)
    draft = perturbed(build_attached(target, [1], features=True, taps=[0]), 0.3, seed=4)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(2, VOCAB, (context + 9,), generator=g)  # context + answer 9
    context, answer = seq[:context].numpy(), seq[context:].numpy()
    with torch.no_grad():
        out = target.model(input_ids=seq[None, :-1], output_hidden_states=True)
    states = torch.cat([out.hidden_states[1][0], out.last_hidden_state[0]], -1)  # [T - 1, 2H]: layer 0 ; final
    bits = states.to(torch.bfloat16).view(torch.int16).numpy()  # as stored
    dummy = np.zeros((len(answer), 1))
    sample = FeatureSample(context, answer, dummy.astype(np.int32), dummy.astype(np.float16), 0, features=bits)
    objective = FeatureObjective(regression=0.0, unroll=3)
    kept_index = torch.arange(VOCAB)
    head = draft.get_output_embeddings().weight.detach().float()  # [V, H]
    batch = objective.batch([sample], kept_index, pad=0)
    with torch.no_grad():
        steps, _ = objective.predict(draft, batch, head, training=False)  # 3 x [9, V]
    feats = to_tensor(bits)  # [T - 1, 2H] what both sides read
    checked = 0
    for m, row in enumerate(batch.cols.tolist()):  # row j drafts s_{j+2}
        for depth in range(3):
            r = row - depth  # the last real row of the chain
            if r < 0:
                continue
            chain = FeatureDrafter(draft, k=1, vocab_trim=0)
            chain.lean_forward = lean
            state = DecodeState(target=target, ids=seq[: r + 2].tolist(), params=SamplingParams(),
                                generator=make_generator(0), max_length=20, remaining=10)
            state.target_hidden.append(feats[: r + 1])
            chain.begin(state)
            with torch.no_grad():
                logits = chain._catch_up(state)
                for i in range(1, depth + 1):
                    logits = chain._next_logits(state, [int(seq[r + 1 + i])])
            torch.testing.assert_close(steps[depth][m], logits, rtol=2e-4, atol=2e-4)
            checked += 1
    assert checked == sum(row - d >= 0 for row in batch.cols.tolist() for d in range(3))
