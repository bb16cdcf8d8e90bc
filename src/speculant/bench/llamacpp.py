"""Baselines that run the target's GGUF file through llama.cpp's own programs, the usual CPU runtime.

``llamacpp-ar``
    plain decoding: ``llama-lookup`` with no draft tokens (``--spec-draft-n-max 0``), so one target call per token
    in the same loop and with the same timers as the lookup baseline.
``llamacpp-lookup[:k=N]``
    llama.cpp's lookup decoding (``llama-lookup``: drafts of up to N tokens from its 1- to 4-gram cache of the
    prompt and the text so far).
``llamacpp-draft[:k=N]``
    llama.cpp's draft-model speculation (``llama-speculative-simple --spec-type draft-simple``) with the GGUF file
    of the target's draft (the one speculant ships for it, e.g. the 0.5B Qwen2.5-Coder for the 1.5B, or
    ``--draft``), N draft tokens per round (default 3), greedy verification by llama.cpp's sampler.

``make llamacpp`` builds these programs natively from the llama.cpp sources vendored in the ``llama-cpp-python``
sdist into ``.llamacpp/build/bin`` (``$SPECULANT_LLAMACPP_BIN`` points elsewhere); it is never part of ``make
test``. The target (and the draft) must come from a GGUF file (a packaged model or a ``.gguf`` path): llama.cpp
reads that file, with its own quantized weights and kernels.

Each generation is one subprocess with the same threads (``-t``/``-tb``), context, max new tokens and sampling
settings. The prompt is our token ids decoded to text with the special tokens written out, which llama.cpp
tokenises back (special tokens parsed); the count it reports is checked against ours. Times are the ones llama.cpp
prints itself (``encoded ... in S seconds``: the prompt, ``prefill_s``; ``decoded ... in S seconds``: the
decoding loop), so model loading and process start are excluded; ``wall_s`` is their sum. The programs print
text, not token ids: the output is re-tokenised with our tokenizer (and cut at max new tokens: llama.cpp's loops
may overshoot by a round; ``llama-speculative-simple`` does not print the stop token it ends at, which is put
back) for the identity column, while ``new_tokens`` and tokens/s are llama.cpp's own counts.
Per round, llama.cpp reports totals only: target calls = rounds = tokens - accepted drafts (each round emits its
accepted drafts plus one), τ = tokens / rounds, ``draft_acceptance`` = accepted / drafted; no per-round histogram.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.types import GenerationStats
from ..models.sources import SOURCE_FILE, gguf_backing

__all__ = ["INSTALL_HINT", "PROGRAMS", "SERVER_PROGRAM", "SETTINGS_NOTE", "LlamaTimings", "available", "bin_dir",
           "gguf_of", "llama_server_binary", "llama_server_command", "llamacpp_runner", "parse_timings",
           "start_llama_server", "stop_llama_server"]

PROGRAMS = {"llamacpp-ar": "llama-lookup", "llamacpp-lookup": "llama-lookup",
            "llamacpp-draft": "llama-speculative-simple"}
"""The llama.cpp program each baseline runs."""

SERVER_PROGRAM = "llama-server"
"""llama.cpp's HTTP server (OpenAI's chat API, and its own ``/completion`` and ``/infill``), for ``speculant bench
serve`` comparisons; ``make llamacpp`` builds it beside the baselines' programs."""

DEFAULT_DRAFT_K = 3
"""``llamacpp-draft``'s draft tokens per round when ``k`` is not given."""

SETTINGS_NOTE = ("llama.cpp baselines: llama.cpp's own programs (llama-lookup, llama-speculative-simple), built "
                 "natively by `make llamacpp`, one process per generation, same threads/prompt/max new tokens/"
                 "sampling; times are those llama.cpp prints (prompt encoding = prefill_s, its decoding loop), model "
                 "load excluded; token ids re-tokenised from its text; target calls = rounds = tokens - accepted")
"""Written into the results' settings when a llama.cpp baseline ran."""

INSTALL_HINT = ("the llama.cpp programs are not built: `make llamacpp` builds them natively into .llamacpp/ (about "
                "a quarter of an hour on a small machine; or set SPECULANT_LLAMACPP_BIN to a folder holding llama-lookup and "
                "llama-speculative-simple)")


def bin_dir() -> Path:
    """Where the llama.cpp programs are: ``$SPECULANT_LLAMACPP_BIN``, else ``.llamacpp/build/bin`` in the
    checkout this package runs from (``make llamacpp`` puts them there)."""
    env = os.environ.get("SPECULANT_LLAMACPP_BIN")
    return Path(env) if env else Path(__file__).resolve().parents[3] / ".llamacpp" / "build" / "bin"


def available() -> bool:
    """Whether every program of :data:`PROGRAMS` is built."""
    return all(os.access(bin_dir() / p, os.X_OK) for p in set(PROGRAMS.values()))


