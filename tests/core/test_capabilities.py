"""Declared capabilities instead of special cases: the engine reads a drafter's declarations and a KV
policy's hooks only, takes objects only, and budget-matched sizing reads each method's declared keys."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import speculant
import speculant.core.engine
from speculant.bench.matched_specs import at_budget, at_depth, shape
from speculant.bench.cost import drafter_params_per_forward, params_per_forward
from speculant.core.drafting import Drafter, capability
from speculant.core.types import DraftTree
from speculant.drafters import registry
from speculant.drafters.lookup import PromptLookupDrafter, lookup_continuation
from speculant.drafters.registry import Key, Sizing, build_drafter
from speculant.drafters.model_lookup import ModelWithLookup
from speculant.kv import Eviction, KeyDiff, Protect, parse_policy
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 96
REPEATING = [5, 6, 7, 8, 9] * 6
PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    return target, perturbed(target, scale=0.05, seed=3)


class ThirdParty:
    """A drafter from outside the package: only the protocol's three methods, no base class, no capabilities."""

    def __init__(self) -> None:
        self.calls = {"begin": 0, "propose": 0, "commit": 0}

    def begin(self, state) -> None:
        self.calls["begin"] += 1

    def propose(self, state) -> DraftTree:
        self.calls["propose"] += 1
        return DraftTree.chain(lookup_continuation(state.ids, 3, min(4, state.remaining - 1)))

    def commit(self, state, accepted) -> None:
        self.calls["commit"] += 1


def test_third_party_drafter_without_the_base_runs(pair):
    target, _ = pair
    drafter = ThirdParty()
    assert isinstance(drafter, Drafter)  # structural: the three protocol methods
    assert not isinstance(object(), Drafter)
    assert [capability(drafter, c) for c in ("uses_target_hidden", "target_taps", "model", "params_per_forward")] \
        == [False, (), None, None]
    plain = speculant.generate(target, REPEATING, max_new_tokens=20, eos_token_id=[])
    gen = speculant.core.engine.generate(target, REPEATING, drafter=drafter, max_new_tokens=20, eos_token_id=[])
    assert gen.token_ids == plain.token_ids
    assert drafter.calls["begin"] == 1 and drafter.calls["propose"] >= 1 and drafter.calls["commit"] >= 1
    assert gen.stats.depth_reached[0] > 0 and gen.stats.draft_tokens > 0  # its drafts were verified


def test_every_in_tree_drafter_subclasses_the_base_and_declares_its_model(pair):
    _, draft = pair
    for spec in ("chain:k=2", "specinfer:width=2:depth=2", "rsd-c:branching=2/1", "tree", "lookup", "mask-probe",
                 "hybrid", "chain:k=2:lookup=4"):
        drafter = build_drafter(spec, draft)
        assert type(drafter).__mro__.count(Drafter) == 1, spec  # a real subclass, not only structurally
        expected = None if spec in ("lookup", "mask-probe", "hybrid") else draft
        assert capability(drafter, "model") is expected, spec
        assert capability(drafter, "uses_target_hidden") is False, spec
    wrapped = ModelWithLookup(build_drafter("chain:k=2", draft))
    assert capability(wrapped, "params_per_forward") == capability(wrapped.inner, "params_per_forward") > 0


def test_undeclared_cost_counts_the_modules_a_drafter_holds(pair):
    _, draft = pair

    class HoldsAModel(ThirdParty):
        def __init__(self, model) -> None:
            super().__init__()
            self.net = model

    assert drafter_params_per_forward(HoldsAModel(draft)) == params_per_forward(draft)
    assert drafter_params_per_forward(ThirdParty()) == 0
    assert drafter_params_per_forward(PromptLookupDrafter()) == 0  # declared


def test_capability_rejects_an_undeclared_name():
    with pytest.raises(ValueError, match="unknown drafter capability 'speed'"):
        capability(ThirdParty(), "speed")


class HiddenReader(PromptLookupDrafter):
    """Prompt lookup that declares it reads the target's hidden states, and records what it is given."""

    uses_target_hidden = True

    def __init__(self) -> None:
        super().__init__(ngram=3, k=4)
        self.seen: list[torch.Tensor] = []

    def propose(self, state):
        self.seen += state.target_hidden  # [N, H] blocks
        state.target_hidden.clear()
        return super().propose(state)


@pytest.mark.parametrize("declared", [True, False])
def test_a_drafter_declaring_uses_target_hidden_gets_the_hidden_states(pair, declared):
    target, _ = pair
    drafter = HiddenReader()
    if not declared:
        drafter.uses_target_hidden = False
    gen = speculant.generate(target, REPEATING, drafter=drafter, max_new_tokens=20, eos_token_id=[])
    if not declared:
        assert drafter.seen == []
        return
    seen = torch.cat(drafter.seen)  # one state per committed token but the root, in order
    with torch.no_grad():
        ref = target.model(input_ids=torch.tensor([REPEATING + gen.token_ids])).last_hidden_state[0]  # [T, H]
    assert seen.shape[0] >= len(REPEATING) - 1 + sum(gen.stats.depth_accepted)
    torch.testing.assert_close(seen, ref[: seen.shape[0]], rtol=1e-4, atol=1e-4)


