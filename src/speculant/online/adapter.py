"""The online adapter: wraps each generation's drafter, keeps what verification said, and runs update rounds.

Liu et al. 2024 ("Online Speculative Decoding"): the requests a deployment sees differ from the drafter's training
data, and verification already computes the target's distribution wherever the drafter proposed a token. An
:class:`OnlineAdapter` wraps each generation's drafter (:class:`~.observed.ObservedDrafter`), keeps what verification
said in a bounded buffer (:class:`~.buffer.OnlineBuffer`), and every ``update_every`` finished requests (once
``min_held`` requests are held back for the check) runs a round: a few distillation steps on a *copy* of the draft
model (:mod:`.trainer`), the copy checked on held-back requests (:mod:`.evaluation`) and swapped in for new requests
only if it agrees more, by more than noise; else it is rolled back. Each accepted update is a new version; every
round is logged in :attr:`OnlineAdapter.history`.

Exactness is untouched: the verifier does not care which drafter proposed. Only the draft's own parameters train,
and parameters shared with the target are never copied nor changed.

Where it runs: :meth:`OnlineAdapter.generate` (Python, sequential: the update runs between requests) or a server
(``speculant serve --online``), whose decoding thread takes the round a step at a time while idle
(:meth:`OnlineAdapter.work`; :mod:`.scheduler` says why not a thread of its own). ``state_dir`` persists the drafter's
trained parameters, the buffer, the traffic memory and the history (:mod:`.state`; saved on :meth:`~OnlineAdapter.stop`,
loaded on start).

With :attr:`~.config.OnlineConfig.traffic` the adapter also keeps a :class:`~.traffic.TrafficMemory` of every
finished request's tokens and merges its lookup chain into each draft: what earlier requests said is drafted again at
once, with no training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from . import evaluation
from .buffer import OnlineBuffer
from .config import OnlineConfig
from .evaluation import mcnemar_z, share
from .observed import Observation, ObservedDrafter
from .scheduler import RoundScheduler, run_steps
from .state import STATE_FILE, load_state, save_state
from .traffic import TrafficMemory, WithTraffic
from .trainer import optimizer_step, trainable_copy, trained_positions

__all__ = ["OnlineAdapter"]

log = logging.getLogger(__name__)


class OnlineAdapter:
    """Online adaptation of ``session``'s draft model (a :class:`speculant.session.Session` with a float draft
    model; with :attr:`~.config.OnlineConfig.distill` False, any session: the traffic memory only); ``state_dir``:
    where the state is saved and, if present, resumed from."""

    def __init__(self, session, config: OnlineConfig | None = None, state_dir: str | Path | None = None) -> None:
        from ..core.quant import quantization_of

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
        self.scheduler = RoundScheduler(self.due, self._round, self.config.quiet_s)
        self._gen = torch.Generator().manual_seed(self.config.seed)
        self.on_update = None  # called with each round's history entry (a server's metrics)
        if self.state_dir is not None and (self.state_dir / STATE_FILE).exists():
            self.load(self.state_dir)

    # ------------------------------------------------------------------------------------------- observing

    def drafter(self, spec=None) -> ObservedDrafter:
        """A fresh drafter of ``spec`` (None: the session's method) over the current draft model, with the traffic
        memory's chain merged in (if :attr:`~.config.OnlineConfig.traffic`), observed."""
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
        rose beyond noise (:attr:`~.config.OnlineConfig.min_z`; else roll it back). Returns the round's
        :attr:`history` entry."""
        if not self.config.distill:
            raise ValueError("this adapter does not distil (OnlineConfig.distill False): it has no updates to run")
        return run_steps(self._round())

    def pending(self) -> bool:
        """Whether :meth:`work` has something to do: a round under way, or one due."""
        return self.scheduler.pending()

    def work(self) -> dict[str, Any] | None:
        """One step of the current round (one training forward and backward, or one checking forward), starting a
        round if one is due; the round's :attr:`history` entry when this step ended it, else None. A server's
        decoding thread calls it while idle (see the module doc)."""
        return self.scheduler.work()

    def work_or_abandon(self) -> dict[str, Any] | None:
        """:meth:`work`, except that a step that fails abandons its round (logged; the drafter is unchanged) and
        returns None: an update must never take the program down."""
        try:
            return self.work()
        except Exception:  # noqa: BLE001: whatever failed, serving goes on with the drafter it had
            self.abandon()
            log.exception("online update failed; the drafter is unchanged")
            return None

    def abandon(self) -> None:
        """Drop the round under way (its half-trained copy); the serving drafter is unchanged, and the next round
        waits for ``update_every`` more requests (a round that fails is not retried at once)."""
        self.scheduler.drop()
        with self._lock:
            self._since_update = 0

    def agreement(self, model: torch.nn.Module, observations: list[Observation]) -> float:
        """Share of the drafted positions of ``observations`` where ``model``'s greedy token is the target's most
        probable one (the acceptance of a greedy draft at those positions; nan without positions)."""
        return share(run_steps(evaluation.agreement_hits(model, observations, self.config.window)))

    def _round(self) -> Generator[None, None, dict[str, Any]]:
        """:meth:`update` as a generator: yields after each forward (and backward), returns the history entry."""
        with self._lock:
            train, held = self.buffer.train(), self.buffer.held()
            self._since_update = 0
        cfg = self.config
        stopping = self.scheduler.stopping
        start = time.perf_counter()
        serving = self.session.draft
        candidate, params = trainable_copy(serving, self.session.target)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        losses = []
        usable = [o for o in train if trained_positions(o, cfg.positions).any()]
        for _ in range(cfg.steps if usable else 0):
            if stopping.is_set():
                break
            pick = torch.randint(len(usable), (min(cfg.batch, len(usable)),), generator=self._gen).tolist()
            losses.append((yield from optimizer_step(candidate, params, optimizer, [usable[i] for i in pick], cfg)))
        candidate.eval().requires_grad_(False)
        gained = lost = 0
        z = 0.0
        if stopping.is_set():  # stopping: a half-trained copy is neither checked nor kept
            losses = []
            before = after = float("nan")
        else:
            was = yield from evaluation.agreement_hits(serving, held, cfg.window)  # [N] bool: the serving one agrees
            now = yield from evaluation.agreement_hits(candidate, held, cfg.window)  # [N] bool: the copy agrees
            before, after = share(was), share(now)
            gained, lost, z = mcnemar_z(was, now)  # McNemar's, paired positions
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

    # ------------------------------------------------------------------------------------------- a background thread

    def set_busy(self, busy: bool) -> None:
        """For :meth:`start`'s thread: whether requests are running or waiting (its steps run only after
        ``quiet_s`` of idleness)."""
        self.scheduler.set_busy(busy)

    def start(self, poll_s: float = 0.5) -> None:
        """Run updates in a background thread whenever one is due (:meth:`due`), a step at a time after a quiet
        period (:meth:`set_busy`), until :meth:`stop`. On a machine with few cores prefer calling :meth:`work` from
        the decoding thread (:mod:`.scheduler` says why; ``speculant serve --online`` does)."""
        self.scheduler.start(self.work_or_abandon, poll_s)

    def stop(self) -> None:
        """Stop the background thread (an update in flight ends after its current step) and save the state to
        ``state_dir`` if one was given."""
        self.scheduler.stop()
        if self.state_dir is not None:
            self.save(self.state_dir)

    # ------------------------------------------------------------------------------------------- persistence

    def save(self, directory: str | Path) -> None:
        """Write the draft model's own parameters, the buffer, the traffic memory and the history to ``directory``
        (:mod:`.state`)."""
        with self._lock:  # the drafter and its version together
            save_state(directory, self.config, self.session.draft if self.config.distill else None,
                       self.session.target, self.buffer, self.traffic,
                       {"version": self.version, "history": self.history, "since_update": self._since_update})
        log.info("online state (drafter version %d, %d requests buffered) saved to %s", self.version,
                 len(self.buffer), directory)

    def load(self, directory: str | Path) -> None:
        """Resume from :meth:`save`'s files: the draft model's parameters (names and shapes must match), the
        buffer, the traffic memory and the history."""
        counters = load_state(directory, self.session.draft if self.config.distill else None, self.session.target,
                              self.buffer, self.traffic)
        self.version, self.history = counters["version"], counters["history"]
        self._since_update = counters["since_update"]
        log.info("online state resumed from %s: drafter version %d, %d requests buffered", directory, self.version,
                 len(self.buffer))
