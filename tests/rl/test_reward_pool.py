"""Tests for tltjax/rl/reward_pool.py: ordering, counts, and the isolation of failing, hanging
and dying reward functions."""

import logging

import pytest

from tltjax.rl import reward_pool

FNS = "tests.rl.reward_fns_for_tests"



def test_inline_pool_orders_and_counts():
    """num_workers=0 scores in-process: errors and non-finite values are status "error" with
    reward 0, results come back ordered by index, and counts accumulate."""
    with reward_pool.RewardPool(f"{FNS}:scripted", num_workers=0) as pool:
        for index, response in [(3, "a"), (0, "b"), (2, "raise"), (1, "nan"), (4, "text")]:
            pool.submit(index, response, "a")
        results = pool.results()
        assert [r.index for r in results] == [0, 1, 2, 3, 4]
        assert [r.status for r in results] == ["ok", "error", "error", "ok", "error"]
        assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0, 0.0]
        assert "ValueError: cannot score 'raise'" in results[2].error
        assert "returned nan" in results[1].error
        pool.submit(0, "a", "a")  # indices are free again after results()
        assert pool.results()[0].reward == 1.0
        assert pool.counts == {"ok": 3, "error": 3, "timeout": 0}
        with pytest.raises(ValueError, match="index 5 is already submitted"):
            pool.submit(5, "a", "a")
            pool.submit(5, "a", "a")
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(9, "a", "a")


def test_pool_survives_errors_hangs_and_crashes(caplog):
    """In worker processes: a raise gives "error", a hang is killed after timeout_s ("timeout"),
    a dying worker gives "error"; each is replaced and later samples still succeed. Failures are
    logged with the sample."""
    caplog.set_level(logging.WARNING, logger="tltjax.rl.rewards")
    with reward_pool.RewardPool(f"{FNS}:scripted", num_workers=2, timeout_s=0.5) as pool:
        responses = ["ok", "hang", "raise", "ok", "die", "ok", "no"]
        for index in reversed(range(len(responses))):
            pool.submit(index, responses[index], "ok")
        results = pool.results()
        assert [r.index for r in results] == list(range(len(responses)))
        assert [r.status for r in results] == ["ok", "timeout", "error", "ok", "error", "ok", "ok"]
        assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
        assert results[1].seconds >= 0.5
        assert "died (exit code 3)" in results[4].error

        for index in range(4):  # the replaced workers go on working
            pool.submit(index, "ok", "ok")
        assert [r.reward for r in pool.results()] == [1.0] * 4
        assert pool.counts == {"ok": 8, "error": 2, "timeout": 1}
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "timeout on sample 1" in messages and "response: 'hang'" in messages
    assert "cannot score 'raise'" in messages


def test_pool_checks_the_function_in_the_parent():
    """A "module:function" that does not import fails at construction, before any worker starts."""
    with pytest.raises(ValueError, match="cannot import module"):
        reward_pool.RewardPool("no_such_module_xyz:f", num_workers=2)


def test_pool_reports_worker_startup_failure():
    """A worker that cannot get ready (warmup raises) makes results() raise with its message."""
    with reward_pool.RewardPool(f"{FNS}:broken_warmup", num_workers=1, timeout_s=0.5) as pool:
        pool.submit(0, "a", "a")
        with pytest.raises(RuntimeError, match="warmup exploded"):
            pool.results()
