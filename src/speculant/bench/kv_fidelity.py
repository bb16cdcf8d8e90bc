"""How much a KV budget costs: fidelity to the full cache, a synthetic retrieval task, and peak KV memory.

* Fidelity (teacher forcing), on each of several held-out sequences (by default the ``files`` longest test-split
  standard-library modules, which the bundled models never saw in training, each cut to its first ``seq_len``
  tokens): the first ``T - C`` tokens are prefilled block-wise under the budget, the last ``C`` are fed one token
  at a time (``step=1``, as in decoding, evicting after each); at those ``C`` positions the next-token
  distributions are compared with the full cache's: mean KL(full || budget), top-1 agreement, and the ratio of the
  mean negative log-likelihoods of the actual next tokens. Reported per sequence and as the mean over sequences,
  with standard errors over all scored positions.
* Retrieval: a long Python dict literal of ``"key": "value"`` pairs generated in code, then one key asked for
  (``retrieval_format``): ``repeat`` (default) repeats that entry's exact prefix ``"key": "`` in a second dict, so
  a model that copies what followed an earlier occurrence (induction) answers it; ``lookup`` asks
  ``table["key"] == "`` (key -> value association). Correct when greedy decoding under the budget reproduces the
  value's tokens exactly (checked by teacher forcing: greedy reproduces them iff every value token is the argmax
  given the previous ones); the mean NLL of the answer tokens is reported too. The bundled target solves neither
  with the full cache (accuracy 0): it shows no in-context copying at all (``benchmarks/in_context_copying.py``:
  its accuracy on a verbatim repeat of held-out text is no better than on the first occurrence, and zero on a
  repeated random token sequence), so on it retrieval cannot separate policies and fidelity is the informative
  measurement.
* Memory: peak live KV bytes of a full prefill and of a block-wise budgeted prefill, per prompt length.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from ..core.cache import SpecCache, cache_kwarg
from ..core.checks import num_layers
from ..kv.budget import BudgetCache, fraction_budget, prefill_blockwise
from ..kv.policies import ScorePolicy

__all__ = [
    "EvalConfig",
    "Fidelity",
    "default_texts",
    "fidelity",
    "memory_profile",
    "retrieval_prompts",
    "retrieval_scores",
    "run_eval",
]


@dataclass
class Fidelity:
    kl: float  # mean KL(full || budget) in nats over the scored positions
    top1_agreement: float  # share of positions whose argmax agrees with the full cache's
    nll_ratio: float  # mean NLL of the true next tokens under the budget / under the full cache
    positions: int

    def as_dict(self) -> dict:
        return asdict(self)


def _budgeted_logits(model, ids, policy, budget, block, tail) -> torch.Tensor:
    """Logits ``[tail, V]`` predicting ``ids[-tail:]``: prefill block-wise, then decode the rest one by one."""
    head = ids.shape[1] - tail
    cache = BudgetCache(num_layers(model), capacity=budget + block)
    first = prefill_blockwise(model, ids[:, :head], cache, policy, budget, block)[:, None]  # [1, 1, V]
    if tail == 1:
        return first[0].float()
    rest = prefill_blockwise(model, ids[:, head:-1], cache, policy, budget, block=1, all_logits=True)  # [1, tail-1, V]
    return torch.cat([first, rest], 1)[0].float()


@torch.no_grad()
def _per_position(model, input_ids, policy, budget, tail, block, full_logits) -> dict[str, torch.Tensor]:
    """Per scored position ``[tail]``: KL(full || budget), argmax agreement, NLL of the true token (both caches)."""
    if not 1 <= tail < input_ids.shape[1]:
        raise ValueError(f"tail must be in [1, {input_ids.shape[1] - 1}], got {tail}")
    if full_logits is None:
        full_logits = model(input_ids=input_ids).logits[0]
    ref = full_logits[-tail - 1 : -1].float().log_softmax(-1)  # [tail, V]
    got = _budgeted_logits(model, input_ids, policy, budget, block, tail).log_softmax(-1)
    target = input_ids[0, -tail:, None]
    return {
        "kl": (ref.exp() * (ref - got)).sum(-1),
        "agree": (ref.argmax(-1) == got.argmax(-1)).float(),
        "nll_ref": -ref.gather(1, target)[:, 0],
        "nll_got": -got.gather(1, target)[:, 0],
    }


def _summary(pp: dict[str, torch.Tensor]) -> Fidelity:
    return Fidelity(
        kl=float(pp["kl"].mean()),
        top1_agreement=float(pp["agree"].mean()),
        nll_ratio=float(pp["nll_got"].mean() / pp["nll_ref"].mean().clamp_min(1e-9)),
        positions=int(pp["kl"].numel()),
    )


def _stderr(x: torch.Tensor) -> float:
    """Standard error of the mean of ``x`` (positions treated as independent: a lower bound on the noise)."""
    return float(x.std(unbiased=True) / x.numel() ** 0.5) if x.numel() > 1 else 0.0


@torch.no_grad()
def fidelity(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: ScorePolicy,
    budget: int,
    tail: int = 32,
    block: int = 128,
    full_logits: torch.Tensor | None = None,
) -> Fidelity:
    """Teacher-forced fidelity of ``policy`` at ``budget`` on ``input_ids [1, T]``, scored on the last ``tail``
    next-token predictions. ``full_logits [T, V]`` (the full cache's) may be passed to share them across runs."""
    return _summary(_per_position(model, input_ids, policy, budget, tail, block, full_logits))


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be")


RETRIEVAL_FORMATS = ("repeat", "lookup")


def retrieval_prompts(n_pairs: int = 64, n_examples: int = 8, seed: int = 0,
                      fmt: str = "repeat") -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs: a dict literal ``table`` of ``n_pairs`` random ``"key": "NNNN"`` entries, then
    one random key asked for; the answer is its value followed by the closing quote.

    ``fmt="repeat"``: ``backup = {"key": "`` (the entry's exact prefix again: answered by copying);
    ``fmt="lookup"``: ``assert table["key"] == "`` (answered by key -> value association)."""
    if fmt not in RETRIEVAL_FORMATS:
        raise ValueError(f"unknown retrieval format {fmt!r}; known: {', '.join(RETRIEVAL_FORMATS)}")
    rng = random.Random(seed)
    out = []
    for _ in range(n_examples):
        keys: list[str] = []
        while len(keys) < n_pairs:
            k = "".join(rng.choice(_SYLLABLES) for _ in range(3))
            if k not in keys:
                keys.append(k)
        values = [str(rng.randrange(1000, 10000)) for _ in keys]
        body = "".join(f'    "{k}": "{v}",\n' for k, v in zip(keys, values))
        i = rng.randrange(n_pairs)
        if fmt == "repeat":
            query = f'# one entry of table, copied\nbackup = {{\n    "{keys[i]}": "'
        else:
            query = f'assert table["{keys[i]}"] == "'
        out.append((f"table = {{\n{body}}}\n\n{query}", f'{values[i]}"'))
    return out


@torch.no_grad()
def retrieval_scores(model, tokenizer, policy: ScorePolicy | None, budget: int | None,
                     examples: list[tuple[str, str]], block: int = 128) -> dict:
    """``{"accuracy", "answer_nll"}`` over ``examples`` (``policy=None``: the full cache): the share of answers
    greedy decoding reproduces exactly, and the mean NLL per answer token (a softer signal for weak models)."""
    hits, nll = 0, 0.0
    for prompt, answer in examples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + a], device=model.device)
        if policy is None:
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()  # [len(a), V]
        else:
            logits = _budgeted_logits(model, ids, policy, budget, block, len(a))
        hits += logits.argmax(-1).tolist() == a
        target = torch.tensor(a, device=logits.device)[:, None]
        nll += float(-logits.log_softmax(-1).gather(1, target).mean())
    n = max(1, len(examples))
    return {"accuracy": hits / n, "answer_nll": nll / n}


