"""The feature (EAGLE) drafter: exact in every regime, fed the target's true hidden states, saved and loaded.

All-accepted regime: a target whose layers add nothing (zero output projections) is a bigram model whose final
state at ``t`` is ``norm(emb(x_t))``; a feature drafter whose input map passes the embedding through and whose
layer adds nothing outputs exactly the target's next state, so every draft is accepted. Partial: a perturbed
drafter on real tiny models. Sampling: the chi-square test of :mod:`test_sampling_distribution`.
"""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.models.attached import build_attached, is_feature_drafter, load_attached, save_attached
from speculant.core.drafting import DecodeState
from speculant.core.sampling import make_generator
from speculant.drafters.feature import FeatureDrafter, FeatureTreeDrafter, feature_variant
from speculant.drafters.trees import SpecInferDrafter
from speculant.tiny_models import tiny_model
from speculant.core.types import SamplingParams

from helpers import sizes

PROMPT = list(range(3, 20))


def _zero_layers(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _pass_embedding(draft: torch.nn.Module) -> torch.nn.Module:
    """Input map ``[emb ; f] -> emb``."""
    h = draft.config.hidden_size
    with torch.no_grad():
        draft.feature_fc.weight.zero_()
        draft.feature_fc.weight[:, :h].copy_(torch.eye(h))
        draft.feature_fc.bias.zero_()
    return draft


def _perturb(draft: torch.nn.Module, scale: float, seed: int = 3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("model.embed_tokens", "lm_head")):
                continue  # shared with the target
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


def test_all_accepted_when_the_drafter_predicts_the_next_state_exactly():
    target = _zero_layers(tiny_model("llama", seed=1, layers=2))
    draft = _pass_embedding(build_attached(target, [0], features=True))
    plain = speculant.generate(target, PROMPT, max_new_tokens=25, eos_token_id=[])
    gen = speculant.generate(target, PROMPT, drafter=FeatureDrafter(draft, k=4), max_new_tokens=25,
                             eos_token_id=[])
    assert gen.token_ids == plain.token_ids
    steps = gen.stats.target_calls
    assert gen.stats.accepted_hist[4] == steps  # every step accepted all 4 drafts (25 = 5 x 5)
    assert steps == 5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("forward", ["auto", "model"])
def test_greedy_equals_plain_decoding(arch, forward):
    target = tiny_model(arch, seed=2)
    draft = _perturb(build_attached(target, [1], features=True), 0.2)
    plain = speculant.generate(target, PROMPT, max_new_tokens=40, eos_token_id=[])
    for k in (1, 3, 6):
        gen = speculant.generate(target, PROMPT, drafter=FeatureDrafter(draft, k=k), max_new_tokens=40,
                                 eos_token_id=[], forward=forward)
        assert gen.token_ids == plain.token_ids, (arch, forward, k)


def test_greedy_with_kv_eviction_equals_plain_decoding_with_the_same_eviction():
    target = tiny_model("llama", seed=4)
    draft = _perturb(build_attached(target, [0], features=True), 0.2)
    kv = {"kv_policy": "keydiff", "kv_budget": 10, "kv_block": 4}
    plain = speculant.generate(target, PROMPT, max_new_tokens=30, eos_token_id=[], **kv)
    gen = speculant.generate(target, PROMPT, drafter=FeatureDrafter(draft, k=3), max_new_tokens=30,
                             eos_token_id=[], **kv)
    # eviction depends on which tokens a step commits together, so only the first step is comparable exactly;
    # the invariant that holds throughout: the drafter is fed one state per committed token (no RuntimeError)
    assert gen.token_ids[0] == plain.token_ids[0]
    assert len(gen.token_ids) == 30


class _Recording(FeatureDrafter):
    """Keeps every block of target states it is handed."""

    def begin(self, state):
        super().begin(state)
        self.seen: list[torch.Tensor] = []

    def _catch_up(self, state):
        self.seen.extend(h.clone() for h in state.target_hidden)
        return super()._catch_up(state)


@pytest.mark.parametrize("forward", ["auto", "model"])
def test_the_drafter_reads_the_targets_final_states_of_the_committed_tokens(forward):
    target = tiny_model("llama", seed=5)
    draft = _perturb(build_attached(target, [0], features=True), 0.3)
    drafter = _Recording(draft, k=3)
    gen = speculant.generate(target, PROMPT, drafter=drafter, max_new_tokens=30, eos_token_id=[], forward=forward)
    seen = torch.cat(drafter.seen)  # [n, H]: one state per committed token but the root, in order
    full = torch.tensor([PROMPT + gen.token_ids])
    with torch.no_grad():
        ref = target.model(input_ids=full).last_hidden_state[0]  # [T, H]
    assert seen.shape[0] >= len(PROMPT)  # the prompt and at least one step
    torch.testing.assert_close(seen, ref[: seen.shape[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("forward", ["auto", "model"])
def test_tapped_layers_reach_the_drafter(forward):
    """EAGLE-3 style: a drafter that also reads layer 0's output gets [layer 0 output ; final state] per token."""
    target = tiny_model("llama", seed=9, layers=3)
    draft = _perturb(build_attached(target, [0], features=True, taps=[0]), 0.3)
    assert draft.feature_fc.in_features == 3 * target.config.hidden_size
    drafter = _Recording(draft, k=3)
    assert drafter.target_taps == [0]
    gen = speculant.generate(target, PROMPT, drafter=drafter, max_new_tokens=30, eos_token_id=[], forward=forward)
    plain = speculant.generate(target, PROMPT, max_new_tokens=30, eos_token_id=[])
    assert gen.token_ids == plain.token_ids
    seen = torch.cat(drafter.seen)  # [n, 2H]
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([PROMPT + gen.token_ids]), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[1][0], out.last_hidden_state[0]], -1)  # layer 0's output ; final state
    torch.testing.assert_close(seen, ref[: seen.shape[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", sizes(3000, id="n"))
def test_sampling_matches_the_target_distribution(n):
    from test_sampling_distribution import VOCAB, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = _perturb(build_attached(target, [1], features=True), 0.5, seed=7)
    params = SamplingParams(temperature=1.0)
    k = 2
    counts, hist, drafted = sample_counts(target, lambda: FeatureDrafter(draft, k=k), params, k + 1, n, seed0=777)
    accepted = float((hist * torch.arange(len(hist)).numpy()).sum()) / max(drafted, 1)
    assert 0.15 < accepted < 0.95, accepted  # both accepted and rejected drafts
    expected = exact_joint(target, params, k + 1)
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_save_and_load_round_trip(tmp_path):
    target = tiny_model("llama", seed=6)
    draft = _perturb(build_attached(target, [1], features=True), 0.2)
    path = save_attached(draft, target, tmp_path / "eagle", target_name="tiny", dtype=torch.float32)
    loaded = load_attached(path, target)
    assert is_feature_drafter(loaded)
    assert loaded.get_input_embeddings().weight is target.get_input_embeddings().weight  # shared, no copy
    a = speculant.generate(target, PROMPT, drafter=FeatureDrafter(draft, k=3), max_new_tokens=20, eos_token_id=[])
    b = speculant.generate(target, PROMPT, drafter=loaded, max_new_tokens=20, eos_token_id=[])  # chain by default
    assert a.token_ids == b.token_ids and a.stats.accepted_hist == b.stats.accepted_hist


def test_clear_errors():
    target = tiny_model("llama", seed=7)
    token_level = build_attached(target, [0])
    feature = build_attached(target, [0], features=True)
    with pytest.raises(ValueError, match="not a feature drafter"):
        FeatureDrafter(token_level)
    with pytest.raises(ValueError, match="feature_variant"):
        SpecInferDrafter(feature)
    assert isinstance(speculant.build_drafter("chain:k=2", feature), FeatureDrafter)
    assert isinstance(speculant.build_drafter("tree", feature), FeatureTreeDrafter)
    assert isinstance(speculant.build_drafter("specinfer", feature), feature_variant(SpecInferDrafter))
    other = tiny_model("llama", seed=8, hidden=48)
    with pytest.raises(ValueError):
        speculant.generate(other, PROMPT, drafter=FeatureDrafter(feature), max_new_tokens=4)


TREES = ("tree:budget=8:topk=2:depth=3", "specinfer:width=2:depth=3", "spectr:width=2:depth=2",
         "rsd-c:branching=2/2", "rsd-s:width=2:depth=3")


def test_a_tree_accepts_everything_when_the_drafter_predicts_the_next_state_exactly():
    target = _zero_layers(tiny_model("llama", seed=1, layers=2))
    draft = _pass_embedding(build_attached(target, [0], features=True))
    plain = speculant.generate(target, PROMPT, max_new_tokens=24, eos_token_id=[])
    gen = speculant.generate(target, PROMPT, drafter=FeatureTreeDrafter(draft, budget=9, topk=3, depth=3),
                             max_new_tokens=24, eos_token_id=[])
    assert gen.token_ids == plain.token_ids
    assert gen.stats.accepted_hist[3] == gen.stats.target_calls == 6  # 24 = 6 x (3 accepted + the bonus)


class _NodeLogits(FeatureTreeDrafter):
    """Records the draft logits after each fed tree node, in feed order."""

    def _all_logits(self, state, tokens, mask, positions):
        out = super()._all_logits(state, tokens, mask, positions)
        self.node_logits.extend(out)
        return out


@pytest.mark.parametrize("forward", ["lean", "model"])
def test_each_tree_node_drafts_from_its_own_path(forward):
    """A node's row reads its parent's output state and sees the committed rows and its ancestors only: its
    logits equal those of a chain fed along its path."""
    target = tiny_model("llama", seed=2)
    draft = _perturb(build_attached(target, [1], features=True), 0.3)

    def state():
        with torch.no_grad():
            hidden = target.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0, :-1]  # [T - 1, H]
        s = DecodeState(target=target, ids=list(PROMPT), params=SamplingParams(), generator=make_generator(0),
                        max_length=len(PROMPT) + 20, remaining=20)
        s.target_hidden.append(hidden)
        return s

    tree_drafter = _NodeLogits(draft, budget=12, topk=2, depth=4)
    tree_drafter.lean_forward = forward == "lean"
    tree_drafter.node_logits = []
    s = state()
    tree_drafter.begin(s)
    tree_drafter.propose(s)
    fed_tokens, fed_parents = tree_drafter._fed_tokens, tree_drafter._fed_parents
    assert len(fed_tokens) == 2 + 2 + 2 and len(tree_drafter.node_logits) == len(fed_tokens)
    for j in range(len(fed_tokens)):
        path, node = [], j
        while node >= 0:
            path.insert(0, fed_tokens[node])
            node = fed_parents[node]
        chain = FeatureDrafter(draft, k=1)
        chain.lean_forward = forward == "lean"
        c = state()
        chain.begin(c)
        chain._catch_up(c)
        for tok in path:
            logits = chain._next_logits(c, [tok])
        torch.testing.assert_close(tree_drafter.node_logits[j], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", TREES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_feature_trees_greedy_equal_plain_decoding(arch, spec):
    target = tiny_model(arch, seed=2)
    draft = _perturb(build_attached(target, [1], features=True, taps=[0]), 0.2)
    plain = speculant.generate(target, PROMPT, max_new_tokens=30, eos_token_id=[])
    for prompt in (PROMPT, PROMPT[:1]):  # a one-token prompt: no target state before the first step
        ref = plain if prompt is PROMPT else speculant.generate(target, prompt, max_new_tokens=30, eos_token_id=[])
        gen = speculant.generate(target, prompt, drafter=speculant.build_drafter(spec, draft), max_new_tokens=30,
                                 eos_token_id=[])
        assert gen.token_ids == ref.token_ids, (arch, spec, len(prompt))


@pytest.mark.parametrize("spec,n", [*sizes(3000, "specinfer:width=2:depth=2", id="specinfer:width=2:depth=2"),
                                    *sizes(3000, "tree:budget=5:topk=2:depth=2", id="tree:budget=5:topk=2:depth=2")])
def test_feature_trees_sample_the_target_distribution(spec, n):
    from test_sampling_distribution import VOCAB, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = _perturb(build_attached(target, [1], features=True), 0.5, seed=7)
    params = SamplingParams(temperature=1.0)
    counts, _, _ = sample_counts(target, lambda: speculant.build_drafter(spec, draft), params, 3, n, seed0=99)
    bad = {name: p for name, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_the_eagle3_method_drafts_a_dynamic_tree_from_a_feature_drafter():
    from speculant.bench.harness import _method_draft
    from speculant.models.loading import bundled_dir, default_draft_for

    target = tiny_model("qwen2", seed=2)
    draft = _perturb(build_attached(target, [1], features=True, taps=[0]), 0.2)
    drafter = speculant.build_drafter("eagle3:budget=6:topk=2:depth=3", draft)
    assert isinstance(drafter, FeatureTreeDrafter) and drafter.budget == 6
    plain = speculant.generate(target, PROMPT, max_new_tokens=20, eos_token_id=[])
    assert speculant.generate(target, PROMPT, drafter=drafter, max_new_tokens=20, eos_token_id=[]).token_ids == \
        plain.token_ids
    with pytest.raises(ValueError, match="EAGLE-3 feature drafter"):
        speculant.build_drafter("eagle3", build_attached(target, [0]))
    # the drafter shipped per target and method: named only where it is installed; the bench says how to give one
    name = "qwen2.5-coder-1.5b-instruct-eagle3"
    shipped = bundled_dir(name) is not None
    assert default_draft_for("qwen2.5-coder-1.5b-instruct", "eagle3") == (name if shipped else None)
    assert _method_draft("eagle3:draft=/some/dir", "qwen2.5-coder-1.5b-instruct") == "/some/dir"
    assert _method_draft("chain:k=3", "qwen2.5-coder-1.5b-instruct") is None
    if shipped:
        assert _method_draft("eagle3", "qwen2.5-coder-1.5b-instruct") == name
    else:
        with pytest.raises(ValueError, match="eagle3:draft=DIR"):
            _method_draft("eagle3", "qwen2.5-coder-1.5b-instruct")
