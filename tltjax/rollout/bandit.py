"""Choosing, per batch-size bucket, whether to speculate and with which strategy, from measured speed.

The rollout engine runs one program per chunk; which one is an *arm* of the
chunk's bucket: plain decoding (``None``) or a `Strategy` whose program is in the
engine's compiled pool. After each chunk the engine reports the tokens it emitted
and the device seconds the call took (the wall time up to the read-back of its
tokens, which the engine does anyway: no extra device sync; on the CPU backend the
process's CPU time, capped by the wall time, so that other processes' load does not
count), and `Bandit.update` turns them into a reward, tokens per second scaled to a
full bucket (``tokens / seconds * bucket / rows``, ``rows`` the live rows averaged
over the chunk's steps), so that chunks run with fewer live rows, or in which rows
finished early, are comparable. Rewards are kept per (bucket, arm) in a sliding window of
the last ``window`` chunks; costs that change (a drafter that improves over RL
steps, a policy whose responses change) age out of it, and a reward older than
``horizon`` pulls of its bucket no longer counts, so no estimate is older than that.

Choice per bucket (`Bandit.select`):

* The first chunk of a bucket runs its *default* arm: the first strategy when the
  bucket is at most the configured ``default_threshold``, plain above it, unless
  measured buckets say otherwise (speculation that pays in a larger bucket pays
  here too; plain that wins in a smaller bucket wins here too). Then every arm not
  yet measured (or whose rewards have all expired) is tried once.
* The *greedy* arm of a bucket changes only when another arm's estimate beats it
  by a relative margin ``hysteresis`` and rests on at least ``confirm`` rewards: an
  arm that looks better on fewer gets the next chunks until it has them (one lucky
  chunk on a noisy machine does not move the table), and near-equal arms do not flap.
* The policy, from the registry `POLICIES`, decides each pull: ``egreedy``
  (TLT's BEG-MAB: the greedy arm on the window *median*, another arm with
  probability ``epsilon``) or ``ucb`` (UCB1 on the window *mean*, normalised by
  the bucket's best mean).

Speculation therefore turns on as the running batch shrinks into buckets whose
greedy arm is a strategy, and off again when it grows (preemption, admissions)
into buckets where plain wins; the speculation threshold is whatever the measured
rewards make it (`Bandit.threshold`), with ``default_threshold`` only for buckets
not measured yet. The state is plain Python (`state_dict` is JSON), carries the
random generator's state, and is safe to share between threads (rollout replicas).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import threading
from typing import Callable, Sequence

import numpy as np

from tltjax.rollout.speculative import Strategy

PLAIN = "plain"


def arm_name(arm: Strategy | None) -> str:
    """``"plain"`` for no speculation, else the strategy's name."""
    return PLAIN if arm is None else arm.name


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """How a `Bandit` chooses (see the module docstring).

    ``policy``: a name in `POLICIES` (ucb by default: on the long-tail benchmark it
    stayed within 4% of the best fixed table where egreedy, TLT's, came to 9%). ``epsilon``: probability of an exploration
    pull (egreedy). ``window``: rewards kept per (bucket, arm). ``hysteresis``:
    relative margin by which another arm must beat the greedy one to replace it;
    ``confirm``: rewards the challenger needs first.
    ``horizon``: pulls of its bucket after which a reward expires (an arm with
    no reward left is measured again). ``ucb_c``: exploration weight of ucb
    (rewards normalised to the bucket's best mean). ``default_threshold``:
    buckets up to this size speculate until measurements say otherwise.
    ``seed``: the exploration generator's seed.
    """

    policy: str = "ucb"
    epsilon: float = 0.05
    window: int = 16
    hysteresis: float = 0.05
    confirm: int = 3
    horizon: int = 256
    ucb_c: float = 0.1
    default_threshold: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"bandit policy {self.policy!r} is unknown; choose one of {sorted(POLICIES)}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"bandit epsilon={self.epsilon} must lie in [0, 1]")
        if not isinstance(self.window, (int, np.integer)) or self.window < 1:
            raise ValueError(f"bandit window={self.window!r} must be an int >= 1 (rewards kept per bucket and arm)")
        if not isinstance(self.confirm, (int, np.integer)) or not 1 <= self.confirm <= self.window:
            raise ValueError(f"bandit confirm={self.confirm!r} must be an int in [1, window={self.window}]")
        if self.hysteresis < 0:
            raise ValueError(f"bandit hysteresis={self.hysteresis} must be >= 0 (a relative margin, e.g. 0.05)")
        if not isinstance(self.horizon, (int, np.integer)) or self.horizon < 1:
            raise ValueError(f"bandit horizon={self.horizon!r} must be an int >= 1 (pulls of a bucket a reward counts)")
        if self.ucb_c < 0 or self.default_threshold < 0:
            raise ValueError(f"bandit ucb_c={self.ucb_c} and default_threshold={self.default_threshold} must be >= 0")


