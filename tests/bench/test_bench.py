"""The benchmark harness: ``speculant bench`` end to end, transformers baselines against our ``ar``, prompt sets,
reports and the README table script.

Models are tiny random Llamas (in-process, or saved as HF directories with a small BPE tokenizer, as in
commands/test_cli.py); float32 with well-separated logits, so greedy equality compares decisions, not float noise.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

from speculant import cli, generate
from speculant.bench import harness, load_prompts, run_bench
from speculant.models import loading as model_loading
from speculant.bench.hf import hf_runner, parse_baseline
from speculant.data.prompts import builtin_prompts, grounded_prompts
from speculant.bench.report import category_table, render_markdown, write_plots
from speculant.bench.speed import (
    MethodRun,
    first_difference,
    run_side_by_side,
    summarise,
)
from speculant.models.chat import chat_ids
from speculant.models.loading import load_model_dir
from speculant.tiny_models import perturbed, tiny_model

from speculant.data.corpus import split_of

ROOT = Path(__file__).resolve().parents[2]
N = 12  # new tokens per generation
SUMMARY_KEYS = {"acceptance_length", "tokens_per_second", "speedup_vs_ar", "mbsu", "overhead_share",
                "identical_to_ar", "mismatches", "accepted_hist", "position_acceptance", "target_calls",
                "peak_memory_bytes", "kv_cache_peak_bytes", "param_bytes", "target_forward_share",
                "draft_forward_share", "draft_cost_ratio", "draft_calls_per_step"}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def pair():
    """An in-process target and a draft that agrees with it often (perturbed weights)."""
    target = tiny_model("llama", vocab_size=96, hidden=32, layers=2, context=256, init_std=0.5)
    return target, perturbed(target, scale=0.02)


@pytest.fixture(scope="module")
def dirs(code_models, tmp_path_factory):
    """The session's code pair (target and draft directories) and a JSONL prompt file with ids."""
    prompts = tmp_path_factory.mktemp("bench-prompts") / "prompts.jsonl"
    lines = [{"id": "add", "prompt": "def add(a, b):\n    return a + b\n\n", "tag": "x"},
             {"id": "wrap", "prompt": "def wrap(text, width=70):\n"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return {"target": code_models["target"], "draft": code_models["draft"], "prompts": str(prompts)}


MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture(scope="module")
def chat_dirs(chat_models):
    """The session's chat pair: a tokenizer with a chat template, a context long enough for MT-Bench."""
    return {"target": chat_models[0], "draft": chat_models[1]}


def ids_prompts(n: int = 3) -> list[dict]:
    return [{"id": f"p{i}", "input_ids": list(range(2 + 3 * i, 14 + 3 * i))} for i in range(n)]


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_json_end_to_end(dirs, capsys, tmp_path):
    out = tmp_path / "res"
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--methods", "chain:k=3,chain",
                     "--baselines", "hf-ar,hf-assisted:k=3,hf-prompt-lookup", "--target", dirs["target"],
                     "--draft", dirs["draft"], "--max-new-tokens", str(N), "--out", str(out), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert list(obj["methods"]) == ["ar", "chain:k=3", "chain", "hf-ar", "hf-assisted:k=3", "hf-prompt-lookup"]
    for name, s in obj["methods"].items():
        assert SUMMARY_KEYS <= set(s), (name, SUMMARY_KEYS - set(s))
        assert s["identical_to_ar"] == 1.0 and s["mismatches"] == [], name
        assert s["runs"] == 2
    ar = obj["methods"]["ar"]
    assert ar["speedup_vs_ar"] == 1.0 and ar["acceptance_length"] == 1.0 and ar["mbsu"] == 1.0
    assert obj["methods"]["hf-ar"]["acceptance_length"] == 1.0
    chain = obj["methods"]["chain:k=3"]
    assert chain["acceptance_length"] > 1.0 and chain["draft_cost_ratio"] == pytest.approx(1.0)
    assert 0 < chain["mbsu"] < chain["acceptance_length"]
    # the same algorithm in transformers: drafts of 3, verified the same way
    assert obj["methods"]["hf-assisted:k=3"]["acceptance_length"] > 1.0
    assert obj["methods"]["hf-assisted:k=3"]["k"] == 3 and obj["methods"]["hf-prompt-lookup"]["k"] == 3
    assert obj["settings"]["methods"] == ["ar", "chain:k=3", "chain"]
    assert "bench" in stderr  # the progress bar is on stderr
    files = {Path(f).name for f in obj["files"]}
    assert files == {"results.json", "results.md", "speedup.png", "accepted_lengths.png"}
    results = json.loads((out / "results.json").read_text())
    assert [p["id"] for p in results["prompts"]] == ["add", "wrap"] and results["prompts"][0]["tag"] == "x"
    assert {"machine", "settings", "definitions", "methods", "runs"} <= set(results)
    assert results["machine"]["transformers"] and results["settings"]["max_new_tokens"] == N
    assert len(results["runs"]["chain"]) == 2 and "token_ids" in results["runs"]["chain"][0]
    md = (out / "results.md").read_text()
    assert "| method | τ | tokens/s | speed-up vs ar | MBSU | overhead | identical to ar |" in md
    for name in obj["methods"]:
        assert f"| `{name}` |" in md
    for png in ("speedup.png", "accepted_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_without_json(dirs, capsys, tmp_path):
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--num-prompts", "1", "--methods", "ar",
                     "--baselines", "none", "--target", dirs["target"], "--max-new-tokens", "4", "--warmup", "0",
                     "--out", str(tmp_path)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "| `ar` | 1.00 |" in stdout and "wrote " in stdout and "hf-ar" not in stdout


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--prompts", "no/such/file.jsonl"], "prompt file 'no/such/file.jsonl' does not exist"),
        (["--prompts", "builtin:nope"], "unknown built-in prompt set 'nope'; known: code, grounded, mt-bench"),
        (["--methods", "nope"], "unknown method 'nope'"),
        (["--methods", "chain:k=x"], "bad value 'x' for option 'k'"),
        (["--methods", "chain,chain"], "'chain' is given twice"),
        (["--baselines", "hf-nope"], "unknown baseline 'hf-nope'"),
        (["--baselines", "hf-assisted:k=0"], "must be >= 1"),
        (["--baselines", "hf-ar:k=2"], "unknown option 'k' for baseline 'hf-ar'"),
        (["--max-new-tokens", "0"], "expected an integer >= 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--budgets", "8,0"], "comma-separated integers >= 1"),
        (["--methods", "mask-probe", "--depths", "2"], "mask-probe has no tree size to match"),
        (["--methods", "chain:k=4", "--budgets", "8"],
         "'chain:k=4' already sets k, the size that --budgets sets: give the family without it ('chain')"),
        (["--methods", "chain,tree:topk=2:depth=5", "--depths", "3"],
         "'tree:topk=2:depth=5' already sets depth, the size that --depths sets"),
        (["--methods", "specinfer:width=2:depth=2", "--budgets", "8", "--depths", "2"], "already sets depth"),
    ],
)
def test_cli_bad_input_one_line_exit_2(dirs, capsys, extra, needle):
    args = ["bench", "--prompts", dirs["prompts"], "--target", dirs["target"], "--draft", dirs["draft"], *extra]
    code = cli.main(args)
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith("speculant: error: ") and needle in stderr, stderr


