"""A process pool that computes rewards with a per-call time-out.

`RewardPool` runs a reward function (see `tltjax.rl.rewards`) in worker processes, so a
function that raises, hangs or crashes costs one sample (reward 0.0, status "error" or
"timeout") and never the run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import sys
import threading
import time
from typing import Any, Literal

from tltjax.rl.rewards import RewardFn, get_reward_fn

log = logging.getLogger("tltjax.rl.rewards")

Status = Literal["ok", "error", "timeout"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout")
STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then (imports, warmup) fails the pool
_SAMPLE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The reward of sample `index`; 0.0 unless status is "ok". `seconds` is the call's time."""

    index: int
    reward: float
    status: Status
    error: str | None
    seconds: float


def _score(fn: RewardFn, index: int, response: str, answer: str) -> RewardResult:
    """Calls `fn`, turning an exception or a non-finite / non-numeric return into status "error"."""
    start = time.perf_counter()
    try:
        value = fn(response, answer)
    except Exception as e:
        return RewardResult(index, 0.0, "error", f"{type(e).__name__}: {e}"[:1000], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return RewardResult(index, float(value), "ok", None, seconds)
    return RewardResult(
        index, 0.0, "error", f"reward function returned {value!r} ({type(value).__name__}); expected a finite float",
        seconds,
    )


def _worker_main(fn_name: str, import_paths: list[str], conn) -> None:
    """A pool worker: resolves the function, reports ready, then scores tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    sys.path[:] = import_paths + [p for p in sys.path if p not in import_paths]
    try:
        fn = get_reward_fn(fn_name)
        warmup = getattr(fn, "warmup", None)
        if warmup is not None:
            warmup()
    except BaseException as e:
        conn.send(("startup_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(("result", _score(fn, *task)))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any
    started: float  # when the process (ready=False) or the current task started
    ready: bool = False
    task: tuple[int, str, str] | None = None


class RewardPool:
    """Computes rewards in `num_workers` spawned processes, each call limited to `timeout_s`.

    `submit` queues a sample and returns at once; `results` waits for every sample submitted
    since the last `results` and returns them ordered by index. A call that raises or returns a
    non-finite / non-numeric value gives reward 0.0 and status "error"; one that runs past
    `timeout_s` has its worker killed and replaced, and gives 0.0 and status "timeout". The
    pool goes on either way; each failure is logged to "tltjax.rl.rewards" with the sample.

    Workers are started with "spawn" (the parent runs JAX, which is not fork-safe), receive the
    parent's sys.path, and resolve `fn_name` themselves, so "module:function" must be importable
    there; a script that makes a pool needs an ``if __name__ == "__main__":`` guard.
    `num_workers=0` scores inline in `submit`, in the calling process, with no timeout (for
    tests and debugging). `counts` holds the number of results per status so far.
    """

    def __init__(self, fn_name: str, num_workers: int = 2, timeout_s: float = 5.0):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 scores in this process), got {num_workers}.")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
        self.fn_name = fn_name
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._fn = get_reward_fn(fn_name)  # checked once here, so a bad name fails in the parent
        self._counts = dict.fromkeys(STATUSES, 0)
        self._cond = threading.Condition()
        self._outstanding: set[int] = set()
        self._done: dict[int, RewardResult] = {}
        self._pending: collections.deque[tuple[int, str, str]] = collections.deque()
        self._closed = False
        self._fatal: str | None = None
        self._wake_pending = False
        self._workers: list[_Worker] = []
        if num_workers == 0:
            return
        self._ctx = multiprocessing.get_context("spawn")
        self._import_paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # --- public API -----------------------------------------------------------------------------

    @property
    def counts(self) -> dict[str, int]:
        """Results so far per status: {"ok": n, "error": n, "timeout": n}."""
        with self._cond:
            return dict(self._counts)

    def submit(self, index: int, response: str, answer: str) -> None:
        """Queues the reward of sample `index` (unique until the next `results`); non-blocking."""
        with self._cond:
            self._check_usable()
            if index in self._outstanding:
                raise ValueError(
                    f"sample index {index} is already submitted and not yet collected; indices must "
                    "be unique between two results() calls."
                )
            self._outstanding.add(index)
            if self.num_workers:
                self._pending.append((index, response, answer))
                self._wake()
                return
        result = _score(self._fn, index, response, answer)
        with self._cond:
            self._finish(result, response)

    def results(self) -> list[RewardResult]:
        """Waits for every sample submitted since the last call; returns them ordered by index."""
        with self._cond:
            while True:
                self._check_usable()
                if all(i in self._done for i in self._outstanding):
                    break
                self._cond.wait()
            out = [self._done.pop(i) for i in sorted(self._outstanding)]
            self._outstanding.clear()
        return out

    def close(self) -> None:
        """Stops the workers; queued samples are dropped. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            if not self.num_workers:
                return
            self._wake()
        self._thread.join(timeout=10)
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=1)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._fatal is not None:
            raise RuntimeError(f"reward pool for {self.fn_name!r} failed: {self._fatal}")
        if self._closed:
            raise RuntimeError(f"reward pool for {self.fn_name!r} is closed; make a new RewardPool.")

    def _wake(self) -> None:
        """Interrupts the dispatcher's wait (lock held); at most one wake-up is ever in the pipe,
        so this never blocks on a full pipe."""
        if not self._wake_pending:
            self._wake_pending = True
            self._wake_w.send_bytes(b"")

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(self.fn_name, self._import_paths, child_conn), daemon=True,
            name=f"reward-worker-{self.fn_name}",
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, started=time.monotonic())

    def _finish(self, result: RewardResult, response: str) -> None:
        """Records a result (lock held) and logs it when it failed."""
        self._counts[result.status] += 1
        self._done[result.index] = result
        if result.status != "ok":
            sample = response[:_SAMPLE_CHARS] + ("..." if len(response) > _SAMPLE_CHARS else "")
            log.warning(
                "reward %r %s on sample %d after %.2fs: %s; response: %r",
                self.fn_name, result.status, result.index, result.seconds, result.error, sample,
            )
        self._cond.notify_all()

    def _replace(self, i: int) -> None:
        w = self._workers[i]
        w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()
        self._workers[i] = self._start_worker()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never leave results() waiting on a dead thread
            with self._cond:
                self._fatal = f"dispatcher thread crashed: {type(e).__name__}: {e}"
                self._cond.notify_all()
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed or self._fatal:
                    return
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.task is None and self._pending:
                        task = self._pending.popleft()
                        try:
                            w.conn.send(task)
                        except OSError:  # the worker died idle: requeue; its EOF replaces it below
                            self._pending.appendleft(task)
                            continue
                        w.task, w.started = task, now
            deadlines = [w.started + (self.timeout_s if w.ready else STARTUP_TIMEOUT_S)
                         for w in self._workers if w.task is not None or not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            readable = multiprocessing.connection.wait([self._wake_r, *(w.conn for w in self._workers)], wait_s)
            with self._cond:
                if self._wake_pending and self._wake_r in readable:
                    self._wake_r.recv_bytes()
                    self._wake_pending = False
                for i, w in enumerate(self._workers):
                    if w.conn in readable:
                        self._receive(i)
                now = time.monotonic()
                for i, w in enumerate(self._workers):
                    if not w.ready and now - w.started > STARTUP_TIMEOUT_S:
                        self._fatal = f"a worker was not ready after {STARTUP_TIMEOUT_S:.0f}s (imports or warmup hang?)"
                        self._cond.notify_all()
                    elif w.task is not None and now - w.started >= self.timeout_s:
                        index, response, _ = w.task
                        self._finish(RewardResult(index, 0.0, "timeout", f"took over {self.timeout_s}s; worker killed",
                                                  now - w.started), response)
                        self._replace(i)

    def _receive(self, i: int) -> None:
        """Handles one message (or the death) of worker `i`; lock held."""
        w = self._workers[i]
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            if not w.ready:
                self._fatal = f"a worker exited with code {w.process.exitcode} before it was ready; see its stderr."
                self._cond.notify_all()
                return
            if w.task is not None:
                index, response, _ = w.task
                error = f"reward worker died (exit code {w.process.exitcode}) during the call; replaced"
                self._finish(RewardResult(index, 0.0, "error", error, time.monotonic() - w.started), response)
            self._replace(i)
            return
        kind = message[0]
        if kind == "ready":
            w.ready = True
        elif kind == "startup_error":
            self._fatal = f"workers could not load reward function {self.fn_name!r}: {message[1]}"
            self._cond.notify_all()
        else:  # "result"
            _, response, _ = w.task
            w.task = None
            self._finish(message[1], response)
