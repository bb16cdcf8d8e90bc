"""The ``speculant`` CLI (via ``cli.main``), model-directory loading and the method registry.

The models are tiny random Llamas saved as HF directories with a small BPE tokenizer trained in-process
(the demo's helpers), once per session.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
import torch

import speculant.core.checks
import speculant.models.loading
from speculant import DraftModelDrafter, GenerationStats, cli, generate
from speculant.commands import common
from speculant.commands.generate import _Writer
from speculant.drafters import registry
from speculant.drafters.registry import Key, build_drafter, default_of, parse_method, register
from speculant.models.loading import check_model_dir, load_model_dir, tokenizers_match

from helpers import CODE_CONTEXT as CONTEXT, MULTIBYTE

PROMPT = "def add(a, b):\n    return a + b\n\n"
N = 24  # new tokens per CLI run


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="session")
def dirs(code_models):
    """target, its perturbed draft, a draft with a different tokenizer (same vocab size) and a spare tokenizer."""
    return code_models


def run(capsys, *args):
    code = cli.main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def base_args(dirs, method="chain", *extra):
    return [PROMPT, "--target", dirs["target"], "--draft", dirs["draft"], "--method", method,
            "--max-new-tokens", str(N), *extra]


# ---------------------------------------------------------------------------------------------- generate


def test_json_output_matches_library_generate(dirs, capsys):
    code, out, err = run(capsys, *base_args(dirs, "chain", "--json"))
    assert code == 0, err
    assert out.count("\n") == 1 and out.endswith("\n")  # exactly one JSON object and nothing else
    obj = json.loads(out)
    assert set(obj) == {"text", "token_ids", "stats"}
    assert set(obj["stats"]) == set(GenerationStats().as_dict())
    target, tok = load_model_dir(dirs["target"])
    ids = tok(PROMPT)["input_ids"]
    expected = generate(target, ids, max_new_tokens=N).token_ids
    assert obj["token_ids"] == expected
    assert obj["text"] == tok.decode(expected, skip_special_tokens=True)
    assert obj["stats"]["new_tokens"] == len(expected)
    assert obj["stats"]["acceptance_length"] > 1.0  # the draft was used and accepted sometimes
    assert "speculant:" not in err  # no summary line with --json


def test_ar_and_chain_stream_identical_greedy_text(dirs, capsys):
    code_ar, out_ar, err_ar = run(capsys, PROMPT, "--target", dirs["target"], "--method", "ar", "--max-new-tokens",
                                  str(N))  # no --draft: ar would warn that it is not used
    code_ch, out_ch, err_ch = run(capsys, *base_args(dirs, "chain:k=3"))
    assert code_ar == code_ch == 0
    assert out_ar == out_ch and out_ar.strip()
    target, tok = load_model_dir(dirs["target"])
    expected = generate(target, tok(PROMPT)["input_ids"], max_new_tokens=N).token_ids
    assert out_ar == tok.decode(expected, skip_special_tokens=True) + "\n"
    summary = re.compile(r"^speculant: method=(\S+) τ=([\d.]+) tokens=(\d+) tokens/s=[\d.]+ target_calls=(\d+) "
                         r"overhead=[\d.]+% forward=lean \(one cold run: `speculant bench` times methods properly\)$")
    m_ar, m_ch = summary.match(err_ar.strip()), summary.match(err_ch.strip())
    assert m_ar and m_ch, (err_ar, err_ch)
    assert m_ar.group(1) == "ar" and float(m_ar.group(2)) == 1.0 and m_ar.group(4) == m_ar.group(3)
    assert m_ch.group(1) == "chain:k=3" and float(m_ch.group(2)) > 1.0
    assert int(m_ch.group(4)) < int(m_ch.group(3))  # fewer target calls than tokens


def test_without_method_the_packaged_default_or_chain(dirs, capsys, monkeypatch):
    from speculant.models import loading

    no_method = [PROMPT, "--target", dirs["target"], "--draft", dirs["draft"], "--max-new-tokens", str(N)]
    code, out, err = run(capsys, *no_method)
    assert code == 0 and err.startswith("speculant: method=chain "), err  # not a packaged target
    seen = []
    monkeypatch.setattr(loading, "default_method_for", lambda t, d: seen.append((t, d)) or "chain:k=2:lookup=3")
    code, out_default, err = run(capsys, *no_method)
    assert code == 0 and err.startswith("speculant: method=chain:k=2:lookup=3 "), err
    assert seen == [(dirs["target"], dirs["draft"])]  # asked with the names as given, before they resolve
    assert out_default == out  # greedy: the same text whichever method


def test_k_flag_overrides_spec_and_sampling_is_seeded(dirs, capsys):
    args = base_args(dirs, "chain:k=8", "--k", "1", "--json", "--temperature", "0.8", "--top-k", "50",
                     "--top-p", "0.9", "--seed", "3")
    code, out1, _ = run(capsys, *args)
    assert code == 0
    code, out2, _ = run(capsys, *args)
    one, two = json.loads(out1), json.loads(out2)
    assert one["token_ids"] == two["token_ids"]
    assert one["stats"]["draft_tokens"] <= one["stats"]["target_calls"]  # k=1, not 8: one draft token per step


def test_stream_is_incremental_and_multibyte_safe(dirs):
    tok = dirs["tok"]
    ids = tok(MULTIBYTE)["input_ids"]
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # some tokens split characters

    class Out(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    out = Out()
    stream = _Writer(tok, out)
    for i in ids:
        stream([i])
    assert len(out.writes) > 3  # written as it goes, not at the end
    assert all("\ufffd" not in w for w in out.writes)
    stream.finish()
    assert out.getvalue() == MULTIBYTE + "\n"


def test_prompt_from_stdin(dirs, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    code, out_stdin, _ = run(capsys, "-", *base_args(dirs, "ar", "--json")[1:])
    code2, out_arg, _ = run(capsys, *base_args(dirs, "ar", "--json"))
    assert code == code2 == 0
    assert json.loads(out_stdin)["token_ids"] == json.loads(out_arg)["token_ids"]


def test_threads_set_only_when_asked(dirs, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert run(capsys, *base_args(dirs, "ar", "--json", "--max-new-tokens", "2"))[0] == 0
    assert calls == []
    assert run(capsys, *base_args(dirs, "ar", "--json", "--max-new-tokens", "2", "--threads", "3"))[0] == 0
    assert calls == [3]


def test_help_exits_zero_and_documents_every_option(capsys):
    assert cli.main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for opt in ("--target", "--draft", "--method", "--k", "--max-new-tokens", "--temperature", "--top-k",
                "--top-p", "--seed", "--dtype", "--threads", "--json", "PROMPT"):
        assert opt in text
    assert "default: 128" in text  # max_new_tokens: read from generate()'s signature
    assert f"chain: {default_of(DraftModelDrafter, 'k')}" in text  # --k default from the registry
    assert "k (int, default 4)" in text and "ar:" in text  # method list


# ---------------------------------------------------------------------------------------------- bad input


def assert_one_line_error(code, out, err, *needles):
    assert code == 2, (out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--max-new-tokens", "200"], ["exceeds", "context of 128"]),
        (["--max-new-tokens", "0"], ["max_new_tokens"]),
        (["--temperature=-0.5"], ["temperature"]),
        (["--top-p", "0"], ["top_p"]),
        (["--top-p", "1.5"], ["top_p"]),
        (["--top-k", "0"], ["top_k"]),
        (["--k", "0"], ["k must be"]),
        (["--method", "chain:k=0"], ["k must be"]),
        (["--method", "nope"], ["unknown method 'nope'", "ar, chain"]),
        (["--method", "chain:x=1"], ["unknown option 'x'"]),
        (["--method", "chain:k=two"], ["bad value 'two'", "int"]),
        (["--method", "ar", "--k", "2"], ["takes no k"]),
        (["--k", "two"], ["--k"]),
        (["--dtype", "int8"], ["--dtype"]),
        (["--threads", "0"], ["--threads"]),
        (["--seed", str(2**70)], [f"seed {2**70} is out of range"]),
        (["--device", "nope"], ["unknown device 'nope': expected auto, cpu, cuda, cuda:N or mps"]),
    ],
)
def test_bad_options_one_line_exit_2(dirs, capsys, extra, needles):
    assert_one_line_error(*run(capsys, *base_args(dirs), *extra), *needles)


def test_bad_pack_setting_one_line_exit_2(dirs, capsys, monkeypatch):
    monkeypatch.setenv("SPECULANT_PACK", "yes")
    assert_one_line_error(*run(capsys, *base_args(dirs)), "SPECULANT_PACK must be auto, 1 or 0, got 'yes'")


def test_prompt_too_long_for_context(dirs, capsys):
    long_prompt = PROMPT * 20
    assert len(dirs["tok"](long_prompt)["input_ids"]) > CONTEXT
    args = base_args(dirs)
    args[0] = long_prompt
    assert_one_line_error(*run(capsys, *args), "exceeds", "context")


def test_empty_prompt(dirs, capsys):
    args = base_args(dirs)
    args[0] = ""
    assert_one_line_error(*run(capsys, *args), "empty")


def test_chain_without_draft(dirs, capsys):
    assert_one_line_error(*run(capsys, PROMPT, "--target", dirs["target"], "--method", "chain"),
                          "needs a draft model", "--draft")


def test_missing_target_argument(capsys, monkeypatch):
    monkeypatch.setattr(common, "default_model_dir", lambda role: None)  # an installation without bundled models
    assert_one_line_error(*run(capsys, PROMPT), "--target")


def test_bundled_models_are_the_default(capsys):
    if cli.default_model_dir("target") is None:
        pytest.fail("the bundled models are missing from this checkout")
    code, out, err = run(capsys, "def add(a, b):\n", "--max-new-tokens", "6", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["new_tokens"] >= 1 and result["stats"]["draft_calls"] >= 1


def test_mismatched_tokenizers(dirs, capsys):
    args = base_args(dirs)
    args[args.index(dirs["draft"])] = dirs["bad_draft"]
    assert_one_line_error(*run(capsys, *args), "tokenizers differ")
    # ar does not use the draft, so its tokenizer does not matter
    assert run(capsys, *args[:-4], "--method", "ar", "--max-new-tokens", "2")[0] == 0


@pytest.mark.parametrize(
    "remove, needle",
    [
        (["config.json"], "config.json"),
        (["model.safetensors"], "weights"),
        (["tokenizer.json"], "tokenizer files"),
        (["config.json", "tokenizer.json"], "config.json; tokenizer files"),
    ],
)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_missing_model_files(dirs, capsys, tmp_path, remove, needle, role):
    broken = tmp_path / "broken"
    shutil.copytree(dirs[role], broken)
    for name in remove:
        (broken / name).unlink()
    args = base_args(dirs)
    args[args.index(dirs[role])] = str(broken)
    assert_one_line_error(*run(capsys, *args), str(broken), needle)


def test_nonexistent_model_dir(dirs, capsys, tmp_path):
    args = base_args(dirs)
    args[args.index(dirs["target"])] = str(tmp_path / "nowhere")
    assert_one_line_error(*run(capsys, *args), "does not exist", "nowhere")


# ---------------------------------------------------------------------------------------------- loading


def test_load_model_dir(dirs):
    model, tok = load_model_dir(dirs["target"], dtype="bfloat16")
    assert not model.training and model.dtype == torch.bfloat16
    assert tok.get_vocab() == dirs["tok"].get_vocab()
    assert check_model_dir(dirs["target"]).is_dir()
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model_dir(dirs["target"], dtype="int3")
    with pytest.raises(ValueError, match="is missing config.json; weights .*; tokenizer files"):
        check_model_dir(dirs["root"])  # holds model dirs, is none
    with pytest.raises(ValueError, match="is not a directory"):
        check_model_dir(f"{dirs['target']}/config.json")


def test_pytorch_bin_weights_accepted(dirs, tmp_path):
    d = tmp_path / "bin"
    shutil.copytree(dirs["target"], d)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert check_model_dir(d) == d


def test_tokenizers_match(dirs):
    _, tok_t = load_model_dir(dirs["target"])
    _, tok_d = load_model_dir(dirs["draft"])
    _, tok_bad = load_model_dir(dirs["bad_draft"])
    assert tokenizers_match(tok_t, tok_d) and tokenizers_match(tok_t, tok_t)
    assert not tokenizers_match(tok_t, tok_bad)


# ---------------------------------------------------------------------------------------------- registry


@pytest.fixture
def dummy_method():
    seen = {}

    def factory(draft_model, tokenizers_match=None, **options):
        seen.update(options, draft_model=draft_model, tokenizers_match=tokenizers_match)
        return None

    register("dummy-x", factory, needs_draft=False, doc="test method",
             keys={"branching": Key(list[int], "per depth"), "t": Key(float, "a float"), "on": Key(bool, "flag"),
                   "name": Key(str, "a string")})
    yield seen
    registry._REGISTRY.pop("dummy-x")


def test_parse_method_converts_declared_types(dummy_method):
    assert parse_method("chain") == ("chain", {})
    assert parse_method(" chain : k = 8 ") == ("chain", {"k": 8})
    assert parse_method("ar") == ("ar", {})
    name, opts = parse_method("dummy-x:branching=2/1/1:t=0.5:on=yes:name=abc")
    assert name == "dummy-x" and opts == {"branching": [2, 1, 1], "t": 0.5, "on": True, "name": "abc"}
    assert parse_method("dummy-x:on=off:branching=3")[1] == {"on": False, "branching": [3]}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty method spec"),
        ("beam", "unknown method 'beam'; known methods: ar, chain"),
        ("chain:q=1", "unknown option 'q' for method 'chain'; its options: k"),
        ("ar:k=1", "unknown option 'k' for method 'ar'; its options: none"),
        ("chain:k=2.5", "bad value '2.5' for option 'k' of method 'chain': expected int"),
        ("chain:k", "expected key=value"),
        ("chain:=3", "expected key=value"),
        ("chain:k=1:k=2", "given twice"),
        ("dummy-x:branching=2/x", "expected int/int/..."),
        ("dummy-x:branching=", "bad value"),
        ("dummy-x:on=maybe", "expected bool"),
    ],
)
def test_parse_method_errors(dummy_method, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_method(spec)


def test_build_drafter(dirs, dummy_method):
    draft, _ = load_model_dir(dirs["draft"])
    assert build_drafter("ar") is None
    assert build_drafter("ar", draft, tokenizers_match=True) is None  # context it does not take is dropped
    d = build_drafter("chain:k=3", draft, tokenizers_match=True)
    assert isinstance(d, DraftModelDrafter) and d.k == 3 and d.tokenizers_match is True and d.model is draft
    assert build_drafter("chain", draft).k == default_of(DraftModelDrafter, "k") == 4
    assert build_drafter(("chain", {"k": "5"}), draft).k == 5  # a (name, options) pair, values converted
    with pytest.raises(ValueError, match="needs a draft model"):
        build_drafter("chain")
    with pytest.raises(ValueError, match="k must be"):
        build_drafter("chain:k=0", draft)
    with pytest.raises(ValueError, match="unknown option"):
        build_drafter(("chain", {"kk": 5}), draft)
    with pytest.raises(ValueError, match="both as method options and as context"):
        build_drafter("dummy-x:t=1", t=2.0)
    build_drafter("dummy-x:branching=2/2", draft, tokenizers_match=False, unrelated=1)
    assert dummy_method == {"branching": [2, 2], "draft_model": draft, "tokenizers_match": False}


def test_register_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register("chain", lambda draft_model: None, needs_draft=False)
    with pytest.raises(ValueError, match="must match"):
        register("Bad:Name", lambda draft_model: None, needs_draft=False)
    assert registry.get_method("chain").needs_draft and not registry.get_method("ar").needs_draft
    assert "chain" in registry.describe_methods() and "[needs --draft]" in registry.describe_methods()


def test_verbose_logs_info_to_stderr(dirs, capsys):
    args = [PROMPT, "--target", dirs["target"], "--method", "ar", "--max-new-tokens", "2", "--json"]
    assert cli.main(["-v", "generate", *args]) == 0
    err = capsys.readouterr().err
    assert "speculant: INFO: loading model and tokenizer from" in err and "speculant: INFO: loaded " in err
    assert cli.main(["generate", *args]) == 0
    assert capsys.readouterr().err == ""


def test_verbose_after_the_subcommand(dirs, capsys):
    args = [PROMPT, "--target", dirs["target"], "--method", "ar", "--max-new-tokens", "2", "--json"]
    assert cli.main(["generate", *args, "-v"]) == 0
    assert "speculant: INFO: loading model and tokenizer from" in capsys.readouterr().err
    assert cli.main(["-v", "generate", *args, "--verbose"]) == 0
    assert "speculant: INFO:" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- devices


def unusable_cuda() -> tuple[str, str]:
    """A CUDA device torch cannot use on this machine, and what the error says about it."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"cuda:{n}", f"device 'cuda:{n}' is not available: {n} CUDA GPU(s) visible"
    if torch.version.cuda is None:
        return "cuda", f"device 'cuda' is not available: this torch build has no CUDA support (torch {torch.__version__})"
    return "cuda", "device 'cuda' is not available: torch finds no CUDA GPU"


