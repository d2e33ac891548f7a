"""`tltjax.controller.guard`: spot training rationed so that the decoding replicas slow down by at most a
tolerance, from the measured spans of their decode calls.

The rule is checked on a simulated tail (a clock of its own, decode calls that run ``s`` times slower while
the trainer is busy) and then on the real `SpotTrainer` thread, whose yields a stop must cut short.
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tltjax.controller.guard import ContentionGuard
from tltjax.controller.spot import SpotTrainer


def STILL():  # noqa: N802 - a clock that stays at 0: the synthetic calls below (all at t >= 0) stay recent
    return 0.0


def _feed(guard, clear: float, over: float, n: int, key="k", t0: float | None = None):
    """``n`` clear calls of ``clear`` s and ``n`` overlapped calls of ``over`` s, on the guard's own timeline
    (from ``t0``; default: after the calls fed so far)."""
    t = 1000.0 + 10.0 * len(guard._busy) if t0 is None else t0
    for i in range(n):
        guard.record_call(key, t, t + clear, some_idle=True)
        t += clear + 1.0
        guard.busy_start(t)
        guard.record_call(key, t, t + over, some_idle=True)
        t += over
        guard.busy_end(t)
        t += 1.0


def test_calls_are_classified_by_their_overlap_with_the_trainers_busy_time():
    g = ContentionGuard()
    g.busy_start(10.0)
    g.busy_end(11.0)
    assert g.record_call("k", 10.2, 10.8, some_idle=True) == "overlapped"
    assert g.record_call("k", 10.7, 11.5, some_idle=True) == "mixed"  # 0.3 of 0.8 s overlaps
    assert g.record_call("k", 10.8, 11.1, some_idle=True) == "overlapped"  # 0.2 of 0.3 s
    assert g.record_call("k", 11.5, 12.0, some_idle=True) == "clear"
    assert g.record_call("k", 11.5, 12.0, some_idle=False) == "skipped"  # nobody idle: not comparable
    assert g.record_call("k", 12.0, 12.0, some_idle=True) == "skipped"
    g.busy_start(20.0)  # an interval still in progress counts up to the call's end
    assert g.record_call("k", 19.0, 21.0, some_idle=True) == "overlapped"
    assert g.counts == {"clear": 1, "overlapped": 3, "mixed": 1, "yields": 0}


def test_slowdown_is_the_median_over_every_keys_overlapped_calls():
    """Each overlapped call is compared with its own key's clear calls; the estimates of all keys pool."""
    g = ContentionGuard(min_samples=5, min_clear=3, clock=STILL)
    assert g.slowdown() is None and g.duty() == g.probe_duty
    _feed(g, 0.1, 0.3, 2, key="a")
    _feed(g, 0.2, 0.2, 2, key="b")
    assert g.slowdown() is None  # 2 clear calls per key < min_clear
    _feed(g, 0.1, 0.3, 2, key="a")
    assert g.slowdown() is None  # only key a's 4 overlapped calls count yet
    _feed(g, 0.2, 0.2, 1, key="b")  # b: 3 clear calls; pooled: 4 calls at 3, 3 at 1
    assert g.slowdown() == pytest.approx(3.0)
    _feed(g, 0.2, 0.2, 2, key="b")
    assert g.slowdown() == pytest.approx(1.0)  # 4 at 3, 5 at 1


def test_a_partly_overlapped_call_shows_the_slowdown_of_its_overlapped_part():
    """1 s of work took 1.5 s with 1 s of it overlapped: 0.5 s at full speed, then 0.5 s of work in 1 s."""
    g = ContentionGuard(min_samples=1, min_clear=3, clock=STILL)
    for t in (0.0, 2.0, 4.0):
        g.record_call("c", t, t + 1.0, some_idle=True)
    g.busy_start(10.0)
    assert g.record_call("c", 9.5, 11.0, some_idle=True) == "overlapped"
    assert g.slowdown() == pytest.approx(2.0)


@pytest.mark.parametrize("ratio,duty", [(1.0, 1.0), (1.02, 1.0), (1.5, 0.06), (3.0, 0.03), (100.0, 2 / 99)])
def test_duty_keeps_the_mean_slowdown_within_the_tolerance(ratio, duty):
    """Busy a share d of the time, at 1/s of the speed there, the tail loses d (1 - 1/s) of its time."""
    g = ContentionGuard(0.02, clock=STILL)
    _feed(g, 0.1, 0.1 * ratio, 6)
    assert g.duty() == pytest.approx(duty, rel=1e-3)
    assert g.duty() * (1 - 1 / g.slowdown()) <= 0.02 + 1e-12