@torch.no_grad()
def memory_profile(model, policy: ScorePolicy, budget: int, block: int, prompt_lengths: list[int],
                   vocab_size: int, seed: int = 0) -> list[dict]:
    """Peak live KV bytes of a full prefill vs a block-wise budgeted prefill, per prompt length (random ids)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in prompt_lengths:
        ids = torch.randint(0, vocab_size, (1, n), generator=gen).to(model.device)
        full = SpecCache(num_layers(model), capacity=n)
        model.base_model(input_ids=ids, **cache_kwarg(model.base_model, full), use_cache=True)
        small = BudgetCache(num_layers(model), capacity=budget + block)
        prefill_blockwise(model, ids, small, policy, budget, block)
        rows.append({"prompt_tokens": n, "full_peak_kv_bytes": full.nbytes(),
                     "budget_peak_kv_bytes": small.peak_nbytes})
    return rows


@dataclass
class EvalConfig:
    """Settings of ``speculant kv-eval`` (the CLI reads its defaults from here)."""

    policies: str = "keydiff,streaming,knorm,random,h2o,tova,snapkv,caote:h2o,fastcaote:snapkv"
    budgets: str | None = None  # comma-separated token budgets; None: budget_fraction of each prompt
    budget_fraction: float = 0.25
    block: int = 128
    files: int = 4  # held-out modules for fidelity (the longest ones) when no text is given
    seq_len: int = 1024  # tokens of each fidelity sequence
    tail: int = 128  # scored next-token predictions at the end of each
    retrieval_format: str = "repeat"
    retrieval_pairs: int = 48
    retrieval_examples: int = 8
    memory_lengths: str = "512,1024,2048"
    seed: int = 0


def _budgets(cfg: EvalConfig, length: int) -> list[int]:
    if cfg.budgets:
        return [int(b) for b in cfg.budgets.split(",")]
    return [fraction_budget(cfg.budget_fraction, length)]


def _held_out(n: int) -> list:
    from ..data.corpus import load_corpus

    held_out = [d for d in load_corpus(include_topics=False) if d.split == "test"]
    return sorted(held_out, key=lambda d: (-len(d.text), d.module))[:n]


def default_texts(n: int = 4) -> dict[str, str]:
    """The fidelity texts when none is given: ``{module: source}`` of the ``n`` longest held-out (test-split)
    standard-library modules, which the bundled models never saw in training (:mod:`speculant.data.corpus`)."""
    return {d.module: d.text for d in _held_out(n)}


@torch.no_grad()
def run_eval(model, tokenizer, cfg: EvalConfig, text: str | dict[str, str] | None = None, progress=None) -> dict:
    """All three measurements for every policy x budget; returns ``{"results": [...], "memory": [...]}``.

    ``text``: one fidelity text, ``{name: text}`` for several, or None for :func:`default_texts` (``cfg.files``).
    Each result row holds the mean over the sequences (``kl``, ``top1_agreement``, ``nll_ratio``), standard errors
    over all scored positions, and the per-sequence numbers in ``per_file``."""
    from ..kv.registry import parse_policy

    specs = [p.strip() for p in cfg.policies.split(",") if p.strip()]
    policies = [parse_policy(p) for p in specs]  # results name each policy by its spec, as given
    texts = default_texts(cfg.files) if text is None else ({"text": text} if isinstance(text, str) else text)
    seqs = {}
    for name, t in texts.items():
        ids = tokenizer(t, add_special_tokens=False)["input_ids"][: cfg.seq_len]
        if len(ids) <= cfg.tail:
            raise ValueError(f"fidelity text {name!r} has {len(ids)} tokens, need more than --tail {cfg.tail}")
        ids = torch.tensor([ids], device=model.device)
        seqs[name] = (ids, model(input_ids=ids).logits[0])
    seq_tokens = min(ids.shape[1] for ids, _ in seqs.values())
    examples = retrieval_prompts(cfg.retrieval_pairs, cfg.retrieval_examples, cfg.seed, cfg.retrieval_format)
    r_len = len(tokenizer(examples[0][0], add_special_tokens=False)["input_ids"])
    full = retrieval_scores(model, tokenizer, None, None, examples, cfg.block)
    results = []
    for spec, policy in zip(specs, policies):
        for budget, r_budget in zip(_budgets(cfg, seq_tokens), _budgets(cfg, r_len)):
            per_file, pooled = [], []
            for name, (ids, full_logits) in seqs.items():
                pp = _per_position(model, ids, policy, budget, cfg.tail, cfg.block, full_logits)
                per_file.append({"name": name, "sequence_tokens": ids.shape[1], **_summary(pp).as_dict()})
                pooled.append(pp)
            pp = {k: torch.cat([p[k] for p in pooled]) for k in pooled[0]}
            mean = {k: sum(f[k] for f in per_file) / len(per_file) for k in ("kl", "top1_agreement", "nll_ratio")}
            ret = retrieval_scores(model, tokenizer, policy, r_budget, examples, cfg.block)
            results.append({
                "policy": spec, "budget": budget, **mean, "positions": int(pp["kl"].numel()),
                "top1_agreement_se": _stderr(pp["agree"]), "kl_se": _stderr(pp["kl"]),
                "files": len(per_file), "sequence_tokens": seq_tokens, "per_file": per_file,
                "retrieval_accuracy": ret["accuracy"], "retrieval_answer_nll": ret["answer_nll"],
                "full_retrieval_accuracy": full["accuracy"], "full_retrieval_answer_nll": full["answer_nll"],
                "retrieval_budget": r_budget, "retrieval_prompt_tokens": r_len,
                "retrieval_format": cfg.retrieval_format,
            })
            if progress is not None:
                progress(results[-1])
    lengths = [int(n) for n in cfg.memory_lengths.split(",") if n]
    mem_budget = _budgets(cfg, min(lengths))[0]  # the first budget, or the fraction of the shortest prompt
    memory = memory_profile(model, policies[0], mem_budget, cfg.block, lengths, len(tokenizer), cfg.seed)
    for row in memory:
        row.update(policy=specs[0], budget=mem_budget, block=cfg.block)
    return {"results": results, "memory": memory}
