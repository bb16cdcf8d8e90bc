"""Shared test helpers."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of ``counts`` against ``probs`` (same shape, any dims).

    Categories with probability 0 must never be observed (asserted). Categories whose expected count is below 5
    are pooled into one bin; if that bin is still below 5 it is merged into the smallest other bin, so that
    every bin the test sees has an expected count of at least 5 (the chi-square approximation needs it).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"observed impossible outcomes: {np.flatnonzero(impossible & (counts > 0))}"
    exp = probs * counts.sum()
    big = exp >= 5
    small = (~big) & (~impossible)
    obs_bins, exp_bins = list(counts[big]), list(exp[big])
    assert len(obs_bins) >= 2, "too few categories with an expected count >= 5 for a chi-square test"
    if small.any():
        o, e = counts[small].sum(), exp[small].sum()
        if e < 5:
            i = int(np.argmin(exp_bins))
            obs_bins[i] += o
            exp_bins[i] += e
        else:
            obs_bins.append(o)
            exp_bins.append(e)
    obs_bins, exp_bins = np.array(obs_bins), np.array(exp_bins)
    exp_bins *= obs_bins.sum() / exp_bins.sum()
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)


N_FAST = 1200
"""Seeded generations per end-to-end distribution test in the default suite; each such test also runs at its
full size (3,000-3,500) under ``@pytest.mark.slow`` (``make test-all``). They run 50 at a time as one batch
(``test_sampling_distribution.sample_counts``; ``plain-k2`` one by one through ``speculant.generate``), which
cuts their time by about a third; a variant whose code a default case of the same test runs already (the same rule
under another warping, k = 3 beside k = 2) runs in the slow suite only (:func:`sizes` ``fast=False``).

Power. The tests pass at p > 1e-4 (chi-square). Against an error of total-variation distance δ in the first
token's distribution (5 categories, df 4), the test statistic is noncentral chi-square with λ ≥ 4 N δ² (the
chi-square divergence is at least 4 δ²); at α = 1e-4 (critical value 23.5) λ = 47.8 gives power 0.99. So N
samples detect, with probability ≥ 0.99, any first-token error of δ ≥ sqrt(47.8 / (4 N)) (:func:`detectable_tv`):
0.10 at N_FAST = 1,200 and 0.06 at 3,500. The negative controls of the chain engine (accept-all, resampling from q,
a stale KV cache, trimmed probabilities on the wrong ids) run at N_FAST and are caught with p < 1e-6; the tree
rules' controls need 1,500 (SpecInfer with its duplicate draws dropped is a smaller bias); the full-size runs
bound smaller errors."""


def detectable_tv(n: int, categories: int = 5, alpha: float = 1e-4, power: float = 0.99) -> float:
    """The smallest total-variation error of a ``categories``-way distribution that a chi-square test of ``n``
    samples at level ``alpha`` detects with probability >= ``power`` (noncentrality 4 n δ², a lower bound)."""
    from scipy import optimize

    df = categories - 1
    critical = stats.chi2.isf(alpha, df)
    lam = optimize.brentq(lambda x: stats.ncx2.sf(critical, df, x) - power, 1e-6, 1e6)
    return float(np.sqrt(lam / (4 * n)))


def sizes(n_full: int, *values, id: str, fast: bool = True, n_fast: int = N_FAST) -> list:
    """Parameters ``(*values, n_fast)`` for the default suite and ``(*values, n_full)`` marked slow (id + '-full');
    ``fast=False``: the slow one only (a variant whose code a default case of the same test already runs, e.g. the
    same rule under another warping: the default suite stays within its time, ``make test-all`` runs every one)."""
    full = pytest.param(*values, n_full, id=f"{id}-full", marks=pytest.mark.slow)
    return [pytest.param(*values, n_fast, id=id), full] if fast else [full]


def record_caches(monkeypatch, module, name: str) -> list:
    """Replace the cache class ``module.name`` with a subclass that records every instance; returns the list."""
    created: list = []
    base = getattr(module, name)

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(module, name, Recording)
    return created


API_VOCAB = 96
"""The vocabulary of the API tests' tiny target (:func:`api_target`)."""


@pytest.fixture(scope="module", name="target")
def api_target():
    """The ``target`` fixture of the Python API tests (api/test_api.py, api/test_api_errors.py; import it there): a tiny
    Llama with :data:`API_VOCAB` tokens and a context of 64, one per module."""
    from speculant.tiny_models import tiny_model

    return tiny_model("llama", seed=0, vocab_size=API_VOCAB, context=64)


