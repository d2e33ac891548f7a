"""Reward functions looked up by name, and a process pool that computes them with a timeout.

A reward function is ``fn(response, answer) -> float``: the model's decoded response and the
dataset's answer field in, a reward out. `REWARD_FNS` holds the built-in ones:

    "math", "gsm8k"   final answer (``\\boxed{}``, ``#### x``, "answer is x", last number)
                      compared numerically, then symbolically; 1.0 or 0.0
    "reasoning_gym"   the answer field is `reasoning_gym_answer(dataset, entry)` JSON; scored by
                      reasoning_gym's own ``score_answer`` on the ``<answer>...</answer>`` text
    <task name>       each synthetic task of `tltjax.rl.tasks.TASKS`, scored by its ``score``

`get_reward_fn` also accepts ``"package.module:function"`` for a reward function of your own.
`tltjax.rl.reward_pool.RewardPool` runs them in worker processes with a time-out.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

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
