"""Watching a model's forwards from the outside: calls, input and cache lengths, time, KV-cache bytes.

A :class:`ForwardProbe` attaches a forward pre-hook and a forward hook (with keyword arguments) to one module and
records, for every call of that module, the number of input tokens, the cache length before the call, the
call's wall time and the bytes the KV cache holds after it. The benchmark harness uses it

* on transformers' own ``generate`` (the ``hf-*`` baselines), whose loop it cannot instrument otherwise: target
  calls (so τ is reported for baselines too), per-step drafted/accepted counts, and the time split;
* on every run, ours included, for the memory figure: the peak bytes held by the KV caches that were passed to the
  model (the storage actually allocated, so a preallocated buffer counts at its full capacity).

Hooks fire only for calls of the hooked module itself: ``target.base_model(...)`` (the engine's prefill) is not
seen by a probe on ``target``, which matches :class:`~speculant.core.types.GenerationStats`, where the prefill is not
a target call either.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from speculant.core.cache import output_cache

__all__ = ["ForwardCall", "ForwardProbe", "cache_bytes", "peak_kv_bytes", "probing"]


def cache_bytes(cache) -> int:
    """Bytes of the distinct storages behind a transformers ``Cache``'s keys and values (0 for None or an
    unrecognised object). Views of one buffer count once, at the buffer's full size."""
    if cache is None:
        return 0
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", None) or ():
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


@dataclass
class ForwardCall:
    """One forward of the probed module: ``inputs`` tokens fed, ``past`` tokens in its cache before the call,
    ``seconds`` of wall time, ``kv_bytes`` held by the cache after it, ``end`` = ``time.perf_counter()`` when it
    returned (orders the calls of several probes)."""

    inputs: int
    past: int
    seconds: float
    kv_bytes: int
    end: float


@dataclass
class ForwardProbe:
    """Records every forward of ``module`` while attached (see :func:`probing`)."""

    module: torch.nn.Module
    calls: list[ForwardCall] = field(default_factory=list)
    _start: float = 0.0
    _past: int = 0
    _inputs: int = 0

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            self._inputs = int(ids.shape[-1])
        elif isinstance(embeds, torch.Tensor):
            self._inputs = int(embeds.shape[-2])
        else:
            self._inputs = 0
        cache = output_cache(kwargs)
        self._past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        self._start = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        end = time.perf_counter()
        cache = output_cache(kwargs)
        if cache is None and isinstance(output, dict):
            cache = output_cache(output)
        self.calls.append(ForwardCall(self._inputs, self._past, end - self._start, cache_bytes(cache), end))

    @contextmanager
    def attached(self) -> Iterator[ForwardProbe]:
        """Attach the hooks for the duration of the block (always removed afterwards)."""
        pre = self.module.register_forward_pre_hook(self._pre, with_kwargs=True)
        post = self.module.register_forward_hook(self._post, with_kwargs=True)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.calls)


@contextmanager
def probing(*modules: torch.nn.Module | None) -> Iterator[list[ForwardProbe | None]]:
    """One attached :class:`ForwardProbe` per module, in order (None for a None entry; a module given twice is
    probed once and its probe returned twice). The hooks are removed when the block ends."""
    probes: dict[int, ForwardProbe] = {}
    with ExitStack() as stack:
        out: list[ForwardProbe | None] = []
        for m in modules:
            if m is None:
                out.append(None)
                continue
            if id(m) not in probes:
                probes[id(m)] = stack.enter_context(ForwardProbe(m).attached())
            out.append(probes[id(m)])
        yield out


def peak_kv_bytes(*probes: ForwardProbe | None) -> int:
    """Peak of the summed KV-cache bytes of several probed models over their interleaved calls (each model's
    cache counted at its size after its latest call; None entries and repeated probes are ignored)."""
    probes = tuple({id(p): p for p in probes if p is not None}.values())
    events = sorted((c.end, i, c.kv_bytes) for i, p in enumerate(probes) for c in p.calls)
    current = [0] * len(probes)
    peak = 0
    for _, i, nbytes in events:
        current[i] = nbytes
        peak = max(peak, sum(current))
    return peak