def test_token_bucket_yields_what_the_duty_asks_and_carries_the_balance():
    g = ContentionGuard(0.02, clock=STILL)
    _feed(g, 0.1, 0.3, 6)  # s = 3: d = 0.03, each busy second costs 97 / 3 yielded ones
    assert g.wait_before_update() == 0.0  # no update span known yet: the first goes ahead
    g.spent(0.5)
    assert g.credit == -0.5
    assert g.wait_before_update() == pytest.approx(97 / 3)  # pay the debt and earn the next span
    g.earned(20.0)  # a step boundary cut the yield short: the balance stays
    assert g.credit == pytest.approx(-0.5 + 20 * 0.03 / 0.97)
    g.earned(97 / 3 - 20)
    assert g.credit == pytest.approx(0.5) and g.wait_before_update() == 0.0
    g.earned(100.0)
    assert g.credit == pytest.approx(0.5), "at most one update's worth is banked"


def test_at_full_duty_it_still_yields_now_and_then_to_keep_the_clear_calls_current():
    g = ContentionGuard(0.02, probe_every=4, clock=STILL)
    _feed(g, 0.1, 0.1, 6)
    waits = []
    for _ in range(12):
        w = g.wait_before_update()
        waits.append(w)
        if w:
            g.earned(w)
        g.spent(0.25)
    assert waits[0] == 0.0 and waits.count(0.25) == 2 and waits.count(0.0) == 10


def test_a_yield_lasts_at_least_two_decode_calls():
    """Where decode calls are longer than updates, a yield of one update's span could not hold a clear call."""
    g = ContentionGuard(0.02, probe_every=1, clock=STILL)
    _feed(g, 0.5, 0.5, 6)  # s = 1: full duty
    g.spent(0.1)
    assert g.wait_before_update() == pytest.approx(1.0)  # the periodic yield: 2 x 0.5 s, not 0.1 s
    h = ContentionGuard(0.02, clock=STILL)
    _feed(h, 0.5, 1.5, 6)  # s = 3: d = 0.03
    h.spent(0.01)
    # 0.01 * 97 / 3 = 0.32 s would be too short: twice the median call (as many of 0.5 as of 1.5 s)
    assert h.wait_before_update() == pytest.approx(2.0)


def test_bad_settings_are_rejected():
    for kw in ({"tolerance": 0.0}, {"min_duty": 0.0}, {"probe_duty": 1.0}, {"min_samples": 0},
               {"window": 3, "min_clear": 5}, {"min_clear": 0}, {"probe_every": 0}, {"min_duty": 0.6, "probe_duty": 0.5},
               {"max_age": 0.0}):
        with pytest.raises(ValueError):
            ContentionGuard(**kw)


def _simulate(s_true, tol: float = 0.02, horizon: float = 120.0, dt: float = 1e-3, call: float = 0.02,
              update: float = 0.1, updates_at: list | None = None, **guard_kw):
    """A tail of ``horizon`` seconds: a replica's decode calls of ``call`` s of work (a number, or a function
    of the call's start: longer contexts make later calls slower), run ``s_true`` times
    (a number, or a function of the time) slower while the trainer is busy, and a trainer of
    ``update``-second updates that the guard rations (their end times go to ``updates_at``).
    Returns (slowdown over the second half, updates, the guard)."""
    now = [0.0]
    s_at = s_true if callable(s_true) else (lambda t: s_true)
    work_at = call if callable(call) else (lambda t: call)
    g = ContentionGuard(tol, clock=lambda: now[0], **guard_kw)
    trainer, began, busy_left, yield_end, yield_start = "ready", 0.0, 0.0, 0.0, 0.0
    call_start, done, updates = 0.0, 0.0, 0
    half_work = None
    for i in range(int(horizon / dt)):
        t = now[0] = i * dt
        if trainer == "ready":
            w = g.wait_before_update()
            if w > 0:
                g.busy_end(t)
                trainer, yield_start, yield_end = "yield", t, t + w
            else:
                g.busy_start(t)
                trainer, began, busy_left = "busy", t, update
        elif trainer == "yield" and t >= yield_end:
            g.earned(t - yield_start)
            trainer = "ready"
        rate = 1.0 / s_at(t) if trainer == "busy" else 1.0
        done += rate * dt
        if trainer == "busy":
            busy_left -= dt
            if busy_left <= 1e-12:
                g.spent(t + dt - began)
                updates += 1
                if updates_at is not None:
                    updates_at.append(t + dt)
                trainer = "ready"
        work = work_at(call_start)
        if done >= work:
            g.record_call("k", call_start, t + dt, some_idle=True)
            call_start, done = t + dt, done - work
            if half_work is not None:
                half_work += work
        if half_work is None and t >= horizon / 2:
            half_work = 0.0
    return (horizon / 2) / half_work - 1.0, updates, g


@pytest.mark.parametrize("s_true", [1.0, 1.5, 3.0])
def test_a_simulated_tail_slows_down_by_at_most_the_tolerance(s_true):
    """Once the guard has measured the slowdown, the tail runs within the tolerance, and the trainer uses
    the share it is allowed: every update on free hardware, a share of 0.02 s / (s - 1) on shared hardware."""
    slowdown, updates, g = _simulate(s_true)
    assert g.slowdown() == pytest.approx(s_true, rel=0.1)
    assert slowdown <= 0.02 * 1.15 + 0.002
    if s_true == 1.0:
        assert slowdown < 0.002 and updates >= 0.9 * 120 / 0.1
    else:
        allowed = 0.02 * s_true / (s_true - 1)
        assert updates >= 0.6 * allowed * 120 / 0.1 and slowdown >= 0.01


