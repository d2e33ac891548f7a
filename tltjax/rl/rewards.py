"""Reward functions looked up by name, and a process pool that computes them with a timeout.

A reward function is ``fn(response, answer) -> float``: the model's decoded response and the
dataset's answer field in, a reward out. `REWARD_FNS` holds the built-in ones:

    "math", "gsm8k"   final answer (``\\boxed{}``, ``#### x``, "answer is x", last number)
                      compared numerically, then symbolically; 1.0 or 0.0
    "reasoning_gym"   the answer field is `reasoning_gym_answer(dataset, entry)` JSON; scored by
                      reasoning_gym's own ``score_answer`` on the ``<answer>...</answer>`` text
    <task name>       each synthetic task of `tltjax.rl.tasks.TASKS`, scored by its ``score``

`get_reward_fn` also accepts ``"package.module:function"`` for a reward function of your own.

`RewardPool` runs a reward function in worker processes, so a function that raises, hangs or
crashes costs one sample (reward 0.0, status "error"/"timeout") and never the run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Literal

from tltjax.rl import tasks as tasks_lib

log = logging.getLogger("tltjax.rl.rewards")

RewardFn = Callable[[str, str], float]

REWARD_FNS: dict[str, RewardFn] = {}


def register_reward(name: str, *, warmup: Callable[[], None] | None = None):
    """Decorator adding a reward function to `REWARD_FNS` under `name` (names are unique).

    `warmup` (optional) is run once by each pool worker before it takes work, e.g. to import a
    heavy library, so that the first call is not charged for it against the timeout.
    """

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARD_FNS:
            raise ValueError(f"reward function {name!r} is already registered; pick another name.")
        if warmup is not None:
            fn.warmup = warmup
        REWARD_FNS[name] = fn
        return fn

    return add


def get_reward_fn(name: str) -> RewardFn:
    """The reward function called `name`: a registered name, a task name, or "module:function"."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if name in tasks_lib.TASKS:  # a task registered after this module was imported
        return tasks_lib.TASKS[name].score
    if ":" in name:
        return _import_reward_fn(name)
    raise KeyError(
        f"unknown reward function {name!r}; registered: {sorted(REWARD_FNS)}, or give "
        "'package.module:function' for your own."
    )


def _import_reward_fn(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({e}); it must be "
            f"importable from sys.path (cwd {os.getcwd()!r})."
        ) from e
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}.")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is a {type(fn).__name__}, not a function.")
    return fn


# --- math: GSM8K / MATH final answers ------------------------------------------------------------

REL_TOL = Fraction(1, 10_000)  # non-integer answers match within this relative tolerance; integers exactly

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.IGNORECASE | re.MULTILINE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm)\s*\{([^{}]*)\}")
_NUMBER_THEN_WORDS = re.compile(rf"^({_NUMBER})\s*(?:[A-Za-z]{{2,}}\.?\s*)+$")
_LATEX_FRAC = re.compile(r"^([+-]?)\\frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}$|^([+-]?)\\frac(\d)(\d)$")
_VARIABLE_IS = re.compile(r"^[A-Za-z]\w*\s*=\s*(.+)$")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%",
         "\\$", "$", "\\(", "\\)", "\\[", "\\]")


def _boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (nested braces matched), or None."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # unbalanced


def extract_final_answer(response: str) -> str | None:
    """The final answer of a worked solution, or None.

    In order of preference: the last ``\\boxed{...}``, the last ``#### x`` line, the last
    "answer is x" / "answer: x", else the last number in the text.
    """
    if not isinstance(response, str):
        return None
    boxed = _boxed(response)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(response)
        if found and found[-1].strip():
            return found[-1].strip()
    numbers_ = _LAST_NUMBER.findall(response)
    return numbers_[-1] if numbers_ else None


def _normalize(answer: str) -> str:
    """Strips LaTeX decoration, units in \\text{}, currency, percent, thousands commas, "x = "."""
    s = answer.strip().replace("\u2212", "-")
    s = _TEXT_MACRO.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"(\d),(?=\d{3}(?!\d))", r"\1", s).strip().rstrip(".").strip()
    match = _VARIABLE_IS.match(s)
    return match.group(1).strip() if match else s


def _to_number(s: str) -> Fraction | None:
    """`s` as an exact rational: "12", "-0.5", "1e3", "3/4", "\\frac{3}{4}", "18 dollars"."""
    s = s.strip()
    try:
        if re.fullmatch(_NUMBER, s):
            return Fraction(s)
        if m := re.fullmatch(rf"({_NUMBER})\s*/\s*({_NUMBER})", s):
            return Fraction(m.group(1)) / Fraction(m.group(2))
        if m := _LATEX_FRAC.match(s):
            sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else m.group(4, 5, 6)
            value = _to_number(num) / _to_number(den)  # TypeError when not numeric
            return -value if sign == "-" else value
        if m := _NUMBER_THEN_WORDS.match(s):
            return Fraction(m.group(1))
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return None


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