def test_cli_chain_without_draft(dirs, capsys):
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--target", dirs["target"], "--baselines", "hf-ar"])
    _, stderr = capsys.readouterr()
    assert code == 2 and "chain:k=4 needs a draft model" in stderr


def test_out_that_is_a_file_is_refused_before_any_model_loads(dirs, capsys, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(model_loading, "load_model_dir", no_loading)
    monkeypatch.setattr(model_loading, "load_draft", no_loading)
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    for out, needle in ((taken, "is a file: give a directory"), (taken / "sub", "cannot be created")):
        code = cli.main(["bench", "--prompts", dirs["prompts"], "--target", dirs["target"], "--draft", dirs["draft"],
                         "--out", str(out)])
        stdout, stderr = capsys.readouterr()
        assert code == 2 and stdout == "" and stderr.count("\n") == 1 and needle in stderr, stderr
    assert taken.read_text() == "not a folder"


def test_device_option(dirs, capsys, tmp_path, monkeypatch):
    """``--device cpu`` runs there; a CUDA device this torch cannot use is one line before any model loads."""
    argv = ["bench", "--prompts", dirs["prompts"], "--num-prompts", "1", "--methods", "chain:k=2", "--baselines",
            "none", "--target", dirs["target"], "--draft", dirs["draft"], "--max-new-tokens", "4", "--warmup", "0",
            "--json"]
    code = cli.main([*argv, "--device", "cpu", "--out", str(tmp_path / "cpu")])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["settings"]["device"] == "cpu"

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --device was checked")

    monkeypatch.setattr(model_loading, "load_model_dir", no_loading)
    monkeypatch.setattr(model_loading, "load_draft", no_loading)
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    code = cli.main([*argv, "--device", device, "--out", str(tmp_path / "gpu")])
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"speculant: error: device {device!r} is not available"), stderr
    assert not (tmp_path / "gpu").exists()


def test_default_out_is_ignored_by_git():
    from speculant.commands.bench import DEFAULT_OUT

    assert f"{DEFAULT_OUT}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_draft_defaults_to_the_one_shipped_for_the_target(dirs, monkeypatch):
    monkeypatch.setattr(model_loading, "default_draft_for",
                        lambda t, method=None: dirs["draft"] if str(t) == dirs["target"] else None)
    res = run_bench(dirs["prompts"], methods=["chain:k=2"], baselines=[], target=dirs["target"], num_prompts=1,
                    max_new_tokens=4, warmup=0, progress=False)
    assert res["settings"]["draft"] == dirs["draft"] and res["methods"]["chain:k=2"]["identical_to_ar"] == 1.0


