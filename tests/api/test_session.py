"""The one way in (speculant.session): defaults resolved once, one parse, a fresh drafter per generation, one
no-draft rule, and every front-end (generate, serve, bench, kv-eval, demo) building through it."""

from __future__ import annotations

import argparse
import json

import re

import pytest
import torch

import speculant
from speculant import cli
from speculant.drafters.registry import build_drafter
from speculant.models import loading
from speculant.plan import ParsedMethod, SessionPlan, resolve
from speculant.session import Session, load
from speculant.tiny_models import save_model_pair, stdlib_texts, tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
NO_DRAFT = "needs a draft model and speculant ships none for"


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Tiny models run on one thread."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target and draft directories (a plain tokenizer) and a chat pair (a tokenizer with a chat template)."""
    tok = tiny_tokenizer(stdlib_texts(["textwrap.py"]), vocab_size=300)
    root = tmp_path_factory.mktemp("session-models")
    target, draft = save_model_pair(root / "plain", tok, hidden=32, layers=2, context=256, init_std=0.5,
                                    draft_scale=0.02)
    tok.chat_template = CHAT_TEMPLATE
    chat_target, chat_draft = save_model_pair(root / "chat", tok, hidden=32, layers=2, context=256, init_std=0.5,
                                              draft_scale=0.02)
    return {"target": str(target), "draft": str(draft), "chat_target": str(chat_target),
            "chat_draft": str(chat_draft), "root": root}


@pytest.fixture(scope="module")
def chain(pair) -> Session:
    return load(pair["target"], pair["draft"], "chain:k=3", device="cpu")


# ---------------------------------------------------------------------------------------------- resolution


def test_exported_from_the_package():
    assert speculant.load is load and speculant.Session is Session and speculant.resolve is resolve
    assert {"load", "Session", "SessionPlan", "resolve"} <= set(speculant.__all__)


def test_packaged_defaults_resolved_once(pair, monkeypatch):
    """No draft and no method: the shipped drafter and its measured method; a method without a model loads none."""
    monkeypatch.setattr(loading, "default_draft_for", lambda t, method=None: pair["draft"])
    monkeypatch.setattr(loading, "default_method_for", lambda t, d: "chain:k=2:lookup=3")
    plan = resolve(pair["target"], device="cpu")
    assert plan.draft == str(loading.check_model_dir(pair["draft"]))
    assert plan.method.spec == "chain:k=2:lookup=3" and plan.method.name == "chain"
    assert dict(plan.method.options) == {"k": 2, "lookup": 3} and plan.method.engine == {}
    assert plan.dtype == torch.float32 and plan.device == torch.device("cpu")
    assert resolve(pair["target"], method="lookup", device="cpu").draft is None
    monkeypatch.setattr(loading, "default_method_for", lambda t, d: None)
    assert resolve(pair["target"], device="cpu").method.spec == speculant.drafters.registry.DEFAULT_METHOD