@dataclasses.dataclass
class _Bucket:
    """What the bandit knows of one bucket: reward windows of (pull number, reward) per arm name."""

    rewards: dict = dataclasses.field(default_factory=dict)
    counts: dict = dataclasses.field(default_factory=dict)  # pulls per arm, all time
    pulls: int = 0
    greedy: str | None = None
    switches: int = 0
    arms: tuple = ()  # arm names in the order last offered (arm index 0 = plain)

    def recent(self, name: str, horizon: int) -> list[float]:
        """The arm's rewards that have not expired (at most ``window``, none older than ``horizon`` pulls)."""
        return [r for t, r in self.rewards.get(name, ()) if t >= self.pulls - horizon]


# ----------------------------------------------------------------------------- policies
def _median(rewards: list[float]) -> float:
    return statistics.median(rewards)


def _mean(rewards: list[float]) -> float:
    return sum(rewards) / len(rewards)


def _egreedy_pull(b: _Bucket, names: list[str], est: dict, n: dict, config: BanditConfig, rng) -> str:
    others = [k for k in names if k != b.greedy]
    if others and rng.random() < config.epsilon:
        return others[int(rng.integers(len(others)))]
    return b.greedy


def _ucb_pull(b: _Bucket, names: list[str], est: dict, n: dict, config: BanditConfig, rng) -> str:
    scale = max(est[k] for k in names) or 1.0
    total = sum(n.values())
    score = {k: est[k] / scale + config.ucb_c * math.sqrt(2.0 * math.log(total) / n[k]) for k in names}
    best = max(names, key=lambda k: score[k])
    # the greedy arm keeps the pull unless the best score beats it by the hysteresis margin
    if score[best] > score[b.greedy] * (1.0 + config.hysteresis):
        return best
    return b.greedy


@dataclasses.dataclass(frozen=True)
class Policy:
    """A selection rule: ``estimate(rewards)`` of an arm from its unexpired rewards, and
    ``pull(bucket, names, estimates, counts, config, rng)``, the arm to run next (every arm measured)."""

    estimate: Callable
    pull: Callable


POLICIES: dict[str, Policy] = {
    "egreedy": Policy(estimate=_median, pull=_egreedy_pull),
    "ucb": Policy(estimate=_mean, pull=_ucb_pull),
}