def test_attached_draft_runs_our_chain_and_hf_assisted(dirs, tmp_path):
    """An attached drafter (no tokenizer, the target's embedding and head) is loaded with load_draft."""
    from speculant.models.attached import build_attached, save_attached

    target, _ = load_model_dir(dirs["target"])
    attached = save_attached(build_attached(target, [0]), target, tmp_path / "attached", "test-target",
                             dtype=torch.float32)
    res = run_bench(dirs["prompts"], methods=["chain:k=2"], baselines=["hf-assisted"], target=dirs["target"],
                    draft=str(attached), max_new_tokens=6, warmup=0, progress=False)
    assert res["settings"]["draft"] == str(attached)
    for name in ("chain:k=2", "hf-assisted"):
        assert res["methods"][name]["identical_to_ar"] == 1.0, name


def test_a_method_may_bring_its_own_draft(dirs, tmp_path):
    """``draft=DIR`` in a spec: that method drafts with its own model (here a feature drafter) in the same
    interleaved run, while the others and hf-assisted use --draft."""
    from speculant.models.attached import build_attached, save_attached

    target, _ = load_model_dir(dirs["target"])
    feature = save_attached(build_attached(target, [0], features=True), target, tmp_path / "eagle", "test-target",
                            dtype=torch.float32)
    own = f"chain:k=2:draft={feature}"
    res = run_bench(dirs["prompts"], methods=["chain:k=2", own], baselines=["hf-assisted"], target=dirs["target"],
                    draft=dirs["draft"], max_new_tokens=6, warmup=0, progress=False)
    assert res["settings"]["draft"] == dirs["draft"]
    assert res["settings"]["method_drafts"] == {own: str(feature)}
    for name in ("chain:k=2", own, "hf-assisted"):
        assert res["methods"][name]["identical_to_ar"] == 1.0, name
    assert res["methods"][own]["tree_nodes"] == 2  # the spec's shape, read without its draft= option
    with pytest.raises(ValueError, match="unknown option"):
        run_bench(dirs["prompts"], methods=["chain:k=2:draft=x:bogus=1"], baselines=[], target=dirs["target"],
                  max_new_tokens=2, warmup=0, progress=False)


# ---------------------------------------------------------------------------------------------- chat workloads