def test_resolve_device():
    from speculant.core.checks import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    best = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device(None) == resolve_device("auto") == torch.device(best)
    device, message = unusable_cuda()
    with pytest.raises(ValueError) as err:
        resolve_device(device)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    for bad in ("nope", "cuda:x", ""):
        with pytest.raises(ValueError, match="unknown device"):
            resolve_device(bad)


def test_device_cpu_gives_the_same_output(dirs, capsys):
    code, out, err = run(capsys, *base_args(dirs, "chain:k=3", "--json", "--device", "cpu"))
    assert code == 0, err
    code, default, _ = run(capsys, *base_args(dirs, "chain:k=3", "--json"))
    assert code == 0
    assert json.loads(out)["token_ids"] == json.loads(default)["token_ids"]


def _no_loading(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad option was reported")

    monkeypatch.setattr(speculant.models.loading, "load_model_dir", refuse)


@pytest.mark.parametrize("command", ["generate", "kv-eval", "train"])
def test_unusable_device_is_one_line_before_any_work(dirs, capsys, monkeypatch, tmp_path, command):
    device, message = unusable_cuda()
    _no_loading(monkeypatch)
    argv = {
        "generate": ["generate", *base_args(dirs)],
        "kv-eval": ["kv-eval", "--target", dirs["target"]],
        "train": ["train", "model", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "tiny"],
    }[command]
    code = cli.main([*argv, "--device", device])
    assert_one_line_error(code, *capsys.readouterr(), message)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- no-op settings


@pytest.mark.parametrize(
    "extra, warning",
    [
        (["--top-k", "5"], "top_k / top_p have no effect with greedy decoding (temperature 0)"),
        (["--top-p", "0.5"], "top_k / top_p have no effect with greedy decoding (temperature 0)"),
        (["--kv-block", "8"], "--kv-block has no effect without eviction (--kv-policy and --kv-budget)"),
        (["--method", "lookup"], "method 'lookup' drafts without a model: --draft is not used"),
        (["--method", "chain:trim=1000"], "vocab_trim (trim) = 1000 is not below the vocabulary size (300 tokens)"),
        (["--kv-policy", "caote:caote:keydiff", "--kv-budget", "16"], "'caote:caote:keydiff' nests CAOTE 2 times"),
    ],
)
def test_settings_without_effect_warn(dirs, capsys, monkeypatch, extra, warning):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    code, out, err = run(capsys, *base_args(dirs, "chain", "--json", "--max-new-tokens", "4"), *extra)
    assert code == 0, err
    assert json.loads(out)["token_ids"]
    (line,) = err.strip().splitlines()
    assert line.startswith("speculant: WARNING: ") and warning in line, line


def test_settings_with_effect_do_not_warn(dirs, capsys, monkeypatch):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    extra = ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "1", "--kv-policy", "caote:keydiff",
             "--kv-budget", "16", "--kv-block", "8", "--method", "chain:trim=0"]
    code, _, err = run(capsys, *base_args(dirs, "chain", "--json", "--max-new-tokens", "4"), *extra)
    assert code == 0 and err == ""