# sympy's parser evaluates Python; only strings of these tokens ever reach it.
_SAFE_EXPR = re.compile(r"^(?:[\d\s.+\-*/^()]|(?:sqrt|pi|sin|cos|tan|log|ln|exp)\b|[A-Za-z](?![A-Za-z]))*$")


def _math_verify_timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread can use.
    return 3 if threading.current_thread() is threading.main_thread() else None


def _symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify's equivalence of two LaTeX answers; sympy on plain expressions if it can't parse."""
    import math_verify

    timeout = _math_verify_timeout()
    gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = math_verify.parse(f"${pred}$", parsing_timeout=timeout)
    if gold_parsed and pred_parsed:
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    if not (_SAFE_EXPR.match(pred) and _SAFE_EXPR.match(gold)):
        return False
    import sympy
    from sympy.parsing import sympy_parser as sp

    transformations = sp.standard_transformations + (sp.implicit_multiplication_application, sp.convert_xor)
    try:
        a, b = (sp.parse_expr(s.replace("ln", "log"), transformations=transformations) for s in (pred, gold))
        return bool(sympy.simplify(a - b) == 0)
    except Exception:  # sympy raises many types on junk input; junk is simply not equal
        return False


def answers_match(pred: str, gold: str) -> bool:
    """Whether two final answers are equal: as strings, as numbers, or symbolically."""
    p, g = _normalize(pred), _normalize(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    p_num, g_num = _to_number(p), _to_number(g)
    if p_num is not None and g_num is not None:
        return _numbers_equal(p_num, g_num)
    return _symbolic_equal(p, g)


def _import_math_verify() -> None:
    import math_verify  # noqa: F401
    import sympy  # noqa: F401


@register_reward("gsm8k", warmup=_import_math_verify)
@register_reward("math", warmup=_import_math_verify)
def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    The reference may be a bare answer or a full solution (``#### x`` or ``\\boxed{x}``).
    """
    pred = extract_final_answer(response)
    gold = extract_final_answer(answer) if ("####" in answer or _BOXED.search(answer)) else answer
    if pred is None or gold is None:
        return 0.0
    return float(answers_match(pred, gold))


# --- reasoning_gym -------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reasoning_gym_answer(dataset: str, entry: Mapping[str, Any]) -> str:
    """The answer field the "reasoning_gym" reward reads: JSON ``{"dataset": ..., "entry": ...}``.

    Tuples, sets and dicts with non-string keys in the entry are tagged (``{"__tuple__": [...]}``)
    so that the scorer sees them as reasoning_gym made them; plain JSON entries work too.
    """
    return json.dumps({"dataset": dataset, "entry": _tag(entry)})


def _tag(x: Any) -> Any:
    """`x` as plain JSON values, with the Python types JSON lacks tagged for `_untag`."""
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    if isinstance(x, list):
        return [_tag(v) for v in x]
    if isinstance(x, tuple):
        return {"__tuple__": [_tag(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {"__set__": [_tag(v) for v in sorted(x, key=repr)]}
    if isinstance(x, Mapping):
        if all(isinstance(k, str) for k in x):
            return {k: _tag(v) for k, v in x.items()}
        return {"__items__": [[_tag(k), _tag(v)] for k, v in x.items()]}
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return _tag(x.tolist())
    return repr(x)


_UNTAG: dict[str, Callable[[list], Any]] = {"__tuple__": tuple, "__set__": set, "__items__": dict}


def _untag(obj: dict) -> Any:
    """`json.loads` object hook undoing `_tag` (inner values are already undone)."""
    if len(obj) == 1:
        ((key, value),) = obj.items()
        if key in _UNTAG and isinstance(value, list):
            return _UNTAG[key](value)
    return obj


def extract_tagged_answer(response: str) -> str:
    """The text of the last ``<answer>...</answer>``, else the last non-empty line (stripped)."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(dataset: str) -> Callable[[str, dict], float]:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(dataset)
    except ValueError:
        raise ValueError(
            f"reasoning_gym has no dataset {dataset!r}; known: {sorted(reasoning_gym.factory.DATASETS)}."
        ) from None


def _import_reasoning_gym() -> None:
    import reasoning_gym  # noqa: F401


@register_reward("reasoning_gym", warmup=_import_reasoning_gym)
def reasoning_gym_reward(response: str, answer: str) -> float:
    """reasoning_gym's own score of the response's answer; `answer` is `reasoning_gym_answer` JSON."""
    try:
        spec = json.loads(answer, object_hook=_untag)
        dataset, entry = spec["dataset"], spec["entry"]
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ValueError(
            f"reasoning_gym answer must be JSON {{'dataset': name, 'entry': {{...}}}} as written by "
            f"tltjax.rl.datasets.reasoning_gym_dataset ({type(e).__name__}: {e}); got {answer[:200]!r}."
        ) from None
    return float(_reasoning_gym_scorer(dataset)(extract_tagged_answer(response), entry))


# --- synthetic tasks -----------------------------------------------------------------------------

for _task in tasks_lib.TASKS.values():
    register_reward(_task.name)(_task.score)


# --- the pool ------------------------------------------------------------------------------------

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