def test_cli_mt_bench_chat_template_and_per_category_table(chat_dirs, capsys, tmp_path):
    out = tmp_path / "res"
    code = cli.main(["bench", "--prompts", "builtin:mt-bench", "--num-prompts", "8", "--methods", "chain:k=3",
                     "--baselines", "hf-ar", "--target", chat_dirs["target"], "--draft", chat_dirs["draft"],
                     "--max-new-tokens", "4", "--warmup", "0", "--out", str(out), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert set(obj["categories"]) == MT_BENCH_CATEGORIES and obj["settings"]["chat_prompts"] == 8
    results = json.loads((out / "results.json").read_text())
    _, tok = load_model_dir(chat_dirs["target"])
    for p in results["prompts"]:  # tokenised through the chat template
        assert p["tokens"] == len(chat_ids(tok, p["messages"])) and p["category"] in MT_BENCH_CATEGORIES
    for category, per_method in results["categories"].items():
        assert set(per_method) == {"ar", "chain:k=3", "hf-ar"} and per_method["ar"]["runs"] == 1, category
        assert per_method["ar"]["acceptance_length"] == 1.0 and per_method["ar"]["speedup_vs_ar"] == 1.0
    md = (out / "results.md").read_text()
    assert "## Per category" in md and "median over the category's runs of the per-run tokens/s ratio" in md
    assert "| category | `chain:k=3` | `hf-ar` |" in md and "| **overall** |" in md
    for category in MT_BENCH_CATEGORIES:
        assert f"| {category} (1) |" in md


def test_chat_prompts_stop_at_the_end_of_the_turn(chat_dirs):
    """Chat prompts stop every method and baseline at the tokenizer's end-of-turn token (here a token greedy
    decoding really produces), raw prompts at the model's EOS only, and --ignore-eos (``[]``) at neither."""
    target, tok = load_model_dir(chat_dirs["target"])
    draft, _ = load_model_dir(chat_dirs["draft"])
    chat = {"id": "c", "messages": [{"role": "user", "content": "Wrap the text to 70 columns."}]}
    free = generate(target, chat_ids(tok, chat["messages"]), max_new_tokens=N, eos_token_id=[]).token_ids
    model_eos = target.generation_config.eos_token_id
    turn_end = next(t for t in free[3:] if t != model_eos)
    tok.eos_token = tok.convert_ids_to_tokens(turn_end)
    stops = {model_eos, turn_end}
    expected = free[: next(i for i, t in enumerate(free) if t in stops) + 1]
    common = dict(methods=["chain:k=3"], baselines=["hf-ar", "hf-assisted"], target=target, draft=draft,
                  tokenizer=tok, max_new_tokens=N, warmup=0, progress=False)
    res = run_bench([chat], **common)
    assert res["settings"]["eos_token_id"] == sorted(stops) and res["settings"]["chat_prompts"] == 1
    for name in ("ar", "chain:k=3", "hf-ar", "hf-assisted"):
        assert res["runs"][name][0]["token_ids"] == expected, name
    raw = run_bench([{"id": "r", "prompt": "def wrap(text):\n"}], **common)
    assert raw["settings"]["eos_token_id"] == [model_eos] and raw["settings"]["chat_prompts"] == 0
    ignored = run_bench([chat], **{**common, "eos_token_id": []})
    assert ignored["settings"]["eos_token_id"] == [] and ignored["runs"]["ar"][0]["token_ids"] == free


def test_chat_prompts_need_a_chat_template(dirs):
    with pytest.raises(ValueError, match="prompt '0' is a chat \\('messages'\\) but the target's tokenizer has no "
                       "chat template"):
        run_bench([{"messages": [{"role": "user", "content": "Hi"}]}], methods=["ar"], baselines=[],
                  target=dirs["target"], progress=False)


def test_per_category_figures(pair, tmp_path):
    """τ pooled over a category's runs; speed-up = median of that category's per-prompt ratios (the main
    table's statistic); prompts without a category are grouped as 'other'."""
    target, draft = pair
    prompts = ids_prompts(5)
    for p, category in zip(prompts, ["a", "b", "a", "b"]):
        p["category"] = category
    res = run_bench(prompts, methods=["chain:k=2"], baselines=[], target=target, draft=draft, max_new_tokens=N,
                    eos_token_id=[], progress=False, warmup=0, out=tmp_path)
    cats = res["categories"]
    assert list(cats) == ["a", "b", "other"]
    ratios = res["methods"]["chain:k=2"]["speedup_per_run"]
    runs = res["runs"]["chain:k=2"]
    for category, members in (("a", [0, 2]), ("b", [1, 3]), ("other", [4])):
        s = cats[category]["chain:k=2"]
        assert s["runs"] == len(members)
        assert s["speedup_vs_ar"] == pytest.approx(statistics.median(ratios[i] for i in members))
        tokens = sum(runs[i]["new_tokens"] for i in members)
        assert s["acceptance_length"] == pytest.approx(tokens / sum(runs[i]["target_calls"] for i in members))
    table = category_table(res)
    assert table.splitlines()[0] == "| category | `chain:k=2` |"
    a = cats["a"]["chain:k=2"]
    assert f"| a (2) | {a['acceptance_length']:.2f} / {a['speedup_vs_ar']:.2f}× |" in table
    overall = res["methods"]["chain:k=2"]
    assert table.splitlines()[-1] == (f"| **overall** | {overall['acceptance_length']:.2f} / "
                                      f"{overall['speedup_vs_ar']:.2f}× |")
    assert table in (tmp_path / "results.md").read_text()
    assert "categories" not in run_bench(ids_prompts(1), methods=["ar"], baselines=[], target=target,
                                         max_new_tokens=2, progress=False, warmup=0)


def test_bench_help_lists_methods_and_baselines(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("chain", "ar:", "hf-ar", "hf-assisted", "hf-prompt-lookup", "builtin:grounded", "builtin:mt-bench",
                 "messages", "--json"):
        assert word in out


# ---------------------------------------------------------------------------------------------- baselines


def test_hf_baselines_identical_to_ar_and_stop_at_eos(pair):
    target, draft = pair
    free = generate(target, ids_prompts(1)[0]["input_ids"], max_new_tokens=N, eos_token_id=[]).token_ids
    eos = free[5]  # a token the greedy output really produces: every method must stop right there
    res = run_bench(ids_prompts(3), methods=["chain:k=3"], baselines=["hf-ar", "hf-assisted", "hf-prompt-lookup"],
                    target=target, draft=draft, max_new_tokens=N, eos_token_id=eos, progress=False)
    runs = res["runs"]
    assert runs["ar"][0]["token_ids"] == free[: free.index(eos) + 1]  # stopped early, stop token included
    for name in ("chain:k=3", "hf-ar", "hf-assisted", "hf-prompt-lookup"):
        assert [r["token_ids"] for r in runs[name]] == [r["token_ids"] for r in runs["ar"]], name
        assert res["methods"][name]["identical_to_ar"] == 1.0 and res["methods"][name]["mismatches"] == []
    assert res["methods"]["hf-assisted"]["k"] == 3  # the k of the first chain method


def test_hf_assisted_runs_constant_k_without_confidence_threshold(pair):
    """Same draft, same k, greedy, no early stop: transformers' assisted generation makes exactly our chain's
    verification steps (its default confidence threshold 0.4 would cut drafts short)."""
    target, draft = pair
    res = run_bench(ids_prompts(2), methods=["chain:k=4"], baselines=["hf-assisted"], target=target, draft=draft,
                    max_new_tokens=24, eos_token_id=[], progress=False, warmup=0)
    ours, hf = res["methods"]["chain:k=4"], res["methods"]["hf-assisted"]
    assert hf["accepted_hist"] == ours["accepted_hist"] and len(ours["accepted_hist"]) == 5
    assert hf["target_calls"] == ours["target_calls"]
    assert hf["position_acceptance"] == pytest.approx(ours["position_acceptance"])
    assert hf["draft_cost_ratio"] == pytest.approx(1.0) and hf["mbsu"] == pytest.approx(ours["mbsu"], rel=0.05)
    assert draft.generation_config.assistant_confidence_threshold != 0.0  # restored afterwards


def test_mismatch_is_reported_with_first_difference(pair):
    """hf-ar on a DIFFERENT model than our ar's target: the outputs differ and the report must say where."""
    target, _ = pair
    other = perturbed(target, scale=0.5, seed=7)
    prompts = [p["input_ids"] for p in ids_prompts(3)]
    methods = [MethodRun("ar", make=lambda: None),
               MethodRun("hf-ar", run=hf_runner("hf-ar", {}, other, None, 4, stops=[], pad_token_id=1))]
    rows = run_side_by_side(target, methods, prompts, max_new_tokens=N, warmup=0, progress=False, eos_token_id=[])
    summary = summarise(rows)["hf-ar"]
    expected = [first_difference(h["token_ids"], a["token_ids"]) for h, a in zip(rows["hf-ar"], rows["ar"])]
    assert any(d is not None for d in expected)
    assert summary["mismatches"] == [{"prompt": i, "repeat": 0, "first_diff": d}
                                     for i, d in enumerate(expected) if d is not None]
    assert summary["identical_to_ar"] == 1 - len(summary["mismatches"]) / 3
    md = render_markdown({"settings": _settings(), "machine": _machine(), "methods": {
        "hf-ar": {**summary, "mbsu": 1.0}}, "prompts": [{"id": f"p{i}"} for i in range(3)]})
    assert f"first differs at token {summary['mismatches'][0]['first_diff']}" in md and "✗" in md


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_parse_baseline():
    assert parse_baseline("hf-assisted:k=6") == ("hf-assisted", {"k": 6})
    assert parse_baseline(" hf-prompt-lookup:k=10:ngram=3 ") == ("hf-prompt-lookup", {"k": 10, "ngram": 3})
    with pytest.raises(ValueError, match="given twice"):
        parse_baseline("hf-assisted:k=1:k=2")


def test_sampling_skips_identity_check(pair):
    target, draft = pair
    res = run_bench(ids_prompts(1), methods=["chain:k=2"], baselines=["hf-ar"], target=target, draft=draft,
                    max_new_tokens=6, temperature=0.8, seed=3, progress=False, warmup=0)
    for s in res["methods"].values():
        assert "identical_to_ar" not in s and s["new_tokens"] >= 1
    assert "not checked (sampling)" in render_markdown(res)


# ---------------------------------------------------------------------------------------------- prompts


def test_jsonl_prompts_keep_fields(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "x", "lang": "py"}\n\n{"prompt": "y"}\n')
    assert load_prompts(f) == [{"id": "a", "prompt": "x", "lang": "py"}, {"id": "3", "prompt": "y"}]
    assert load_prompts(str(f), n=1) == [{"id": "a", "prompt": "x", "lang": "py"}]


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"id": "a"}\n', "p.jsonl:1: no 'prompt' or 'messages' field"),
        ('{"prompt": "ok"}\n{"prompt": ""}\n', "p.jsonl:2: 'prompt' must be a non-empty string"),
        ('{"prompt": "ok"}\nnot json\n', "p.jsonl:2: not a JSON object"),
        ('["prompt"]\n', "p.jsonl:1: no 'prompt' or 'messages' field"),
        ("\n\n", "no prompts in"),
    ],
)
def test_jsonl_prompt_errors(tmp_path, content, needle):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=None) as exc:
        load_prompts(f)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_prompt_source_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown built-in prompt set 'x'"):
        load_prompts("builtin:x")
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        load_prompts("builtin:code", n=0)