class TwoPassKeyDiff(KeyDiff):
    """KeyDiff whose prefill hooks ask for two passes and record every hook call."""

    def __init__(self) -> None:
        super().__init__()
        self.observer_calls: list[bool] = []  # ``last`` of each prefill_observers call
        self.bound: list = []

    def bind_draft(self, model) -> None:
        self.bound.append(model)

    def prefill_passes(self) -> int:
        return 2

    def prefill_observers(self, model, cache, prefix, following, last, queries_out=None):
        self.observer_calls.append(last)
        return None


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_policys_prefill_hooks_are_called(pair, wrapped):
    """Two passes over a prompt of 5 blocks: the first asks for observers at every block that overflows the
    budget, the second (scoring the earlier blocks with the first pass's end-of-prompt queries) at its last block
    only; a wrapper forwards the hooks to ``inner``; the policy is handed the drafter's declared model."""
    target, draft = pair
    inner = TwoPassKeyDiff()
    policy = Protect(inner, sinks=1, recent=2) if wrapped else inner
    drafter = build_drafter("chain:k=2", draft)
    speculant.core.engine.generate(target, PROMPT, drafter=drafter, max_new_tokens=4, eos_token_id=[],
                                   kv_policy=Eviction(policy), kv_budget=12, kv_block=8)
    assert inner.bound == [draft]
    # 39 prefilled tokens in blocks of 8: the first block (8 <= 12) is not evicted, the other 4 are
    assert inner.observer_calls == [False, False, False, True] + [True]


def test_one_pass_by_default_and_snapkv_declares_its_passes():
    assert KeyDiff().prefill_passes() == 1
    assert parse_policy("snapkv:passes=2").prefill_passes() == 2
    assert parse_policy("caote:protect:snapkv:passes=2").prefill_passes() == 2


def test_the_engine_takes_objects_and_the_public_generate_resolves_names(pair):
    target, draft = pair
    engine = speculant.core.engine.generate
    with pytest.raises(ValueError, match=r"^drafter: speculant.core.engine.generate takes a Drafter or None, got "
                                         r"'lookup'; use speculant.generate"):
        engine(target, REPEATING, drafter="lookup", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"drafter: .* got LlamaForCausalLM; use speculant.generate"):
        engine(target, REPEATING, drafter=draft, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^kv_policy: speculant.core.engine.generate takes an EvictionPolicy or None, "
                                         r"got 'keydiff'; use speculant.generate"):
        engine(target, PROMPT, kv_policy="keydiff", kv_budget=12, max_new_tokens=4)
    by_name = speculant.generate(target, PROMPT, drafter="lookup", kv_policy="keydiff", kv_budget=12, kv_block=8,
                                 max_new_tokens=12, eos_token_id=[])
    by_object = engine(target, PROMPT, drafter=PromptLookupDrafter(), kv_policy=Eviction(KeyDiff()), kv_budget=12,
                       kv_block=8, max_new_tokens=12, eos_token_id=[])
    assert by_name.token_ids == by_object.token_ids
    by_model = speculant.generate(target, PROMPT, drafter=draft, max_new_tokens=8, eos_token_id=[])
    assert by_model.stats.draft_calls > 0  # a draft model gets the default chain


def test_core_imports_nothing_from_the_layers_above():
    core = Path(speculant.core.engine.__file__).parent
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..x import
                assert node.module is not None and node.module.split(".")[0] not in ("drafters", "kv"), path.name


def _toy(draft_model=None, **options):
    return None


def test_budget_sizing_reads_a_newly_registered_methods_declared_keys(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # registrations end with the test
    registry.register("toy-iid", _toy, needs_draft=False,
                      keys={"w": Key(int, "width", 2), "levels": Key(int, "depth", 3)},
                      sizing=Sizing(depth="levels", width="w"))
    registry.register("toy-own", _toy, needs_draft=False,
                      keys={"n": Key(int, "tree tokens", 6), "levels": Key(int, "depth", 2)},
                      sizing=Sizing(depth="levels", budget="n"))
    assert shape("toy-iid") == (6, 3) and shape("toy-iid:w=3:levels=4") == (12, 4)
    assert at_budget("toy-iid", 8) == "toy-iid:levels=4"
    assert at_budget("toy-iid:w=3", 8) is None  # 3 does not divide 8
    assert at_depth("toy-iid:w=3", 5) == "toy-iid:w=3:levels=5"
    assert at_budget("toy-own", 10) == "toy-own:n=10" and at_depth("toy-own", 4) == "toy-own:levels=4"
    with pytest.raises(ValueError, match="already sets n, the size that --budgets sets"):
        at_budget("toy-own:n=4", 8)
    with pytest.raises(ValueError, match="sizing names depth, which are not among its keys"):
        registry.register("toy-bad", _toy, needs_draft=False, keys={"k": Key(int, "k")}, sizing=Sizing(depth="depth"))
    registry.register("toy-none", _toy, needs_draft=False)
    assert shape("toy-none") is None
    with pytest.raises(ValueError, match="toy-none has no tree size to match"):
        at_budget("toy-none", 8)
