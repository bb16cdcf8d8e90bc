"""How much a KV budget costs: fidelity to the full cache, a synthetic retrieval task, and peak KV memory.

* Fidelity (teacher forcing): the sequence's first ``T - C`` tokens are prefilled block-wise under the budget,
  the last ``C`` are fed one token at a time (``step=1``, as in decoding, evicting after each); at those ``C``
  positions the next-token distributions are compared with the full cache's: mean KL(full || budget), top-1
  agreement, and the ratio of the mean negative log-likelihoods of the actual next tokens.
* Retrieval: a long Python dict literal of ``"key": "value"`` pairs generated in code, then a lookup of one key;
  correct when greedy decoding under the budget reproduces the value's tokens exactly (checked by teacher
  forcing: greedy reproduces them iff every value token is the argmax given the previous ones). The mean NLL of
  the answer tokens is reported too: the bundled models are too small to retrieve (full-cache accuracy 0).
* Memory: peak live KV bytes of a full prefill and of a block-wise budgeted prefill, per prompt length.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from ..cache import SpecCache
from ..checks import num_layers
from .budget import BudgetCache, prefill_blockwise
from .policies import ScorePolicy

__all__ = ["EvalConfig", "Fidelity", "default_text", "fidelity", "memory_profile", "retrieval_prompts", "retrieval_scores", "run_eval"]


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
    if not 1 <= tail < input_ids.shape[1]:
        raise ValueError(f"tail must be in [1, {input_ids.shape[1] - 1}], got {tail}")
    if full_logits is None:
        full_logits = model(input_ids=input_ids).logits[0]
    ref = full_logits[-tail - 1 : -1].float().log_softmax(-1)  # [tail, V]
    got = _budgeted_logits(model, input_ids, policy, budget, block, tail).log_softmax(-1)
    target = input_ids[0, -tail:]
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    nll_ref = -ref.gather(1, target[:, None]).mean()
    nll_got = -got.gather(1, target[:, None]).mean()
    return Fidelity(
        kl=float(kl),
        top1_agreement=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        nll_ratio=float(nll_got / nll_ref.clamp_min(1e-9)),
        positions=tail,
    )


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be")


def retrieval_prompts(n_pairs: int = 64, n_examples: int = 8, seed: int = 0) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs: a dict literal of ``n_pairs`` random ``"key": "NNNN"`` entries, then
    ``table["key"]`` of a random key; the answer is its value followed by the closing quote."""
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
        prompt = f"table = {{\n{body}}}\n\nassert table[\"{keys[i]}\"] == \""
        out.append((prompt, f'{values[i]}"'))
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
        model.base_model(input_ids=ids, past_key_values=full, use_cache=True)
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
    seq_len: int = 1024  # tokens of the fidelity sequence
    tail: int = 32  # scored next-token predictions at its end
    retrieval_pairs: int = 48
    retrieval_examples: int = 8
    memory_lengths: str = "512,1024,2048"
    seed: int = 0


def _budgets(cfg: EvalConfig, length: int) -> list[int]:
    if cfg.budgets:
        return [int(b) for b in cfg.budgets.split(",")]
    return [max(1, int(cfg.budget_fraction * length))]


def default_text() -> str:
    """The fidelity text when none is given: the longest held-out (test-split) standard-library module, which
    the bundled models never saw in training (:mod:`speculant.train.corpus`)."""
    from ..train.corpus import load_corpus

    held_out = [d for d in load_corpus(include_topics=False) if d.split == "test"]
    return max(held_out, key=lambda d: (len(d.text), d.module)).text


@torch.no_grad()
def run_eval(model, tokenizer, cfg: EvalConfig, text: str | None = None, progress=None) -> dict:
    """All three measurements for every policy x budget; returns ``{"results": [...], "memory": [...]}``."""
    from .registry import parse_policy

    specs = [p.strip() for p in cfg.policies.split(",") if p.strip()]
    policies = [parse_policy(p) for p in specs]  # results name each policy by its spec, as given
    ids = tokenizer(text or default_text(), add_special_tokens=False)["input_ids"][: cfg.seq_len]
    ids = torch.tensor([ids], device=model.device)
    full_logits = model(input_ids=ids).logits[0]
    examples = retrieval_prompts(cfg.retrieval_pairs, cfg.retrieval_examples, cfg.seed)
    r_len = len(tokenizer(examples[0][0], add_special_tokens=False)["input_ids"])
    full = retrieval_scores(model, tokenizer, None, None, examples, cfg.block)
    results = []
    for spec, policy in zip(specs, policies):
        for budget, r_budget in zip(_budgets(cfg, ids.shape[1]), _budgets(cfg, r_len)):
            fid = fidelity(model, ids, policy, budget, cfg.tail, cfg.block, full_logits)
            ret = retrieval_scores(model, tokenizer, policy, r_budget, examples, cfg.block)
            results.append({
                "policy": spec, "budget": budget, **fid.as_dict(), "sequence_tokens": ids.shape[1],
                "retrieval_accuracy": ret["accuracy"], "retrieval_answer_nll": ret["answer_nll"],
                "full_retrieval_accuracy": full["accuracy"], "full_retrieval_answer_nll": full["answer_nll"],
                "retrieval_budget": r_budget, "retrieval_prompt_tokens": r_len,
            })
            if progress is not None:
                progress(results[-1])
    lengths = [int(n) for n in cfg.memory_lengths.split(",") if n]
    mem_budget = _budgets(cfg, min(lengths))[0]  # the first budget, or the fraction of the shortest prompt
    memory = memory_profile(model, policies[0], mem_budget, cfg.block, lengths, len(tokenizer), cfg.seed)
    for row in memory:
        row.update(policy=specs[0], budget=mem_budget, block=cfg.block)
    return {"results": results, "memory": memory}