def test_grounded_prompts_copy_from_the_prompt():
    rows = grounded_prompts(n=8)
    assert rows == grounded_prompts(n=8) == builtin_prompts("grounded", n=8)  # deterministic
    assert len(rows) == 8 and len({r["id"] for r in rows}) == 8
    assert {r["task"] for r in rows} == {"rename", "type-hints"}
    for r in rows:
        module, name = r["id"].split(":")[0].rsplit(".", 1)
        assert split_of(module.split(".")[0]) == "test"  # held out from training
        src, prompt = r["source"], r["prompt"]
        assert f"def {name}(" in src and src.count("\n") >= 4
        assert prompt.startswith(src)  # the function to copy is in the prompt ...
        new = name + "_v2" if r["task"] == "rename" else name
        assert prompt.endswith(f"def {new}(")  # ... and the answer starts its copy
        ask = prompt[len(src):]
        assert name in ask and ask.count("\n") == 2  # blank line, the request, the def line


# ---------------------------------------------------------------------------------------------- reports


def _settings() -> dict:
    return {"num_prompts": 3, "prompts": "x", "max_new_tokens": N, "temperature": 0.0, "top_k": None, "top_p": None,
            "seed": None, "repeats": 1, "warmup": 0, "target_dtype": "float32", "draft_dtype": None}


