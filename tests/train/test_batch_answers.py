"""Distillation data written by speculant's own batched engine (train.drafter.batch_answers): the same answers as
decoding each prompt alone, the target's top-k and its states taken from the decoding forwards equal to a separate
pass, shards written out of order and resumed exactly; and the ShareGPT reader (data.sharegpt): a cut-off file read
up to the cut, the evaluation split held out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from speculant.core.cache import SpecCache
from speculant.core.engine import generate
from speculant.core.quant import quantize_model
from speculant.core.target_forward import TargetForward
from speculant.data.sharegpt import EVAL_SIZE, read_conversations, sharegpt_first_turns
from speculant.tiny_models import tiny_model
from speculant.train.drafter.answers import AnswerShard, load_shards, plan_shards, shard_paths
from speculant.train.drafter.batch_answers import engine_answers
from speculant.train.drafter.features import load_features, sequence_lengths, to_tensor

VOCAB = 96
STOP = 5


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(6, VOCAB, (3 + (7 * i) % 17,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def target():
    model = tiny_model("qwen2", seed=1, vocab_size=VOCAB)
    return quantize_model(model, "q4")


def test_engine_answers_equal_decoding_alone_with_the_target_topk_and_states(target, tmp_path):
    prompts = _prompts(11)
    taps = [0]
    out, feats = tmp_path / "answers", tmp_path / "features"
    engine_answers(target, prompts, out, stop_ids=[STOP], max_new_tokens=9, temperatures=(0.0,), shard_size=4,
                   batch=3, topk=5, features=feats, taps=taps, progress=False)
    shards = load_shards(out)
    assert [p.name for p in shard_paths(out)] == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
    assert sorted(i for s in shards for i in s.prompt_index) == list(range(11))
    planned = plan_shards(prompts, 4, 0)
    states = load_features(feats, len(shards))
    for n, shard in enumerate(shards):
        assert list(shard.prompt_index) == planned[n]  # plan order within each shard
        assert states[n].shape == (int(sequence_lengths(shard).sum()), 2 * target.config.hidden_size)
        row = 0
        for i in range(len(shard)):
            prompt, answer, where = shard.sample(i)
            alone = generate(target, prompt.tolist(), max_new_tokens=9, eos_token_id=STOP)
            assert answer.tolist() == alone.token_ids
            # the teacher: the target's own log-softmax at each answer position, most likely first
            seq = torch.from_numpy(np.concatenate([prompt, answer[:-1]]).astype(np.int64))[None]  # [1, T]
            forward = TargetForward(target, taps=taps)
            cache = SpecCache(target.config.num_hidden_layers, capacity=seq.shape[1] + 8)
            hidden: list[torch.Tensor] = []
            logits = forward(cache, seq, hidden_out=hidden)[0]  # [T, V]
            logp = logits[len(prompt) - 1:].float().log_softmax(-1)  # [A, V]
            top = logp.topk(5, dim=-1)
            assert np.array_equal(shard.topk_ids[where], top.indices.numpy())
            np.testing.assert_allclose(shard.topk_logprobs[where].astype(np.float32), top.values.numpy(),
                                       atol=2e-3)
            # the states the decoding forwards handed over equal one pass over prompt + answer[:-1]
            got = to_tensor(states[n][row:row + seq.shape[1]])
            torch.testing.assert_close(got, hidden[0][0].to(torch.bfloat16).float(), atol=0.02, rtol=0.02)
            row += seq.shape[1]


def test_engine_answers_resume_with_the_same_shards_and_sample_per_prompt(target, tmp_path):
    prompts = _prompts(9)
    out = tmp_path / "answers"
    kwargs = dict(stop_ids=[STOP], max_new_tokens=7, temperatures=(1.0, 0.0), shard_size=3, batch=2, topk=4,
                  seed=5, progress=False)
    engine_answers(target, prompts, out, **kwargs)
    first = {p.name: AnswerShard.load(p) for p in shard_paths(out)}
    assert len(first) == 3
    (out / "shard-00001.npz").unlink()  # interrupted
    engine_answers(target, prompts, out, batch=3, **{k: v for k, v in kwargs.items() if k != "batch"})
    again = {p.name: AnswerShard.load(p) for p in shard_paths(out)}
    assert again.keys() == first.keys()
    for name, shard in first.items():  # the same answers, whatever ran beside them
        assert all(np.array_equal(getattr(again[name], k), getattr(shard, k)) for k in AnswerShard.__dataclass_fields__)
    assert {float(s.temperature[0]) for s in again.values()} == {1.0, 0.0}
    runs = json.loads((out / "RUNS.json").read_text())  # each run's progress
    assert [r["shards"] for r in runs] == [3, 1]
    assert runs[1]["answer_tokens"] == int(again["shard-00001.npz"].answer_offsets[-1]) and runs[1]["batch"] == 3


def test_the_pipeline_answers_with_the_engine_for_a_quantized_target(tmp_path):
    from helpers import chat_model_pair

    from speculant.train.drafter.answers_stage import run_answers, run_features
    from speculant.train.drafter.checks import DraftRunConfig

    target_dir = chat_model_pair(tmp_path / "m", layers=2)[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(5)))
    extra = tmp_path / "q.jsonl"
    extra.write_text(json.dumps({"prompt": "class A:"}) + "\n")
    cfg = DraftRunConfig(target=target_dir, out=str(tmp_path / "run"), prompts=f"{prompts},{extra}",
                         max_new_tokens=5, gen_batch=2, engine="speculant", quantization="q4", kind="feature",
                         taps=[1])
    folder = run_answers(cfg, progress=False)
    assert sorted(i for s in load_shards(folder) for i in s.prompt_index) == list(range(6))
    features = run_features(cfg, progress=False)  # written while answering: nothing left to extract
    assert json.loads((features / "DONE").read_text())["written_while_answering"] is True
    with pytest.raises(ValueError, match="engine must be one of"):
        run_answers(DraftRunConfig(target=target_dir, out=str(tmp_path / "run2"), prompts=str(prompts),
                                   engine="vllm"), progress=False)


def _conversation(cid: str, first: str, text: str) -> dict:
    return {"id": cid, "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "ok"}]}


def test_sharegpt_reader_keeps_every_complete_conversation_before_the_cut(tmp_path):
    rows = [_conversation(f"c{i}_0", "human", f"question {i}") for i in range(EVAL_SIZE + 40)]
    rows += [_conversation("late_1", "human", "a later chunk"), _conversation("g_0", "gpt", "model first"),
             _conversation("dup_0", "human", "question 3")]
    text = json.dumps(rows, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex('"ok"') - 3])  # cut inside the last conversation
    assert len(list(read_conversations(path))) == len(rows) - 1
    turns = sharegpt_first_turns(path)
    assert len(turns) == EVAL_SIZE + 40  # chunk _1, a model-first chat and the cut duplicate are not first turns
    assert all(t["messages"][0]["role"] == "user" for t in turns)
    assert all(t["answer"] == "ok" for t in turns)  # the model's reply, for teacher-forced drafter data
    held = [t for t in turns if t["split"] == "eval"]
    assert len(held) == EVAL_SIZE
    # the split is a function of the ids only: the same conversations in another order split the same way
    shuffled = tmp_path / "shuffled.json"
    shuffled.write_text(json.dumps(rows[:-3][::-1]))
    assert {t["id"] for t in sharegpt_first_turns(shuffled) if t["split"] == "eval"} == {t["id"] for t in held}
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        list(read_conversations(bad))


def test_a_run_answers_more_of_its_batches_when_asked(tmp_path):
    """--answer-batches N answers a random subset; a later run with a larger N (or none) answers the rest of that
    part in new shards, keeping the first ones."""
    from helpers import chat_model_pair

    from speculant.train.drafter.answers_stage import run_answers
    from speculant.train.drafter.checks import DraftRunConfig

    target_dir = chat_model_pair(tmp_path / "m", layers=2)[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) + "\n"
                               for i in range(7)))
    cfg = DraftRunConfig(target=target_dir, out=str(tmp_path / "run"), prompts=str(prompts), max_new_tokens=4,
                         gen_batch=2, engine="speculant", quantization="q4", answer_batches=2)
    folder = run_answers(cfg, progress=False)
    first = {p.name: p.read_bytes() for p in shard_paths(folder)}
    assert len(first) == 2
    cfg.answer_batches = None
    run_answers(cfg, progress=False)
    assert len(shard_paths(folder)) == 4 and all((folder / n).read_bytes() == b for n, b in first.items())
    assert sorted(i for s in load_shards(folder) for i in s.prompt_index) == list(range(7))
    done = json.loads((folder / "DONE").read_text())
    assert done["answer_tokens"] == sum(int(s.answer_offsets[-1]) for s in load_shards(folder))
    assert done["engine"] == "speculant"


def test_the_validation_split_holds_its_prompts_out_as_the_data_grows():
    from speculant.train.drafter.draft_train import Sample
    from speculant.train.drafter.run import split_validation

    def samples(rows):
        return [Sample(np.zeros(1), np.zeros(1), np.zeros((1, 1)), np.zeros((1, 1)), 0, row=r) for r in rows]

    _, small = split_validation(samples(range(200)), 0.1, seed=0)
    train, big = split_validation(samples(list(range(2000)) * 2), 0.1, seed=0)  # grown; each row answered twice
    assert {s.row for s in small} <= {s.row for s in big}
    assert not {s.row for s in train} & {s.row for s in big}  # a prompt's answers stay on one side
    assert 0.07 < len(big) / 4000 < 0.13
    assert len(split_validation(samples([5]), 0.01, seed=0)[1]) == 1  # at least one held out


def test_batches_grouped_by_length_are_random_windows_of_similar_lengths():
    from speculant.train.drafter.draft_train import _picks

    lengths = np.random.default_rng(0).integers(10, 500, 100)
    order = np.argsort(lengths, kind="stable")
    rng = np.random.default_rng(1)
    starts = set()
    for _ in range(50):
        picks = _picks(rng, order, 100, 8)
        where = [int(np.where(order == i)[0][0]) for i in picks]
        assert where == list(range(where[0], where[0] + 8))  # consecutive in length order
        starts.add(where[0])
    assert len(starts) > 20  # and spread over the data
    assert len(set(_picks(rng, None, 100, 8).tolist())) == 8  # the default: a uniform draw without replacement


def test_forced_answers_hold_the_target_topk_and_states_of_the_given_answers(target, tmp_path):
    """Teacher forcing: each given answer is read in one target forward; the shards hold those answers, the target's
    top-k at each answer token and its states over prompt + answer[:-1], exactly as a forward computes them; an
    interrupted run resumes with the same shards."""
    from speculant.train.drafter.forced_answers import FORCED, forced_answers

    prompts = _prompts(7)
    g = torch.Generator().manual_seed(4)
    answers = [torch.randint(6, VOCAB, (1 + (5 * i) % 9,), generator=g).tolist() + [STOP] for i in range(7)]
    taps = [0]
    out, feats = tmp_path / "answers", tmp_path / "features"
    forced_answers(target, prompts, answers, out, shard_size=3, topk=5, features=feats, taps=taps, progress=False)
    shards = load_shards(out)
    assert sorted(i for s in shards for i in s.prompt_index) == list(range(7))
    states = load_features(feats, len(shards))
    for n, shard in enumerate(shards):
        assert set(shard.temperature.tolist()) == {FORCED}
        assert states[n].shape == (int(sequence_lengths(shard).sum()), 2 * target.config.hidden_size)
        row = 0
        for i in range(len(shard)):
            prompt, answer, where = shard.sample(i)
            assert answer.tolist() == answers[shard.prompt_index[i]]
            seq = torch.from_numpy(np.concatenate([prompt, answer[:-1]]).astype(np.int64))[None]  # [1, T]
            cache = SpecCache(target.config.num_hidden_layers, capacity=seq.shape[1] + 8)
            hidden: list[torch.Tensor] = []
            logits = TargetForward(target, taps=taps)(cache, seq, hidden_out=hidden)[0]  # [T, V]
            top = logits[len(prompt) - 1:].float().log_softmax(-1).topk(5, dim=-1)  # at each answer token
            assert np.array_equal(shard.topk_ids[where], top.indices.numpy())
            np.testing.assert_allclose(shard.topk_logprobs[where].astype(np.float32), top.values.numpy(), atol=2e-3)
            got = to_tensor(states[n][row:row + seq.shape[1]])
            torch.testing.assert_close(got, hidden[0][0].to(torch.bfloat16).float(), atol=0.02, rtol=0.02)
            row += seq.shape[1]
    first = {p.name: AnswerShard.load(p) for p in shard_paths(out)}
    (out / "shard-00001.npz").unlink()  # interrupted
    forced_answers(target, prompts, answers, out, shard_size=3, topk=5, features=feats, taps=taps, progress=False)
    again = {p.name: AnswerShard.load(p) for p in shard_paths(out)}
    assert again.keys() == first.keys()
    assert all(np.array_equal(getattr(again[k], f), getattr(v, f)) for k, v in first.items()
               for f in AnswerShard.__dataclass_fields__)
    assert [r["shards"] for r in json.loads((out / "RUNS.json").read_text())] == [3, 1]
    with pytest.raises(ValueError, match="at least one token"):
        forced_answers(target, prompts[:1], [[]], tmp_path / "x", progress=False)


def test_the_pipeline_reads_the_prompts_own_answers_when_asked(tmp_path):
    """--answers dataset: the rows' own answers (as ShareGPT's replies), tokenised with the chat's stop token and cut
    at max_new_tokens, read by the target; rows without an answer are left out; none at all is a clear error."""
    from helpers import chat_model_pair

    from speculant.models.chat import stop_ids
    from speculant.models.loading import load_pretrained
    from speculant.train.drafter.answers_stage import dataset_answer, run_answers, run_features
    from speculant.train.drafter.checks import DraftRunConfig

    target_dir = chat_model_pair(tmp_path / "m", layers=2)[0]
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x):"}], "answer": "ok" if i % 2 else f"return x + {i} " * 4}
            for i in range(5)] + [{"messages": [{"role": "user", "content": "no answer here"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DraftRunConfig(target=target_dir, out=str(tmp_path / "run"), prompts=str(prompts), max_new_tokens=6,
                         gen_batch=2, engine="speculant", quantization="q4", kind="feature", taps=[1],
                         answers="dataset")
    folder = run_answers(cfg, progress=False)
    shards = load_shards(folder)
    assert sorted(i for s in shards for i in s.prompt_index) == list(range(5))  # the row without an answer: out
    model, tokenizer = load_pretrained(target_dir)
    stop = stop_ids(tokenizer, model)[0]
    cut = 0
    for shard in shards:
        for i in range(len(shard)):
            want = dataset_answer(tokenizer, rows[shard.prompt_index[i]], 6, stop)
            assert shard.sample(i)[1].tolist() == want and 0 < len(want) <= 6
            cut += want[-1] != stop
    assert 0 < cut < 5  # long answers cut at max_new_tokens (no stop token), short ones end with it
    assert json.loads((folder / "DONE").read_text())["engine"] == "forced"
    features = run_features(cfg, progress=False)  # written while reading: nothing left to extract
    assert json.loads((features / "DONE").read_text())["written_while_answering"] is True
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps(rows[-1]) + "\n")
    with pytest.raises(ValueError, match="none of the prompts carries an answer"):
        run_answers(DraftRunConfig(target=target_dir, out=str(tmp_path / "run2"), prompts=str(bare),
                                   answers="dataset", engine="speculant", quantization="q4"), progress=False)
    with pytest.raises(ValueError, match="answers must be one of"):
        run_answers(DraftRunConfig(target=target_dir, out=str(tmp_path / "run3"), prompts=str(bare),
                                   answers="mine"), progress=False)


def test_extra_runs_train_but_never_see_the_requests_the_run_holds_out(tmp_path):
    """--extra-data: the answers of other runs (a teacher-forced one here) join training only; the run's own
    held-out answers validate, and the same requests in the other run stay out of training."""
    from helpers import chat_model_pair

    from speculant.train.drafter.answers_stage import run_answers
    from speculant.train.drafter.checks import DraftRunConfig, check_extra_data
    from speculant.train.drafter.run import _prompt_key, _split_samples

    target_dir = chat_model_pair(tmp_path / "m", layers=2)[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}],
                                           "answer": f"return {i}"}) + "\n" for i in range(8)))
    common = dict(target=target_dir, prompts=str(prompts), max_new_tokens=5, gen_batch=3, engine="speculant",
                  quantization="q4", kind="feature", taps=[1], validation_fraction=0.3)
    own = DraftRunConfig(out=str(tmp_path / "own"), **common)
    forced = DraftRunConfig(out=str(tmp_path / "forced"), answers="dataset", **common)
    for cfg in (own, forced):
        run_answers(cfg, progress=False)
    train, validation = _split_samples(own, tmp_path / "own")
    assert len(train) + len(validation) == 8 and 0 < len(validation) < 8
    own.extra_data = str(tmp_path / "forced")
    more, same = _split_samples(own, tmp_path / "own")
    assert [s.row for s in same] == [s.row for s in validation]  # validation: the run's own answers only
    assert len(more) == len(train) + 8 - len(validation)  # every forced answer but the held-out requests'
    # both runs read the same prompts file: the held-out rows are in neither run's training samples
    assert not {s.row for s in more} & {s.row for s in validation}
    assert {_prompt_key(s) for s in more} == {_prompt_key(s) for s in train}
    from speculant.train.drafter.card import _extra_summary

    assert _extra_summary(own.extra_data) == (f"8 answers of `{tmp_path / 'forced'}` (read by the target, teacher "
                                             f"forcing; {_tokens(tmp_path / 'forced')} "
                                             "answer tokens)")
    own.extra_data = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match="not a drafter run directory"):
        _split_samples(own, tmp_path / "own")
    other = DraftRunConfig(out=str(tmp_path / "taps0"), **{**common, "taps": [0]})
    run_answers(other, progress=False)
    own.extra_data = other.out  # states of other layers: refused before any work
    with pytest.raises(ValueError, match=r"lacks the target's states of taps \[1\]"):
        check_extra_data(own)
    own.extra_data = own.out
    with pytest.raises(ValueError, match="is this run itself"):
        check_extra_data(own)


def test_train_draft_on_answers_read_by_the_target_end_to_end(tmp_path, capsys):
    """The CLI: --answers dataset without answers to read is one line and exit 2, leaving no run directory; with
    them a feature drafter trains and its model card says its data was read, not written, by the target."""
    from helpers import chat_model_pair

    from speculant import cli

    target_dir = chat_model_pair(tmp_path / "m", layers=2)[0]
    bare, answered = tmp_path / "bare.jsonl", tmp_path / "answered.jsonl"
    bare.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(4)))
    answered.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}],
                                            "answer": f"return x * {i}"}) + "\n" for i in range(8)))
    base = ["train", "draft", "--target", target_dir, "--answers", "dataset", "--kind", "feature", "--taps", "1",
            "--engine", "speculant", "--quantization", "q4", "--max-new-tokens", "6", "--gen-batch", "3",
            "--steps", "2", "--batch-size", "2", "--warmup", "1", "--keep", "64", "--layers", "1",
            "--validation-fraction", "0.3"]
    capsys.readouterr()  # the model pair's own progress
    assert cli.main(base + ["--out", str(tmp_path / "r0"), "--prompts", str(bare)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none of the --prompts rows carries an \"answer\"" in err
    assert not (tmp_path / "r0").exists()
    assert cli.main(base + ["--out", str(tmp_path / "r1"), "--prompts", str(answered)]) == 0, capsys.readouterr().err
    export = Path(capsys.readouterr().out.strip())
    card = (export / "MODEL_CARD.md").read_text()
    assert "read by the target in one forward each (teacher forcing)" in card and "cycled per batch" not in card
    # --init: a later run continues that drafter (untrained here: --loss none exports the initialisation as it is)
    from safetensors.torch import load_file

    again = base + ["--out", str(tmp_path / "r2"), "--prompts", str(answered), "--loss", "none", "--init", str(export)]
    assert cli.main(again) == 0, capsys.readouterr().err
    continued = Path(capsys.readouterr().out.strip())
    first, second = load_file(str(export / "model.safetensors")), load_file(str(continued / "model.safetensors"))
    assert first.keys() == second.keys()
    for k in first:  # the int8 rows round-trip: the same drafter, not the target's layer again
        assert torch.allclose(first[k].float(), second[k].float(), atol=1e-6, rtol=1e-3), k
    assert f"continued from the drafter in `{export}`" in (continued / "MODEL_CARD.md").read_text()
    for wrong, message in ((["--kind", "eagle3"], "is a drafter with kind 'feature'"),
                           (["--taps", "0"], "is a drafter with taps [1]")):
        assert cli.main(again[:-2] + ["--init", str(export), "--out", str(tmp_path / "r3")] + wrong) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert cli.main(base + ["--out", str(tmp_path / "r4"), "--prompts", str(answered), "--init", str(tmp_path)]) == 2
    assert "is not an exported drafter" in capsys.readouterr().err
    assert not (tmp_path / "r3").exists() and not (tmp_path / "r4").exists()  # refused before any work


def _tokens(run) -> int:
    """Answer tokens in a run's shards."""
    return sum(int(s.answer_offsets[-1]) for s in load_shards(run / "answers"))
