"""Vision-language targets with a text-only drafter: the target reads the image (its features fill the prompt's
image tokens), the drafter sees the text only, and every method's output is the target's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import speculant
from speculant.core.batch import Batch
from speculant.core.engine import generate
from speculant.drafters.registry import build_drafter
from speculant.drafters.text_only import TextOnlyDrafter, text_ids
from speculant.models.vlm import image_token_ids, prompt_embeds, text_view
from speculant.core.types import PromptEmbeds
from speculant.tiny_models import perturbed, qwen2_vl_inputs, save_tiny_llava, tiny_model, tiny_vlm

from helpers import chisq_pvalue
from test_sampling_distribution import BATCH

VOCAB, IMAGE = 96, 95
TOKENS = {"llava": 16, "idefics3": 4, "qwen2_vl": 4, "qwen2_5_vl": 4}  # image tokens per 32x32 image
KINDS = ["llava", "idefics3", "qwen2_vl", "qwen2_5_vl"]
MROPE = ("qwen2_vl", "qwen2_5_vl")


def _inputs(kind: str, seed: int = 0) -> dict:
    if kind in MROPE:  # the vision start and end tokens around the image's tokens, M-RoPE's grid and types
        return qwen2_vl_inputs([1, 5, 6], [7, 8, 9], IMAGE, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = [1, 5, 6] + [IMAGE] * TOKENS[kind] + [7, 8, 9]
    pixels = torch.randn(1, 3, 32, 32, generator=g)
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixels if kind == "llava" else pixels[None]}


class _Spy(TextOnlyDrafter):
    """Records every id list the inner drafter was shown."""

    seen: list

    def propose(self, state):
        tree = super().propose(state)
        self.seen.append(list(self._view.ids))
        return tree


METHODS = ["ar", "chain:k=3", "lookup", "specinfer:width=2:depth=3", "tree", "rsd-s", "hybrid", "mask-probe"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_method_decodes_the_targets_own_greedy_tokens(kind):
    vlm = tiny_vlm(kind, vocab_size=VOCAB, image_token=IMAGE)
    inputs = _inputs(kind)
    ids = inputs["input_ids"][0].tolist()
    want = vlm.generate(**inputs, max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()  # stops at EOS (1)
    target, embeds = text_view(vlm), prompt_embeds(vlm, inputs)
    rows = embeds.embeds if isinstance(embeds, PromptEmbeds) else embeds
    assert rows.shape == (1, len(ids), 32) and target.model is vlm.get_decoder()
    assert isinstance(embeds, PromptEmbeds) == (kind in MROPE)
    draft = perturbed(tiny_model("llama", vocab_size=VOCAB, seed=0, init_std=0.2), 0.3, seed=4)
    for spec in METHODS:
        inner = None if spec == "ar" else build_drafter(spec, None if spec == "lookup" else draft)
        drafter = None if inner is None else _Spy(inner, image_token_ids(vlm))
        if drafter is not None:
            drafter.seen = []
        got = generate(target, ids, drafter, max_new_tokens=24, eos_token_id=[], prompt_embeds=embeds)
        assert got.token_ids[: len(want)] == want and len(want) > 8, (kind, spec)
        if drafter is not None:  # the drafter saw the text only: the prompt without its image tokens, then the output
            text = text_ids(ids, [IMAGE])
            assert drafter.seen and all(IMAGE not in s[: len(text)] for s in drafter.seen)  # (a tiny model may
            # write the image token's id itself: then it is a generated token, text like any other)
            assert all(s[: len(text)] == text and s[len(text):] == want[: len(s) - len(text)] for s in drafter.seen)


@pytest.mark.parametrize("kind", KINDS)
def test_a_feature_drafter_reads_the_text_positions_states_only(kind):
    """EAGLE-style drafters read one target state per token they see: the text positions' states, in step with the
    ids (the image positions' states are dropped with the image tokens); outputs stay the model's own."""
    from speculant.drafters.feature import FeatureDrafter, FeatureTreeDrafter
    from speculant.models.attached import build_attached

    vlm = tiny_vlm(kind, vocab_size=VOCAB, image_token=IMAGE)
    inputs = _inputs(kind)
    ids = inputs["input_ids"][0].tolist()
    target, embeds = text_view(vlm), prompt_embeds(vlm, inputs)
    want = generate(target, ids, None, max_new_tokens=20, eos_token_id=[], prompt_embeds=embeds).token_ids
    draft = build_attached(target, [0], features=True, taps=[0])

    class _Count(FeatureDrafter):  # the states handed over match the ids the drafter sees
        def propose(self, state):
            self.rows += sum(int(b.shape[0]) for b in state.target_hidden)
            assert self.rows == len(state.ids) - 1, (self.rows, len(state.ids))  # all but the root's
            return super().propose(state)

    counting = _Count(draft, k=3)
    counting.rows = 0
    for inner in (counting, FeatureTreeDrafter(draft)):
        drafter = TextOnlyDrafter(inner, [IMAGE])
        assert drafter.uses_target_hidden and list(drafter.target_taps) == [0]
        got = generate(target, ids, drafter, max_new_tokens=20, eos_token_id=[], prompt_embeds=embeds)
        assert got.token_ids == want and got.stats.draft_tokens > 0
    with pytest.raises(ValueError, match="marker"):
        TextOnlyDrafter(FeatureDrafter(draft, k=3), [IMAGE], marker=[9])


def test_the_image_changes_the_answer_and_a_marker_can_stand_for_it():
    vlm = tiny_vlm("llava", vocab_size=VOCAB, image_token=IMAGE)
    a, b = _inputs("llava", seed=0), _inputs("llava", seed=1)
    ids = a["input_ids"][0].tolist()
    target = text_view(vlm)
    out = [generate(target, ids, None, max_new_tokens=12, eos_token_id=[], prompt_embeds=prompt_embeds(vlm, x))
           .token_ids for x in (a, b)]
    assert out[0] != out[1]  # the image is read
    assert text_ids([1, IMAGE, IMAGE, 4, IMAGE, 5], [IMAGE], marker=[9, 9]) == [1, 9, 9, 4, 9, 9, 5]
    with pytest.raises(ValueError, match="marker"):
        TextOnlyDrafter(build_drafter("lookup", None), [IMAGE], marker=[IMAGE])


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_an_image_keeps_the_targets_distribution(kind):
    vocab, image, n = 6, 5, 1200
    vlm = tiny_vlm(kind, vocab_size=vocab, image_token=image, init_std=0.3)
    if kind in MROPE:  # vision start/end 3 and 4 around the image's 4 tokens
        inputs = qwen2_vl_inputs([1, 2], [1, 2], image)
    else:
        inputs = _inputs(kind)
        inputs["input_ids"] = torch.tensor([[1, 2] + [image] * TOKENS[kind] + [3, 4]])
    ids = inputs["input_ids"][0].tolist()
    target, embeds = text_view(vlm), prompt_embeds(vlm, inputs)
    rows = embeds.embeds if isinstance(embeds, PromptEmbeds) else embeds
    with torch.no_grad():  # the exact joint of two new tokens: the model's own forward with the image, then the
        first = vlm(**inputs).logits[0, -1].softmax(-1)  # new token's embedding after the prompt's (a sampled image
        joint = np.zeros((vocab, vocab))  # id is a plain token there: the model's forward would want features)
        for t in range(vocab):
            x = torch.cat([rows, target.get_input_embeddings()(torch.tensor([[t]]))], 1)
            positions = None
            if isinstance(embeds, PromptEmbeds):  # M-RoPE: the prompt's positions, then the next one (text)
                positions = torch.cat([embeds.positions, embeds.positions[:, :, -1:] + 1], -1)
            hidden = target.model(inputs_embeds=x, position_ids=positions).last_hidden_state
            joint[t] = (first[t] * target.lm_head(hidden[0, -1]).softmax(-1)).numpy()
    draft = perturbed(tiny_model("llama", vocab_size=vocab, seed=0, init_std=0.3), 0.5, seed=4)
    counts = np.zeros((vocab, vocab))
    drafted = 0
    for start in range(0, n, BATCH):  # BATCH image prompts per batch (one verification forward per step for all)
        batch = Batch(target)
        index = [batch.add(ids, TextOnlyDrafter(build_drafter("chain:k=2", draft), [image]), 2, temperature=1.0,
                           seed=1000 + i, eos_token_id=[], prompt_embeds=embeds) for i in range(start, min(n, start + BATCH))]
        while len(batch):
            batch.step()
        for i in index:
            g = batch.result(i)
            counts[tuple(g.token_ids)] += 1
            drafted += g.stats.draft_tokens
    assert drafted > 0
    assert chisq_pvalue(counts, joint) > 1e-4


def test_a_session_reads_images_from_a_saved_model(tmp_path):
    from PIL import Image

    path = save_tiny_llava(tmp_path / "vlm")
    plain = speculant.load(str(path), method="ar")
    draft = perturbed(tiny_model("llama", vocab_size=len(plain.tokenizer), seed=0, init_std=0.2), 0.3, seed=4)
    spec = speculant.load(str(path), draft=draft, method="chain:k=3")
    red, blue = Image.new("RGB", (40, 30), (200, 10, 50)), Image.new("RGB", (32, 32), (10, 10, 240))
    image_file = tmp_path / "red.png"
    red.save(image_file)
    want = plain.generate("describe this", images=[red], max_new_tokens=16)
    assert spec.generate("describe this", images=[str(image_file)], max_new_tokens=16).token_ids == want.token_ids
    assert plain.generate("describe this", images=[blue], max_new_tokens=16).token_ids != want.token_ids
    with pytest.raises(ValueError, match="does not exist"):
        plain.generate("describe this", images=[str(tmp_path / "missing.png")])
    with pytest.raises(ValueError, match="not an image"):
        plain.generate("describe this", images=[b"not a picture"])
    with pytest.raises(ValueError, match="not token ids"):
        plain.generate([3, 4, 5], images=[red])
    text_only = speculant.load(target=tiny_model("llama", vocab_size=VOCAB), method="ar")
    with pytest.raises(ValueError, match="vision-language target"):
        text_only.generate([3, 4, 5], images=[red])


@pytest.mark.parametrize("kind, reason", [("qwen3_vl", "reads more"), ("gemma3", "both ways")])
def test_decoders_the_engine_cannot_reproduce_are_refused(kind, reason):
    vlm = tiny_vlm("llava", vocab_size=VOCAB, image_token=IMAGE)
    vlm.config.model_type = kind
    with pytest.raises(ValueError, match=reason):
        text_view(vlm)


def test_an_oversized_image_is_refused_before_it_is_decoded():
    from PIL import Image

    from speculant.models.vlm import load_image

    with pytest.raises(ValueError, match="pixels"):
        load_image(Image.new("1", (5000, 4000)))  # 20M pixels (1 bit each here)


def test_the_command_line_reads_an_image(tmp_path, capsys):
    import json

    from PIL import Image

    from helpers import cli_error_line
    from speculant import cli

    path = save_tiny_llava(tmp_path / "vlm")
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 10, 50)).save(image)
    assert cli.main(["generate", "describe this", "--target", str(path), "--method", "lookup", "--image", str(image),
                     "--max-new-tokens", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = speculant.load(str(path), method="ar").generate("describe this", images=[str(image)], max_new_tokens=8)
    assert got["token_ids"] == want.token_ids
    capsys.readouterr()  # the in-process load's progress bar
    cli_error_line(capsys, ["generate", "hi", "--target", str(path), "--image", str(tmp_path / "none.png")],
                   "--image", "not a file")
    cli_error_line(capsys, ["generate", "hi", "--target", str(path), "--image", str(image), "--raw"], "--raw")


def test_the_bench_runs_image_prompts(tmp_path):
    from PIL import Image

    from speculant.bench.harness import run_bench

    path = save_tiny_llava(tmp_path / "vlm")
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 10, 50)).save(image)
    prompts = ["describe this", {"messages": [{"role": "user", "content": "what colour is it?"}]}]
    results = run_bench(prompts, methods="ar,lookup", baselines="", target=str(path), max_new_tokens=8,
                        eos_token_id=[], images=[str(image)], progress=False, warmup=0)
    assert results["methods"]["lookup"]["identical_to_ar"] == 1.0 and len(results["runs"]["lookup"]) == 2
    with pytest.raises(ValueError, match="baselines none"):
        run_bench(prompts, methods="ar", target=str(path), images=[str(image)], progress=False)


def test_taking_a_prompts_embeddings_leaves_other_threads_decoding_alone():
    """The embeddings are taken by a hook on the decoder, which is the target's own: a forward another thread runs
    through it meanwhile (a server decoding while a request's image is read) is untouched."""
    import threading

    vlm = tiny_vlm("llava", vocab_size=VOCAB, image_token=IMAGE)
    target, inputs = text_view(vlm), _inputs("llava")
    want = prompt_embeds(vlm, inputs)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        logits = target(input_ids=ids).logits
    errors: list[BaseException] = []
    done = threading.Event()

    def decode():
        try:
            while not done.is_set():
                with torch.no_grad():
                    assert torch.equal(target(input_ids=ids).logits, logits)
        except BaseException as e:  # noqa: BLE001: reported below
            errors.append(e)

    worker = threading.Thread(target=decode)
    worker.start()
    try:
        for _ in range(50):
            assert torch.equal(prompt_embeds(vlm, inputs), want)
    finally:
        done.set()
        worker.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("kind", ["none", "q4"])
def test_m_rope_prompts_decode_at_their_offset_alone_and_in_a_batch(kind):
    """Qwen2-VL: the image's 4 tokens take the positions of their 2x2 grid, so the text after the prompt sits at
    its index minus 2 (the offset); the engine prefills the prompt at the model's own M-RoPE positions and decodes
    at index + offset: greedy output is the model's own (its generate), alone and in a batch with a second image
    prompt and a text-only one, with the lean forward after the prompt (also in q4 weights, against plain decoding
    in the same weights)."""
    from speculant.core.batch import Batch
    from speculant.core.quant import quantize_model
    from speculant.core.target_forward import TargetForward

    vlm = tiny_vlm("qwen2_vl", vocab_size=VOCAB, image_token=IMAGE)
    a, b = _inputs("qwen2_vl", seed=0), _inputs("qwen2_vl", seed=1)
    ids = a["input_ids"][0].tolist()
    want = vlm.generate(**a, max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    target = text_view(vlm)
    ea, eb = prompt_embeds(vlm, a), prompt_embeds(vlm, b)
    assert ea.offset == -2 and ea.positions.shape == (3, 1, len(ids))
    if kind == "none":
        assert TargetForward(target).kind == "lean"
        assert generate(target, ids, None, max_new_tokens=16, eos_token_id=[], prompt_embeds=ea).token_ids[
            : len(want)] == want and len(want) > 8
    else:
        quantize_model(target, kind)
    alone = [generate(target, ids, None, max_new_tokens=16, eos_token_id=[], prompt_embeds=e).token_ids
             for e in (ea, eb)]
    assert alone[0] != alone[1]  # each reads its image
    draft = perturbed(tiny_model("qwen2", vocab_size=VOCAB, seed=0, init_std=0.2), 0.3, seed=4)
    if kind != "none":
        quantize_model(draft, kind)
    text = [1, 5, 6, 7]
    plain_text = generate(target, text, None, max_new_tokens=16, eos_token_id=[]).token_ids
    batch = Batch(target)
    jobs = [(ids, ea, TextOnlyDrafter(build_drafter("chain:k=3", draft), [IMAGE])), (text, None, None),
            (ids, eb, TextOnlyDrafter(build_drafter("tree", draft), [IMAGE]))]
    indices = [batch.add(p, d, 16, eos_token_id=[], prompt_embeds=e) for p, e, d in jobs]
    while len(batch):
        batch.step()
    got = [batch.result(i) for i in indices]
    assert [g.token_ids for g in got] == [alone[0], plain_text, alone[1]]
    assert got[0].stats.draft_tokens > 0 and got[2].stats.draft_tokens > 0