def _machine() -> dict:
    return {"torch_threads": 1, "machine": "x86_64", "cpu_count": 2, "torch": "t", "transformers": "tf",
            "speculant": "s"}


def test_plots_skipped_without_matplotlib(pair, tmp_path, monkeypatch, caplog):
    target, _ = pair
    res = run_bench(ids_prompts(1), methods=["ar"], baselines=[], target=target, max_new_tokens=4, progress=False,
                    warmup=0)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import raises ImportError
    with caplog.at_level("WARNING", logger="speculant"):
        assert write_plots(res, tmp_path) == []
    assert "matplotlib is not installed: plots skipped" in caplog.text
    assert list(tmp_path.iterdir()) == []


def _readme_table_module():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_rewrites_only_between_markers(pair, tmp_path, capsys):
    target, _ = pair
    run_bench(ids_prompts(2), methods=["ar"], baselines=["hf-ar"], target=target, max_new_tokens=4,
              progress=False, warmup=0, out=tmp_path / "res")
    mod = _readme_table_module()
    head = "# Title\n\nintro text  \n<!-- bench:start -->"
    tail = "<!-- bench:end -->\n\n## After\nmore text\n"
    readme = tmp_path / "README.md"
    readme.write_text(head + "\nstale | table\n" + tail)
    args = ["--results", str(tmp_path / "res" / "results.json"), "--readme", str(readme)]
    assert mod.main(args) == 0
    text = readme.read_text()
    assert text.startswith(head) and text.endswith(tail) and "stale" not in text
    inner = text[len(head):-len(tail)]
    assert "| `ar` | 1.00 |" in inner and "| `hf-ar` |" in inner and "res/results.json" in inner
    assert mod.main(args) == 0 and readme.read_text() == text  # idempotent
    assert "already up to date" in capsys.readouterr().out
    readme.write_text("no markers here\n")
    assert mod.main(args) == 2
    assert readme.read_text() == "no markers here\n"
    assert "needs exactly one <!-- bench:start -->" in capsys.readouterr().err


def test_the_page_make_bench_readme_rewrites_has_the_markers():
    """The page the Makefile's bench-readme target hands readme_table.py (--readme) holds the bench markers."""
    recipe = (ROOT / "Makefile").read_text().split("\nbench-readme:", 1)[1].split("\n\n", 1)[0]
    page = re.search(r"--readme\s+(\S+)", recipe)
    text = (ROOT / (page.group(1) if page else "README.md")).read_text()
    assert text.count("<!-- bench:start -->") == 1 and text.count("<!-- bench:end -->") == 1


def test_run_bench_adds_reference_first(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="unknown method 'hf-ar'"):
        run_bench(ids_prompts(1), methods=["hf-ar"], target=target, progress=False)
    with pytest.raises(ValueError, match="hf-assisted needs a draft model"):
        run_bench(ids_prompts(1), methods=["ar"], baselines=["hf-assisted"], target=target, progress=False)
    res = run_bench(ids_prompts(1), methods="chain:k=2, ar", baselines="", target=target, draft=draft,
                    max_new_tokens=4, progress=False, warmup=0)
    assert list(res["methods"]) == ["ar", "chain:k=2"]  # the reference first, specs as given (stripped)


# -------------------------------------------------------------------------------------- budget-matched trees


def test_families_are_sized_to_a_budget_or_a_depth():
    from speculant.bench.matched_specs import at_budget, at_depth, shape

    cases = {  # family: (at budget 8, at depth 3)
        "chain": ("chain:k=8", "chain:k=3"),
        "lookup:ngram=2": ("lookup:ngram=2:k=8", "lookup:ngram=2:k=3"),
        "specinfer:width=2": ("specinfer:width=2:depth=4", "specinfer:width=2:depth=3"),
        "specinfer:width=3": (None, "specinfer:width=3:depth=3"),  # 3 does not divide 8
        "spectr:width=4": ("spectr:width=4:depth=2", "spectr:width=4:depth=3"),
        "rsd-s:width=4:trim=0": ("rsd-s:width=4:trim=0:depth=2", "rsd-s:width=4:trim=0:depth=3"),
        "rsd-c:branching=2": ("rsd-c:branching=2/1/1/1", "rsd-c:branching=2/1/1"),
        "rsd-c:branching=2/2": (None, "rsd-c:branching=2/2/1"),  # 2 + 4 = 6 nodes, then +4 per level
        "rsd-c:branching=3": (None, "rsd-c:branching=3/1/1"),  # 3, 6, 9 nodes: never 8
        "tree:topk=2": ("tree:topk=2:budget=8", "tree:topk=2:depth=3"),
    }
    for family, (b8, d3) in cases.items():
        assert at_budget(family, 8) == b8, family
        assert at_depth(family, 3) == d3, family
        if b8 is not None:
            assert shape(b8)[0] == 8, b8
        assert shape(d3)[1] == 3, d3
    assert at_budget("rsd-c:branching=2/2", 10) == "rsd-c:branching=2/2/1" and shape("rsd-c:branching=2/2/1") == (10, 3)
    assert at_depth("rsd-c:branching=2/2/2", 2) is None
    assert shape("ar") is None
    with pytest.raises(ValueError, match="no tree size"):
        at_budget("mask-probe", 8)


