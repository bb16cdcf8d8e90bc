"""ConFu (contemplate tokens, soft prompt, future vector): the target's output never changes, the future vector
the drafter reads at inference is the one training computes, every method over a ConFu drafter is exact (greedy
equality, the sampling distribution), saved and loaded, and trained a few steps from one command."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import speculant
from speculant.train.drafter.confu_training import ConFuObjective, contemplate_states
from speculant.core.drafting import Drafter
from speculant.core.types import DraftTree, Probes
from speculant.drafters.confu import ConFuDrafter, ConFuTreeDrafter
from speculant.models.attached import build_attached, load_attached, save_attached
from speculant.models.confu_contemplation import add_contemplation, is_confu_drafter
from speculant.tiny_models import tiny_model

from helpers import sizes

PROMPT = list(range(3, 20))


def _confu(target: torch.nn.Module, seed: int = 3, soft: int = 4, mixture: int = 3, scale: float = 0.2):
    """A ConFu drafter over one of the target's layers, its contemplation and future input set at random."""
    draft = build_attached(target, [1], features=True, taps=[0])
    c = add_contemplation(draft, target.config, soft=soft, mixture=mixture)
    c.init_from(target, torch.arange(5, 5 + soft) % target.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.startswith(("model.embed_tokens", "lm_head")):
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-2))
    return draft


class _FixedTree(Drafter):
    """Proposes one fixed tree each step, with contemplate probes over the given soft entries or none; records the
    tree rows' logits and the probe rows' states of each verification."""

    uses_target_hidden = True

    def __init__(self, soft=None, anchors=(0,), logits=True):
        self.soft, self.anchors, self.logits, self.rows, self.probes = soft, list(anchors), logits, [], []

    def propose(self, state):
        tree = DraftTree(tokens=[7, 9, 11, 13], parents=[-1, -1, 0, 1])
        if self.soft is not None:
            h = state.target.config.hidden_size
            embeds = torch.randn(len(self.anchors), h, generator=torch.Generator().manual_seed(len(state.ids)))
            tree.probes = Probes(anchors=self.anchors, length=1, embeds=embeds, soft_keys=self.soft[0],
                                 soft_values=self.soft[1], logits=self.logits)
        return tree

    def commit(self, state, accepted):
        state.target_hidden.clear()
        self.rows.append(state.last_logits[:5].clone())
        self.probes.append(None if state.probe_hidden is None else state.probe_hidden.clone())


