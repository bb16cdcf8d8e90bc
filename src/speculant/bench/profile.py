"""``speculant bench --profile``: where a target forward's time goes, and how far it is from the machine's floor.

For each target forward (:mod:`speculant.core.target_forward`: the lean one where it applies, and the model's own):

* ``step_ms``: the median time of a one-token decoding forward (after a prompt is in the cache), unprofiled;
* its split into matmuls (``aten::mm``/``addmm``/``linear`` ... self time), attention (SDPA kernels) and the rest
  (norms, RoPE, cache writes, Python and dispatch), as shares from ``torch.profiler`` applied to ``step_ms``
  (the profiler slows small ops down, so its absolute times are not used);
* ``verify5_ms``/``verify5_ratio``: a forward over 5 new tokens (a root and a chain of 4) and its cost in
  one-token forwards.

And for the weights a forward reads (every matrix of the layers plus the LM head, fused as the lean forward
fuses them): ``bare_matmul_ms`` (the same matrix products as bare calls for 1 and 5 tokens, through the lean forward's kernels:
packed matrices where it packs them, :mod:`speculant.core.packed`),
``weight_bytes``, the measured read bandwidth (a reduction over a buffer of that size) and
``bandwidth_floor_ms`` = bytes / bandwidth: no forward can read its weights faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from ..core.cache import SpecCache
from ..core.checks import num_layers
from ..core.packed import PackedMatrix, linear
from ..core.target_forward import TargetForward, llama_forward_for

__all__ = ["profile_target"]

_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::addmv", "aten::mv",
           "mkldnn", "onednn")
_ATTENTION = ("scaled_dot_product", "flash_attention", "_efficient_attention")


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _weights(model: torch.nn.Module) -> list[torch.Tensor | PackedMatrix]:
    """The 2-D matrices a forward multiplies by, each once: the lean forward's (q/k/v and gate/up fused, packed
    when it packs) where it applies, else every Linear weight; the LM head included."""
    lean = llama_forward_for(model)
    if lean is not None:
        mats = [m for layer in lean.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [*mats, lean.head_matrix()]
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            seen.setdefault(module.weight.data_ptr() or id(module.weight), module.weight.detach())  # meta: released
    return list(seen.values())


def _nbytes(w: torch.Tensor | PackedMatrix) -> int:
    return w.nbytes if isinstance(w, PackedMatrix) else w.numel() * w.element_size()


def _category(name: str) -> str:
    if any(a in name for a in _ATTENTION):
        return "attention"
    if any(m in name for m in _MATMUL):
        return "matmul"
    return "other"


def _forward_profile(model: torch.nn.Module, kind: str, ids: list[int], steps: int, repeats: int) -> dict:
    fwd = TargetForward(model, kind)
    device = model.device
    cache = SpecCache(num_layers(model), capacity=len(ids) + 64)
    fwd.prefill(cache, torch.tensor([ids[:-1]], device=device))
    base = cache.length
    one = torch.tensor([[ids[-1]]], device=device)  # [1, 1]
    five = torch.tensor([ids[-5:]] if len(ids) >= 5 else [[ids[-1]] * 5], device=device)  # [1, 5]

    def step(tokens):
        fwd(cache, input_ids=tokens)
        cache.crop(base)

    for _ in range(3):
        step(one), step(five)
    step_ms = _median_ms(lambda: step(one), repeats)
    verify_ms = _median_ms(lambda: step(five), repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(one)
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    total = 0.0
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total
        total += self_us
        split[_category(event.key)] += self_us
    shares = {k: v / total if total else 0.0 for k, v in split.items()}
    return {"forward": fwd.kind, "step_ms": step_ms, **{f"{k}_ms": step_ms * s for k, s in shares.items()},
            "shares": shares, "verify5_ms": verify_ms, "verify5_ratio": verify_ms / step_ms}


def profile_target(model: torch.nn.Module, ids: Sequence[int], steps: int = 16, repeats: int = 21) -> dict:
    """The profile described in the module docstring, for ``model`` after the prompt ``ids`` (a list of ints)."""
    ids = list(ids)
    with torch.inference_mode():
        forwards = {}
        for kind in ("lean", "model"):
            if kind == "lean" and TargetForward(model).kind != "lean":
                continue
            forwards[kind] = _forward_profile(model, kind, ids, steps, repeats)
        weights = _weights(model)
        nbytes = sum(_nbytes(w) for w in weights)
        hidden = weights[0].shape[1]
        device = model.get_input_embeddings().weight.device
        bare = {}
        for t in (1, 5):
            xs = {}
            for w in weights:  # each matrix's input width (down projections take the MLP width)
                xs.setdefault(w.shape[1], torch.randn(1, t, w.shape[1], dtype=w.dtype, device=device))
            for _ in range(3):
                for w in weights:
                    linear(xs[w.shape[1]], w)
            bare[str(t)] = _median_ms(lambda: [linear(xs[w.shape[1]], w) for w in weights], repeats)
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        buf.sum()
        read_ms = _median_ms(buf.sum, repeats)
    bandwidth = nbytes / (read_ms / 1000) / 1e9
    floor_ms = nbytes / (bandwidth * 1e9) * 1000
    result = {
        "forwards": forwards,
        "bare_matmul_ms": bare,
        "weight_bytes": nbytes,
        "read_bandwidth_gb_s": bandwidth,
        "bandwidth_floor_ms": floor_ms,
        "hidden": hidden,
        "dtype": str(weights[0].dtype),
        "packed": isinstance(weights[0], PackedMatrix),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
    }
    for f in forwards.values():
        f["vs_bare_matmul"] = f["step_ms"] / bare["1"]
        f["vs_floor"] = f["step_ms"] / floor_ms
    return result