def test_budget_matched_run_reports_each_family_at_each_size(pair, tmp_path):
    target, draft = pair
    res = run_bench(ids_prompts(1), methods=["chain", "rsd-c:branching=2", "specinfer:width=3"], baselines=[],
                    target=target, draft=draft, max_new_tokens=8, temperature=1.0, seed=0, progress=False,
                    warmup=0, budgets=[4, 6], depths=[2], out=tmp_path)
    matched = res["budget_matched"]
    assert matched["budgets"] == {
        "4": {"chain": "chain:k=4", "rsd-c:branching=2": "rsd-c:branching=2/1", "specinfer:width=3": None},
        "6": {"chain": "chain:k=6", "rsd-c:branching=2": "rsd-c:branching=2/1/1",
              "specinfer:width=3": "specinfer:width=3:depth=2"},
    }
    assert matched["depths"]["2"] == {"chain": "chain:k=2", "rsd-c:branching=2": "rsd-c:branching=2/1",
                                      "specinfer:width=3": "specinfer:width=3:depth=2"}
    # each sized spec runs once, after the reference
    assert list(res["methods"]) == ["ar", "chain:k=4", "rsd-c:branching=2/1", "chain:k=6", "rsd-c:branching=2/1/1",
                                    "specinfer:width=3:depth=2", "chain:k=2"]
    s = res["methods"]["rsd-c:branching=2/1/1"]
    assert (s["tree_nodes"], s["tree_depth"]) == (6, 3) and 0 < s["tree_tokens_per_call"] <= 6
    md = (tmp_path / "results.md").read_text()
    assert "### At equal tree tokens per target call" in md and "### At equal draft depth" in md
    assert "| `specinfer:width=3` | – |" in md
    assert (tmp_path / "budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no method family"):
        run_bench(ids_prompts(1), methods=["specinfer:width=3"], baselines=[], target=target, draft=draft,
                  budgets=[4], progress=False)


def test_budget_matching_refuses_sized_specs_and_defaults_to_the_chain_family(pair):
    """``--budgets 8 --methods chain:k=4`` used to run chain:k=8 labelled chain:k=4."""
    from speculant.bench.matched_specs import at_budget, at_depth

    with pytest.raises(ValueError, match="'chain:k=4' already sets k, the size that --budgets sets"):
        at_budget("chain:k=4", 8)
    with pytest.raises(ValueError, match="'rsd-s:width=2:depth=3' already sets depth"):
        at_depth("rsd-s:width=2:depth=3", 2)
    with pytest.raises(ValueError, match="'tree:budget=8' already sets budget"):
        at_budget("tree:budget=8", 8)
    assert at_budget("tree:depth=4", 8) == "tree:depth=4:budget=8"  # depth is not what a budget sizes
    target, draft = pair
    res = run_bench(ids_prompts(1), baselines=[], target=target, draft=draft, max_new_tokens=4, progress=False,
                    warmup=0, budgets=[2])
    assert list(res["methods"]) == ["ar", "chain:k=2"]  # default methods under budget matching: the family chain


# ---------------------------------------------------------------------------------- target forward, profile


def test_forward_option_and_profile(pair, tmp_path):
    """``ar:forward=model`` runs the model's own forward beside the lean one (same tokens); ``profile=True`` adds the
    per-forward split, the verify-forward ratio and the floor to results.json and results.md."""
    target, _ = pair
    res = run_bench(ids_prompts(2), methods=["ar", "ar:forward=model"], baselines=[], target=target,
                    max_new_tokens=N, eos_token_id=[], progress=False, warmup=0, out=tmp_path, profile=True)
    assert {r["target_forward"] for r in res["runs"]["ar"]} == {"lean"}
    assert {r["target_forward"] for r in res["runs"]["ar:forward=model"]} == {"model"}
    assert res["methods"]["ar:forward=model"]["identical_to_ar"] == 1.0
    prof = res["profile"]
    assert set(prof["forwards"]) == {"lean", "model"}
    for f in prof["forwards"].values():
        assert f["step_ms"] > 0 and f["verify5_ratio"] > 0
        assert f["matmul_ms"] + f["attention_ms"] + f["other_ms"] == pytest.approx(f["step_ms"])
    assert prof["weight_bytes"] == sum(m.weight.numel() * 4 for m in target.modules()
                                       if isinstance(m, torch.nn.Linear))
    assert "## Profile of the target forward" in (tmp_path / "results.md").read_text()