# ----------------------------------------------------------------------------- the bandit
class Bandit:
    """Per-bucket arm selection from measured throughput; see the module docstring.

    ``select(bucket, arms)`` returns one of ``arms`` (``None`` = plain); ``update``
    records what the chunk it ran achieved. State persists across `Engine.generate`
    calls (RL steps) and through `state_dict` / `load_state_dict` (checkpoints).
    """

    def __init__(self, config: BanditConfig = BanditConfig()):
        self.config = config
        self._policy = POLICIES[config.policy]
        self._buckets: dict[int, _Bucket] = {}
        self._rng = np.random.default_rng(config.seed)
        self._lock = threading.Lock()
        self._mark = (0, 0)  # (switches, pulls) at the last `metrics` call

    # ---------------------------------------------------------------- choosing
    def select(self, bucket: int, arms: Sequence[Strategy | None]) -> Strategy | None:
        """The arm to run for the next chunk of ``bucket``, out of ``arms`` (the pool's programs for it)."""
        if not arms:
            raise ValueError(f"bucket {bucket}: no arms to choose from")
        by_name = {arm_name(a): a for a in arms}
        names = list(by_name)
        with self._lock:
            b = self._buckets.setdefault(int(bucket), _Bucket())
            b.arms = tuple(names)
            if b.greedy not in by_name:
                b.greedy = self._default(int(bucket), arms)
            recent = {n: b.recent(n, self.config.horizon) for n in names}
            unmeasured = [n for n in names if not recent[n]]
            if b.greedy in unmeasured:  # the default's first chunk (or a greedy arm gone stale)
                return by_name[b.greedy]
            if unmeasured:
                return by_name[unmeasured[0]]
            est = {n: self._policy.estimate(recent[n]) for n in names}
            counts = {n: len(recent[n]) for n in names}
            challenger = self._refresh_greedy(b, est, counts)
            if challenger is not None:  # looks better on too few rewards: measure it again
                return by_name[challenger]
            return by_name[self._policy.pull(b, names, est, counts, self.config, self._rng)]

    def update(self, bucket: int, arm: Strategy | str | None, tokens: float, seconds: float,
               rows: float | None = None) -> None:
        """Records a chunk of ``bucket`` run with ``arm``: ``tokens`` emitted in ``seconds`` of device time by
        ``rows`` live rows on average over its steps (None: a full bucket)."""
        if seconds <= 0 or tokens < 0:
            return
        reward = tokens / seconds * (bucket / rows if rows else 1.0)
        name = arm if isinstance(arm, str) else arm_name(arm)
        with self._lock:
            b = self._buckets.setdefault(int(bucket), _Bucket())
            w = b.rewards.setdefault(name, collections.deque(maxlen=self.config.window))
            w.append((b.pulls, float(reward)))
            b.pulls += 1
            b.counts[name] = b.counts.get(name, 0) + 1
            if b.greedy is not None:
                recent = {n: b.recent(n, self.config.horizon) for n in b.arms or (name,)}
                if b.greedy in recent and all(recent.values()):
                    self._refresh_greedy(b, {n: self._policy.estimate(w) for n, w in recent.items()},
                                         {n: len(w) for n, w in recent.items()})

    def _refresh_greedy(self, b: _Bucket, est: dict[str, float], counts: dict[str, int]) -> str | None:
        """Makes the best arm greedy when it beats the greedy one by the hysteresis margin on at least
        ``confirm`` rewards; returns the best such arm that still lacks rewards (None if there is none)."""
        bar = est[b.greedy] * (1.0 + self.config.hysteresis)
        better = sorted((n for n in est if est[n] > bar), key=est.get, reverse=True)
        confirmed = [n for n in better if counts[n] >= self.config.confirm]
        if confirmed:
            b.greedy = confirmed[0]
            b.switches += 1
            return None
        return better[0] if better else None

    def _estimate(self, b: _Bucket, name: str) -> float | None:
        w = b.recent(name, self.config.horizon)
        return self._policy.estimate(w) if w else None

    def _speculates(self, bucket: int) -> bool | None:
        """Whether the measured greedy arm of ``bucket`` speculates (None: not measured)."""
        b = self._buckets.get(bucket)
        if b is None or b.greedy is None or self._estimate(b, b.greedy) is None:
            return None
        return b.greedy != PLAIN

    def _default(self, bucket: int, arms: Sequence[Strategy | None]) -> str:
        """A bucket's first arm: from the nearest measured buckets when they decide it, else the configured
        threshold (speculation pays less as the batch grows: a larger bucket that speculates means this one
        should, a smaller one where plain wins means this one should not)."""
        names = [arm_name(a) for a in arms]
        strategies = [n for n in names if n != PLAIN]
        measured = sorted(k for k in self._buckets if self._speculates(k) is not None)
        above = [k for k in measured if k > bucket and self._speculates(k)]
        below = [k for k in measured if k < bucket and not self._speculates(k)]
        if not strategies or PLAIN not in names:
            return names[0]
        if above:
            g = self._buckets[above[0]].greedy
            return g if g in strategies else strategies[0]
        if below:
            return PLAIN
        return strategies[0] if bucket <= self.config.default_threshold else PLAIN

    # ---------------------------------------------------------------- reporting
    def threshold(self) -> int:
        """The largest measured bucket whose greedy arm speculates (0: none): the threshold the rewards set."""
        with self._lock:
            return max((k for k in self._buckets if self._speculates(k)), default=0)

    def table(self) -> dict[int, str]:
        """Greedy arm name per bucket."""
        with self._lock:
            return {k: b.greedy for k, b in sorted(self._buckets.items()) if b.greedy is not None}

    def estimates(self) -> dict[int, dict[str, float]]:
        """Estimated reward (tokens/s at a full bucket) per bucket and measured arm."""
        with self._lock:
            out = {}
            for k, b in sorted(self._buckets.items()):
                est = {n: self._estimate(b, n) for n in list(b.arms) or list(b.rewards)}
                out[k] = {n: v for n, v in est.items() if v is not None}
            return out

    def metrics(self) -> dict[str, float]:
        """Scalars for the step's metrics: per bucket its greedy arm's index (0 = plain, then the pool's
        strategies in order), whether it speculates, its estimated reward and pulls so far; overall the
        threshold the rewards set, and switches of greedy arms and pulls since the last `metrics` call."""
        thr = self.threshold()
        with self._lock:
            m: dict[str, float] = {}
            for k, b in sorted(self._buckets.items()):
                if b.greedy is None:
                    continue
                names = list(b.arms) or [b.greedy]
                est = self._estimate(b, b.greedy)
                m[f"bandit/b{k}/arm"] = float(names.index(b.greedy)) if b.greedy in names else -1.0
                m[f"bandit/b{k}/speculates"] = float(b.greedy != PLAIN)
                m[f"bandit/b{k}/reward"] = 0.0 if est is None else float(est)
                m[f"bandit/b{k}/pulls"] = float(b.pulls)
            switches = sum(b.switches for b in self._buckets.values())
            pulls = sum(b.pulls for b in self._buckets.values())
            m["bandit/threshold"] = float(thr)
            m["bandit/switches"] = float(switches - self._mark[0])
            m["bandit/pulls"] = float(pulls - self._mark[1])
            self._mark = (switches, pulls)
            return m

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: reward windows, greedy arms, counters, the generator."""
        with self._lock:
            return {
                "config": dataclasses.asdict(self.config),
                "rng": self._rng.bit_generator.state,
                "mark": list(self._mark),
                "buckets": {
                    str(k): {
                        "rewards": {n: [[t, r] for t, r in w] for n, w in b.rewards.items()},
                        "counts": dict(b.counts), "pulls": b.pulls, "greedy": b.greedy,
                        "switches": b.switches, "arms": list(b.arms),
                    }
                    for k, b in self._buckets.items()
                },
            }

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict` output (this bandit's config stays; windows are cut to its ``window``)."""
        try:
            buckets = {}
            for k, d in state["buckets"].items():
                b = _Bucket(counts={n: int(c) for n, c in d["counts"].items()}, pulls=int(d["pulls"]),
                            greedy=d["greedy"], switches=int(d["switches"]), arms=tuple(d["arms"]))
                for n, w in d["rewards"].items():
                    b.rewards[n] = collections.deque(((int(t), float(r)) for t, r in w), maxlen=self.config.window)
                buckets[int(k)] = b
            rng = np.random.default_rng()
            rng.bit_generator.state = state["rng"]
            mark = tuple(int(x) for x in state["mark"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a Bandit.state_dict() (missing or bad field: {e!r})") from None
        with self._lock:
            self._buckets, self._rng, self._mark = buckets, rng, mark

    @classmethod
    def from_state_dict(cls, state: dict) -> "Bandit":
        """A bandit with the saved config and state."""
        bandit = cls(BanditConfig(**state["config"]))
        bandit.load_state_dict(state)
        return bandit