def test_engine_options_split_and_with_options():
    m = ParsedMethod.parse("chain:k=2:forward=model")
    assert dict(m.options) == {"k": 2} and dict(m.engine) == {"forward": "model"} and m.needs_draft
    m8 = m.with_options(k=8)
    assert dict(m8.options) == {"k": 8} and dict(m8.engine) == {"forward": "model"} and m8.spec.startswith("chain:")
    with pytest.raises(ValueError, match="unknown option"):
        m.with_options(nope=1)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(method="nope"), "unknown method 'nope'"),
        (dict(method="ar", kv_policy="keydiff"), "--kv-policy and --kv-budget go together"),
        (dict(method="ar", kv_policy="nope", kv_budget=8), "unknown KV policy"),
        (dict(method="ar", dtype="float12"), "unknown dtype"),
        (dict(method="ar", device="tpu:0"), "device"),
    ],
)
def test_bad_input_is_one_line_before_loading(pair, monkeypatch, kwargs, needle):
    monkeypatch.setattr(loading, "load_model_dir", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=needle) as info:
        load(pair["target"], **kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- the no-draft rule


def test_no_draft_rule_is_a_one_line_error_naming_the_fix(pair, monkeypatch):
    monkeypatch.setattr(loading, "load_model_dir", lambda *a, **k: pytest.fail("loaded a model"))
    for method in (None, "chain", "tree"):
        with pytest.raises(ValueError) as info:
            resolve(pair["target"], method=method)
        message = str(info.value)
        assert NO_DRAFT in message and "--draft" in message and "--method ar" in message and "\n" not in message
    with pytest.raises(ValueError, match="hf-assisted needs a draft model"):
        resolve(pair["target"], method="ar", draft_for=["hf-assisted"])
    assert resolve(pair["target"], method="ar", device="cpu").draft is None  # ar needs none


def _cli_error(capsys, argv) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("speculant: error: "), err
    return err.strip()


def test_front_ends_agree_on_the_no_draft_rule(pair, capsys, tmp_path):
    """generate, serve, bench and kv-eval: the same error, where serve used to fall back to ar."""
    from speculant.bench import run_bench
    from speculant.serve import ServeSettings, check_settings

    t = pair["target"]
    generate = _cli_error(capsys, ["generate", "hi", "--target", t])
    with pytest.raises(ValueError) as served:
        check_settings(ServeSettings(target=t))
    assert generate == f"speculant: error: {served.value}"
    bench = _cli_error(capsys, ["bench", "--prompts", str(_prompts(tmp_path)), "--target", t, "--baselines", "none"])
    with pytest.raises(ValueError) as in_python:
        run_bench([{"prompt": "def f():"}], target=t, baselines=())
    assert bench == f"speculant: error: {in_python.value}"
    haystack = tmp_path / "haystack.txt"
    haystack.write_text("Some text. " * 50)
    niah = _cli_error(capsys, ["kv-eval", "--task", "niah", "--target", t, "--policies", "speckv", "--haystack",
                               str(haystack)])
    for err in (generate, bench, niah):
        assert NO_DRAFT in err and "--draft" in err and "--method ar" in err, err
    assert "chain:k=4 needs a draft model" in bench and "KV policy speckv needs a draft model" in niah


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- generation


def test_greedy_output_equals_generate_with_the_same_drafter(chain):
    ids = chain.tokenizer("def wrap(text, width=70):\n")["input_ids"]
    ours = chain.generate(ids, max_new_tokens=24)
    drafter = build_drafter("chain:k=3", chain.draft, **chain.context)
    ref = speculant.generate(chain.target, ids, drafter=drafter, max_new_tokens=24)
    plain = speculant.generate(chain.target, ids, drafter=None, max_new_tokens=24)
    assert ours.token_ids == ref.token_ids == plain.token_ids and len(ours.token_ids) > 0
    assert ours.stats.target_calls == ref.stats.target_calls
    # text without a chat template: the tokenizer's own encoding
    assert chain.generate("def wrap(text, width=70):\n", max_new_tokens=24).token_ids == ours.token_ids


def test_fresh_drafter_per_generation_and_one_parse(pair, monkeypatch):
    from speculant.core import engine
    from speculant.drafters import registry
    import speculant.kv as kv

    parses, policies, drafters = [], [], []
    real_parse, real_policy, real_generate = registry.parse_method, kv.parse_policy, engine.generate
    monkeypatch.setattr(registry, "parse_method", lambda spec: parses.append(spec) or real_parse(spec))
    monkeypatch.setattr(kv, "parse_policy", lambda spec: policies.append(spec) or real_policy(spec))

    def recording(target, ids, drafter=None, **kw):
        drafters.append(drafter)
        assert not isinstance(kw.get("kv_policy"), str)  # the parsed policy object, not its spec
        return real_generate(target, ids, drafter=drafter, **kw)

    monkeypatch.setattr(engine, "generate", recording)
    s = load(pair["target"], pair["draft"], "chain:k=2", device="cpu", kv_policy="h2o", kv_budget=16, kv_block=8)
    for _ in range(3):
        s.generate(list(range(5, 40)), max_new_tokens=6)
    assert parses == ["chain:k=2"] and policies == ["h2o"]
    assert len(drafters) == 3 and len({id(d) for d in drafters}) == 3 and all(d is not None for d in drafters)
    assert s.drafter() is not s.drafter()


def test_chat_template_applied_unless_raw(pair):
    s = load(pair["chat_target"], pair["chat_draft"], "chain:k=2", device="cpu")
    ids, stops = s.encode("Hello there")
    assert ids == speculant.chat_ids(s.tokenizer, "Hello there") and stops == speculant.stop_ids(s.tokenizer, s.target)
    raw_ids, raw_stops = s.encode("Hello there", raw=True)
    assert raw_ids == s.tokenizer("Hello there")["input_ids"] and raw_stops is None
    gen = s.generate("Hello there", max_new_tokens=8)
    ref = speculant.generate(s.target, ids, drafter=None, max_new_tokens=8, eos_token_id=stops)
    assert gen.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="drop --raw"):
        s.encode("hi", raw=True, system="be brief")
    with pytest.raises(ValueError, match="prompt is empty"):
        s.generate("")


def test_loaded_modules_and_another_method(chain):
    """A session over loaded modules (kept where they are) runs any other method spec on the same models."""
    s = load(chain.target, chain.draft, "chain:k=2", tokenizer=chain.tokenizer)
    assert s.target is chain.target and s.draft is chain.draft and s.plan.target_name.startswith("<in-process")
    ids = list(range(5, 30))
    ar = s.generate(ids, method="ar", max_new_tokens=10)
    assert ar.stats.acceptance_length == 1.0
    assert s.generate(ids, method="tree:budget=6:topk=2:depth=3", max_new_tokens=10).token_ids == ar.token_ids
    other = s.with_draft(chain.plan.draft)  # another draft (here: the same directory, loaded again)
    assert other.target is s.target and other.draft is not s.draft


