"""One RL step's rollout over the replicas, with spot drafter training on the ones that finish.

`Controller.rollout` splits the prompts over the replicas (all samples of a prompt
on one replica, so a GRPO group never straddles two), runs every replica's engine
in a thread, and as each replica finishes: hands its sequences' harvested features
to ``on_replica_done`` (the drafter buffer), moves it ROLLOUT → IDLE and, with a
spot trainer, IDLE → DRAFT_TRAIN so the trainer's mesh takes its devices. When the
last replica finishes, the trainer stops at its next update boundary, every replica
moves back to ROLLOUT and the new drafter parameters go to every engine (averaged
over hosts first when there are several). Nothing here touches tokens: the
replicas' engines and the trainer's jitted update do all device work.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tltjax.controller.partition import Replica
from tltjax.controller.replica import Phase, ReplicaLog
from tltjax.controller.spot import SpotStats, SpotTrainer


@dataclasses.dataclass
class RolloutResult:
    """Sequences in prompt-major order (as one engine would return them) and what the step cost."""

    sequences: list
    stats: list  # per replica `GenerateStats`
    finish_times: list[float]  # per replica, seconds since the rollout started
    wall: float  # the rollout's critical path: the last replica's finish
    stop_latency: float  # from that finish to the trainer's stop (an update in flight)
    spot: SpotStats | None
    drafter_state: object | None
    idle_device_seconds: float  # devices waiting for the tail, without spot training
    idle_device_seconds_spot: float  # what spot training left idle

    def metrics(self) -> dict[str, float]:
        m = {"controller/rollout_wall": self.wall, "controller/stop_latency": self.stop_latency,
             "controller/idle_device_seconds": self.idle_device_seconds,
             "controller/idle_device_seconds_spot": self.idle_device_seconds_spot}
        if self.spot is not None:
            m.update({f"spot/{k}": v for k, v in self.spot.summary().items()})
        return m


def merge_stats(stats: Sequence, wall: float):
    """One `GenerateStats` for the replicas' ``stats``: counts and device times add up, lists join,
    ``time_total`` is the rollout's wall time ``wall`` (its critical path)."""
    from tltjax.rollout.engine import GenerateStats

    out = GenerateStats()
    for st in stats:
        if st is None:
            continue
        for f in dataclasses.fields(GenerateStats):
            v = getattr(st, f.name)
            if isinstance(v, list):
                getattr(out, f.name).extend(v)
            elif f.name == "max_pages_used":
                out.max_pages_used = max(out.max_pages_used, v)
            else:
                setattr(out, f.name, getattr(out, f.name) + v)
    out.time_total = wall
    return out


def assign_prompts(num_prompts: int, num_replicas: int) -> list[list[int]]:
    """Prompt indices per replica, round robin (equal shares within one prompt)."""
    return [list(range(r, num_prompts, num_replicas)) for r in range(num_replicas)]


