"""Synthetic tasks with verifiable answers, looked up by name.

A task generates `Example`s (prompt, reference response, answer) deterministically from a seed
and scores a model's response against the answer. Tasks are registered in `TASKS`; configs name
them (`get_task(config.rl.task)`).

`longtail_arith` reproduces, at toy scale, what makes reasoning-RL rollouts slow: the worked
solution is a chain of one-line steps whose count is drawn from a (truncated) geometric
distribution, so most responses are short and a few are many times longer:

    prompt:   "23 +7 *2 -5"        start value, then operations applied left to right
    response: "23+7=30\\n30*2=60\\n60-5=55\\n#55"

Every intermediate value stays in [0, max_value], so each step is small-number arithmetic that a
tiny model learns, while a long chain still gives it many chances to slip. The final answer is
the first line that starts with `#` (`ANSWER_MARKER`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: the prompt, a correct worked response, and its final answer."""

    prompt: str
    response: str
    answer: str
    num_steps: int


@dataclasses.dataclass(frozen=True)
class Task:
    """A named task: `generate(n, seed, **knobs)`, `score(response, answer)` and its alphabet.

    `score` returns a reward in [0, 1] and never raises; `alphabet` holds every character that
    prompts and reference responses use (what a character tokenizer needs).
    """

    name: str
    generate: Callable[..., list[Example]]
    score: Callable[[str, str], float]
    alphabet: str
    # `slip(example, rng, rate)`: the example with a fraction `rate` of its worked steps made wrong,
    # the rest of the solution consistent with them (SFT data with mistakes); None: not supported.
    slip: Callable[[Example, np.random.Generator, float], Example] | None = None


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Adds `task` to `TASKS` under `task.name`; names are unique."""
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already registered; pick another name.")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called `name`."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)}.") from None


def length_stats(examples: Sequence[Example]) -> dict[str, float]:
    """Response-length statistics in characters (= tokens of a character tokenizer).

    Returns median, p90, p99, max and ratio_p99_median (the long-tail measure).
    """
    if not examples:
        raise ValueError("length_stats needs at least one example; got none.")
    lengths = np.array([len(e.response) for e in examples], dtype=np.float64)
    median, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "median": float(median),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(lengths.max()),
        "ratio_p99_median": float(p99 / median),
    }


# --- longtail_arith ----------------------------------------------------------------------------

ANSWER_MARKER = "#"


@dataclasses.dataclass(frozen=True)
class _Op:
    """A step `a{op}b=c`: c = apply(a, b), for b in the inclusive range operands(a, max_value,
    max_operand) that keeps c in [0, max_value] (the range is empty when lo > hi)."""

    apply: Callable[[int, int], int]
    operands: Callable[[int, int, int], tuple[int, int]]


_OPS: dict[str, _Op] = {
    "+": _Op(operator.add, lambda a, max_value, m: (1, min(m, max_value - a))),
    "-": _Op(operator.sub, lambda a, max_value, m: (1, min(m, a))),
    # b >= 2 so that the step does something; any b is fine on 0.
    "*": _Op(operator.mul, lambda a, max_value, m: (2, m if a == 0 else min(m, max_value // a))),
}

LABELS = "abcdefghijklmnopqrstuvwxyz"  # step labels; max_steps is at most their number
alphabet = "0123456789" + "".join(_OPS) + "=" + ANSWER_MARKER + ":" + LABELS + " \n"


def _num_steps(rng: np.random.Generator, n: int, p_stop: float, max_steps: int) -> np.ndarray:
    """n draws of Geometric(p_stop) on {1, ..., max_steps}, truncated exactly (inverse CDF)."""
    if p_stop == 1.0:
        return np.ones(n, dtype=np.int64)
    tail = (1.0 - p_stop) ** max_steps  # P(K > max_steps) before truncation.
    u = rng.uniform(0.0, 1.0 - tail, size=n)
    k = np.ceil(np.log1p(-u) / math.log1p(-p_stop)).astype(np.int64)
    return np.clip(k, 1, max_steps)  # The clip only guards float rounding at the ends.


def generate_longtail_arith(
    n: int,
    seed: int,
    *,
    p_stop: float = 0.25,
    max_steps: int = 24,
    max_value: int = 99,
    max_operand: int = 9,
) -> list[Example]:
    """`n` chains of arithmetic steps with long-tailed lengths; the same seed gives the same list.

    Steps per example ~ Geometric(p_stop) truncated to [1, max_steps]; its median is
    about ceil(ln 2 / -ln(1 - p_stop)) (3 for the default) and its p99 about 16.
    Operations are labelled ``a``, ``b``, ... in the prompt (``68 a-5 b-7 c+1``) and line i of
    the response names its label and applies that operation to the previous value
    (``b:63-7=56``), ending with ``#answer``.
    Each step applies +, - or * (uniform over those that keep the value in [0, max_value]) with
    an operand in [1, max_operand] ([2, max_operand] for *).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    if not 0.0 < p_stop <= 1.0:
        raise ValueError(f"p_stop must be in (0, 1], got {p_stop}; smaller means longer chains.")
    if not 1 <= max_steps <= len(LABELS):
        raise ValueError(f"max_steps must be in [1, {len(LABELS)}] (one label per step), got {max_steps}.")
    if not 2 <= max_operand <= max_value:
        raise ValueError(
            f"need 2 <= max_operand <= max_value, got max_operand={max_operand}, "
            f"max_value={max_value}."
        )
    rng = np.random.default_rng(seed)
    steps = _num_steps(rng, n, p_stop, max_steps)
    examples = []
    for k in steps:
        start = value = int(rng.integers(0, max_value + 1))
        ops, done = [], []
        for _ in range(k):
            ranges = {op: o.operands(value, max_value, max_operand) for op, o in _OPS.items()}
            valid = [op for op, (lo, hi) in ranges.items() if lo <= hi]
            op = valid[rng.integers(len(valid))]
            lo, hi = ranges[op]
            b = int(rng.integers(lo, hi + 1))
            result = _OPS[op].apply(value, b)
            ops.append(f"{op}{b}")
            done.append(f"{value}{op}{b}={result}")
            value = result
        # Operation i carries the label LABELS[i] in the prompt; line i of the response repeats
        # that label, so a step finds its operation by content (no counting) and its operand
        # on the line above.
        labels = LABELS[: len(ops)]
        lines = [f"{label}:{line}" for label, line in zip(labels, done)]
        answer = str(value)
        examples.append(
            Example(
                prompt=str(start) + "".join(f" {label}{op}" for label, op in zip(labels, ops)),
                response="\n".join([*lines, ANSWER_MARKER + answer]),
                answer=answer,
                num_steps=int(k),
            )
        )
    return examples


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the rest of the first line starting with `#`, stripped.

    Taking the first marker line (not the last) means emitting several answers never pays.
    """
    if not isinstance(response, str):
        return None
    for line in response.split("\n"):
        if line.startswith(ANSWER_MARKER):
            return line[len(ANSWER_MARKER):].strip()
    return None


_STEP_LINE = re.compile(r"^([a-z]):(\d+)([-+*])(\d+)=(\d+)$")


def slip_longtail_arith(example: Example, rng: np.random.Generator, rate: float) -> Example:
    """`example` with each worked step's result off by 1 or 2 with probability `rate`.

    Later steps continue from the wrong value, so the solution stays self-consistent and its final
    answer (`answer`) is the wrong one: what a model that imitates it learns is to slip at that
    rate, an error that reward can remove (the data of `sft.slip_rate`).
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"slip rate must be in [0, 1), got {rate}.")
    labels, ops = [], []
    for line in example.response.split("\n")[:-1]:
        m = _STEP_LINE.match(line)
        if m is None:
            raise ValueError(f"not a longtail_arith step line: {line!r} in {example.response!r}")
        labels.append(m.group(1))
        ops.append((m.group(3), int(m.group(4))))
    start = int(_STEP_LINE.match(example.response.split("\n")[0]).group(2))

    def stays_non_negative(value: int, rest) -> bool:
        for op, b in rest:
            value = _OPS[op].apply(value, b)
            if value < 0:
                return False
        return True

    out, value = [], start
    for i, (label, (op, b)) in enumerate(zip(labels, ops)):
        a, value = value, _OPS[op].apply(value, ops[i][1])
        if rng.random() < rate:
            # off by 1 or 2, in a direction that keeps every later value >= 0 (the rest computed exactly)
            d = int(rng.choice([-2, -1, 1, 2]))
            for cand in (value + d, value - d):
                if cand >= 0 and stays_non_negative(cand, ops[i + 1 :]):
                    value = cand
                    break
        out.append(f"{label}:{a}{op}{b}={value}")
    answer = str(value)
    return dataclasses.replace(example, response="\n".join([*out, ANSWER_MARKER + answer]), answer=answer)


def score_longtail_arith(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals `answer` exactly, else 0.0; never raises."""
    if not isinstance(answer, str):
        return 0.0
    return float(extract_answer(response) == answer.strip())


LONGTAIL_ARITH = register_task(
    Task(
        name="longtail_arith",
        generate=generate_longtail_arith,
        score=score_longtail_arith,
        alphabet=alphabet,
        slip=slip_longtail_arith,
    )
)

# The default task's functions under short names: `tasks.generate(...)`, `tasks.score(...)`.
generate = generate_longtail_arith
score = score_longtail_arith
