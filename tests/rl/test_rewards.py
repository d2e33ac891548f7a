"""Tests for tltjax/rl/rewards.py: the reward registry, the math and reasoning_gym rewards."""

import json

import pytest

from tltjax.rl import rewards, tasks

FNS = "tests.rl.reward_fns_for_tests"


# --- registry ------------------------------------------------------------------------------------


def test_registry_has_math_alias_and_every_task():
    """"gsm8k" is "math", and every synthetic task is scored by its own scorer under its name."""
    assert rewards.get_reward_fn("gsm8k") is rewards.get_reward_fn("math") is rewards.math_reward
    for name, task in tasks.TASKS.items():
        assert rewards.get_reward_fn(name) is task.score
    ex = tasks.generate(1, seed=0)[0]
    score = rewards.get_reward_fn("longtail_arith")
    assert score(ex.response, ex.answer) == 1.0
    assert score(ex.response, str(int(ex.answer) + 1)) == 0.0


def test_lookup_errors_are_actionable():
    """Unknown names list the registered ones; a bad "module:function" says what failed."""
    with pytest.raises(KeyError, match="unknown reward function 'nope'.*'math'"):
        rewards.get_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        rewards.get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        rewards.get_reward_fn(f"{FNS}:missing")
    with pytest.raises(ValueError, match="is a int, not a function"):
        rewards.get_reward_fn(f"{FNS}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("math")(lambda r, a: 0.0)


def test_module_function_names_resolve():
    """"module:function" imports the function."""
    from tests.rl import reward_fns_for_tests

    assert rewards.get_reward_fn(f"{FNS}:exact") is reward_fns_for_tests.exact


# --- math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("so the total is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt2}{2}", 1.0),  # nested braces
        ("\\boxed{\\frac{1}{2}} and later \\boxed{7}", "7", 1.0),  # the last box counts
        ("work...\n#### 1,234", "1234", 1.0),  # thousands comma
        ("The answer is $1,234.50.", "1234.5", 1.0),  # currency, trailing period
        ("The answer is 18 dollars.", "18", 1.0),
        ("Answer: 50%", "50", 1.0),
        ("I computed 3/4 then 7", "7", 1.0),  # last number
        ("It is 3/4", "0.75", 1.0),  # plain fraction vs decimal
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),  # latex frac vs decimal
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.3333", 1.0),  # within the relative tolerance
        ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),  # outside it
        ("\\boxed{x=5}", "5", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic, via math-verify
        ("\\boxed{\\text{(B)}}", "\\text{(B)}", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("#### 1,235", "1234", 0.0),
        ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
        ("I do not know.", "5", 0.0),  # no number at all
        ("", "5", 0.0),
        ("the sum is 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K-style reference
        ("\\boxed{72}", "... so \\boxed{72}", 1.0),  # MATH-style reference
    ],
)
def test_math_reward(response, answer, reward):
    """The final answer is extracted (boxed, ####, "answer is", last number) and compared
    numerically (commas, $, %, fractions) or symbolically; 1.0 or 0.0."""
    assert rewards.math_reward(response, answer) == reward


def test_math_reward_never_evaluates_code():
    """Non-math text in an answer is rejected without reaching sympy's Python evaluator."""
    assert rewards.math_reward("\\boxed{__import__('os').getcwd()}", "x") == 0.0


# --- reasoning_gym -------------------------------------------------------------------------------


def test_reasoning_gym_roundtrip():
    """A generated entry's own answer scores 1, a wrong one 0; <answer> tags or the last line."""
    from tltjax.rl.datasets import reasoning_gym_dataset

    (example,) = reasoning_gym_dataset("chain_sum", 1, seed=3)
    truth = json.loads(example.answer)["entry"]["answer"]
    assert rewards.reasoning_gym_reward(f"thinking...<answer> {truth} </answer>", example.answer) == 1.0
    assert rewards.reasoning_gym_reward(f"thinking...\n{truth}\n", example.answer) == 1.0
    assert rewards.reasoning_gym_reward(f"<answer>{int(truth) + 1}</answer>", example.answer) == 0.0
    assert rewards.reasoning_gym_reward("", example.answer) == 0.0


def test_reasoning_gym_answer_keeps_python_types():
    """Tuples, sets and non-string keys survive the answer JSON, so scorers compare like with like."""
    entry = {"answer": "x", "metadata": {"grid": ((1, 2), (3, 4)), "seen": {5, 6}, "by_id": {7: "a"}}}
    spec = json.loads(rewards.reasoning_gym_answer("d", entry), object_hook=rewards._untag)
    assert spec == {"dataset": "d", "entry": entry}


def test_reasoning_gym_bad_answer_field_raises():
    """An answer field that is not the reasoning_gym JSON raises, naming the expected format."""
    with pytest.raises(ValueError, match="reasoning_gym answer must be JSON"):
        rewards.reasoning_gym_reward("<answer>1</answer>", "42")
    with pytest.raises(ValueError, match="no dataset 'not_a_dataset'"):
        rewards.reasoning_gym_reward("1", json.dumps({"dataset": "not_a_dataset", "entry": {}}))
