"""The contention guard: spot training may use the tail's devices only as far as it leaves the tail alone.

On accelerators an idle replica's devices are free hardware, and a spot update
cannot slow the replicas that still decode. Where devices share something (the
cores of a CPU host, a host's memory bandwidth, one chip split in two), an update
slows them, and the tail is the critical path. The guard measures that and
rations the trainer so that the critical path pays at most ``tolerance``.

What it measures. Every decode call of a replica reports its span and a key (its
batch bucket, its strategy, how many replicas still decode: calls of one key do
the same work, but more of it as the contexts grow). A call that overlaps the
trainer's busy time for at least half its span is *overlapped*; one that does
not overlap it at all, while at least one replica is idle, is *clear* (the other
calls are left out). A call of ``c`` seconds' work (the median of the last
``NEAREST`` clear calls of its key before it, at least ``min_clear``; failing
those, of the ones nearest in time) that took ``D`` seconds, a share ``f`` of them
overlapped, ran at ``1/s`` of its speed while overlapped when
``D·(1 − f) + D·f/s = c``; the median of that ``s`` over the overlapped calls of
every key (the last ``window`` of each), once there are ``min_samples``, is the
measured slowdown ``s``. Pooling the keys makes it known after a few overlapped
calls, however many keys the tail goes through. Calls older than ``max_age``
seconds are forgotten: a slowdown that goes away (the first step's compilations,
a neighbour's job) stops rationing the trainer within that time, however few
updates it was allowed meanwhile (with too few recent calls ``s`` is unknown
again and the trainer probes).

What it allows. If updates take a share ``d`` of the tail's time, the tail does
``1/s`` of its work in that share instead of all of it and finishes later by
``d·(1 − 1/s)`` of the time, so the guard lets the trainer be busy for
``d = min(1, tolerance · s / (s − 1))`` of the time (``probe_duty`` while ``s`` is
unknown, which gives both kinds of calls). It keeps this as a token bucket: time
the trainer spends yielding earns ``d / (1 − d)`` seconds of busy time, an
update spends its span, and the balance (at most one update's worth, or what the
shortest yield earns) carries over from one RL step to the next, so that even a
trainer allowed one update in many steps keeps to its share. At ``d = 1`` it
still yields one update's span every ``probe_every`` updates, so that the clear
calls stay current. A yield lasts at least two decode calls (the median of the
last ``window`` calls' spans), so that a clear call fits in it even where calls
are longer than updates.

The guard bounds the slowdown of the tail only; the stop latency (an update in
flight when the last replica finishes) comes on top and is measured apart.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable, Hashable


class ContentionGuard:
    """Rations spot training so that the decoding replicas slow down by at most ``tolerance`` (see the module)."""

    MAX_SLOWDOWN = 100.0  # what one call can show at most (a call slower than its overlap explains)
    NEAREST = 5  # an overlapped call is compared with the median of this many clear calls just before it

    def __init__(self, tolerance: float = 0.02, *, window: int = 32, min_samples: int = 5, min_clear: int = 3,
                 probe_duty: float = 0.5, min_duty: float = 1e-3, probe_every: int = 16, max_age: float = 30.0,
                 clock: Callable[[], float] = time.perf_counter):
        if not tolerance > 0:
            raise ValueError(f"tolerance={tolerance} must be > 0 (the allowed slowdown of the tail, e.g. 0.02)")
        if not max_age > 0:
            raise ValueError(f"max_age={max_age} must be > 0 (seconds a decode call is remembered)")
        if not 0 < min_duty <= probe_duty < 1:
            raise ValueError(f"need 0 < min_duty <= probe_duty < 1; got min_duty={min_duty}, probe_duty={probe_duty}")
        if not 1 <= min_clear <= window or min_samples < 1 or probe_every < 1:
            raise ValueError(f"need min_samples >= 1, 1 <= min_clear <= window and probe_every >= 1; got "
                             f"min_samples={min_samples}, min_clear={min_clear}, window={window}, "
                             f"probe_every={probe_every}")
        self.tolerance, self.window, self.min_samples, self.min_clear = tolerance, window, min_samples, min_clear
        self.probe_duty, self.min_duty, self.probe_every, self.clock = probe_duty, min_duty, probe_every, clock
        self.max_age = max_age
        self._lock = threading.Lock()
        self._busy: collections.deque = collections.deque()  # finished busy intervals (start, end)
        self._busy_since: float | None = None  # start of the busy interval in progress
        # key -> (clear calls (midpoint, span), overlapped calls (midpoint, span, overlapped share,
        # median of the clear calls just before it or None))
        self._calls: dict[Hashable, tuple[collections.deque, collections.deque]] = {}
        self.credit = 0.0  # busy seconds the trainer may still spend
        self.last_span = 0.0  # the last busy span (one update and what prepares it)
        self._updates_at_full = 0
        self._spans: collections.deque = collections.deque(maxlen=window)  # the last decode calls' spans
        self.counts = {"clear": 0, "overlapped": 0, "mixed": 0, "yields": 0}

    # ------------------------------------------------------------------ the trainer's side
    def busy_start(self, t: float | None = None) -> None:
        """The trainer starts working (sampling, placing, updating)."""
        with self._lock:
            if self._busy_since is None:
                self._busy_since = self.clock() if t is None else t

    def busy_end(self, t: float | None = None) -> float:
        """The trainer stops working; returns the busy span's seconds (0 if it was not busy)."""
        with self._lock:
            if self._busy_since is None:
                return 0.0
            t = self.clock() if t is None else t
            start, self._busy_since = self._busy_since, None
            self._busy.append((start, t))
            while len(self._busy) > 4 * self.window:
                self._busy.popleft()
            return t - start

    def spent(self, span: float) -> None:
        """A busy span of ``span`` seconds ended with an update: it is paid from the credit."""
        self.last_span = span
        self.credit -= span
        if self.duty() >= 1.0:
            self._updates_at_full += 1

    def earned(self, seconds: float) -> None:
        """The trainer yielded for ``seconds`` while it had devices: that earns busy time at the duty's rate.

        The balance is capped at one update's span, or at what the shortest yield (two decode calls)
        earns where that is more: a duty near 1 then comes as a short yield and many updates."""
        d = self.duty()
        if d >= 1.0:
            self.credit = self.last_span
            return
        rate = d / (1.0 - d)
        self.credit = min(self.credit + seconds * rate, max(self.last_span, self._two_calls() * rate))

    def wait_before_update(self) -> float:
        """Seconds the trainer must yield before its next update (0: go ahead)."""
        if self.last_span <= 0.0:  # nothing known about an update's span yet
            return 0.0
        d = self.duty()
        if d >= 1.0:
            if self._updates_at_full >= self.probe_every:  # keep the clear calls current
                self._updates_at_full = 0
                self.credit = 0.0
                self.counts["yields"] += 1
                return max(self.last_span, self._two_calls())
            self.credit = max(self.credit, self.last_span)
            return 0.0
        need = self.last_span - self.credit
        if need <= 1e-9 * self.last_span:  # (rounding of what was earned)
            return 0.0
        self.counts["yields"] += 1
        return max(need * (1.0 - d) / d, self._two_calls())

    def _two_calls(self) -> float:
        """Twice the median span of the last decode calls (0 before any): the shortest yield worth having."""
        with self._lock:
            return 2.0 * statistics.median(self._spans) if self._spans else 0.0

    # ------------------------------------------------------------------ the rollout's side
    def record_call(self, key: Hashable, start: float, end: float, *, some_idle: bool) -> str:
        """One decode call of a replica spanned [start, end]; ``some_idle``: whether another replica had
        finished its sequences by then. Returns how the call counted: clear, overlapped, mixed or skipped."""
        span = end - start
        if span <= 0.0:
            return "skipped"
        with self._lock:
            self._spans.append(span)
            overlap = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._busy)
            if self._busy_since is not None:
                overlap += max(0.0, end - max(self._busy_since, start))
            if overlap >= 0.5 * span:
                kind = "overlapped"
            elif overlap == 0.0 and some_idle:
                kind = "clear"
            elif overlap:
                self.counts["mixed"] += 1
                return "mixed"
            else:
                return "skipped"
            clear, over = self._calls.setdefault(key, (collections.deque(maxlen=self.window),
                                                        collections.deque(maxlen=self.window)))
            mid = 0.5 * (start + end)  # when the call ran (its work is compared with clear calls near it)
            if kind == "clear":
                clear.append((mid, span))
            else:  # its reference: the key's last clear calls, before the contexts grew further (or later)
                last = [d for t, d in list(clear)[-self.NEAREST:] if t >= end - self.max_age]
                ref = statistics.median(last) if len(last) >= self.min_clear else None
                over.append((mid, span, min(overlap / span, 1.0), ref))
            self.counts[kind] += 1
        return kind

    # ------------------------------------------------------------------ estimates
    def slowdown(self) -> float | None:
        """How much slower a decode call runs while the trainer is busy (1: not at all); None until known."""
        since = self.clock() - self.max_age
        with self._lock:
            recent = [([x for x in c if x[0] >= since], [x for x in o if x[0] >= since])
                      for c, o in self._calls.values()]
        each = []
        for clear, over in recent:
            if len(clear) < self.min_clear:
                continue
            for t, d, f, c in over:
                if c is None:  # no clear calls before it: the ones nearest in time
                    c = statistics.median(x[1] for x in sorted(clear, key=lambda x: abs(x[0] - t))[:self.NEAREST])
                each.append(f / max(c / d - 1.0 + f, f / self.MAX_SLOWDOWN))
        return statistics.median(each) if len(each) >= self.min_samples else None

    def duty(self) -> float:
        """The share of the tail's time the trainer may be busy."""
        s = self.slowdown()
        if s is None:
            return self.probe_duty
        if s <= 1.0 or self.tolerance * s >= s - 1.0:
            return 1.0
        return max(self.min_duty, self.tolerance * s / (s - 1.0))

    def summary(self) -> dict[str, float]:
        s = self.slowdown()
        return {"slowdown": float("nan") if s is None else s, "duty": self.duty(),
                **{f"calls_{k}": float(v) for k, v in self.counts.items() if k != "yields"},
                "yields": float(self.counts["yields"])}