def wait_for(predicate, what: str = "condition", timeout: float = 30.0):
    """``predicate()``'s first truthy value, polled every 20 ms; an AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def until_loaded(client, timeout: float = 60.0) -> None:
    """Wait until an in-process server (a FastAPI ``TestClient``) answers /health with 200: its model is loaded."""
    wait_for(lambda: client.get("/health").status_code == 200, "the model to load", timeout)


MULTIBYTE = "héllo wörld ✓ naïve café 日本語"
"""Text with multi-byte UTF-8 characters, in the code tokenizer's corpus (streaming must not split them)."""
CODE_CONTEXT = 128
"""The context of the session's code pair (``code_models``): tests of prompts too long for it rely on it."""


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
"""A minimal ChatML-like template for the tiny test tokenizers (``<s>`` / ``</s>`` are their bos / eos)."""


def chat_model_pair(root, layers: int = 2, context: int = 256, special_tokens=()):
    """A tiny random target and its perturbed draft whose tokenizer has :data:`CHAT_TEMPLATE` (and
    ``special_tokens`` after its 300 tokens, e.g. :data:`speculant.tiny_models.FIM_TOKENS`); their dirs."""
    from speculant.tiny_models import save_model_pair, tiny_tokenizer

    tok = tiny_tokenizer(vocab_size=300, special_tokens=special_tokens)
    tok.chat_template = CHAT_TEMPLATE
    target, draft = save_model_pair(root, tok, hidden=32, layers=layers, context=context, init_std=0.5)
    return str(target), str(draft)


TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<s>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call></s>\n{% endif %}"
    "{%- for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<s>assistant\n{% if m['content'] %}{{ m['content'] }}\n"
    "{% endif %}{% for c in m['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}</s>\n"
    "{% else %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
"""A Qwen2.5-style template with tools for the tiny tokenizers: the tools as JSON lines in a system turn, an
assistant's calls as ``<tool_call>`` blocks (``arguments`` rendered with ``tojson``)."""


def tool_model_pair(root, layers: int = 2, context: int = 1024):
    """A tiny random target and its draft whose tokenizer has :data:`TOOL_CHAT_TEMPLATE` and ``<tool_call>`` /
    ``</tool_call>`` as added (not special) tokens after its 300, as Qwen2.5's; their dirs."""
    from speculant.tiny_models import save_model_pair, tiny_tokenizer

    tok = tiny_tokenizer(vocab_size=300)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TOOL_CHAT_TEMPLATE
    target, draft = save_model_pair(root, tok, hidden=32, layers=layers, context=context, init_std=0.5)
    return str(target), str(draft)


def start_server(args: list[str], log: Path, env: dict | None = None,
                 ready: bool = False) -> tuple[subprocess.Popen, str]:
    """Start ``python -m speculant serve ARGS --port 0 --threads 1`` and return it with its base URL (read from its
    stderr line). ``ready``: also wait until ``/health`` answers 200 (the model is loaded)."""
    err = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "serve", *args, "--port", "0", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env)
    deadline = time.time() + 90
    url = None
    while time.time() < deadline and url is None:
        match = re.search(r"at (http://\S+)/v1", log.read_text())
        if match:
            url = match.group(1)
        elif proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        else:
            time.sleep(0.05)
    if url is None:
        proc.kill()
        raise AssertionError(f"server did not start: {log.read_text()}")
    if ready:
        import httpx

        deadline = time.time() + 300  # a real model may be converted first
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                stop_server(proc)
                raise AssertionError(f"server not ready: {log.read_text()}")
            time.sleep(0.1)
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (graceful shutdown), then kill after 15 s."""
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli_error_line(capsys, argv: list[str], *needles: str) -> str:
    """Run ``speculant ARGV`` in-process and check the house style of a mistake: exit code 2, nothing on stdout, one
    line ``speculant: error: ...`` on stderr (no traceback) containing every needle; returns that line."""
    from speculant import cli

    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and err.count("\n") == 1 and lines[0].startswith("speculant: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def model_metrics(url: str) -> dict[str, float]:
    """The samples of a server's /metrics without labels other than model_name: name -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if set(s.labels) == {"model_name"}:
                out[s.name] = s.value
    return out


def serve_settings(models: dict, **kw):
    """Checked settings of a server of ``models`` (``{"target": dir, "draft": dir}``) named ``tiny-chat``,
    drafting ``chain:k=4``; ``kw`` sets any other :class:`speculant.serve.ServeSettings` field."""
    from speculant.serve import ServeSettings, check_settings

    return check_settings(ServeSettings(target=models["target"], draft=models["draft"], method="chain:k=4",
                                        model_name="tiny-chat", **kw))
