"""How close each weight quantization stays to the float32 model (teacher-forced), on MT-Bench answers.

The float32 model (a packaged GGUF model: the file's weights dequantized to float32) answers N MT-Bench first
turns greedily in its chat template; then each quantized variant (``--kinds``, loaded as every front-end loads it:
``load_model_dir(quantization=...)``, so a GGUF file's tensors keep their codes where the kind holds them) reads the
same prompt + answer once (teacher forcing, the lean forward every decoding method runs), and at every answer
position we compare its next-token distribution with float32's over the same sequence:

* ``top1_agreement``: the quantized model's most likely token is float32's (a format should reach 0.99);
* ``mean_kl``: KL(p_fp32 || p_quant) in nats, averaged over positions (and its 99th percentile, ``p99_kl``).

``KIND/8bit``, ``KIND/7bit`` (e.g. ``file/8bit``): the kind with a GGUF file's 6-bit tensors requantized to 8- or
7-bit q8 codes instead of kept as q6 (``quantize_loaded(wide_bits=8)``: ``file`` before q6 existed; 7: the q4 kernel's
cheaper route on AVX2 without VNNI).

Also ``weights``: for each int4/q4/q8 kind, the matrices built from the file's own codes and how far their values
are from the file's (int4: the kernel's ``(q - 8) * scale + zero`` form; q4, q8: scale and minimum in float16), in
units of each group's quantization step (``scale``), and how many matrices of each kind the model holds. Nothing is timed (the CPU may be shared); the float32
reference's own teacher-forced argmax is checked against the answer it generated (``reference_self_agreement``:
below 1 only at float near-ties between a one-token and a whole-sequence forward).

    PYTHONPATH=src python benchmarks/quant_fidelity.py --target qwen2.5-coder-0.5b-instruct --num-prompts 16 \\
        --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch

from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.quant import QUANTIZATIONS, quantization_of
from speculant.core.target_forward import TargetForward
from speculant.data.prompts import load_prompts, prompt_ids
from speculant.models.chat import stop_ids
from speculant.models.loading import load_model_dir, quantize_loaded, resolve_model, wide_variant
from speculant.models.sources import gguf_backing


@torch.inference_mode()
def answer_logprobs(model, sequences: list[tuple[list[int], list[int]]], forward: str = "auto") -> list[torch.Tensor]:
    """Per (prompt, answer): the log-probabilities ``[A, V]`` (float32) the model gives each answer position, read
    over prompt + answer in one forward (the lean forward where it applies, as decoding runs it; ``forward="model"``:
    transformers' own)."""
    forward = TargetForward(model, forward)
    out = []
    for prompt, answer in sequences:
        ids = torch.tensor(prompt + answer[:-1])[None]  # [1, T]: position t predicts token t + 1
        cache = SpecCache(num_layers(model), capacity=ids.shape[1] + 8)
        logits = forward(cache, input_ids=ids, logits_to_keep=len(answer))[0]  # [A, V]: the answer's only
        out.append(torch.log_softmax(logits.float(), -1))
        del cache, logits
    return out


@torch.inference_mode()
def generate_answers(model, tokenizer, records: list[dict], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The float model's greedy answers to ``records`` (chat template), as (prompt ids, answer ids)."""
    from speculant import generate

    stops = stop_ids(tokenizer, model)
    out = []
    for r in records:
        ids = prompt_ids(r, tokenizer)
        answer = generate(model, ids, max_new_tokens=max_new_tokens, eos_token_id=stops).token_ids
        out.append((ids, list(answer)))
    return out


def _base(kind: str) -> str:
    """The quantization of a ``--kinds`` entry (``file/8bit`` -> ``file``; an unknown tag leaves it unknown)."""
    try:
        return wide_variant(kind)[0]
    except ValueError:
        return kind


def weight_error(path: Path, model) -> dict:
    """How far the quantized ``model``'s matrices built from the GGUF file's own codes (:data:`CODE_TYPES`) are
    from the file's values, in units of each group's quantization step (``scale``; groups whose scale is 0, all 32
    weights equal, are counted apart: there a step is undefined and only the minimum's float16 rounding can differ);
    and how many matrices the model holds of each kind (a ``file`` model keeps the file's Q6_K tensors in q6, its 5- and
    8-bit ones in q8). q6 matrices hold the file's values exactly (tests/test_quant_loading.py) and are not counted."""
    from speculant.core.quant import ATTR, quantized_linears
    from speculant.models.gguf import Q6_K, file_tensors

    modules = {id(m.weight): m for m in quantized_linears(model)}
    params = dict(model.named_parameters())
    n = weights = off = flat = 0
    worst = total = 0.0
    kinds: dict[str, int] = defaultdict(int)
    for name, qtype, codes, scale, minimum in file_tensors(path, model):
        module = modules.get(id(params[name]))
        if module is None:
            continue
        matrix = getattr(module, ATTR)
        kinds[matrix.kind] += 1
        if codes is None or qtype == Q6_K or int(codes.max()) >= 1 << matrix.bits:
            continue  # requantized from values (8-bit codes in 4 bits; Q6_K in q8), or q6: the file's values (exact)
        want = (codes.float().reshape(codes.shape[0], -1, 32) * scale[..., None] + minimum[..., None])
        got = matrix.dequantize().float().reshape(want.shape)
        stepped = scale != 0  # [out, groups]
        rel = ((got - want).abs() / scale.abs()[..., None].where(stepped[..., None], 1))[stepped]  # [groups', 32]
        n, weights, off = n + 1, weights + rel.numel(), off + int((rel > 0).sum())
        flat += int((~stepped).sum())
        worst, total = max(worst, float(rel.max())), total + float(rel.sum(dtype=torch.float64))
    return {"matrices_from_codes": n, "matrix_kinds": dict(kinds), "weights": weights, "weights_off": off,
            "flat_groups": flat, "max_error_in_steps": worst, "mean_error_in_steps": total / max(weights, 1)}


def act8(model) -> None:
    """Diagnostic kind ``act8``: the float32 model with only q4's activation rounding (every linear layer's input
    rounded to int8 per block of 32, as the kernel does) and the file's weights exact, to separate the two sources
    of q4's error."""
    from speculant.core.quant import q4_activations

    def hook(_module, args):
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        a, d, _ = q4_activations(rows)
        return ((a * d[..., None]).reshape(rows.shape).to(x.dtype).view(x.shape),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook)


def compare(reference: list[torch.Tensor], other: list[torch.Tensor], categories: list[str]) -> dict:
    """Top-1 agreement and KL(reference || other) over every answer position, overall and per category."""
    agree, kls, per = [], [], defaultdict(lambda: [0, 0, 0.0])
    for ref, got, cat in zip(reference, other, categories):
        same = (ref.argmax(-1) == got.argmax(-1))  # [A]
        kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0)  # [A] nats (rounding can dip below 0)
        agree.append(same)
        kls.append(kl)
        per[cat][0] += int(same.sum())
        per[cat][1] += same.numel()
        per[cat][2] += float(kl.sum())
    agree_all, kl_all = torch.cat(agree).float(), torch.cat(kls)
    return {"positions": agree_all.numel(), "top1_agreement": float(agree_all.mean()),
            "mean_kl": float(kl_all.mean()), "p99_kl": float(kl_all.quantile(0.99)),
            "max_kl": float(kl_all.max()),
            "per_category": {c: {"positions": v[1], "top1_agreement": v[0] / v[1], "mean_kl": v[2] / v[1]}
                             for c, v in sorted(per.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--kinds", default="int8,int4,q4", help="quantization kinds to compare, separated by ','")
    ap.add_argument("--prompts", default="builtin:mt-bench")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/quant-fidelity/TARGET.json); "
                    "kinds already in it (same settings) are kept, so each kind can run in its own process")
    ap.add_argument("--answers", default=None, help="cache of the float32 answers (JSON; default: OUT with "
                    "'.answers.json'): read when present, else generated and written")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any((_base(k) not in QUANTIZATIONS or k == "none") and k != "act8" for k in kinds):
        raise SystemExit(f"--kinds: choose among {', '.join(QUANTIZATIONS[1:])} (KIND/8bit, KIND/7bit: a GGUF file's "
                         f"6-bit tensors in 8- or 7-bit codes) and act8 (see act8())")
    torch.set_num_threads(args.threads)
    out = Path(args.out or f"benchmarks/results/quant-fidelity/{Path(str(args.target)).name}.json")
    directory = resolve_model(args.target)
    backing = gguf_backing(directory)
    records = load_prompts(args.prompts, args.num_prompts)
    categories = [r.get("category", "?") for r in records]

    settings = {"target": str(args.target), "gguf": None if backing is None else backing.name,
                "prompts": args.prompts, "num_prompts": len(records), "max_new_tokens": args.max_new_tokens,
                "dtype": "float32", "forward": "lean (auto)"}
    answers = Path(args.answers or out.with_suffix(".answers.json"))
    t0 = time.perf_counter()
    model, tok = load_model_dir(directory, "float32")
    cached = json.loads(answers.read_text()) if answers.is_file() else None
    if cached is not None and cached["settings"] == settings:
        sequences = [(p, a) for p, a in cached["sequences"]]
    else:
        sequences = generate_answers(model, tok, records, args.max_new_tokens)
        answers.parent.mkdir(parents=True, exist_ok=True)
        answers.write_text(json.dumps({"settings": settings, "sequences": sequences}))
    reference = answer_logprobs(model, sequences)
    self_agree = float(torch.cat([ref.argmax(-1) == torch.tensor(a) for ref, (_, a) in zip(reference, sequences)])
                       .float().mean())
    print(f"float32: {sum(len(a) for _, a in sequences)} answer tokens, teacher-forced argmax = answer at "
          f"{self_agree:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    del model
    gc.collect()

    previous = json.loads(out.read_text()) if out.is_file() else {}
    results = previous.get("results", {}) if previous.get("settings", {}).get("target") == settings["target"] and \
        all(previous["settings"].get(k) == v for k, v in settings.items()) else {}
    for kind in kinds:
        model, _ = load_model_dir(directory, "float32")
        if kind == "act8":  # the model's own forward (hooks), not the lean one
            act8(model)
            built = 0
            logprobs = answer_logprobs(model, sequences, forward="model")
        else:
            base, wide = wide_variant(kind)
            built = quantize_loaded(model, base, backing, wide_bits=wide)
            assert quantization_of(model) == base
            logprobs = answer_logprobs(model, sequences)
        row = compare(reference, logprobs, categories)
        row["matrices_from_file_codes"] = built
        if backing is not None and _base(kind) in ("int4", "q4", "file", "q8"):
            row["weights"] = weight_error(backing, model)
        results[kind] = row
        print(f"{kind}: top-1 agreement {row['top1_agreement']:.4f}, mean KL {row['mean_kl']:.5f} nats "
              f"(p99 {row['p99_kl']:.4f}), {built} matrices from the file's codes", flush=True)
        del model
        gc.collect()

    report = {
        "what": "teacher-forced fidelity of weight quantizations against the float32 (dequantized GGUF) model on "
                "its own greedy MT-Bench answers (benchmarks/quant_fidelity.py)",
        "target": 0.99,
        "settings": {**settings, "threads": args.threads, "kinds": sorted(results)},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "answer_tokens": sum(len(a) for _, a in sequences),
        "reference_self_agreement": self_agree,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
