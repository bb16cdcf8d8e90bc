"""Attached drafters share the target's embedding and LM head; the draft-training pipeline on a tiny target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from speculant import cli
from speculant.models.attached import build_attached, load_attached, save_attached
from speculant.models.chat import chat_ids, stop_ids
from speculant.drafters.registry import build_drafter
from speculant.core.engine import generate
from speculant.models.loading import check_model_dir, load_draft, load_model_dir
from speculant.tiny_models import tiny_model

from helpers import chat_model_pair

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return chat_model_pair(tmp_path_factory.mktemp("attached"), layers=3)[0]


def test_shares_embedding_and_saves_own_weights_only(target_dir, tmp_path):
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = build_attached(target, [0, 2])
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    assert draft.get_output_embeddings().weight is target.get_output_embeddings().weight
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    out = save_attached(draft, target, tmp_path / "d", target_name="tiny", dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert check_model_dir(out) == out  # no tokenizer needed
    loaded = load_draft(out, target)
    assert loaded.get_input_embeddings().weight is target.get_input_embeddings().weight  # no copy in memory
    ids = torch.tensor([[3, 7, 11, 5]])
    assert torch.equal(loaded(ids).logits, draft(ids).logits)


def test_int8_storage_round_trips(target_dir, tmp_path):
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = build_attached(target, [0, 1])
    out = save_attached(draft, target, tmp_path / "q", target_name="tiny", dtype=torch.int8)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert w.dtype == torch.int8
    loaded = load_draft(out, target)
    ref = draft.model.layers[0].mlp.up_proj.weight
    got = loaded.model.layers[0].mlp.up_proj.weight
    step = ref.abs().amax(dim=1, keepdim=True) / 127  # one int8 step per row
    assert got.dtype == target.dtype and bool(((got - ref).abs() <= step / 2 + 1e-7).all())


def test_q4_storage_round_trips_to_the_q4_matrix(target_dir, tmp_path):
    """4-bit codes with a float16 scale and minimum per 32 inputs: the loaded weight is exactly the q4 matrix's
    values (what the q4 kernel would multiply by), the file well under the int8 one."""
    from speculant.core.quant import QuantMatrix

    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = build_attached(target, [0, 1])
    q4 = save_attached(draft, target, tmp_path / "q4", target_name="tiny", storage="q4")
    int8 = save_attached(draft, target, tmp_path / "int8", target_name="tiny", storage="int8")
    with safe_open(str(q4 / "model.safetensors"), "pt") as f:
        codes = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.up_proj.weight.q4_scale")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    ref = draft.model.layers[0].mlp.up_proj.weight
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (ref.shape[0], ref.shape[1] // 2)
    assert scale.dtype == torch.float16 and tuple(scale.shape) == (ref.shape[0], ref.shape[1] // 32)
    assert norm.dtype == torch.bfloat16
    assert (q4 / "model.safetensors").stat().st_size < 0.75 * (int8 / "model.safetensors").stat().st_size
    loaded = load_draft(q4, target)
    for name, p in draft.named_parameters():
        if p.dim() == 2 and not name.startswith(("model.embed_tokens", "lm_head")):
            got = dict(loaded.named_parameters())[name]
            assert torch.equal(got, QuantMatrix.quantize(p.detach(), "q4").dequantize()), name
    assert json.loads((q4 / "attached.json").read_text())["storage"] == "q4"
    with pytest.raises(ValueError, match="storage must be one of"):
        save_attached(draft, target, tmp_path / "x", target_name="tiny", storage="int4")
    with pytest.raises(ValueError, match="needs a float dtype"):
        save_attached(draft, target, tmp_path / "x", target_name="tiny", storage="float", dtype=torch.int8)


def test_q4_storage_keeps_int8_rows_for_other_input_sizes(target_dir, tmp_path):
    """A matrix whose input size is not a multiple of 32 (one added by hand) is stored as int8 rows beside the q4
    ones; a file missing a q4 companion is a one-line error."""
    from safetensors.torch import load_file, save_file

    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = build_attached(target, [0])
    odd = torch.nn.Parameter(torch.randn(draft.config.hidden_size, 40))  # 40 inputs: not a multiple of 32
    draft.register_parameter("odd_weight", odd)
    out = save_attached(draft, target, tmp_path / "mixed", target_name="tiny", storage="q4")
    state = load_file(str(out / "model.safetensors"))
    assert state["odd_weight"].dtype == torch.int8 and "odd_weight.int8_scale" in state
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
    del state["model.layers.0.mlp.down_proj.weight.q4_min"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks its 4-bit codes or minimums") as exc:
        load_draft(out, target)
    assert "\n" not in str(exc.value)


def test_refuses_another_target(target_dir, tmp_path):
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    out = save_attached(build_attached(target, [0]), target, tmp_path / "d", target_name="tiny")
    other = tiny_model("llama", seed=5, vocab_size=target.config.vocab_size, hidden=32, layers=2)
    with pytest.raises(ValueError, match="different model|hidden size"):
        load_attached(out, other)
    with pytest.raises(ValueError, match="layers"):
        build_attached(target, [7])


@pytest.mark.parametrize("spec", ["chain:k=3", "tree:budget=6", "specinfer:width=2:depth=2"])
def test_attached_drafter_is_exact(target_dir, spec):
    target, tok = load_model_dir(target_dir, dtype=torch.float32)
    ids = chat_ids(tok, "def f(x):")
    expected = generate(target, ids, max_new_tokens=24).token_ids
    drafter = build_drafter(spec, build_attached(target, [0]))
    assert generate(target, ids, drafter=drafter, max_new_tokens=24).token_ids == expected


def test_train_draft_end_to_end(target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(8)) + json.dumps({"prompt": "class A:"}) + "\n")
    out = tmp_path / "run"
    argv = ["train", "draft", "--target", target_dir, "--out", str(out), "--prompts", str(prompts),
            "--max-new-tokens", "6", "--gen-batch", "4", "--gen-dtype", "float32", "--steps", "4", "--batch-size",
            "3", "--warmup", "1", "--keep", "64", "--layers", "1", "--validation-fraction", "0.2", "--loss", "tvd++"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    export = out / "tvdpp" / "draft"
    assert capsys.readouterr().out.strip() == str(export)
    meta = json.loads((export / "attached.json").read_text())
    assert meta["loss"] == "tvd++" and meta["layers_from_target"] == [1] and meta["steps"] == 4
    card = (export / "MODEL_CARD.md").read_text()
    assert "\n| 4 | " in card and "| `tvd++` | 4 |" in card  # the last validation row, the ablation row
    trim = json.loads((export / "vocab_trim.json").read_text())
    assert trim["default_size_sampling"] == trim["calibration"]["distinct"] <= 64  # all tokens seen, at most --keep
    history = json.loads((out / "tvdpp" / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 4]
    # resuming a finished run does no work and prints the same drafter
    assert cli.main(argv) == 0 and capsys.readouterr().out.strip() == str(export)
    _exact_through_cli(target_dir, export, capsys)


def test_a_run_grows_with_more_prompts(target_dir, tmp_path):
    """Prompts appended to a finished run are answered in new shards numbered after the old ones (which stay as
    they are); an interrupted growth resumes with the same shards; every prompt row is answered once."""
    from speculant.train.drafter.answers import AnswerShard, load_shards, shard_paths
    from speculant.train.drafter.answers_stage import run_answers
    from speculant.train.drafter.checks import DraftRunConfig

    rows = [json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n" for i in range(10)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(rows[:6]))
    cfg = DraftRunConfig(target=target_dir, out=str(tmp_path / "run"), prompts=str(prompts), max_new_tokens=4,
                         gen_batch=4, gen_dtype="float32")
    folder = run_answers(cfg, progress=False)
    first = {p.name: p.read_bytes() for p in shard_paths(folder)}
    assert sorted(first) == ["shard-00000.npz", "shard-00001.npz"]
    prompts.write_text("".join(rows))
    run_answers(cfg, progress=False)
    assert [p.name for p in shard_paths(folder)] == [f"shard-{n:05d}.npz" for n in range(3)]
    assert all(p.read_bytes() == first[p.name] for p in shard_paths(folder)[:2])
    assert sorted(i for s in load_shards(folder) for i in s.prompt_index) == list(range(10))
    parts = json.loads((folder / "PARTS.json").read_text())
    assert [p["rows"] for p in parts] == [[0, 6], [6, 10]] and parts[1]["first_shard"] == 2
    assert json.loads((folder / "DONE").read_text())["rows"] == 10
    grown = AnswerShard.load(folder / "shard-00002.npz")
    (folder / "shard-00002.npz").unlink()  # interrupted while answering the new rows
    parts[1]["seconds"] = None
    (folder / "PARTS.json").write_text(json.dumps(parts))
    (folder / "DONE").unlink()
    run_answers(cfg, progress=False)
    again = AnswerShard.load(folder / "shard-00002.npz")
    assert all(np.array_equal(getattr(again, k), getattr(grown, k)) for k in AnswerShard.__dataclass_fields__)
    saved = (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(r)["messages"] for r in saved] == [json.loads(r)["messages"] for r in rows]


def test_an_interrupted_run_keeps_its_answering_time(target_dir, tmp_path):
    """A batched-engine run killed while answering is finished by the next run: the run's DONE counts the killed
    run's seconds too (from RUNS.json, which records every answering run shard by shard), not only the last run's."""
    from speculant.train.drafter.answers_stage import run_answers
    from speculant.train.drafter.checks import DraftRunConfig

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(8)))
    cfg = DraftRunConfig(target=target_dir, out=str(tmp_path / "run"), prompts=str(prompts), max_new_tokens=4,
                         gen_batch=4, engine="speculant", quantization="q4")
    folder = run_answers(cfg, progress=False)
    runs = json.loads((folder / "RUNS.json").read_text())
    parts = json.loads((folder / "PARTS.json").read_text())
    (folder / "shard-00001.npz").unlink()  # killed while answering: its part never closed, its run was recorded
    parts[-1]["seconds"] = None
    (folder / "PARTS.json").write_text(json.dumps(parts))
    (folder / "DONE").unlink()
    runs[0]["seconds"] = 1000.0
    (folder / "RUNS.json").write_text(json.dumps(runs))
    run_answers(cfg, progress=False)
    done = json.loads((folder / "DONE").read_text())
    assert done["seconds"] >= 1000.0 and len(json.loads((folder / "RUNS.json").read_text())) == 2


def test_a_run_grows_with_self_written_prompts(target_dir, tmp_path, capsys):
    """--self-prompts N: the target writes N user requests after its template's user-turn prefix (Magpie); they
    follow the configured prompts in the run's prompts file and are answered like them; the requests are a
    function of the seed, and an interrupted batch is written again the same way."""
    from speculant.models.chat import user_turn_prefix_ids
    from speculant.train.drafter.answers import load_shards
    from speculant.train.drafter.self_prompts import generate_self_prompts, read_self_prompts

    _, tok = load_model_dir(target_dir, dtype=torch.float32)
    prefix = user_turn_prefix_ids(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert tok.decode(prefix) == rendered[:rendered.index("hello")] and prefix == chat_ids(tok, "hello")[:len(prefix)]
    rows = [json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n" for i in range(4)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(rows))
    run = tmp_path / "run"
    argv = ["train", "draft", "--target", target_dir, "--out", str(run), "--prompts", str(prompts), "--self-prompts",
            "6", "--self-prompt-tokens", "8", "--max-new-tokens", "4", "--gen-batch", "4", "--gen-dtype", "float32",
            "--steps", "2", "--batch-size", "3", "--warmup", "1", "--keep", "64", "--layers", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    folder = run / "answers"
    card = (run / "fkl" / "draft" / "MODEL_CARD.md").read_text()
    assert "4 built-in" not in card and "and 6 requests the target wrote itself" in card
    assert "min writing the self prompts" in card
    written = read_self_prompts(run / "self_prompts.jsonl")
    texts = [r["messages"][0]["content"] for r in written]
    assert len(written) >= 6 and len(set(texts)) == len(texts) and all(len(t) >= 12 for t in texts)
    assert all(r["kind"] == "self" and r["messages"][0]["role"] == "user" for r in written)
    saved = [json.loads(r) for r in (run / "prompts.jsonl").read_text().splitlines()]
    assert [r["messages"] for r in saved] == [json.loads(r)["messages"] for r in rows] + [r["messages"] for r in
                                                                                             written[:6]]
    assert sorted(i for s in load_shards(folder) for i in s.prompt_index) == list(range(10))
    assert json.loads((run / "self_prompts.json").read_text())["rows"] == 6
    # the same seed writes the same requests; a batch cut off mid-line is dropped and written again
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    path = tmp_path / "again.jsonl"
    generate_self_prompts(target, tok, 6, path, stop_ids=stop_ids(tok, target), batch_size=4, max_new_tokens=8,
                          progress=False)
    whole = path.read_text()
    assert [json.loads(line) for line in whole.splitlines()] == written
    path.write_text(whole[:whole.rindex("\n", 0, len(whole) - 1) + 8])  # the last row cut off
    generate_self_prompts(target, tok, 6, path, stop_ids=stop_ids(tok, target), batch_size=4, max_new_tokens=8,
                          progress=False)
    assert path.read_text() == whole
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        generate_self_prompts(target, tok, 2, tmp_path / "none.jsonl", stop_ids=[0], progress=False)


def _exact_through_cli(target_dir, export, capsys) -> None:
    """The trained drafter in ``export`` gives plain greedy decoding's tokens through ``speculant generate``."""
    target, tok = load_model_dir(target_dir, dtype=torch.float32)
    code = cli.main(["generate", "def g(y):", "--target", target_dir, "--draft", str(export), "--method",
                     "chain:k=2", "--max-new-tokens", "10", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0
    assert got["token_ids"] == generate(target, chat_ids(tok, "def g(y):"), max_new_tokens=10,
                                        eos_token_id=stop_ids(tok, target)).token_ids


def test_train_feature_draft_end_to_end(target_dir, tmp_path, capsys):
    """--kind feature: the target's states are extracted, an EAGLE drafter (tapping layer 0) is trained, exported,
    described and drafts exactly through the CLI."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(8)))
    out = tmp_path / "run"
    argv = ["train", "draft", "--target", target_dir, "--out", str(out), "--prompts", str(prompts), "--kind",
            "feature", "--taps", "0", "--unroll", "2", "--max-new-tokens", "6", "--gen-batch", "4", "--gen-dtype",
            "float32", "--steps", "3", "--batch-size", "3", "--warmup", "1", "--keep", "64", "--layers", "2",
            "--validation-fraction", "0.25"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    export = out / "feature-fkl" / "draft"
    assert capsys.readouterr().out.strip() == str(export)
    assert (out / "features-taps-0" / "DONE").exists()
    meta = json.loads((export / "attached.json").read_text())
    assert meta["features"] is True and meta["kind"] == "feature"
    card = (export / "MODEL_CARD.md").read_text()
    assert "feature drafter" in card and "2nd token" in card
    history = json.loads((out / "feature-fkl" / "history.json").read_text())
    assert "greedy_agreement_d2" in history[-1]
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = load_draft(export, target)
    assert draft.feature_fc.in_features == 3 * target.config.hidden_size  # [emb ; layer 0 ; final]
    _exact_through_cli(target_dir, export, capsys)


def test_train_eagle3_draft_end_to_end(target_dir, tmp_path, capsys):
    """--kind eagle3: taps default to a low, a middle and a high layer, the training-time test runs 3 depths,
    no regression; stored in 4 bits (--store q4), the drafter drafts exactly with a dynamic tree through the CLI."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(8)))
    out = tmp_path / "run"
    argv = ["train", "draft", "--target", target_dir, "--out", str(out), "--prompts", str(prompts), "--kind",
            "eagle3", "--engine", "speculant", "--quantization", "q4", "--max-new-tokens", "6", "--gen-batch", "4",
            "--group-by-length", "--store", "q4",
            "--steps", "3", "--batch-size", "3", "--warmup", "1", "--keep", "64", "--layers", "2",
            "--validation-fraction", "0.25"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    export = out / "eagle3-fkl" / "draft"
    assert "in 4 bits with a float16 scale and minimum per 32 inputs (q4)" in (export / "MODEL_CARD.md").read_text()
    with safe_open(str(export / "model.safetensors"), "pt") as f:  # stored in 4 bits (--store q4)
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.uint8
    assert capsys.readouterr().out.strip() == str(export)
    assert (out / "features-taps-0-1-2" / "DONE").exists()  # recorded while answering
    config = json.loads((out / "eagle3-fkl" / "run_config.json").read_text())
    assert config["taps"] == [0, 1, 2] and config["unroll"] == 3 and config["regression"] == 0.0
    history = json.loads((out / "eagle3-fkl" / "history.json").read_text())
    assert "greedy_agreement_d3" in history[-1]
    assert "EAGLE-3 drafter" in (export / "MODEL_CARD.md").read_text()
    target, _ = load_model_dir(target_dir, dtype=torch.float32)
    draft = load_draft(export, target)
    assert draft.feature_fc.in_features == 5 * target.config.hidden_size  # [emb ; 3 taps ; final]
    prompt = chat_ids(load_model_dir(target_dir)[1], [{"role": "user", "content": "def g(y):"}])
    plain = generate(target, prompt, max_new_tokens=12)
    for spec in ("tree:budget=6:topk=2:depth=3", "chain:k=3"):
        assert generate(target, prompt, drafter=build_drafter(spec, draft), max_new_tokens=12).token_ids == \
            plain.token_ids
    # through a session whose target kind's draft default differs (file -> q4): an attached drafter shares the
    # target's head, so it takes the target's kind
    import speculant

    session = speculant.load(target_dir, draft=str(export), method="eagle3:budget=4:topk=2:depth=2",
                             quantization="file")
    ref = speculant.load(target_dir, method="ar", quantization="file")
    assert session.generate(prompt, max_new_tokens=10).token_ids == ref.generate(prompt, max_new_tokens=10).token_ids


@pytest.fixture(scope="module")
def sibling_dir(target_dir, tmp_path_factory):
    """A smaller model with the target's tokenizer: a draft model of its own for ``--kind model``."""
    from speculant.models.loading import load_tokenizer

    tok = load_tokenizer(target_dir)
    path = tmp_path_factory.mktemp("sibling") / "sibling"
    tiny_model("llama", seed=3, vocab_size=len(tok), hidden=16, layers=2, heads=2, kv_heads=1).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_train_model_draft_end_to_end(target_dir, sibling_dir, tmp_path, capsys):
    """--kind model: a draft model of its own (smaller, the target's tokenizer) is fine-tuned whole but
    for its embedding and head, exported with its tokenizer, described, and drafts exactly through the CLI; its
    untrained export (--loss none) is the same model."""
    from speculant.models.loading import load_model_dir

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(8)))
    out = tmp_path / "run"
    argv = ["train", "draft", "--target", target_dir, "--out", str(out), "--prompts", str(prompts), "--kind", "model",
            "--draft", sibling_dir, "--max-new-tokens", "6", "--gen-batch", "4", "--gen-dtype", "float32", "--steps",
            "3", "--batch-size", "3", "--warmup", "1", "--keep", "64", "--validation-fraction", "0.25", "--lr", "1e-2"]
    assert cli.main(argv + ["--loss", "tvd++"]) == 0, capsys.readouterr().err
    export = out / "model-tvdpp" / "draft"
    assert capsys.readouterr().out.strip() == str(export)
    meta = json.loads((export / "draft_model.json").read_text())
    assert meta["kind"] == "model" and meta["draft"] == sibling_dir and meta["loss"] == "tvd++" and meta["steps"] == 3
    assert not (export / "attached.json").exists()
    card = (export / "MODEL_CARD.md").read_text()
    assert f"the draft model `{sibling_dir}`" in card and "| model | `tvd++` | 3 |" in card
    before, _ = load_model_dir(sibling_dir, dtype=torch.float32)
    after, _ = load_model_dir(export, dtype=torch.float32)
    assert after.config.hidden_size == 16 and after.config.num_hidden_layers == 2
    frozen = before.get_input_embeddings().weight.to(torch.bfloat16).float()
    assert torch.equal(after.get_input_embeddings().weight, frozen)  # embedding (tied head) frozen
    for layer in (0, 1):
        moved = after.model.layers[layer].mlp.up_proj.weight - before.model.layers[layer].mlp.up_proj.weight
        assert moved.abs().max() > 1e-2  # every layer trained (beyond bfloat16 rounding)
    _exact_through_cli(target_dir, export, capsys)
    # --train-last 1: the first layer stays as it was
    assert cli.main(argv + ["--loss", "fkl", "--train-last", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    last = load_model_dir(out / "model-fkl" / "draft", dtype=torch.float32)[0].model.layers
    assert torch.equal(last[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16).float())
    assert (last[1].mlp.up_proj.weight - before.model.layers[1].mlp.up_proj.weight).abs().max() > 1e-2
    card = (out / "model-fkl" / "draft" / "MODEL_CARD.md").read_text()
    assert "its last 1 decoder layers and final norm trained" in card
    kept = torch.load(out / "model-fkl" / "checkpoint.pt", weights_only=False)["own"]
    assert kept and all(k.startswith(("model.layers.1.", "model.norm.")) for k in kept)  # the trained ones only
    assert json.loads((out / "model-fkl" / "run_config.json").read_text())["lr"] == 1e-2  # given
    assert json.loads((out / "model-tvdpp" / "run_config.json").read_text())["lr"] == 1e-2
    import shutil

    shutil.rmtree(out / "model-fkl" / "draft")  # a checkpoint without its export: resuming must train the same
    capsys.readouterr()
    assert cli.main(argv + ["--loss", "fkl", "--train-last", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--train-last 1" in err
    assert cli.main(argv + ["--loss", "none"]) == 0, capsys.readouterr().err
    untrained, _ = load_model_dir(out / "model-none" / "draft", dtype=torch.float32)
    for a, b in zip(untrained.parameters(), before.parameters()):
        assert torch.equal(a, b.to(torch.bfloat16).float())
    assert "| model | `none` | 0 |" in (out / "model-none" / "draft" / "MODEL_CARD.md").read_text()


def test_train_model_draft_bad_input(target_dir, sibling_dir, tmp_path, capsys):
    """--kind model without --draft, --draft without --kind model, --init, --taps or another kind's settings
    with it, and a draft model of another vocabulary: one line each, before any work. The learning rate defaults
    to the kind's."""
    from speculant.tiny_models import save_model_pair, tiny_tokenizer
    from speculant.train.drafter.checks import MODEL_LR, DraftRunConfig, resolve_kind

    assert resolve_kind(DraftRunConfig(target_dir, "o", kind="model", draft=sibling_dir)).lr == MODEL_LR
    assert resolve_kind(DraftRunConfig(target_dir, "o")).lr == 2e-3

    other = save_model_pair(tmp_path / "other", tiny_tokenizer(vocab_size=200), hidden=16, layers=1)[1]
    capsys.readouterr()  # the save's progress bars
    base = ["train", "draft", "--target", target_dir, "--out", str(tmp_path / "r")]
    for extra, needle in ((["--kind", "model"], "--draft"), (["--draft", sibling_dir], "--kind model"),
                          (["--kind", "model", "--draft", sibling_dir, "--init", sibling_dir], "--init"),
                          (["--kind", "model", "--draft", sibling_dir, "--taps", "0"], "--taps"),
                          (["--train-last", "1"], "--train-last"),
                          (["--kind", "model", "--draft", sibling_dir, "--train-last", "0"], "--train-last"),
                          (["--kind", "model", "--draft", sibling_dir, "--train-last", "3"], "has 2 layers"),
                          (["--kind", "model", "--draft", sibling_dir, "--store", "q4"], "--store"),
                          (["--kind", "model", "--draft", sibling_dir, "--layers", "1"], "--layers"),
                          (["--kind", "model", "--draft", str(other)], "tokenizer is not the target's"),
                          (["--kind", "model", "--draft", str(tmp_path / "nowhere")], "--draft")):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (extra, err)
    assert not (tmp_path / "r").exists()


def test_train_draft_bad_input(target_dir, tmp_path, capsys):
    base = ["train", "draft", "--target", target_dir, "--out", str(tmp_path / "r")]
    for extra, needle in ((["--loss", "rkl"], "--loss"), (["--prompts", str(tmp_path / "none.jsonl")], "--prompts"),
                          (["--steps", "0"], "steps"), (["--kind", "eagle"], "--kind"),
                          (["--kind", "feature", "--taps", "99"], "taps"), (["--self-prompts", "-1"], "--self-prompts"),
                          (["--self-prompt-tokens", "0"], "self-prompt-tokens"), (["--store", "int4"], "--store")):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err