# ---------------------------------------------------------------------------------------------- front-ends


def test_every_front_end_builds_through_the_session(pair, capsys, monkeypatch, tmp_path):
    from speculant.bench import run_bench
    from speculant.serve import ServeSettings, check_settings
    from speculant.serve.metrics import ServerMetrics
    from speculant.serve.worker import Worker

    import speculant.session

    plans: list[SessionPlan] = []
    real = speculant.session.load_plan
    monkeypatch.setattr(speculant.session, "load_plan", lambda plan: plans.append(plan) or real(plan))
    both = ["--target", pair["target"], "--draft", pair["draft"]]

    assert cli.main(["generate", "def f(", *both, "--method", "chain:k=2", "--k", "3", "--max-new-tokens", "4",
                     "--raw", "--device", "cpu", "--json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert plans[-1].method.spec == "chain:k=3" and plans[-1].draft is not None

    worker = Worker(check_settings(ServeSettings(target=pair["target"], draft=pair["draft"], device="cpu")),
                    ServerMetrics("m"))
    worker.load()
    assert plans[-1].method.spec == "chain" and worker.session.draft is worker.draft_model is not None

    run_bench([{"prompt": "def f():"}], methods="chain:k=2", baselines=(), target=pair["target"],
              draft=pair["draft"], max_new_tokens=4, warmup=0, progress=False)
    assert plans[-1].method.spec == "ar" and plans[-1].draft is not None  # the reference; drafts built per spec

    assert len(plans) == 3


def test_shared_model_options_have_one_help_text():
    from speculant.commands import bench, generate, kv_eval, serve

    helps: dict[str, set] = {}
    for module in (generate, serve, bench, kv_eval):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        for action in p._actions:
            if action.dest in ("draft", "method", "dtype", "threads", "kv_policy", "kv_budget", "kv_block"):
                helps.setdefault(action.dest, set()).add(action.help)
    assert set(helps) == {"draft", "method", "dtype", "threads", "kv_policy", "kv_budget", "kv_block"}
    assert all(len(texts) == 1 for texts in helps.values()), helps


# ----------------------------------------------------------------------------------------------- prefix reuse


def test_a_session_reuses_the_prefixes_of_its_earlier_generations(pair):
    """Generations of one session share a prefix cache (target and draft): a conversation's next turn computes only
    its new tokens, and the answers equal those of a session that reuses nothing."""
    from speculant.plan import DEFAULT_PREFIX_CACHE_MB

    session = load(pair["chat_target"], pair["chat_draft"], "chain:k=3")
    cold = load(pair["chat_target"], pair["chat_draft"], "chain:k=3", prefix_cache_mb=0)
    assert session.prefix_cache.budget_bytes == int(DEFAULT_PREFIX_CACHE_MB * 2**20) and cold.prefix_cache is None
    text = "def wrap(text, width):\n    lines = text.split()\n"
    first = session.generate(text, max_new_tokens=24)
    assert first.stats.prompt_cached_tokens == 0
    again = session.generate(text + " and more", max_new_tokens=24)
    assert again.token_ids == cold.generate(text + " and more", max_new_tokens=24).token_ids
    assert again.stats.prompt_cached_tokens >= 16 and again.stats.draft_cached_tokens >= 16


@pytest.mark.parametrize("bad", [-1, float("nan"), "big", True])
def test_a_bad_prefix_cache_budget_is_one_line_before_loading(pair, bad):
    with pytest.raises(ValueError, match="prefix cache's budget must be a number of MiB >= 0"):
        resolve(pair["target"], pair["draft"], "chain:k=3", prefix_cache_mb=bad)


def test_a_session_decodes_under_a_response_format(pair):
    """``response_format`` on :meth:`Session.generate` and :meth:`Session.generate_batch`: compiled with the
    session's tokenizer; chain and plain agree; the prefix cache is reused as without a format; a bad format is a
    one-line ValueError."""
    session = load(pair["chat_target"], pair["chat_draft"], "chain:k=3")
    fmt = {"type": "regex", "pattern": r"(yes|no), [a-z]{2,6}\."}
    text = "def wrap(text, width):\n    lines = text.split()\n"
    first = session.generate(text, max_new_tokens=24, response_format=fmt)
    plain = session.generate(text, max_new_tokens=24, response_format=fmt, drafter=None)
    assert first.token_ids == plain.token_ids and first.finish_reason == "stop"
    assert re.fullmatch(fmt["pattern"], session.tokenizer.decode(first.token_ids))
    assert plain.stats.prompt_cached_tokens >= 16  # the constraint leaves the cache alone
    batch = session.generate_batch([text, text + " x"], max_new_tokens=24, response_format=fmt)
    assert batch[0].token_ids == first.token_ids
    assert re.fullmatch(fmt["pattern"], session.tokenizer.decode(batch[1].token_ids))
    with pytest.raises(ValueError, match=r"^response_format regex: .*unclosed group"):
        session.generate(text, response_format={"type": "regex", "pattern": "("})