@pytest.mark.parametrize("s_true", [1.0, 1.5, 3.0])
def test_calls_that_slow_down_as_contexts_grow_do_not_fool_it(s_true):
    """Decode calls whose work grows fivefold over the tail (longer contexts): each overlapped call is
    compared with the clear calls just before it, not with a window of clear calls that may be seconds
    newer (which made it think s = 1.5 was 1.3, and let the tail slow by 3%) or older."""
    slowdown, updates, g = _simulate(s_true, call=lambda t: 0.02 * (1 + t / 30))
    assert slowdown <= 0.02 * 1.15 + 0.002
    if s_true == 1.0:
        assert updates >= 0.7 * 120 / 0.1  # clear calls lag a little at full duty: s reads 1.0-1.05
    else:
        assert g.slowdown() == pytest.approx(s_true, rel=0.1)


def test_overlapped_calls_older_than_max_age_are_forgotten():
    now = [0.0]
    g = ContentionGuard(0.02, max_age=30.0, clock=lambda: now[0])
    _feed(g, 0.1, 0.3, 6)  # overlapped calls end at t = 1001.4 ... 1013.4: s = 3
    now[0] = 1020.0
    assert g.slowdown() == pytest.approx(3.0) and g.duty() == pytest.approx(0.03)
    now[0] = 1100.0  # every overlapped call is older than 30 s: unknown again, the trainer probes
    assert g.slowdown() is None and g.duty() == g.probe_duty
    _feed(g, 0.1, 0.1, 6, t0=1100.0)  # fresh calls, no slowdown
    now[0] = 1120.0
    assert g.slowdown() == pytest.approx(1.0) and g.duty() == 1.0


@pytest.mark.parametrize("max_age", [30.0, float("inf")])
def test_a_slowdown_that_goes_away_stops_rationing_within_max_age(max_age):
    """Shared hardware for a minute (s = 3), then free (s = 1). Decode calls as long as an update give
    about one overlapped call per update, so at the rationed duty the old calls would take about a
    minute to leave the window; forgotten after ``max_age`` they free the trainer within that time.
    (Never forgetting them, the guard still rations it 30-50 s after the change.)"""
    ends: list = []
    _simulate(lambda t: 3.0 if t < 60.0 else 1.0, horizon=150.0, call=0.1, update=0.1, updates_at=ends,
              max_age=max_age)
    before = sum(t < 60.0 for t in ends)
    assert before < 0.1 * 600  # rationed while the hardware was shared (at most 600 updates fit)
    after = sum(90.0 < t < 110.0 for t in ends)  # 30-50 s after the change: at most 200 fit
    if max_age == 30.0:
        assert after >= 0.8 * 200
    else:
        assert after < 0.2 * 200


def test_spot_trainer_yields_as_the_guard_asks_and_a_stop_cuts_the_yield_short():
    """A guard that measured a slowdown of 100 allows the trainer 2% of the time: after its first
    update it yields for about 100 times the update's span; a stop during that yield returns at once, and
    the guard's figures are in the stats."""
    @jax.jit
    def update(state, target_params, batch):
        return {"n": state["n"] + 1}, {"loss": jnp.mean(batch["x"])}

    guard = ContentionGuard(0.02, clock=STILL)
    _feed(guard, 0.1, 10.0, 6)
    assert guard.duty() == pytest.approx(2 / 99)
    def sample(rng, rows):  # 50 ms of preparing a batch: the span of an update is at least that
        time.sleep(0.05)
        return {"x": rng.normal(size=(rows, 4)).astype(np.float32)}

    dev = jax.devices()[:1]
    spot = SpotTrainer(update, sample, rows_per_device=2, guard=guard)
    spot.start({"n": jnp.zeros((), jnp.int32)}, {}, lambda: dev, step=0, device_sets=[dev])
    deadline = time.perf_counter() + 120
    while spot._phase != "yielding" or spot.stats.steps < 1:
        assert time.perf_counter() < deadline and not spot.stats.error, spot.stats.error
        time.sleep(0.01)
    time.sleep(0.3)
    t = time.perf_counter()
    state, st = spot.stop()
    assert time.perf_counter() - t < 0.25
    assert st.steps == 1 == int(state["n"])
    assert st.stop_phase == "yielding" and st.phase_seconds["yielding"] >= 0.25
    assert guard.wait_before_update() > 90 * guard.last_span
    summary = st.summary()
    assert summary["guard_duty"] == pytest.approx(2 / 99) and summary["guard_yields"] >= 1
    assert math.isclose(summary["guard_slowdown"], 100.0)