def gguf_of(model_dir: str | Path | None, role: str = "target") -> Path:
    """The GGUF file a converted model directory came from (its ``speculant_source.json``), or a one-line
    ValueError naming ``role`` ("target" or "draft")."""
    source = Path(model_dir) / SOURCE_FILE if model_dir is not None else None
    if source is None or not source.is_file():
        raise ValueError(f"llama.cpp baselines need a {role} converted from a GGUF file (a packaged model such as "
                         f"qwen2.5-coder-1.5b-instruct, or a path/to/model.gguf); {model_dir!s} is not one")
    import json

    path = gguf_backing(model_dir) or Path(json.loads(source.read_text())["gguf"])
    if not path.is_file():
        raise ValueError(f"the GGUF file {str(path)!r} the {role} was converted from is gone")
    return path


@dataclass(frozen=True)
class LlamaTimings:
    """What a llama.cpp lookup/speculative program reports on stderr after one generation."""

    prompt_tokens: int  # tokens llama.cpp made of the prompt
    prefill_s: float  # "encoded N tokens in S seconds"
    new_tokens: int  # "decoded N tokens in S seconds": n_predict
    decode_s: float
    drafted: int  # n_drafted
    accepted: int  # n_accept
    draft_s: float = 0.0  # llama-lookup's "t_draft = X ms" (its n-gram cache's time); 0 when not printed

    @property
    def rounds(self) -> int:
        """Target calls while decoding: each round emits its accepted drafts plus one token."""
        return max(0, self.new_tokens - self.accepted)


_PATTERNS = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}
_T_DRAFT = re.compile(r"t_draft\s*=\s*([0-9.]+) ms")


def parse_timings(text: str) -> LlamaTimings:
    """Parse the report ``llama-lookup``/``llama-speculative-simple`` print at the end (their stderr); a one-line
    ValueError naming the missing line when it is not there (e.g. the program failed)."""
    found = {}
    for key, pattern in _PATTERNS.items():
        match = pattern.search(text)
        if match is None:
            tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
            raise ValueError(f"llama.cpp printed no {key!r} line; its output ended: {tail[-300:]!r}")
        found[key] = match.groups()
    draft = _T_DRAFT.search(text)
    return LlamaTimings(prompt_tokens=int(found["encoded"][0]), prefill_s=float(found["encoded"][1]),
                        new_tokens=int(found["decoded"][0]), decode_s=float(found["decoded"][1]),
                        drafted=int(found["drafted"][0]), accepted=int(found["accepted"][0]),
                        draft_s=float(draft.group(1)) / 1e3 if draft else 0.0)


def generated_text(stdout: str, prompt_text: str) -> str:
    """The generated text of a program's stdout: ``"\\n\\n"``, the prompt, the new text, ``"\\n\\n\\n\\n"``."""
    body = stdout[2:] if stdout.startswith("\n\n") else stdout
    if body.startswith(prompt_text):
        body = body[len(prompt_text):]
    return body[:-4] if body.endswith("\n\n\n\n") else body.rstrip("\n")


def stats_from_timings(t: LlamaTimings) -> GenerationStats:
    """:class:`GenerationStats` totals from llama.cpp's report (no per-round histogram: it prints totals)."""
    stats = GenerationStats(new_tokens=t.new_tokens, target_calls=t.rounds, draft_tokens=t.drafted,
                            wall_s=t.prefill_s + t.decode_s, prefill_s=t.prefill_s, draft_forward_s=t.draft_s,
                            target_forward="llama.cpp")
    stats.target_forward_s = max(0.0, t.decode_s - t.draft_s)
    return stats


def command(name: str, options: Mapping[str, Any], gguf: Path, draft_gguf: Path | None, default_k: int,
            n_ctx: int, threads: int) -> list[str]:
    """The program and its arguments for baseline ``name`` (without prompt, length and sampling)."""
    if name not in PROGRAMS:
        raise ValueError(f"unknown llama.cpp baseline {name!r}; known: {', '.join(PROGRAMS)}")
    cmd = [str(bin_dir() / PROGRAMS[name]), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(n_ctx), "-b", str(n_ctx), "-ngl", "0"]
    if name == "llamacpp-ar":
        return cmd + ["--spec-draft-n-max", "0"]
    if name == "llamacpp-lookup":
        return cmd + ["--spec-draft-n-max", str(int(options.get("k", default_k)))]
    if draft_gguf is None:
        raise ValueError("llamacpp-draft needs the draft's GGUF file")
    return cmd + ["--spec-type", "draft-simple", "-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads),
                  "--spec-draft-n-max", str(int(options.get("k", DEFAULT_DRAFT_K))), "--spec-draft-n-min", "0"]