# ---------------------------------------------------------------------------------------------- pipes


def test_closed_stdout_exits_quietly(dirs, capsys, monkeypatch):
    """``speculant generate ... | head -c 1``: the reader goes away; no traceback, no error line, exit 141."""

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", Closed())
    assert cli.main(["generate", *base_args(dirs, "ar")]) == cli.EXIT_BROKEN_PIPE == 141
    # nothing but warnings (a once-per-process warning lands in whichever test runs first)
    assert all(line.startswith("speculant: WARNING") for line in capsys.readouterr().err.splitlines())


# ---------------------------------------------------------------------------------------------- kv-eval


def kv_eval_args(dirs, tmp_path, *extra):
    text = tmp_path / "text.py"
    text.write_text(PROMPT * 30)
    return ["kv-eval", "--target", dirs["target"], "--text", str(text), "--policies", "keydiff,streaming",
            "--budgets", "8", "--seq-len", "64", "--tail", "4", "--block", "8", "--retrieval-pairs", "2",
            "--retrieval-examples", "1", "--memory-lengths", "32", *extra]


def test_kv_eval_progress_threads_and_device(dirs, capsys, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    code = cli.main(kv_eval_args(dirs, tmp_path, "--json", "--threads", "1", "--device", "cpu"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert calls == [1]
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["policy"] for r in report["results"]] == ["keydiff", "streaming"]
    assert [f["name"] for f in report["results"][0]["per_file"]] == ["text.py"]  # the file's name, not its path
    assert "kv-eval" in err and "2/2" in err  # the progress bar over the policy x budget grid, on stderr


@pytest.mark.parametrize("extra, needle", [
    (["--seq-len", "200"], f"--seq-len 200 exceeds the target model's context of {CONTEXT} tokens"),
    (["--memory-lengths", "32,512"], f"--memory-lengths: 512 tokens exceed the target model's context of {CONTEXT}"),
    (["--threads", "0"], "--threads"),
])
def test_kv_eval_refuses_what_the_model_cannot_take(dirs, capsys, tmp_path, extra, needle):
    assert_one_line_error(cli.main(kv_eval_args(dirs, tmp_path, *extra)), *capsys.readouterr(), needle)