@pytest.mark.parametrize("forward", ["auto", "model"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_contemplate_tokens_never_change_the_targets_output(arch, forward):
    """The verification rows' logits are the same with and without contemplate tokens and soft entries (which
    only those tokens see), and so is everything decoded after them."""
    target = tiny_model(arch, seed=2)
    draft = _confu(target)
    c = draft.contemplation
    soft = (c.soft_keys.detach() * 5, c.soft_values.detach() * 5)  # large: any leak would show
    plain = _FixedTree()
    a = speculant.generate(target, PROMPT, drafter=plain, max_new_tokens=12, eos_token_id=[], forward=forward)
    assert a.token_ids == speculant.generate(target, PROMPT, max_new_tokens=12, eos_token_id=[]).token_ids
    states = []
    for logits in (True, False):  # with the probe rows' logits, or their states only (no LM head rows)
        probed = _FixedTree(soft, anchors=[0, 1, 3], logits=logits)
        b = speculant.generate(target, PROMPT, drafter=probed, max_new_tokens=12, eos_token_id=[], forward=forward)
        assert a.token_ids == b.token_ids
        for x, y in zip(plain.rows, probed.rows):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert all(p is not None and p.shape[0] == 3 for p in probed.probes)
        states.append(probed.probes)
    for x, y in zip(*states):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contemplate", ["root", "all"])
@pytest.mark.parametrize("forward", ["auto", "model"])
def test_the_future_vector_at_inference_is_the_one_training_computes(contemplate, forward):
    """The state of the root's contemplate token in the verification forward equals
    :func:`contemplate_states` (the training path) for the same sequence and anchor."""
    target = tiny_model("qwen2", seed=2)
    draft = _confu(target)
    seen = []

    class Recording(ConFuTreeDrafter):
        def commit(self, state, accepted):
            if state.probe_hidden is not None:
                seen.append((list(self._last_ids), state.probe_hidden[0, -target.config.hidden_size:].clone()))
            super().commit(state, accepted)

        def propose(self, state):
            tree = super().propose(state)
            self._last_ids = list(state.ids)  # the root is the last one
            return tree

    drafter = Recording(draft, budget=4, topk=2, depth=2, contemplate=contemplate)
    speculant.generate(target, PROMPT, drafter=drafter, max_new_tokens=12, eos_token_id=[], forward=forward)
    assert len(seen) >= 3
    for ids, f in seen:
        ref = contemplate_states(target, draft.contemplation, torch.tensor(ids), torch.tensor([len(ids) - 1]),
                                 grad=False)[0]
        torch.testing.assert_close(f, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["confu:budget=6:topk=2:depth=3", "confu:budget=6:topk=2:depth=3:contemplate=all",
                                  "chain:k=3", "tree:budget=5:topk=2:depth=2", "tree:budget=5:lookup=4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_method_over_a_confu_drafter_equals_plain_decoding(arch, spec):
    target = tiny_model(arch, seed=2)
    draft = _confu(target)
    for prompt in (PROMPT, PROMPT[:1]):  # a one-token prompt: no target state before the first step
        ref = speculant.generate(target, prompt, max_new_tokens=30, eos_token_id=[])
        drafter = speculant.build_drafter(spec, draft)
        confu = getattr(drafter, "inner", drafter)  # lookup= wraps it
        assert isinstance(confu, (ConFuDrafter, ConFuTreeDrafter))
        gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=30, eos_token_id=[])
        assert gen.token_ids == ref.token_ids, (arch, spec, len(prompt))
        assert confu._future is not None  # the drafter read the target's contemplation


@pytest.mark.parametrize("n", sizes(3000, id="n"))
def test_confu_sampling_matches_the_target_distribution(n):
    from test_sampling_distribution import VOCAB, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = _confu(target, scale=0.5, seed=7)
    params = speculant.SamplingParams(temperature=1.0)
    counts, hist, drafted = sample_counts(target, lambda: ConFuDrafter(draft, k=2), params, 3, n, seed0=321)
    accepted = float((hist * torch.arange(len(hist)).numpy()).sum()) / max(drafted, 1)
    assert 0.1 < accepted < 0.95, accepted
    bad = {name: p for name, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_save_load_and_clear_errors(tmp_path):
    target = tiny_model("qwen2", seed=6)
    draft = _confu(target)
    path = save_attached(draft, target, tmp_path / "confu", target_name="tiny", dtype=torch.float32)
    assert json.loads((path / "attached.json").read_text())["contemplate"] == {"soft": 4, "mixture": 3}
    loaded = load_attached(path, target)
    assert is_confu_drafter(loaded)
    a = speculant.generate(target, PROMPT, drafter=ConFuTreeDrafter(draft, budget=5), max_new_tokens=16,
                           eos_token_id=[])
    b = speculant.generate(target, PROMPT, drafter=speculant.build_drafter("confu:budget=5", loaded),
                           max_new_tokens=16, eos_token_id=[])
    assert a.token_ids == b.token_ids and a.stats.accepted_hist == b.stats.accepted_hist
    eagle = build_attached(target, [1], features=True, taps=[0])
    with pytest.raises(ValueError, match="use eagle3 for it"):
        speculant.build_drafter("confu", eagle)
    with pytest.raises(ValueError, match="contemplate must be one of"):
        speculant.build_drafter("confu:contemplate=some", draft)
    with pytest.raises(ValueError, match="KV-budget"):
        speculant.generate(target, PROMPT, drafter=ConFuTreeDrafter(draft), max_new_tokens=8, eos_token_id=[],
                           kv_policy="keydiff", kv_budget=8)


def test_the_objective_replicates_each_anchors_future_over_its_window():
    """One anchor per window; row t reads the latest anchor a <= t within the window, zeros before the first;
    the contemplate tokens' states carry gradients to the soft prompt and the embeddings only."""
    target = tiny_model("qwen2", seed=2)
    draft = _confu(target)
    objective = ConFuObjective(unroll=3, regression=0.0, target=target, window=4)
    anchors = objective.anchors(13, training=False, first=3)  # the prompt's last token in column 3
    assert anchors[0] == 3 and len(anchors) == 4
    assert all(4 + 4 * i <= a < min(8 + 4 * i, 13) for i, a in enumerate(anchors[1:].tolist()))
    assert not torch.equal(objective.anchors(400, training=True), objective.anchors(400, training=True))
    batch = SimpleNamespace(input_ids=torch.tensor([PROMPT[:13]]), mask=torch.ones(1, 13, dtype=torch.long),
                            prefixes=[torch.tensor(PROMPT[13:15])], contexts=[4])  # two tokens before column 0
    with torch.no_grad():
        futures = objective.futures(draft, batch, training=False)[0]  # [13, H]
        f = contemplate_states(target, draft.contemplation, torch.tensor(PROMPT[13:15] + PROMPT[:13]), anchors + 2)
    for t in range(13):
        latest = [j for j, a in enumerate(anchors.tolist()) if a <= t and t - a < 4]
        want = f[latest[-1]] if latest else torch.zeros_like(f[0])
        torch.testing.assert_close(futures[t], want)
    assert not futures[:3].any() and futures[3].any()  # the prompt's rows read none, its last token does
    ids = torch.tensor(PROMPT)
    f = contemplate_states(target, draft.contemplation, ids, anchors)
    f.sum().backward()
    c = draft.contemplation
    assert c.soft_keys.grad is not None and c.soft_keys.grad.abs().sum() > 0 and c.embeds.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.model.layers.parameters())


def test_train_draft_confu_end_to_end_from_an_eagle3_drafter(tmp_path, capsys):
    """``train draft --kind confu`` grows an exported EAGLE-3 drafter into a ConFu drafter (--init), trains a few
    steps, exports it with its card, and the ``confu`` method over it decodes exactly."""
    from helpers import chat_model_pair

    from speculant import cli

    target_dir = chat_model_pair(tmp_path / "m", layers=3)[0]
    answered = tmp_path / "answered.jsonl"
    answered.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}],
                                            "answer": f"return x * {i} + {i} # done"}) + "\n" for i in range(8)))
    base = ["train", "draft", "--target", target_dir, "--answers", "dataset", "--prompts", str(answered),
            "--engine", "speculant", "--quantization", "q4", "--max-new-tokens", "8", "--gen-batch", "4",
            "--steps", "2", "--batch-size", "2", "--warmup", "1", "--keep", "64", "--layers", "1",
            "--validation-fraction", "0.3", "--taps", "0/1/2"]
    capsys.readouterr()
    assert cli.main(base + ["--kind", "eagle3", "--out", str(tmp_path / "e"), "--loss", "none"]) == 0, \
        capsys.readouterr().err
    eagle = Path(capsys.readouterr().out.strip())
    grow = base + ["--kind", "confu", "--out", str(tmp_path / "c"), "--init", str(eagle), "--soft", "4",
                   "--mixture", "2", "--window", "3"]
    assert cli.main(grow) == 0, capsys.readouterr().err
    export = Path(capsys.readouterr().out.strip())
    assert export.parent.name == "confu-fkl"
    assert json.loads((export / "attached.json").read_text())["contemplate"] == {"soft": 4, "mixture": 2}
    assert "ConFu drafter" in (export / "MODEL_CARD.md").read_text()
    target, tokenizer = speculant.load_pretrained(target_dir)
    draft = speculant.load_draft(str(export), target)
    prompt = tokenizer("def g(x): return", add_special_tokens=False)["input_ids"]
    ref = speculant.generate(target, prompt, max_new_tokens=20, eos_token_id=[])
    gen = speculant.generate(target, prompt, drafter=speculant.build_drafter("confu:budget=6", draft),
                             max_new_tokens=20, eos_token_id=[])
    assert gen.token_ids == ref.token_ids
    assert cli.main(base + ["--kind", "confu", "--out", str(tmp_path / "x"), "--soft", "0"]) == 2
    assert "soft" in capsys.readouterr().err
    again = base + ["--kind", "confu", "--out", str(tmp_path / "y"), "--init", str(export), "--mixture", "2"]
    assert cli.main(again + ["--soft", "8"]) == 2  # a ConFu drafter continues with its own soft prompt
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with soft 4, this run trains one with soft 8" in err, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_batch_of_confu_sequences_equals_each_decoded_alone():
    """Sequences of different lengths, each with its own ConFu drafter (root and all), beside plain decoding, in one
    verification forward per step (quantized weights: batched rows compute the same bits as solo ones)."""
    from speculant.core.quant import quantize_model

    target = tiny_model("qwen2", seed=2)
    draft = _confu(target)
    target = quantize_model(target, "q4")
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:14]]
    specs = ["confu:budget=6:topk=2:depth=3", "confu:budget=4:contemplate=all", None]
    make = lambda spec: None if spec is None else speculant.build_drafter(spec, draft)  # noqa: E731
    batch = speculant.generate_batch(target, prompts, drafter=[make(s) for s in specs], max_new_tokens=20,
                                     eos_token_id=[])
    for prompt, spec, got in zip(prompts, specs, batch):
        alone = speculant.generate(target, prompt, drafter=make(spec), max_new_tokens=20, eos_token_id=[])
        assert got.token_ids == alone.token_ids, spec
        assert got.stats.accepted_hist == alone.stats.accepted_hist, spec  # the same drafts: the same contemplation
    # speculation that adapts to load may draft nothing in some steps: still each prompt's own output
    auto = speculant.generate_batch(target, prompts, drafter=[make(s) for s in specs], max_new_tokens=20,
                                    eos_token_id=[], speculation="auto")
    assert [g.token_ids for g in auto] == [g.token_ids for g in batch]