def llamacpp_runner(name: str, options: Mapping[str, Any], gguf: Path, tokenizer: Any, default_k: int,
                    stops: list[int], n_ctx: int, threads: int, draft_gguf: Path | None = None) -> Callable[..., dict]:
    """A ``run(ids, max_new_tokens, **sampling) -> row`` callable running baseline ``name`` of :data:`PROGRAMS`
    (a one-line ValueError when the programs are not built)."""
    if not available():
        raise ValueError(INSTALL_HINT)
    base = command(name, options, gguf, draft_gguf, default_k, n_ctx, threads)

    def run(ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, eos_token_id=None) -> dict:
        stop_ids = stops if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                                        else list(eos_token_id))
        prompt = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # the loops stop once they have made more than -n tokens: ask for one fewer (-n 0 would mean unlimited)
        cmd = [*base, "-p", prompt, "-n", str(max(1, max_new_tokens - 1)), "--temp", str(float(temperature)),
               "--top-k", str(top_k or 0), "--top-p", str(1.0 if top_p is None else top_p), "--min-p", "0",
               "--repeat-penalty", "1", "--seed", str(0 if seed is None else seed)]
        if not stop_ids:
            cmd.append("--ignore-eos")
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ValueError(f"{PROGRAMS[name]} failed (exit {done.returncode}): {tail[-300:]}")
        t = parse_timings(done.stderr)
        if t.prompt_tokens != len(ids):
            raise ValueError(f"llama.cpp made {t.prompt_tokens} tokens of a {len(ids)}-token prompt (the GGUF's "
                             "tokenizer does not read our decoded prompt back)")
        text = generated_text(done.stdout, prompt)
        new = list(tokenizer.encode(text, add_special_tokens=False))[:max_new_tokens]
        if name == "llamacpp-draft" and stop_ids and len(new) < min(t.new_tokens, max_new_tokens):
            # llama-speculative-simple does not print the end-of-generation token it stopped at: put it back (the
            # tokenizer's EOS when it is a stop, else the first stop) so the identity column compares like with like
            eos = getattr(tokenizer, "eos_token_id", None)
            new.append(eos if eos in stop_ids else stop_ids[0])
        stats = stats_from_timings(t)
        return {"token_ids": new, **stats.as_dict(), "depth_reached": [], "depth_accepted": [],
                "kv_cache_peak_bytes": 0, "draft_accepted": t.accepted,
                "llamacpp_decode_s": t.decode_s}

    return run


# ---------------------------------------------------------------------------------------------- llama-server


def llama_server_binary() -> Path:
    """The path of ``llama-server`` in :func:`bin_dir`, or a one-line ValueError saying how to build it."""
    path = bin_dir() / SERVER_PROGRAM
    if not os.access(path, os.X_OK):
        raise ValueError(f"{SERVER_PROGRAM} is not built: `make llamacpp` builds it natively into .llamacpp/ (or "
                         f"set SPECULANT_LLAMACPP_BIN to a folder holding {SERVER_PROGRAM})")
    return path


def llama_server_command(gguf: str | Path, port: int, threads: int | None = None, n_ctx: int = 0,
                         parallel: int = 1, alias: str | None = None) -> list[str]:
    """``llama-server`` serving ``gguf`` on ``127.0.0.1:port`` on the CPU, ``parallel`` slots, a context of
    ``n_ctx`` tokens per server (0: the model's), ``threads`` for decoding and prompts (None: llama.cpp's default),
    the model listed as ``alias`` (default: the file's stem). Its prompt cache is left at its default (on: each slot
    keeps its last prompt's KV cache and reuses the common prefix)."""
    cmd = [str(bin_dir() / SERVER_PROGRAM), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(n_ctx), "-np", str(parallel), "-ngl", "0", "-a", alias or Path(gguf).stem]
    if threads is not None:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    return cmd


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_llama_server(gguf: str | Path, threads: int | None = None, n_ctx: int = 0, parallel: int = 1,
                       log: str | Path | None = None, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """Start ``llama-server`` on ``gguf`` on a free loopback port (:func:`llama_server_command`; for benchmarks)
    and wait until ``GET /health`` answers 200; returns the process and its base URL. Its output goes to ``log``
    (default: discarded). Stop it with :func:`stop_llama_server`.

    Raises:
        ValueError: one line: the program is not built, the file is missing, or the server exits or is not ready
            within ``timeout_s`` seconds (with the end of its log when there is one).
    """
    import time
    import urllib.error
    import urllib.request

    llama_server_binary()  # a one-line error when it is not built
    if not Path(gguf).is_file():
        raise ValueError(f"--llama-server: no GGUF file {str(gguf)!r}")
    port = _free_port()
    cmd = llama_server_command(gguf, port, threads, n_ctx, parallel)  # runs that same binary
    sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115: closed with the process
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s

    def tail() -> str:
        if log is None:
            return ""
        lines = Path(log).read_text(errors="replace").strip().splitlines()[-2:]
        return ": " + " | ".join(lines)[-300:]

    while True:
        if proc.poll() is not None:
            raise ValueError(f"{SERVER_PROGRAM} exited with code {proc.returncode}{tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_llama_server(proc)
            raise ValueError(f"{SERVER_PROGRAM} was not ready after {timeout_s:.0f} s{tail()}")
        time.sleep(0.25)


def stop_llama_server(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop a server :func:`start_llama_server` started: SIGINT, then kill after ``grace_s`` seconds."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
