"""Baselines that run the target's GGUF file through llama.cpp (``llama-cpp-python``), the usual CPU runtime.

``llamacpp-ar``
    plain decoding of the same GGUF file.
``llamacpp-lookup[:k=N][:ngram=M]``
    llama-cpp-python's prompt-lookup decoding (``LlamaPromptLookupDecoding``).

They need ``llama-cpp-python`` (``make llamacpp`` builds it from source with ``-DGGML_NATIVE=OFF``: about 15
minutes on 2 cores; never part of ``make test``) and a target that came from a GGUF file (a packaged model such
as ``smollm2-135m-instruct``, or a ``.gguf`` path): llama.cpp reads that file, with its own quantized weights and
kernels. The tokens are therefore those of the quantized model, not of the dequantized one our methods and the
transformers baselines run: the identity column compares them all the same and says how often they agree.

Prompts are fed as our token ids (the GGUF's own vocabulary: the converted tokenizer has the same ids). Each
``eval`` call is probed like a transformers forward (tokens fed, tokens already in the context, time), so τ and
the target-call counts come out as for the other baselines.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..models.sources import SOURCE_FILE
from .hf import stats_from_calls
from .probe import ForwardCall

__all__ = ["available", "gguf_of", "llamacpp_runner"]

INSTALL_HINT = ("llama-cpp-python is not installed: `make llamacpp` builds it (about 15 minutes on 2 cores; "
                "CMAKE_ARGS=-DGGML_NATIVE=OFF pip install llama-cpp-python==0.3.36)")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(model_dir: str | Path | None) -> Path:
    """The GGUF file a converted model directory came from (its ``speculant-source.json``), or a ValueError."""
    source = Path(model_dir) / SOURCE_FILE if model_dir is not None else None
    if source is None or not source.is_file():
        raise ValueError("llama.cpp baselines need a target converted from a GGUF file (a packaged model such as "
                         "smollm2-135m-instruct, or --target path/to/model.gguf)")
    path = Path(json.loads(source.read_text())["gguf"])
    if not path.is_file():
        raise ValueError(f"the GGUF file {str(path)!r} the target was converted from is gone")
    return path


class _Probe:
    """Counts the llama.cpp context's ``eval`` calls like :class:`.probe.ForwardProbe` counts forwards."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.calls: list[ForwardCall] = []
        self._eval = llm.eval

        def eval_probed(tokens):
            past = int(self.llm.n_tokens)
            start = time.perf_counter()
            self._eval(tokens)
            end = time.perf_counter()
            self.calls.append(ForwardCall(len(tokens), past, end - start, 0, end))

        llm.eval = eval_probed


def llamacpp_runner(name: str, options: Mapping[str, Any], gguf: Path, default_k: int, stops: list[int],
                    n_ctx: int, threads: int) -> Callable[..., dict]:
    """A ``run(ids, max_new_tokens, **sampling) -> row`` callable for ``llamacpp-ar``/``llamacpp-lookup``."""
    if not available():
        raise ValueError(INSTALL_HINT)
    from llama_cpp import Llama

    draft = None
    if name == "llamacpp-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=int(options.get("k", default_k)),
                                          max_ngram_size=int(options.get("ngram", 2)))
    elif name != "llamacpp-ar":
        raise ValueError(f"unknown llama.cpp baseline {name!r}")
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                verbose=False)

    def run(ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, eos_token_id=None) -> dict:
        stop_ids = set(stops if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                                            else eos_token_id))
        if seed is not None:
            llm.set_seed(seed)
        probe = _Probe(llm)
        new: list[int] = []
        start = time.perf_counter()
        try:
            for tok in llm.generate(ids, temp=float(temperature), top_k=top_k or 0,
                                    top_p=1.0 if top_p is None else top_p, min_p=0.0, repeat_penalty=1.0,
                                    reset=True):
                new.append(int(tok))
                if tok in stop_ids or len(new) >= max_new_tokens:
                    break
        finally:
            llm.eval = probe._eval
        wall = time.perf_counter() - start
        stats = stats_from_calls(probe, len(ids), len(new))
        stats.wall_s, stats.target_forward = wall, "llama.cpp"
        return {"token_ids": new, **stats.as_dict(), "depth_reached": list(stats.depth_reached),
                "depth_accepted": list(stats.depth_accepted), "kv_cache_peak_bytes": 0}

    return run
