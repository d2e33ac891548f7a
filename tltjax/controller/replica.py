"""The replica state machine: ROLLOUT → IDLE → DRAFT_TRAIN → ROLLOUT, every transition logged.

One RL step, per replica: it decodes its share of the sequences (ROLLOUT); when
all of them have finished it is IDLE; the controller then hands its devices to the
spot trainer (DRAFT_TRAIN); when the step's last replica finishes, training stops
at the next update boundary and every replica returns to ROLLOUT for the next
step. A replica that is idle when the rollout ends (spot training off, or no
data yet) goes straight back to ROLLOUT. Anything else is a bug and raises.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    IDLE = "idle"
    DRAFT_TRAIN = "draft_train"


ALLOWED = {
    (Phase.ROLLOUT, Phase.IDLE),
    (Phase.IDLE, Phase.DRAFT_TRAIN),
    (Phase.IDLE, Phase.ROLLOUT),
    (Phase.DRAFT_TRAIN, Phase.ROLLOUT),
}


@dataclasses.dataclass(frozen=True)
class Transition:
    """Replica ``replica`` went ``src`` → ``dst`` at ``time`` (seconds since the log's start) in RL step ``step``."""

    step: int
    replica: int
    src: Phase
    dst: Phase
    time: float
    reason: str = ""

    def to_dict(self) -> dict:
        return {"step": self.step, "replica": self.replica, "src": self.src.value, "dst": self.dst.value,
                "time": self.time, "reason": self.reason}


class ReplicaLog:
    """The phase of every replica and the log of its transitions; safe to use from several threads."""

    def __init__(self, num_replicas: int, *, clock=time.perf_counter):
        self._clock = clock
        self.origin = clock()  # the clock reading that `now` counts from
        self._lock = threading.Lock()
        self.phases = [Phase.ROLLOUT] * num_replicas
        self.transitions: list[Transition] = []

    def now(self) -> float:
        return self._clock() - self.origin

    def move(self, step: int, replica: int, dst: Phase, reason: str = "") -> Transition:
        """Moves ``replica`` to ``dst``; raises ValueError for a transition the machine does not allow."""
        with self._lock:
            src = self.phases[replica]
            if (src, dst) not in ALLOWED:
                raise ValueError(f"replica {replica}: {src.value} -> {dst.value} is not a valid transition "
                                 f"(allowed: {sorted((a.value, b.value) for a, b in ALLOWED)})")
            t = Transition(step, replica, src, dst, self.now(), reason)
            self.phases[replica] = dst
            self.transitions.append(t)
            return t

    def in_phase(self, phase: Phase) -> list[int]:
        with self._lock:
            return [i for i, p in enumerate(self.phases) if p is phase]

    def for_step(self, step: int) -> list[Transition]:
        with self._lock:
            return [t for t in self.transitions if t.step == step]
