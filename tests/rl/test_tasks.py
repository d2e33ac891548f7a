"""Tests for tltjax/rl/tasks.py: the task registry and the longtail_arith task."""

import operator
import re

import numpy as np
import pytest

from tltjax.rl import tasks

STEP = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.fixture(scope="module")
def examples():
    return tasks.generate(5000, seed=0)


def test_registry_lookup():
    """`get_task` returns the registered task and names the known tasks for an unknown one."""
    task = tasks.get_task("longtail_arith")
    assert task is tasks.TASKS["longtail_arith"]
    assert (task.generate, task.score) == (tasks.generate, tasks.score)
    assert task.alphabet == tasks.alphabet
    with pytest.raises(KeyError, match="unknown task 'nope'.*longtail_arith"):
        tasks.get_task("nope")


def test_generate_is_deterministic_by_seed():
    """The same seed gives the same examples; another seed gives different ones."""
    assert tasks.generate(200, seed=3) == tasks.generate(200, seed=3)
    assert tasks.generate(200, seed=3) != tasks.generate(200, seed=4)
    assert tasks.generate(50, seed=3, max_steps=5) == tasks.generate(50, seed=3, max_steps=5)


def test_solution_steps_are_correct(examples):
    """Each response is a chain of true steps that follows the prompt's labelled operations in
    order, each line naming its operation's label, values stay within [0, 99], and it ends with
    `#answer` for the last value; all chars in `alphabet`."""
    for ex in examples:
        start, *labelled = ex.prompt.split(" ")
        labels = [item[0] for item in labelled]
        ops = [item[1:] for item in labelled]
        assert "".join(labels) == tasks.LABELS[: len(ops)]
        *lines, final = ex.response.split("\n")
        assert len(ops) == len(lines) == ex.num_steps >= 1
        value = int(start)
        for label, op_text, line in zip(labels, ops, lines):
            assert line.startswith(label + ":")
            a, op, b, c = STEP.fullmatch(line[2:]).groups()
            assert (int(a), op + b) == (value, op_text)
            assert int(c) == OPS[op](int(a), int(b)) and 0 <= int(c) <= 99
            value = int(c)
        assert final == f"#{value}" and ex.answer == str(value)
        assert set(ex.prompt + ex.response) <= set(tasks.alphabet)


def test_reference_scores_one_and_corruptions_score_zero(examples):
    """The reference response scores 1.0; a wrong, missing or later-only answer scores 0.0."""
    for ex in examples[:500]:
        assert tasks.score(ex.response, ex.answer) == 1.0
        body = ex.response.rsplit("\n", 1)[0]
        wrong = str(int(ex.answer) + 1)
        assert tasks.score(f"{body}\n#{wrong}", ex.answer) == 0.0
        assert tasks.score(body, ex.answer) == 0.0
        assert tasks.score(f"{body}\n#{wrong}\n#{ex.answer}", ex.answer) == 0.0  # first # counts


def test_response_lengths_are_long_tailed(examples):
    """Over 5000 examples, p99 response length is at least 4x the median."""
    stats = tasks.length_stats(examples)
    assert stats["ratio_p99_median"] >= 4.0, stats
    assert stats["median"] <= stats["p90"] <= stats["p99"] <= stats["max"]


def test_score_never_raises_on_garbage():
    """`score` returns 0.0 or 1.0 for random strings and non-string inputs, never raising."""
    rng = np.random.default_rng(0)
    chars = list(tasks.alphabet + "abc\t\x00é<|>")
    for _ in range(2000):
        text = "".join(rng.choice(chars, size=rng.integers(0, 30)))
        assert tasks.score(text, "7") in (0.0, 1.0)
    for response, answer in [(None, "1"), (b"#1", "1"), (12, "12"), ("#1", None), ("#1", 1)]:
        assert tasks.score(response, answer) == 0.0


def test_bad_knobs_are_clear_errors():
    """Out-of-range knobs raise errors naming the knob and its value."""
    with pytest.raises(ValueError, match="p_stop must be in"):
        tasks.generate(1, seed=0, p_stop=0.0)
    with pytest.raises(ValueError, match="max_operand=1"):
        tasks.generate(1, seed=0, max_operand=1)


def test_slips_are_small_consistent_and_at_the_asked_rate(examples):
    """`slip_longtail_arith` makes a fraction `rate` of the steps wrong by 1 or 2; every later step
    computes correctly from the (wrong) value above it, and `answer` is the chain's own end."""
    rng = np.random.default_rng(0)
    slipped = [tasks.slip_longtail_arith(ex, rng, 0.2) for ex in examples[:2000]]
    steps = wrong = 0
    for ex, sl in zip(examples, slipped):
        assert sl.prompt == ex.prompt and sl.num_steps == ex.num_steps
        *lines, final = sl.response.split("\n")
        value = int(ex.prompt.split(" ")[0])
        for line, op_text in zip(lines, [item[1:] for item in ex.prompt.split(" ")[1:]]):
            a, op, b, c = STEP.fullmatch(line[2:]).groups()
            assert (int(a), op + b) == (value, op_text)  # continues from the line above
            true = OPS[op](int(a), int(b))
            assert abs(int(c) - true) in (0, 1, 2) and int(c) >= 0
            steps, wrong = steps + 1, wrong + (int(c) != true)
            value = int(c)
        assert final == f"#{value}" and sl.answer == str(value)
        assert set(sl.prompt + sl.response) <= set(tasks.alphabet)
    assert abs(wrong / steps - 0.2) < 0.02  # ~8000 steps: 4.5 standard errors
    assert tasks.slip_longtail_arith(examples[0], rng, 0.0) == examples[0]
    with pytest.raises(ValueError, match="slip rate"):
        tasks.slip_longtail_arith(examples[0], rng, 1.0)


def test_error_analysis_classifies_the_first_wrong_line():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "error_analysis.py"
    spec = importlib.util.spec_from_file_location("error_analysis", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    classify = module.classify
    for e in tasks.generate(50, seed=3, max_value=29):
        assert classify(e.prompt, e.response) == "ok"
    assert classify("14 a*2", "a:12*2=24\n#24") == "copy"
    assert classify("14 a*2 b+1", "a:14*2=28\nb:28+2=30\n#30") == "operand"
    assert classify("14 a*2 b+1", "a:14*2=28\nb:28+1=27\n#27") == "arith+"
    assert classify("14 a*2 b+1", "a:14*2=28\n#28") == "answer_early"
    assert classify("14 a*2", "a:14*2=28\n#29") == "answer_copy"
    assert classify("14 a*2", "a:14*2=28") == "no_answer"