def test_bad_forward_value_and_llamacpp_errors(pair, monkeypatch):
    target, _ = pair
    with pytest.raises(ValueError, match="bad value 'fast' for option 'forward'"):
        run_bench(ids_prompts(1), methods=["ar:forward=fast"], baselines=[], target=target, progress=False)
    from speculant.bench import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(ValueError, match="make llamacpp"):
        run_bench(ids_prompts(1), methods=["ar"], baselines=["llamacpp-ar"], target=target, progress=False)
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    with pytest.raises(ValueError, match="converted from a GGUF file"):
        run_bench(ids_prompts(1), methods=["ar"], baselines=["llamacpp-ar"], target=target, progress=False)


def test_cli_code_chat_workload(chat_dirs, capsys, tmp_path):
    """builtin:code-chat runs through the chat template, one table row per category."""
    code = cli.main(["bench", "--prompts", "builtin:code-chat", "--num-prompts", "2", "--methods", "chain:k=3",
                     "--baselines", "none", "--target", chat_dirs["target"], "--draft", chat_dirs["draft"],
                     "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "res"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert obj["settings"]["prompts"] == "builtin:code-chat" and obj["settings"]["chat_prompts"] == 2
    assert set(obj["categories"]) == {"write", "rename"}


# ---------------------------------------------------------------------------------------------- default methods


def test_method_specs_default_stands_for_the_targets_default(monkeypatch):
    assert harness.method_specs("default,lookup", "some/dir") == (["chain", "lookup"],
                                                                   {"spec": "chain", "from": "registry"})
    assert harness.method_specs(None, "some/dir") == (list(harness.DEFAULT_METHODS), None)
    assert harness.method_specs(None, "some/dir", matching=True) == (list(harness.DEFAULT_FAMILIES), None)
    monkeypatch.setattr(model_loading, "default_method_for", lambda target, draft=None: "chain:k=2:lookup=10")
    packaged = (["chain:k=2:lookup=10"], {"spec": "chain:k=2:lookup=10", "from": "packaged"})
    assert harness.method_specs(None, "smollm2-135m-instruct") == packaged
    assert harness.method_specs(["default"], "smollm2-135m-instruct") == packaged
    with pytest.raises(ValueError, match="'default' is 'chain:k=2:lookup=10' here, which is given too"):
        harness.method_specs("chain:k=2:lookup=10,default", "smollm2-135m-instruct")
    for empty in ("", " ", []):
        with pytest.raises(ValueError, match="no methods given in .*: name at least one"):
            harness.method_specs(empty, "some/dir")


def test_cli_without_methods_runs_the_packaged_default(dirs, capsys, tmp_path, monkeypatch):
    """A packaged target benches ar and its packaged default method when --methods is left out."""
    monkeypatch.setattr(model_loading, "default_method_for",
                        lambda target, draft=None: "chain:k=2" if target == dirs["target"] else None)
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--num-prompts", "1", "--baselines", "none",
                     "--target", dirs["target"], "--draft", dirs["draft"], "--max-new-tokens", "4", "--warmup", "0",
                     "--out", str(tmp_path / "res"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert list(obj["methods"]) == ["ar", "chain:k=2"]
    assert obj["settings"]["default_method"] == {"spec": "chain:k=2", "from": "packaged"}


def test_cli_methods_default_without_a_packaged_one_is_the_registry_default(dirs, capsys, tmp_path):
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--num-prompts", "1", "--baselines", "none",
                     "--methods", "default", "--target", dirs["target"], "--draft", dirs["draft"],
                     "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "res"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert list(obj["methods"]) == ["ar", "chain"]
    assert obj["settings"]["default_method"] == {"spec": "chain", "from": "registry"}


def test_cli_empty_methods_is_a_one_line_error(dirs, capsys, tmp_path):
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--methods", "", "--target", dirs["target"],
                     "--out", str(tmp_path / "res")])
    _, stderr = capsys.readouterr()
    assert code == 2 and stderr.count("\n") == 1
    assert stderr.startswith("speculant: error: no methods given in '': name at least one")
    assert not (tmp_path / "res").exists()


def test_cli_a_draft_no_method_uses_warns_once(dirs, capsys, tmp_path, monkeypatch):
    import speculant.core.checks

    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    code = cli.main(["bench", "--prompts", dirs["prompts"], "--num-prompts", "1", "--baselines", "none",
                     "--methods", "lookup", "--target", dirs["target"], "--draft", dirs["draft"],
                     "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "res"), "--json"])
    _, stderr = capsys.readouterr()
    assert code == 0, stderr
    warnings = [line for line in stderr.splitlines() if "WARNING" in line]
    assert warnings == ["speculant: WARNING: no method or baseline drafts with the shared draft model: --draft is "
                        "not used"]
