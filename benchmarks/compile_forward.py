"""Does ``torch.compile`` make the lean target forward faster on this machine? (issue 14)

The lean forward (speculant/core/llama_forward.py) is eager PyTorch: per layer a fused QKV matmul, a RoPE, SDPA into our
cache, the output projection and a fused gate-up MLP. Compiling all of it in one graph is not possible without
giving up the in-place cache (its length changes every step), so this compiles what can be: each layer's two
cache-free halves (norm + QKV + RoPE, and output projection + residual + norm + MLP + residual), with inductor
on the CPU, static shapes per token count (one compiled graph serves all 30 layers: the weights are inputs).

Timed per token count T (1 = plain decoding, 4 = a chain of 3 plus its root), eager vs compiled, interleaved,
after a prompt of ``--context`` tokens; the compile (warm-up) time is reported too. The result decides whether a
``--compile`` switch is worth having.

    python benchmarks/compile_forward.py --out benchmarks/results/compile_forward.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from speculant.bench.speed import machine_info
from speculant.core.cache import SpecCache
from speculant.core.target_forward import llama_forward_for
from speculant.models.loading import load_pretrained


def halves(lean):
    """The two cache-free halves of a lean layer, as functions of tensors only."""
    hq, hkv, d, eps = lean.heads, lean.kv_heads, lean.head_dim, lean.eps

    def norm(x, w):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def pre(x, w_in, w_qkv, cos, sin):  # -> q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, D]
        t = x.shape[1]
        qk, v = F.linear(norm(x, w_in), w_qkv).view(1, t, hq + 2 * hkv, d).split([hq + hkv, hkv], dim=2)
        q, k = rope(qk.transpose(1, 2), cos, sin).split([hq, hkv], dim=1)
        return q, k, v.transpose(1, 2)

    def post(x, attn, w_o, w_post, w_gu, w_down):  # -> x [1, T, H]
        t = x.shape[1]
        x = x + F.linear(attn.transpose(1, 2).reshape(1, t, hq * d), w_o)
        gate, up = F.linear(norm(x, w_post), w_gu).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w_down)

    return pre, post


def forward(lean, ids, cache, pre, post):
    """Logits ``[1, T, V]`` of the new tokens ``ids [1, T]`` through the given halves."""
    x = F.embedding(ids, lean.embed)
    t, past = x.shape[1], cache.get_seq_length()
    pos = torch.arange(past, past + t)
    mask = None if t == 1 else torch.ones((t, past + t), dtype=torch.bool).tril(past)[None, None]
    cos, sin = lean._cos[pos][None, None], lean._sin[pos][None, None]
    a = lean.attention_dtype
    for i, w in enumerate(lean.layers):
        q, k, v = pre(x, w.in_norm, w.qkv, cos, sin)
        k_all, v_all = cache.layers[i].update(k, v)
        attn = F.scaled_dot_product_attention(q.to(a), k_all.to(a), v_all.to(a), attn_mask=mask,
                                              scale=lean.scaling, enable_gqa=True).to(x.dtype)
        x = post(x, attn, w.o, w.post_norm, w.gate_up, w.down)
    return lean.logits(lean._norm(x, lean.norm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/compile_forward.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(t) for t in args.tokens.split(",")]
    result = {"settings": vars(args), "machine": machine_info(), "torch": torch.__version__, "ms": {},
              "compile_s": {}}
    for dt in args.dtypes.split(","):
        model = load_pretrained(args.target, dtype=dt)[0]
        lean = llama_forward_for(model)
        eager = halves(lean)
        compiled = tuple(torch.compile(f, dynamic=False) for f in eager)
        variants = {"eager": eager, "compiled": compiled}
        prompt = torch.randint(100, 40000, (1, args.context), generator=torch.Generator().manual_seed(0))
        times = {v: {t: [] for t in counts} for v in variants}
        with torch.inference_mode():
            cache = SpecCache(len(lean.layers), capacity=args.context + 64)
            lean.hidden(prompt, cache)
            start = time.perf_counter()
            for t in counts:  # compile every shape once
                forward(lean, prompt[:, :t], cache, *compiled)
                cache.crop(args.context)
            result["compile_s"][dt] = time.perf_counter() - start
            for rep in range(args.repeats + 3):
                for t in counts:
                    for name, (pre, post) in variants.items():
                        begin = time.perf_counter()
                        forward(lean, prompt[:, :t], cache, pre, post)
                        elapsed = time.perf_counter() - begin
                        cache.crop(args.context)
                        if rep >= 3:
                            times[name][t].append(elapsed)
        result["ms"][dt] = {name: {t: 1000 * statistics.median(v) for t, v in per.items()}
                            for name, per in times.items()}
        print(dt, {name: {t: round(ms, 1) for t, ms in per.items()} for name, per in result["ms"][dt].items()},
              f"compile {result['compile_s'][dt]:.1f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("written", args.out)


if __name__ == "__main__":
    main()
