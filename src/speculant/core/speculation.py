"""Speculation that adapts to load: each step, each sequence's draft depth from its measured acceptance and the
measured cost of a target forward over the batch's rows (goodput; after "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput", SmartSpec).

Batching and speculation compete for the same rows: a forward over a batch reads every weight once whatever the
number of rows, but its cost grows with them (on this 2-core CPU, Qwen2.5-Coder-1.5B q4: about 1x, 1.3x and 2.3x
one row's cost at 4, 8 and 16 rows). Speculating deeper pays while the expected extra tokens outweigh the rows
they add. :class:`Speculation` decides per step, in one of three modes:

* ``on``: every drafter drafts as deep as it likes (a single generation's behaviour);
* ``off``: no drafts (plain decoding for every sequence);
* ``auto``: maximise expected goodput, tokens committed per second of the step:

  ``G(k) = sum_i E_i(k_i) / (D(k) + F(sum_i (1 + w_i k_i)))``,

  where sequence i drafts ``k_i`` levels (at most its drafter's own depth), ``E_i(k) = 1 + a_i + ... + a_i^k``
  is its expected number of committed tokens (bonus included) with ``a_i`` its measured per-level acceptance (a
  prior of 0.6 worth two levels until measured), ``c_i`` its measured seconds per draft level, ``w_i`` its draft
  tokens per level (a chain: 1, a tree: its width), and ``F(rows)`` the target forward's measured seconds for that
  many rows (:class:`ForwardCost`). ``D(k)``, the drafting time, is ``sum_i k_i c_i`` when each sequence drafts
  alone; when the batch runs its sequences' draft forwards together (:mod:`.draft_batch`) the sequences of one
  draft model share each level's forward, so their time is its deepest level times its slowest per-level figure,
  ``max_i k_i * max_i c_i`` per draft model (a sequence drafting no deeper than another of its model drafts for
  free; drafters without a model, lookup, share nothing). The depths are raised one level
  at a time where the gain is largest, as long as the goodput grows (``E`` is concave in ``k``; with a shared draft
  forward the time is not linear in one ``k_i``, so the climb also tries raising every sequence of a model to the
  next level together).

A sequence whose drafter has not drafted yet starts only when that pays: its first proposal feeds its whole context
to the draft model (the draft's prefill, paid inside a step the batch waits for), so it starts when the seconds
drafting is expected to save over the tokens it may still commit exceed that prefill's expected seconds, both from
what the earlier sequences of its draft model measured (acceptance, depth, width, seconds per level and per
context token, answer length; see ``Speculation._starts``). The first sequence of a draft model always starts, and
one after eight turned down too (fresh figures; the wait doubles after each such start, up to 64, until the rule
itself starts one again). Such explorations, and the probes that take a drafting sequence one level past its plan
every eight steps, are made only where drafting could pay at all: at an acceptance of 0.95 (or the drafter's own
where higher) some depth must raise the step's goodput. Where a batch's forward grows faster than any draft row
could return (four sequences on a 2-core CPU), what they would measure cannot change the plan, and their catch-up
forwards, draft levels and verification rows would be spent for nothing while the batch waits. Under load with a
drafter that predicts the traffic poorly, a new request then decodes plainly from its first step instead of paying
the draft's prefill for little or nothing. Drafting, and starting to,
must promise 3% more goodput than none: the model leaves out per-step work that grows with drafting.

Exactness is untouched: the verifier does not care how deep a drafter drafted (a depth of 0 is plain decoding).
Greedy output is the same at any depth; a sampled request's draws depend on the depths, so a request with a seed
keeps its method's own depth in every mode but ``off`` (its seed then reproduces its output under any load).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence as Seq

import torch

from .drafting import capability

__all__ = ["MODES", "ForwardCost", "Speculation"]

MODES = ("auto", "on", "off")
"""Accepted values of ``speculation=`` (``--speculation``)."""

_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT = 0.6, 2.0


class ForwardCost:
    """Seconds of a target forward by its number of rows: a running mean per row count (the last ``memory``
    observations weigh most), read between the counts seen by linear interpolation and beyond them by the line
    through the two nearest (never below the cost of fewer rows)."""

    def __init__(self, memory: int = 8) -> None:
        self.memory = memory
        self._seen: dict[int, tuple[float, int]] = {}  # rows -> (mean seconds, observations)

    def observe(self, rows: int, seconds: float) -> None:
        mean, n = self._seen.get(rows, (0.0, 0))
        n = min(n + 1, self.memory)
        self._seen[rows] = (mean + (seconds - mean) / n, n)

    @property
    def known(self) -> bool:
        """Whether any forward was measured."""
        return bool(self._seen)

    def __call__(self, rows: int) -> float:
        if not self._seen:
            return 1.0
        points = sorted((r, m) for r, (m, _) in self._seen.items())
        if rows in self._seen:
            return self._seen[rows][0]
        if len(points) == 1:
            return points[0][1]  # one point: flat (as a memory-bound forward is, until measured otherwise)
        below = [p for p in points if p[0] < rows]
        above = [p for p in points if p[0] > rows]
        if below and above:
            (r0, m0), (r1, m1) = below[-1], above[0]
        elif above:  # fewer rows than any seen: the first two points' line, not below zero
            (r0, m0), (r1, m1) = points[0], points[1]
        else:  # more rows than any seen
            (r0, m0), (r1, m1) = points[-2], points[-1]
        slope = max(0.0, (m1 - m0) / (r1 - r0))
        return max(0.0, m0 + slope * (rows - r0))

    def calibrate(self, forward, rows: Seq[int] = (1, 4, 8, 16), repeats: int = 3) -> None:
        """Measure ``forward(rows)`` (a callable running one target forward over that many new rows) for each row
        count, after one warm-up: a start for :meth:`__call__` before any step ran."""
        for r in rows:
            forward(r)
        for _ in range(repeats):
            for r in rows:
                start = time.perf_counter()
                forward(r)
                self.observe(r, time.perf_counter() - start)


class Speculation:
    """Chooses the draft depth of every sequence of a batch, each step (see the module doc)."""

    def __init__(self, mode: str = "on", cost: ForwardCost | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.cost = cost if cost is not None else ForwardCost()
        self._pools: dict[object, _Pool] = {}  # per draft model (or drafter kind): what its sequences measured
        self._counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> what observe pooled
        self._refused: weakref.WeakSet = weakref.WeakSet()  # sequences _starts turned down at least once

    def plan(self, all_sequences: list, shared_drafts: bool = False) -> None:
        """Set each sequence's ``state.max_draft`` for the next step (:class:`~speculant.core.sequence.Sequence`:
        its statistics, drafter depth and width). ``shared_drafts``: the sequences of one draft model draft in
        shared forwards (:mod:`.draft_batch`)."""
        own = {id(s): s.speculation or self.mode for s in all_sequences}  # a sequence's own mode wins
        self.observe(all_sequences)
        for s in all_sequences:
            if own[id(s)] != "auto":
                s.state.max_draft = None if own[id(s)] == "on" else 0
        sequences = [s for s in all_sequences if own[id(s)] == "auto"]
        if not sequences:
            return
        waiting = [s for s in sequences if s.drafter is not None and s.draft_start is None and not _pinned(s)]
        free = [s for s in sequences if s.drafter is not None and s not in waiting and (_pinned(s) or _unmeasured(s))]
        for s in free:  # as deep as its drafter likes (see _pinned and _unmeasured)
            s.state.max_draft = None
        rest = [s for s in sequences if s not in free and s not in waiting]
        fixed = [_Profile.of(s) for s in free]  # drafting at their own depth in the same forward
        fixed += [_Profile.of(s, given=0 if own[id(s)] == "off" else None)  # "on" / "off" ones in the same forward
                  for s in all_sequences if own[id(s)] != "auto"]
        fixed += [_Profile.of(s, given=0) for s in waiting]  # not drafting unless started below
        profiles = [_Profile.of(s) for s in rest]
        depths = self.depths(profiles, fixed=fixed, shared=shared_drafts)
        planned = list(zip(profiles, depths))
        given = [(f, f.depth) for f in fixed]
        for i, (s, p, k) in enumerate(zip(rest, profiles, depths)):
            # due: one level deeper than planned, fresh figures at a level's cost, where they could change the plan
            if s.drafter is not None and _due(s):
                if self._could_pay(p, given + planned[:i] + planned[i + 1:], shared_drafts):
                    k = min(p.depth, k + 1)
                s.probed_at = s.stats.target_calls  # probed or not, asked again in _REPROBE steps
            s.state.max_draft = k
        for s in waiting:
            s.state.max_draft = None if self._starts(s, planned, fixed, shared_drafts) else 0

    def depths(self, profiles: list[_Profile], fixed: Seq[_Profile] = (), shared: bool = False) -> list[int]:
        """The goodput-maximising draft depths of ``profiles`` (all 0 unless they promise ``_MARGIN`` times the goodput
        of none); ``fixed``: the profiles of other sequences in the same forward, each at its ``depth``; ``shared``:
        draft forwards shared per draft model, see the module doc."""
        k = [0] * len(profiles)
        given = [(p, p.depth) for p in fixed]

        def goodput(depths: list[int]) -> float:
            return self.goodput(given + list(zip(profiles, depths)), shared)

        def moves(depths: list[int]):
            for i, p in enumerate(profiles):  # one sequence a level deeper
                if depths[i] < p.depth:
                    yield [d + (j == i) for j, d in enumerate(depths)]
            if shared:  # every sequence of a draft model below the next level raised to it (one shared forward)
                for model in {p.model for p in profiles} - {None}:
                    group = [i for i, p in enumerate(profiles) if p.model == model and depths[i] < p.depth]
                    if len(group) > 1:
                        level = min(depths[i] for i in group) + 1
                        yield [max(d, level) if i in group else d for i, d in enumerate(depths)]

        best = base = goodput(k)
        while True:
            choice, value = None, best
            for candidate in moves(k):
                g = goodput(candidate)
                if g > value * (1 + 1e-9):
                    choice, value = candidate, g
            if choice is None:
                break
            k, best = choice, value
        return k if best >= base * _MARGIN else [0] * len(k)  # a predicted gain within the model's error: none

    def goodput(self, pairs: Seq[tuple[_Profile, int]], shared: bool = False) -> float:
        """Expected tokens per second of one step in which each ``(profile, depth)`` sequence drafts that deep."""
        tokens = sum(p.expected(d) for p, d in pairs)
        rows = sum(1 + p.width * d for p, d in pairs)
        seconds = _drafting(pairs, shared) + self.cost(max(1, round(rows)))
        return tokens / seconds if seconds > 0 else float("inf")

    def _starts(self, seq, planned: list, fixed: list[_Profile], shared: bool) -> bool:
        """Whether ``seq``, whose drafter has not drafted yet, starts drafting now. Its first proposal feeds its whole
        context to the draft model (the draft's prefill, paid inside a step the whole batch waits for), which pays
        only if drafting saves more. Drafting at the depth ``d`` best for it, it commits ``E(d)`` tokens a step and
        lives ``R / E(d)`` steps (``R``: the tokens it may still commit, at most what its model's finished sequences
        produced on average), in which the batch commits ``n1`` tokens a step at goodput ``G1`` instead of ``G0``:
        it saves ``R / E(d) * n1 * (1 / G0 - 1 / G1)`` seconds. Its acceptance, depth, width and costs are those its
        draft model's earlier sequences measured (finished ones too). The first sequence of a model always starts
        (nothing is measured yet), and after ``explore_after`` sequences turned down (8, doubling after each such
        start up to 64, back to 8 when the rule starts one) the next starts at its next step (the figures of a model
        whose sequences all decode plainly would never change), once drafting could pay at all (:meth:`_could_pay`:
        under a load where even a well-accepted drafter loses, no sequence explores)."""
        pool = self._pools.get(_model_key(seq))
        if pool is None or pool.level_s is None or pool.start_s_per_token is None:
            return True
        others = [(p, p.depth) for p in fixed if p.seq is not seq] + planned
        if self._pays(seq, pool, others, shared):  # drafting pays again: explorations at the first rate
            pool.refused, pool.explore_after = 0, _EXPLORE
            return True
        if pool.refused >= pool.explore_after and self._could_pay(pool.profile(seq), others, shared):
            # explore (where fresh figures could change the plan), then wait twice as long for the next exploration
            pool.refused, pool.explore_after = 0, min(2 * pool.explore_after, _EXPLORE_MAX)
            return True
        if seq not in self._refused:
            self._refused.add(seq)
            pool.refused += 1
        return False

    def _pays(self, seq, pool: _Pool, others: list, shared: bool) -> bool:
        """The start rule of :meth:`_starts`: whether drafting saves ``seq`` more than its draft's prefill costs,
        the batch's ``others`` ``(profile, depth)`` drafting as planned."""
        me = pool.profile(seq)
        g0 = self.goodput(others + [(me, 0)], shared)
        g1, depth = max(((self.goodput(others + [(me, d)], shared), d) for d in range(1, me.depth + 1)),
                        default=(g0, 0))
        if depth and g1 > g0 * _MARGIN:
            remaining = seq.state.remaining
            if pool.length is not None:
                remaining = min(remaining, max(1.0, pool.length - len(seq.new)))
            e1 = me.expected(depth)
            n1 = sum(p.expected(d) for p, d in others) + e1
            return remaining / e1 * n1 * (1 / g0 - 1 / g1) > pool.start_s_per_token * len(seq.state.ids)
        return False

    def _could_pay(self, me: _Profile, others: list, shared: bool) -> bool:
        """Whether drafting could pay for ``me`` at all, beside ``others`` ``(profile, depth)``: at an acceptance of
        at least ``_OPTIMISTIC`` (its own where higher) and the lower of its own and its draft model's pooled cost
        per level, some depth raises the step's goodput (by any amount: one sequence of many moves a batch's
        goodput little), drafting alone or with its draft model's (or kind's) other sequences at the same level,
        as :meth:`depths` may raise them. A probe or an exploration measures acceptance and costs; where even
        this could not make drafting pay (a batch whose forward grows by more than a draft row can return, as
        four sequences on a 2-core CPU), nothing it measures would change the plan, and its catch-up forward,
        draft levels and verification row are spent for nothing, while the whole batch waits. Always True before
        any target forward was measured."""
        if not self.cost.known:
            return True
        if me.depth < 1:
            return False
        pool = self._pools.get(_model_key(me.seq)) if me.seq is not None else None
        cost = min(me.draft_s, pool.level_s) if pool is not None and pool.level_s is not None else me.draft_s
        best = _Profile(max(_OPTIMISTIC, me.acceptance), me.depth, me.width, cost, me.model, me.seq)
        g0 = self.goodput(others + [(best, 0)], shared)
        mine = _profile_key(me)
        for d in range(1, best.depth + 1):
            alone = others + [(best, d)]
            # the other sequences of its draft model (or drafter kind) at that level too, at their own acceptance
            joint = [(p, max(k, min(d, p.depth)) if _profile_key(p) == mine else k) for p, k in others] + [(best, d)]
            if any(self.goodput(pairs, shared) > g0 * (1 + 1e-9) for pairs in (alone, joint)):
                return True
        return False

    def observe(self, sequences: list) -> None:
        """Pool what each sequence with a drafter measured since it was last observed into its draft model's figures.
        :meth:`plan` observes the batch each step; the batch observes a sequence once more as it finishes, so that
        its last step and its length count."""
        for s in sequences:
            if s.drafter is None:
                continue
            pool = self._pools.setdefault(_model_key(s), _Pool())
            reached, accepted = sum(s.stats.depth_reached), sum(s.stats.depth_accepted)
            r0, a0, level0, started, finished = self._counted.get(s, (0, 0, None, False, False))
            pool.reached += reached - r0
            pool.accepted += accepted - a0
            if pool.reached > _POOL_MEMORY:  # recent sequences weigh most
                pool.reached, pool.accepted = pool.reached / 2, pool.accepted / 2
            if s.natural_depth:
                pool.depth, pool.width = s.natural_depth, s.rows_per_level
            level = s.draft_s_per_level
            if level is not None and level != level0:  # a new measurement
                pool.level_s = _mean(pool.level_s, level)
            if level is not None and not started and s.draft_start is not None:
                # its first proposal less its levels: the prefill, per token fed by every first proposal that shared
                # its draft forwards (each timed the whole step: see Batch; an estimate, the time also holds the
                # others' drafting while they waited for each other)
                seconds, _, depth, fed = s.draft_start
                pool.start_s_per_token = _mean(pool.start_s_per_token, max(0.0, seconds - depth * level) / max(1, fed))
                started = True
            if s.done and not finished:
                pool.length = _mean(pool.length, len(s.new))
                finished = True
            self._counted[s] = (reached, accepted, level, started, finished)


_OPTIMISTIC = 0.95  # the per-level acceptance that probes and explorations are made for (Speculation._could_pay):
# above what the 1.5B's 0.5B sibling reaches on code (0.87-0.88), a drafter's own where higher
_POOL_MEMORY = 4096  # draft levels reached after which a draft model's pooled acceptance halves its history
_EXPLORE = 8  # sequences of a draft model turned down, after which the next one starts (fresh figures) ...
_EXPLORE_MAX = 64  # ... doubling after each such start, up to this, until the rule itself starts one again
_MARGIN = 1.03  # drafting must promise at least this much more goodput than none: the cost model's figures (one
# forward's seconds by its rows, a level's seconds) leave out per-step work that grows with drafting (catch-up
# forwards, building and verifying trees, cache bookkeeping), so a promise within a few percent of none is a loss


def draft_model_id(seq) -> int | None:
    """The id of what a sequence's draft forwards run on (those of one model can share a forward), or None."""
    model = capability(seq.drafter, "model")
    return None if model is None else id(model)


def _model_key(seq) -> object:
    """What a sequence's drafter's figures are pooled under: its draft model, or its kind when it has none."""
    model = draft_model_id(seq)
    return type(seq.drafter) if model is None else model


def _profile_key(p: _Profile) -> object:
    """What a profile's figures pool under (:func:`_model_key` of its sequence; a made-up profile: its model)."""
    return p.model if p.seq is None else _model_key(p.seq)


def _acceptance(accepted: float, reached: float) -> float:
    """Per-level acceptance from draft levels accepted of those reached, with the prior worth _PRIOR_WEIGHT levels."""
    return min((accepted + _PRIOR_ACCEPTANCE * _PRIOR_WEIGHT) / (reached + _PRIOR_WEIGHT), 0.999)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else 0.7 * old + 0.3 * new


def _drafting(pairs: Seq[tuple[_Profile, int]], shared: bool) -> float:
    """Seconds of drafting when each ``(profile, depth)`` drafts that deep (see the module doc)."""
    if not shared:
        return sum(p.draft_s * d for p, d in pairs)
    alone = sum(p.draft_s * d for p, d in pairs if p.model is None)  # no draft model: nothing to share
    levels: dict[object, int] = {}  # per draft model: its deepest level and its slowest level's seconds
    per_level: dict[object, float] = {}
    for p, d in pairs:  # every sequence of a model sets its level cost, drafting or not (figures measured in
        if p.model is not None:  # other batches: the dearest counts)
            levels[p.model] = max(levels.get(p.model, 0), d)
            per_level[p.model] = max(per_level.get(p.model, 0.0), p.draft_s)
    return alone + sum(levels[m] * per_level[m] for m in levels)


class _Pool:
    """What the sequences of one draft model measured: the acceptance pooled over their draft levels (recent ones
    weigh most), their depth and width, seconds per draft level, seconds per context token of a first proposal
    (the draft's prefill), and how many tokens a finished sequence committed."""

    __slots__ = ("reached", "accepted", "depth", "width", "level_s", "start_s_per_token", "length", "refused",
                 "explore_after")

    def __init__(self) -> None:
        self.reached = self.accepted = 0.0
        self.depth, self.width = 1, 1.0
        self.level_s: float | None = None
        self.start_s_per_token: float | None = None
        self.length: float | None = None  # new tokens of a finished sequence (moving average)
        self.refused = 0  # sequences turned down since one last started
        self.explore_after = _EXPLORE  # refusals after which the next sequence starts anyway

    def profile(self, seq) -> _Profile:
        """A profile for ``seq`` before it drafted, from these figures."""
        depth = min(self.depth, max(0, seq.state.remaining - 1))
        return _Profile(_acceptance(self.accepted, self.reached), depth, self.width, self.level_s or 0.0,
                        draft_model_id(seq), seq)


_REPROBE = 8  # steps after which a sequence drafts one level past its plan (fresh acceptance and cost figures)


def _pinned(seq) -> bool:
    """A seeded sampling request drafts at its method's own depth, whatever the load: its sampled tokens then
    depend on its seed only (the draws a step makes depend on how deep it drafted), so a seed reproduces its output;
    greedy output is the same at any depth, and unseeded sampling need not repeat."""
    params = seq.state.params
    return not params.greedy and params.seed is not None


def _unmeasured(seq) -> bool:
    """Whether ``seq``'s drafter should draft uncapped this step, to measure its depth, width, acceptance and cost:
    until its cost per level was measured (its first proposal also fills its cache, so it is not counted)."""
    return seq.probed_at is None or (seq.draft_s_per_level is None and bool(seq.natural_depth))


def _due(seq) -> bool:
    """Whether ``seq`` is due for a probe: ``_REPROBE`` steps since it last drafted past its plan (acceptance and
    costs drift, and a sequence capped to no drafts measures nothing). It then drafts one level deeper than
    planned, not uncapped (under load a full-depth probe of every sequence cost more than what it measured), once
    drafting could pay at all (:meth:`Speculation._could_pay`)."""
    return seq.probed_at is not None and seq.stats.target_calls - seq.probed_at >= _REPROBE


class _Profile:
    """What :meth:`Speculation.depths` knows of one sequence."""

    __slots__ = ("acceptance", "depth", "width", "draft_s", "model", "seq")

    def __init__(self, acceptance: float, depth: int, width: float, draft_s: float, model: object = None,
                 seq: object = None) -> None:
        self.acceptance, self.depth, self.width, self.draft_s = acceptance, depth, width, draft_s
        self.model = model  # what its draft forwards run on (those of one model can share a forward), or None
        self.seq = seq  # the sequence it describes (None: a made-up profile)

    @classmethod
    def of(cls, seq, given: int | None = None) -> _Profile:
        stats = seq.stats
        a = _acceptance(sum(stats.depth_accepted), sum(stats.depth_reached))
        depth = min(seq.natural_depth, max(0, seq.state.remaining - 1)) if seq.drafter is not None else 0
        if _pinned(seq) or seq.probed_at is None:  # drafting uncapped this step: as deep as it did before, at least 1
            depth = max(1, depth) if seq.drafter is not None else 0
        if given is not None:
            depth = given
        return cls(a, depth, seq.rows_per_level, seq.draft_s_per_level or 0.0, draft_model_id(seq), seq)

    def expected(self, k: int) -> float:
        """Expected tokens committed by a step drafting ``k`` levels (bonus included)."""
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a)


def row_cost(target: torch.nn.Module, forward: str = "auto"):
    """A callable ``f(rows)`` that runs one target forward over ``rows`` new tokens after a short prompt, on a
    scratch cache (for :meth:`ForwardCost.calibrate`)."""
    from .cache import SpecCache
    from .checks import num_layers
    from .target_forward import TargetForward

    fwd = TargetForward(target, forward)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0)).to(target.device)
    cache = SpecCache(num_layers(target), capacity=128)
    with torch.inference_mode():
        fwd.prefill(cache, ids[:, :32])

    def run(rows: int) -> None:
        with torch.inference_mode():
            fwd(cache, input_ids=ids[:, 32:32 + rows])
            cache.crop(32)

    return run
