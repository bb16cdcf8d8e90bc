"""Online speculative decoding: a served drafter distilled on the target's verdicts about its own drafts.

Liu et al. 2024 ("Online Speculative Decoding"): the requests a deployment sees differ from the drafter's training
data, and verification already computes the target's distribution wherever the drafter proposed a token. An
:class:`OnlineAdapter` wraps each generation's drafter (:class:`~speculant.drafters.observed.ObservedDrafter`),
keeps what verification said in a bounded buffer (:class:`~speculant.train.online.buffer.OnlineBuffer`), and every
``update_every`` finished requests (once ``min_held`` requests are held back for the check) runs a few distillation
steps (forward KL at the positions where the draft was refused, as in the paper; TVD++ or all drafted positions as
options) on a *copy* of the draft model. The copy is
checked on held-back requests (greedy agreement with the target's top token at every drafted position, which is
the acceptance of a greedy draft) and swapped in for new requests only if it agrees more, by more than noise
(McNemar's test over the paired positions, :attr:`OnlineConfig.min_z`); else it is rolled back. Each accepted
update is a new version; every round is logged in :attr:`OnlineAdapter.history`.

Exactness is untouched: the verifier does not care which drafter proposed. Only the draft's own parameters train:
its token embedding and LM head (for an attached drafter: the target's, shared) stay frozen, and parameters shared
with the target are never copied nor changed.

Where it runs: :meth:`OnlineAdapter.generate` (Python, sequential: the update runs between requests) or a server
(``speculant serve --online``): the server's decoding thread itself takes the update one step at a time
(:meth:`OnlineAdapter.work`: one training forward and backward, or one checking forward) whenever no request has
run or waited for ``quiet_s``, so a request that arrives waits for one step at most. Not a thread of its own: on a
machine with few cores, torch ops issued from a second thread (its own OpenMP team) slow every later parallel op of
the decoding thread for as long as that thread lives (measured on 2 cores: an elementwise op 30 -> 208 ms, a q4
forward 24 -> 108 ms, with the other thread idle). :meth:`start` still runs updates on a background thread for
Python programs that want one. ``state_dir`` persists the drafter's trained parameters, the buffer and the
history (:meth:`save` on shutdown, loaded on start).

With :attr:`OnlineConfig.traffic` the adapter also keeps a :class:`~speculant.drafters.traffic.TrafficMemory` of
every finished request's tokens and merges its lookup chain into each draft: what earlier requests said is drafted
again at once, with no training (persisted with the rest).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ...core.checks import vocab_size
from ...drafters.observed import Observation, ObservedDrafter
from ...drafters.traffic import MIN_SCORE, SCORINGS, TrafficMemory, WithTraffic
from ..losses import LOSSES, distill_loss_probs
from .buffer import OnlineBuffer

__all__ = ["OnlineAdapter", "OnlineConfig"]

log = logging.getLogger(__name__)

_STATE_FILE, _PARAMS_FILE, _BUFFER_FILE, _TRAFFIC_FILE = "online.json", "drafter.pt", "buffer.pt", "traffic.pt"


@dataclass
class OnlineConfig:
    """Settings of online adaptation (``speculant serve --online-*``)."""

    update_every: int = 16
    """Finished requests between two updates."""
    steps: int = 16
    """Optimizer steps per update."""
    batch: int = 4
    """Observations (requests) per step."""
    lr: float = 2e-4
    """AdamW learning rate."""
    loss: str = "fkl"
    """Distillation loss: ``fkl`` (the paper's), ``tvd`` or ``tvd++`` (:mod:`speculant.train.losses`)."""
    positions: str = "rejected"
    """Positions a step trains on: ``rejected`` (where the draft was refused, as the paper) or ``all`` drafted."""
    top_k: int = 32
    """Target probabilities kept per position."""
    max_bytes: int = 32 << 20
    """Bound of the buffer's tensors."""
    holdout_every: int = 5
    """One request in this many is held back for the check."""
    window: int = 512
    """Context tokens a training forward reads before the positions it trains."""
    prompt_weight: float = 0.0
    """Weight of a next-token loss on each request's own text before its first drafted position (its prompt, within
    the ``window`` a training forward reads), added to the distillation loss: the traffic's text itself, with the
    token that follows as the label (no target distribution is known there); 0: off."""
    min_positions: int = 16
    """Refused positions the buffer must hold before an update."""
    min_held: int = 4
    """Held-back requests the buffer must hold before an update: the check compares two drafters' agreement on them,
    and acceptance varies more between requests than within one, so a single request cannot tell a better drafter
    from noise (measured on a 100-request stream, SmolLM2, before this bound: a copy trained at lr 1e-3 passed the
    check on the one held-back request of the first 8, 42 of its 71 positions against 41, then drafted worse than the
    shipped drafter on 20 of the 32 requests it served, τ 0.976x on average; versions 2-4, checked on 8-14 held-back
    requests, drafted at 1.10-1.14x; benchmarks/results/online-stream-js-v2)."""
    min_z: float = 1.64
    """How sure the check must be that the copy agrees more: McNemar's z over the held-back positions where exactly
    one of the two drafters agrees with the target, ``(gained - lost) / sqrt(gained + lost)``; the copy is swapped
    in only if ``z >= min_z`` (1.64: one-sided 5% were positions independent; 0: only "agreement did not drop").
    A copy distilled a few steps on a few requests often moves agreement by noise alone, and "did not drop" then
    passes about half the time: the first kept update of benchmarks/results/online-stream-js-v2 passed on 42
    agreeing positions against 41 and drafted worse than the shipped drafter on 20 of the 32 requests it served."""
    distill: bool = True
    """Distil the draft model on the traffic (the updates above); False: the traffic memory only (``traffic`` > 0),
    for any method, with or without a draft model, quantized or not."""
    traffic: int = 0
    """Tokens per step drafted from the traffic memory (:mod:`speculant.drafters.traffic`: every finished request's
    tokens, looked up like prompt lookup and merged into each draft as one more chain, or with ``traffic_tree`` a
    tree this deep); 0: none. The memory is
    shared by every request (its module doc says what a response's acceptance then tells of earlier ones). Where its
    chain is accepted the position counts as not refused, so with ``positions="rejected"`` the draft model does not
    train there (as with ``lookup=N``)."""
    traffic_min_ngram: int = 1
    """The shortest context suffix (tokens, 1-3) the traffic memory drafts from; 2 drops the chains a single token's
    continuation offers: replaying the 200-request code-chat-train stream with SmolLM2's drafter and 8 tokens per step
    (``benchmarks/traffic_replay.py``, online-stream-traffic-v1, ``"recent"`` scoring) gave 9.8-11.1 draft nodes per
    step instead of 12.6-13.8 for about 1% less τ, for CPUs where every verified row costs."""
    traffic_scoring: str = "frequent"
    """How the traffic memory picks among earlier occurrences of the context
    (:data:`~speculant.drafters.traffic.SCORINGS`): ``"frequent"`` walks its n-gram counts (what most often
    followed), which sharpen as the traffic grows; ``"recent"`` copies what followed the most recent one. Replayed
    with SmolLM2 and prompt lookup (``benchmarks/online_replay.py``, benchmarks/results/online-replay-cc-v1): on a
    400-request code-chat-train stream τ per 50-request window -0.7% (the first) to +3.8% (the last) against
    ``"recent"`` with 25-33% fewer draft tokens per step (with the default ``traffic_min_score``; +0.3% to +5.8% τ
    without it), and level or ahead on a 150-request ShareGPT JavaScript stream with 23-33% fewer."""
    traffic_min_score: float = MIN_SCORE
    """``"frequent"`` scoring: end the memory's chain where its estimated chance of being right falls below this
    (:class:`~speculant.drafters.traffic.TrafficMemory`'s ``min_score``); 0: no bound. Raise it where a verified row
    costs more (a quantized 1.5B target on a CPU), lower it where rows are nearly free."""
    traffic_tree: int = 0
    """``"frequent"`` scoring: draft the memory's tree of at most this many nodes instead of its one chain
    (:meth:`~speculant.drafters.traffic.TrafficMemory.tree`: the best-scoring continuations side by side, each down to
    ``traffic_min_score``); 0: the chain. The memory's counts cover more of the traffic as it grows (on a 400-request
    code stream the answer tokens whose 3-token context had been followed by them before rose from 15% in the first 50
    requests to 32% in the last 50), while a chain proposes only the most frequent continuation; a tree proposes the
    others too, for more verified rows per step (benchmarks/results/online-ceiling-cc). Pair it with a lower
    ``traffic_min_score`` (a tree of 64 nodes grows little above 0.1; the measured trees used 0.05 for 16 nodes, 0.01
    for 64). On a 2-core CPU a 64-node tree's rows cost more than its τ gains
    (benchmarks/results/online-stream-traffic-lookup-tree64-v1); where rows cost little it should pay."""
    traffic_tokens: int = 1 << 17
    """Bound of the traffic memory, in tokens (with its counts 270-290 bytes each measured on code requests with
    ``"frequent"`` scoring, 80 with ``"recent"``'s index, benchmarks/results/traffic_memory_size.json: about 37 MB
    at this default; more where the traffic repeats few n-grams)."""
    quiet_s: float = 0.25
    """In a server, the idle time before training steps: under steady load (no idle gap that long) updates wait, so
    requests never queue behind training; a request that arrives meanwhile waits for one step at most."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"online loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.positions not in ("rejected", "all"):
            raise ValueError(f"online positions must be 'rejected' or 'all', got {self.positions!r}")
        if not self.prompt_weight >= 0:  # also refuses nan
            raise ValueError(f"online prompt_weight must be >= 0, got {self.prompt_weight}")
        if not self.min_z >= 0:  # also refuses nan
            raise ValueError(f"online min_z must be >= 0, got {self.min_z}")
        if self.traffic < 0:
            raise ValueError(f"online traffic must be >= 0 tokens (0: no traffic memory), got {self.traffic}")
        if not 1 <= self.traffic_min_ngram <= 3:
            raise ValueError(f"online traffic_min_ngram must be 1, 2 or 3 (the memory matches suffixes of at most 3 "
                             f"tokens), got {self.traffic_min_ngram}")
        if self.traffic_scoring not in SCORINGS:
            raise ValueError(f"online traffic_scoring must be one of {', '.join(SCORINGS)}, got "
                             f"{self.traffic_scoring!r}")
        if not 0 <= self.traffic_min_score < 1:  # also refuses nan
            raise ValueError(f"online traffic_min_score must be in [0, 1), got {self.traffic_min_score}")
        if not (isinstance(self.traffic_tree, int) and not isinstance(self.traffic_tree, bool)
                and self.traffic_tree >= 0):
            raise ValueError(f"online traffic_tree must be an integer >= 0 nodes (0: a chain), got "
                             f"{self.traffic_tree!r}")
        if self.traffic_tree and not self.traffic:
            raise ValueError("online traffic_tree needs traffic > 0 (the tree's depth, in tokens)")
        if self.traffic_tree and self.traffic_scoring != "frequent":
            raise ValueError("online traffic_tree needs frequent traffic scoring (a tree walks the memory's counts)")
        if not self.distill and not self.traffic:
            raise ValueError("online adaptation without distillation adapts nothing: give traffic > 0 (the traffic "
                             "memory's tokens per step)")
        for name in ("update_every", "steps", "batch", "top_k", "window", "max_bytes", "min_held", "traffic_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"online {name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"online lr must be positive, got {self.lr}")
        if not self.quiet_s >= 0:
            raise ValueError(f"online quiet_s must be >= 0 seconds, got {self.quiet_s}")


class OnlineAdapter:
    """Online adaptation of ``session``'s draft model (a :class:`speculant.session.Session` with a float draft
    model; with :attr:`OnlineConfig.distill` False, any session: the traffic memory only); ``state_dir``: where the
    state is saved and, if present, resumed from."""

    def __init__(self, session, config: OnlineConfig | None = None, state_dir: str | Path | None = None) -> None:
        from ...core.quant import quantization_of

        config = config or OnlineConfig()
        draft = session.draft
        if draft is None and config.distill:
            raise ValueError("online adaptation needs a method with a draft model (e.g. chain:k=4 with --draft), or "
                             "the traffic memory alone (distill=False, traffic > 0; serve: --no-online-distill "
                             "--online-traffic N)")
        if config.distill and quantization_of(draft) != "none":
            raise ValueError(f"online adaptation trains the draft model, which is quantized "
                             f"({quantization_of(draft)}): load it in float (--quantization none; in Python "
                             "speculant.load(..., draft_quantization='none'))")
        self.session, self.config = session, config
        self.buffer = OnlineBuffer(self.config.max_bytes, self.config.holdout_every)
        self.traffic = (TrafficMemory(max_tokens=self.config.traffic_tokens, min_ngram=self.config.traffic_min_ngram,
                                      scoring=self.config.traffic_scoring, min_score=self.config.traffic_min_score)
                        if self.config.traffic else None)
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._since_update = 0
        self._lock = threading.Lock()  # one update at a time; the buffer's add vs an update's snapshot
        self._free = threading.Event()  # set while no request waits: a background update may take a step
        self._free.set()
        self._free_since = time.monotonic()
        self._server = False  # set_busy() was called: updates wait for quiet periods
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gen = torch.Generator().manual_seed(self.config.seed)
        self._current = None  # the round under way (a generator: work() takes its next step)
        self.on_update = None  # called with each round's history entry (a server's metrics)
        if self.state_dir is not None and (self.state_dir / _STATE_FILE).exists():
            self.load(self.state_dir)

    # ------------------------------------------------------------------------------------------- observing

    def drafter(self, spec=None) -> ObservedDrafter:
        """A fresh drafter of ``spec`` (None: the session's method) over the current draft model, with the traffic
        memory's chain merged in (if :attr:`OnlineConfig.traffic`), observed."""
        inner = self.session.drafter(spec)
        if inner is None:
            raise ValueError("online adaptation needs a drafting method, not plain decoding")
        if self.traffic is not None:
            inner = WithTraffic(inner, self.traffic, self.config.traffic, self.config.traffic_tree)
        return ObservedDrafter(inner, self.config.top_k, record=self.config.distill)

    def observe(self, drafter: ObservedDrafter) -> None:
        """Keep what verification said of ``drafter``'s generation (call it once the generation ended)."""
        observation = drafter.observation()
        with self._lock:
            if observation is not None and self.config.distill:
                self.buffer.add(observation)
            if self.traffic is not None:
                self.traffic.add(drafter.token_ids)
            self._since_update += 1

    def due(self) -> bool:
        """Whether enough requests finished since the last update, enough refused positions are buffered and enough
        requests are held back to check an update on."""
        with self._lock:  # the worker adds (and evicts) under the lock
            return (self.config.distill and self._since_update >= self.config.update_every
                    and self.buffer.positions(rejected_only=True) >= self.config.min_positions
                    and len(self.buffer.held()) >= self.config.min_held)

    def generate(self, prompt, **kwargs):
        """:meth:`speculant.session.Session.generate` with an observed drafter, then an update when one is due (in
        this thread, between requests). Returns the generation."""
        drafter = self.drafter(kwargs.pop("method", None))
        generation = self.session.generate(prompt, drafter=drafter, **kwargs)
        self.observe(drafter)
        if self.due():
            self.update()
        return generation

    # ------------------------------------------------------------------------------------------- updating

    def update(self) -> dict[str, Any]:
        """One round: train a copy of the draft model, check it on held-back requests, swap it in if its agreement
        rose beyond noise (:attr:`OnlineConfig.min_z`; else roll it back). Returns the round's :attr:`history` entry."""
        if not self.config.distill:
            raise ValueError("this adapter does not distil (OnlineConfig.distill False): it has no updates to run")
        return _run(self._round())

    def pending(self) -> bool:
        """Whether :meth:`work` has something to do: a round under way, or one due."""
        return self._current is not None or self.due()

    def work(self) -> dict[str, Any] | None:
        """One step of the current round (one training forward and backward, or one checking forward), starting a
        round if one is due; the round's :attr:`history` entry when this step ended it, else None. A server's
        decoding thread calls it while idle (see the module doc)."""
        if self._current is None:
            if not self.due():
                return None
            self._current = self._round()
        try:
            next(self._current)
        except StopIteration as done:
            self._current = None
            return done.value
        return None

    def abandon(self) -> None:
        """Drop the round under way (its half-trained copy); the serving drafter is unchanged, and the next round
        waits for ``update_every`` more requests (a round that fails is not retried at once)."""
        self._current = None
        with self._lock:
            self._since_update = 0

    def _round(self):
        """:meth:`update` as a generator: yields after each forward (and backward), returns the history entry."""
        with self._lock:
            train, held = self.buffer.train(), self.buffer.held()
            self._since_update = 0
        cfg = self.config
        start = time.perf_counter()
        serving = self.session.draft
        candidate, params = self._trainable_copy(serving)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        losses = []
        usable = [o for o in train if _trained(o, cfg.positions).any()]
        for _ in range(cfg.steps if usable else 0):
            if self._stop.is_set():
                break
            pick = torch.randint(len(usable), (min(cfg.batch, len(usable)),), generator=self._gen).tolist()
            losses.append((yield from self._step(candidate, params, optimizer, [usable[i] for i in pick])))
        candidate.eval().requires_grad_(False)
        gained = lost = 0
        if self._stop.is_set():  # stopping: a half-trained copy is neither checked nor kept
            losses = []
            before = after = float("nan")
        else:
            was = yield from self._hits(serving, held)  # [N] bool: the serving drafter agrees at held position i
            now = yield from self._hits(candidate, held)
            before, after = _share(was), _share(now)
            gained, lost = int((now & ~was).sum()), int((was & ~now).sum())
        z = (gained - lost) / (gained + lost) ** 0.5 if gained + lost else 0.0  # McNemar's, paired positions
        accepted = bool(losses) and after >= before and z >= cfg.min_z
        if accepted:
            with self._lock:  # save() reads the drafter and its version together
                self.session.draft = candidate  # new requests draft with it; running ones keep theirs
                self.version += 1
        entry = {"version": self.version, "accepted": accepted, "steps": len(losses),
                 "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                 "agreement_before": before, "agreement_after": after, "gained": gained, "lost": lost,
                 "z": round(z, 3), "train_requests": len(train),
                 "held_requests": len(held), "buffer_bytes": self.buffer.nbytes, "seconds": time.perf_counter() - start,
                 "time": time.time()}
        self.history.append(entry)
        if self.on_update is not None:
            self.on_update(entry)
        log.info("online update %s: agreement %.3f -> %.3f on %d held-back requests (z %.2f, %d steps, %.1f s)%s",
                 "accepted" if accepted else "rolled back", before, after, len(held), z, len(losses),
                 entry["seconds"], f", drafter version {self.version}" if accepted else "")
        return entry

    def _step(self, candidate: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
              batch: list[Observation]):
        """Generator: one optimizer step of ``candidate`` on ``batch`` (one forward and backward per observation,
        yielding after each: a server gets the CPU back between them, gradients clipped to norm 1); returns the batch's
        mean loss."""
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for o in batch:
            with torch.enable_grad():
                loss = self._loss(candidate, o) / len(batch)
                loss.backward()
            total += float(loss.detach())
            yield
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return total

    def _trainable_copy(self, model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        """A deep copy of ``model`` sharing (not copying) the target's tensors, and its trainable parameters: all
        but the token embedding, the LM head and anything shared with the target."""
        target = self.session.target
        memo: dict[int, Any] = {id(t): t for t in target.parameters()}
        memo.update({id(m): m for m in target.modules()})
        candidate = copy.deepcopy(model, memo)
        frozen = {id(p) for p in target.parameters()}
        for m in (candidate.get_input_embeddings(), candidate.get_output_embeddings()):
            if m is not None:
                frozen.update(id(p) for p in m.parameters())
        params = []
        for p in candidate.parameters():
            train = id(p) not in frozen and p.is_floating_point()
            p.requires_grad_(train)
            if train:
                params.append(p)
        if not params:
            raise ValueError("the draft model has no parameters of its own to adapt")
        return candidate, params

    def _logits(self, model: torch.nn.Module, o: Observation, keep: torch.Tensor, prompt: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [P, V], selected [P'] bool, prompt rows [R])``: ``model``'s logits at the positions of ``o``
        picked by ``keep`` ``[P']`` whose predicting row is inside the context window (``selected`` of those picked);
        one forward over the window, the LM head on those rows only (most of a small drafter's cost is its head over
        the vocabulary). ``prompt``: then also at the rows (indices in ``o.ids``, returned) predicting the prompt's
        tokens inside the window, the text before the first drafted position (``[P + R, V]``); else R = 0."""
        positions = o.positions[keep]
        end = int(positions.max())
        start = max(0, end - self.config.window)
        selected = positions - 1 >= start
        first = int(o.positions.min()) - 1 if prompt else start  # the prompt's rows end before the first drafted one
        text = torch.arange(start, max(start, first), dtype=torch.int64)  # [R]: none once the window starts later
        rows = torch.cat([positions[selected] - 1, text]) - start
        logits = model(input_ids=o.ids[start:end].long()[None], logits_to_keep=rows).logits[0]
        return logits, selected, text

    def _loss(self, model: torch.nn.Module, o: Observation) -> torch.Tensor:
        """The distillation loss of ``model`` on ``o``'s trained positions (within the context window), plus
        :attr:`OnlineConfig.prompt_weight` times the next-token loss on the prompt's tokens in that window."""
        keep = _trained(o, self.config.positions)
        prompt = self.config.prompt_weight > 0
        logits, selected, text_rows = self._logits(model, o, keep, prompt)  # [P + R, V]
        top_ids, top_p = o.top_ids[keep][selected].long(), o.top_p[keep][selected].float()
        vocab = logits.shape[-1]
        own, text = logits[: len(top_ids)], logits[len(top_ids):]  # [P, V], [R, V]
        top_p = top_p * (top_ids < vocab)
        q = torch.zeros_like(own, dtype=torch.float32).scatter_(1, top_ids.clamp_max(vocab - 1), top_p)  # [P, V]
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-12)
        loss = distill_loss_probs(own, q, self.config.loss)
        labels = o.ids[text_rows + 1].long()  # [R]: the prompt token each row predicts
        if prompt and bool((labels < vocab).any()):  # (an id beyond the draft's vocabulary is no label)
            loss = loss + self.config.prompt_weight * torch.nn.functional.cross_entropy(
                text.float(), labels.masked_fill(labels >= vocab, -100), ignore_index=-100)
        return loss

    def agreement(self, model: torch.nn.Module, observations: list[Observation]) -> float:
        """Share of the drafted positions of ``observations`` where ``model``'s greedy token is the target's most
        probable one (the acceptance of a greedy draft at those positions; nan without positions)."""
        return _share(_run(self._hits(model, observations)))

    def _hits(self, model: torch.nn.Module, observations: list[Observation]):
        """Generator (yields after each forward) returning ``[N]`` bool over the drafted positions of
        ``observations`` (those inside the context window), in order: ``model``'s greedy token is the target's."""
        hits = []
        for o in observations:
            with torch.no_grad():
                logits, selected, _ = self._logits(model, o, torch.ones_like(o.rejected))  # [P, V]
            hits.append(logits.argmax(-1) == o.top_ids[selected, 0].long())
            yield
        return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)

    # ------------------------------------------------------------------------------------------- a background thread

    def set_busy(self, busy: bool) -> None:
        """For :meth:`start`'s thread: whether requests are running or waiting (its steps run only after
        ``quiet_s`` of idleness)."""
        self._server = True
        if busy and not self._stop.is_set():  # once stopping, an update in flight runs to its end unhindered
            self._free.clear()
        elif not self._free.is_set():
            self._free_since = time.monotonic()
            self._free.set()

    def _wait_quiet(self) -> None:
        """Return once no request has been running or waiting for ``quiet_s`` (at once without :meth:`set_busy`,
        or when stopping)."""
        while self._server and not self._stop.is_set():
            self._free.wait()
            idle = time.monotonic() - self._free_since
            if self._free.is_set() and idle >= self.config.quiet_s:
                return
            time.sleep(max(0.0, self.config.quiet_s - idle) + 0.001)

    def start(self, poll_s: float = 0.5) -> None:
        """Run updates in a background thread whenever one is due (:meth:`due`), a step at a time after a quiet
        period (:meth:`set_busy`), until :meth:`stop`. On a machine with few cores prefer calling :meth:`work` from
        the decoding thread (the module doc says why; ``speculant serve --online`` does)."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(poll_s):
                try:
                    while self.pending() and not self._stop.is_set():
                        self._wait_quiet()
                        self.work()
                except Exception:  # an update must never take the program down
                    self.abandon()
                    log.exception("online update failed; the drafter is unchanged")

        self._thread = threading.Thread(target=loop, name="speculant-online", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (an update in flight ends after its current step) and save the state to
        ``state_dir`` if one was given."""
        self._stop.set()
        self._free.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.state_dir is not None:
            self.save(self.state_dir)

    # ------------------------------------------------------------------------------------------- persistence

    def _own_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        shared = {id(p) for p in self.session.target.parameters()}
        return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) not in shared}

    def save(self, directory: str | Path) -> None:
        """Write the draft model's own parameters, the buffer and the history to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self.config.distill:
                torch.save(self._own_state(self.session.draft), directory / _PARAMS_FILE)
            torch.save(self.buffer.state_dict(), directory / _BUFFER_FILE)
            if self.traffic is not None:
                torch.save(self.traffic.state_dict(), directory / _TRAFFIC_FILE)
            state = {"version": self.version, "history": self.history, "config": asdict(self.config),
                     "since_update": self._since_update}
        (directory / _STATE_FILE).write_text(json.dumps(state, indent=1))
        log.info("online state (drafter version %d, %d requests buffered) saved to %s", self.version,
                 len(self.buffer), directory)

    def load(self, directory: str | Path) -> None:
        """Resume from :meth:`save`'s files: the draft model's parameters (names and shapes must match), the
        buffer and the history."""
        directory = Path(directory)
        try:
            state = json.loads((directory / _STATE_FILE).read_text())
            params = torch.load(directory / _PARAMS_FILE, weights_only=True) if self.config.distill else {}
            buffer = torch.load(directory / _BUFFER_FILE, weights_only=True)
            traffic = torch.load(directory / _TRAFFIC_FILE, weights_only=True) \
                if self.traffic is not None and (directory / _TRAFFIC_FILE).exists() else None
        except Exception as e:  # noqa: BLE001: a missing, truncated or foreign file (pickle, JSON, torch errors)
            raise ValueError(f"cannot read the online state in {directory}: {type(e).__name__}: {e}") from None
        if not all(k in state for k in ("version", "history")) or "items" not in buffer:
            raise ValueError(f"the online state in {directory} is incomplete (online.json or buffer.pt)")
        own = dict(self.session.draft.named_parameters()) if params else {}
        for name, value in params.items():
            if name not in own or own[name].shape != value.shape:
                raise ValueError(f"the online state in {directory} is for another draft model "
                                 f"(parameter {name!r} {tuple(value.shape)} does not fit)")
        if traffic is not None:
            try:  # a bad file: a ValueError before the drafter changes
                self.traffic.load_state_dict(traffic, vocab_size(self.session.target))
            except ValueError as e:
                raise ValueError(f"the online state in {directory}: {e}") from None
        with torch.no_grad():  # in place: a packed lean forward sees the version counters move and rebuilds
            for name, value in params.items():
                own[name].copy_(value)
        self.buffer.load_state_dict(buffer)
        self.version, self.history = int(state["version"]), list(state["history"])
        self._since_update = int(state.get("since_update", 0))
        log.info("online state resumed from %s: drafter version %d, %d requests buffered", directory, self.version,
                 len(self.buffer))


def _trained(o: Observation, positions: str) -> torch.Tensor:
    """``[P]`` bool: the positions of ``o`` a step trains on."""
    return o.rejected if positions == "rejected" else torch.ones_like(o.rejected)


def _share(hits: torch.Tensor) -> float:
    """The share of True in ``hits`` (nan when empty)."""
    return float(hits.float().mean()) if hits.numel() else float("nan")


def _run(steps):
    """Drive a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