def test_a_step_without_a_draft_keeps_the_latest_future_for_its_row():
    """commit() queues one future vector per row the step added to the target's cache: the contemplated ones, or,
    after a step that drafted (and contemplated) nothing, the latest vector again; the prompt's rows read zeros."""
    target = tiny_model("qwen2", seed=2)
    drafter = ConFuTreeDrafter(_confu(target), budget=4)
    h = target.config.hidden_size
    state = speculant.core.drafting.DecodeState(target=target, ids=list(PROMPT), params=speculant.SamplingParams(),
                                                generator=torch.Generator(), max_length=64, remaining=30)
    drafter.begin(state)
    f = torch.randn(3, h)
    drafter._tree = None
    state.probe_hidden, state.last_accepted = f, [1]  # contemplated: the root and 2 nodes' [con]; node 1 accepted
    drafter.commit(state, [5])
    state.probe_hidden, state.last_accepted = None, []  # a step that drafted nothing
    drafter.commit(state, [])
    assert state.probe_hidden is None
    rows = drafter._futures_of(5)  # two prompt rows, then the root and the accepted node, then the plain step's row
    assert not rows[:2].any()
    for i in (2, 3, 4):
        torch.testing.assert_close(rows[i], f[0])  # contemplate=root: the root's vector serves every later row