def average_over_hosts(tree):
    """The mean of ``tree`` over all processes (identity with one process)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(tree)
    return jax.tree.map(lambda x: np.mean(np.asarray(x), axis=0).astype(np.asarray(x).dtype), gathered)


class Controller:
    """Drives the rollout replicas and the spot trainer through each RL step.

    ``engines[i]`` decodes on ``replicas[i]`` (built with ``mesh=replicas[i].mesh``).
    With ``spot=None`` idle replicas just wait (the baseline the idle figures are
    measured against).
    """

    def __init__(self, replicas: Sequence[Replica], engines: Sequence, *, spot: SpotTrainer | None = None,
                 log: ReplicaLog | None = None):
        if len(replicas) != len(engines) or not replicas:
            raise ValueError(f"need one engine per replica; got {len(engines)} engines for {len(replicas)} replicas")
        self.replicas, self.engines, self.spot = list(replicas), list(engines), spot
        self.log = log or ReplicaLog(len(replicas))

    def training_devices(self) -> tuple:
        """The devices of the replicas now in DRAFT_TRAIN, in replica order."""
        return tuple(d for i in self.log.in_phase(Phase.DRAFT_TRAIN) for d in self.replicas[i].devices)

    def training_meshes(self, max_replicas: int = 8) -> list[tuple]:
        """The device sets the spot trainer can be handed, smallest first: the devices of every proper
        subset of the replicas (the last to finish never trains), in replica order; with more than
        ``max_replicas`` replicas (2^replicas sets) only the first k replicas' for each k."""
        n = len(self.replicas)
        if n > max_replicas:
            subsets = [range(k) for k in range(1, n)]
        else:
            subsets = [c for k in range(1, n) for c in itertools.combinations(range(n), k)]
        return [tuple(d for i in c for d in self.replicas[i].devices) for c in subsets]

    def rollout(
        self,
        step: int,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        seed: int = 0,
        drafter_state=None,
        target_params=None,
        on_replica_done: Callable[[int, list], None] | None = None,
        on_finish: Callable | None = None,
        **generate_kwargs,
    ) -> RolloutResult:
        """Generates ``n`` samples of every prompt over the replicas; see the module docstring.

        ``drafter_state`` / ``target_params``: what the spot trainer starts from and
        trains against (needed when there is a spot trainer). ``on_finish`` gets each
        sequence with its global ``prompt_index``. Engine errors are re-raised after
        every replica has stopped.
        """
        r_count = len(self.replicas)
        shares = assign_prompts(len(prompts), r_count)
        results: list = [None] * r_count
        errors: list = []
        finish = [0.0] * r_count
        done = threading.Event()
        remaining = [sum(1 for s in shares if s)]
        lock = threading.Lock()
        start = self.log.now()
        spot = self.spot if drafter_state is not None else None
        if self.spot is not None and drafter_state is None:
            raise ValueError("a controller with a spot trainer needs drafter_state (and target_params)")
        if spot is not None:
            spot.start(drafter_state, target_params, self.training_devices, step=step,
                       device_sets=self.training_meshes())
        guard = spot.guard if spot is not None else None
        user_progress = generate_kwargs.pop("progress", None)

        def progress_of(r: int):
            """The engine's progress hook for replica ``r``: its decode calls' spans go to the guard."""
            if guard is None:
                return user_progress

            def hook(p: dict) -> None:
                decoding = len(self.log.in_phase(Phase.ROLLOUT))
                if "call_start" in p:
                    guard.record_call((p["bucket"], p["strategy"], decoding), p["call_start"], p["call_end"],
                                      some_idle=decoding < r_count)
                if user_progress is not None:
                    user_progress(p)
            return hook

        def work(r: int) -> None:
            local = shares[r]
            try:
                def relabel(s, local=local):
                    s.prompt_index = local[s.prompt_index]
                    if on_finish is not None:
                        on_finish(s)

                seqs, stats = self.engines[r].generate(
                    [prompts[i] for i in local], n=n, seed=seed + 7919 * r, on_finish=relabel,
                    progress=progress_of(r), **generate_kwargs)
                results[r] = (seqs, stats)
                if on_replica_done is not None:
                    on_replica_done(r, seqs)
            except Exception as e:  # noqa: BLE001 - re-raised below, once every replica stopped
                errors.append((r, e))
            finish[r] = self.log.now() - start
            self.log.move(step, r, Phase.IDLE, "finished its sequences")
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done.set()
            elif spot is not None:
                self.log.move(step, r, Phase.DRAFT_TRAIN, "handed to the spot trainer")
                spot.wake()

        threads = []
        for r in range(r_count):
            if shares[r]:
                threads.append(threading.Thread(target=work, args=(r,), name=f"replica-{r}", daemon=True))
            else:  # nothing to decode: idle from the start
                self.log.move(step, r, Phase.IDLE, "no prompts this step")
                results[r] = ([], None)
                if spot is not None:
                    self.log.move(step, r, Phase.DRAFT_TRAIN, "handed to the spot trainer")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(finish) if threads else 0.0
        new_state, spot_stats = drafter_state, None
        if spot is not None:
            new_state, spot_stats = spot.stop()
        stop_latency = self.log.now() - start - wall
        for r in range(r_count):
            self.log.move(step, r, Phase.ROLLOUT, "step boundary")
        if errors:
            r, e = errors[0]
            raise RuntimeError(f"rollout replica {r} failed: {type(e).__name__}: {e}") from e
        if spot is not None:  # hosts trained on their own data: they agree on the mean
            new_state = average_over_hosts(new_state)

        # merge into prompt-major order
        by_prompt: dict[int, list] = {}
        for seqs, _ in results:
            for s in seqs:
                by_prompt.setdefault(s.prompt_index, []).append(s)
        sequences = [s for i in range(len(prompts)) for s in sorted(by_prompt[i], key=lambda s: s.sample_index)]
        idle = sum(self.replicas[r].size * (wall - finish[r]) for r in range(r_count))
        busy = 0.0
        if spot_stats is not None:
            t_end = start + wall  # training after the critical path does not fill idle time
            for a, b, k in spot_stats.intervals:
                a, b = a - self.log.origin, b - self.log.origin
                busy += max(0.0, min(b, t_end) - max(a, start)) * k
        return RolloutResult(
            sequences=sequences, stats=[s for _, s in results], finish_times=finish, wall=wall,
            stop_latency=stop_latency, spot=spot_stats, drafter_state=new_state,
            idle_device_seconds=idle, idle_device_seconds_spot=max(idle - busy, 0.0),
        )

    def push_drafter(self, drafter) -> None:
        """Gives every replica's engine the drafter ``drafter`` (a `Drafter` module) for the next step."""
        for e in self.engines:
            e.set_params(drafter=drafter)

    def push_policy(self, target) -> None:
        """Gives every replica's engine the policy ``target`` (copied onto each replica's mesh)."""
        for e in self.engines:
            e.set_params(target=target)
