"""The RL loop end to end on the micro config: a smoke run, and kill-and-resume reproducibility."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tltjax.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
MICRO = "configs/micro.py"
# metrics that depend on wall time, not on what was computed
TIMING = ("time/", "rollout/tokens_per_s")


def micro_config(workdir, cache_dir, *overrides):
    return load_config(MICRO, [f"--config.workdir={workdir}", f"--config.cache_dir={cache_dir}", *overrides])


@pytest.fixture(scope="module")
def cache_dir(micro_cache):
    """The session's cache of the micro policy and its offline drafter (tests/conftest.py)."""
    return micro_cache


def read(workdir) -> list[dict]:
    from tltjax.metrics import read_metrics

    return read_metrics(pathlib.Path(workdir) / "metrics.jsonl")


def test_rl_smoke_run_logs_every_step_checkpoints_and_plots(tmp_path, cache_dir):
    """A few GRPO steps with speculative rollouts: every step logged with finite metrics, no
    compilation after warm-up, rollout log-probs equal a recompute, checkpoints, plots, summary."""
    from tltjax.rl.trainer import Trainer

    cfg = micro_config(tmp_path / "run", cache_dir, "--config.rl.steps=4")
    summary = Trainer(cfg, log_fn=lambda *a: None).run()
    rows = read(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(np.isfinite(v) for v in r.values()), r
        assert 0.0 <= r["reward/mean"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0
        assert r["rollout/compilations"] == 0  # the engine's pool covered every call
        assert r["logprob/mismatch_max"] < 5e-4  # the rollout's log-probs are the policy's
        assert r["logprob/update_mismatch_max"] < 5e-4
        assert r["reward/errors"] == 0 and r["reward/timeouts"] == 0
        assert r["time/rollout"] > 0 and r["time/update"] > 0
    # below the threshold the engine speculated, and the online drafter trained
    assert any(r["rollout/spec_token_frac"] > 0 for r in rows)
    assert all("drafter/loss" in r for r in rows)
    assert summary["steps"] == 4 and 0.0 <= summary["eval_accuracy_end"] <= 1.0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4
    assert sorted(p.name for p in (tmp_path / "run" / "plots").glob("*.png")) == [
        "accept_length.png", "response_length.png", "reward.png", "time_breakdown.png"]
    from tltjax.checkpoint import Checkpointer

    assert Checkpointer(tmp_path / "run" / "checkpoints").all_steps() == [2, 4]  # keep_checkpoints=2


@pytest.mark.slow
def test_replicas_with_spot_training_on_eight_devices(tmp_path, cache_dir):
    """controller.replica_size=4 on 8 virtual devices: two tensor-parallel replicas decode each step, the
    one that finishes first trains the drafter (logged transitions and spot updates), training stops with
    the rollout, and the loop's metrics stay sane: the rollout's log-probs are still the policy's. The
    spot update was compiled before step 1 (`Trainer.warmup_spot`): no spot update waits for a compilation."""
    from tltjax.rl.trainer import Trainer

    cfg = micro_config(tmp_path / "ctl", cache_dir, "--config.rl.steps=2", "--config.controller.replica_size=4",
                       "--config.rl.eval_prompts=0", "--config.rl.plots=false", "--config.rollout.max_batch=8",
                       "--config.rollout.spec_threshold=0")
    Trainer(cfg, log_fn=lambda *a: None).run()
    rows = read(tmp_path / "ctl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob/mismatch_max"] < 5e-4 and r["drafter/buffer_entries"] > 0
        assert r["controller/idle_device_seconds_spot"] <= r["controller/idle_device_seconds"]
        assert r["spot/compile_waits"] == 0 and r["spot/compile_seconds"] == 0
        assert 0 < r["spot/guard_duty"] <= 1  # the contention guard (on by default) rationed the updates
    assert sum(r["spot/steps"] for r in rows) > 0  # some idle devices trained
    trans = [json.loads(line) for line in (tmp_path / "ctl" / "controller.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [t for t in trans if t["step"] == step]
        assert sorted({t["replica"] for t in mine}) == [0, 1]
        assert sum(t["dst"] == "draft_train" for t in mine) == 1  # the replica that finished first trained
        assert sum(t["dst"] == "rollout" for t in mine) == 2  # both back at the step boundary


def test_baseline_switch_never_speculates(tmp_path, cache_dir):
    """rl.baseline=True runs the same loop with plain decoding only."""
    from tltjax.rl.trainer import Trainer

    cfg = micro_config(tmp_path / "base", cache_dir, "--config.rl.steps=1", "--config.rl.baseline=true",
                       "--config.rl.eval_prompts=0", "--config.rl.plots=false")
    Trainer(cfg, log_fn=lambda *a: None).run()
    (row,) = read(tmp_path / "base")
    assert row["rollout/spec_token_frac"] == 0.0 and row["rollout/accept_length"] == 0.0


@pytest.mark.slow
def test_adaptive_rollout_keeps_its_bandit_across_steps_and_checkpoints(tmp_path, cache_dir):
    """rollout.adaptive: one bandit learns over the steps (its per-bucket metrics are logged), and a
    resumed run starts from the bandit state the checkpoint holds."""
    from tltjax.rl.trainer import Trainer

    cfg = micro_config(tmp_path / "ad", cache_dir, "--config.rl.steps=2", "--config.rollout.adaptive=true",
                       "--config.rl.checkpoint_every=1", "--config.rl.eval_prompts=0", "--config.rl.eval_samples=0",
                       "--config.rl.plots=false")
    trainer = Trainer(cfg, log_fn=lambda *a: None)
    trainer.run()
    assert trainer.engine.pool_summary()["spec_programs"] == 5  # every bucket 1..16 holds the strategy
    rows = read(tmp_path / "ad")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["bandit/pulls"] > 0 and r["rollout/pool_mb"] > 0 and r["rollout/compilations"] == 0
        assert r["bandit/b16/arm"] in (0.0, 1.0) and "bandit/threshold" in r
    saved = trainer.bandit.state_dict()
    resumed = Trainer(cfg, log_fn=lambda *a: None)
    assert resumed.start_step == 2 and resumed.bandit.state_dict() == saved
    resumed.close()


def _cmd(workdir, cache_dir, steps):
    return [sys.executable, "-m", "tltjax.main", f"--config={MICRO}", f"--config.workdir={workdir}",
            f"--config.cache_dir={cache_dir}", f"--config.rl.steps={steps}", "--config.rl.checkpoint_every=1",
            "--config.rl.keep_checkpoints=2", "--config.rl.eval_prompts=0", "--config.rl.plots=false"]


def _run(cmd, until=None, timeout=600, compile_cache=None):
    """Runs ``cmd``; with ``until`` (a predicate polled every 50 ms), SIGKILLs it once that holds.

    ``compile_cache``: a JAX persistent compilation cache shared by the runs (compilation is
    most of a micro run's time; cached executables compute the same values).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if compile_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=str(compile_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    if until is None:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        return True
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if until():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    return False  # finished before the condition held


@pytest.mark.slow
def test_killed_run_resumes_and_reproduces_the_uninterrupted_metrics(tmp_path, cache_dir):
    """SIGKILL during a checkpoint save and again between steps; each restart resumes from the last
    complete checkpoint, and every step's metrics (timings aside) equal an uninterrupted run's."""
    steps = 4
    ref, run = tmp_path / "ref", tmp_path / "killed"
    cc = tmp_path / "xla_cache"
    _run(_cmd(ref, cache_dir, steps), compile_cache=cc)
    ckpts = run / "checkpoints"

    def saving():  # an orbax temp directory exists: a save is in flight
        return ckpts.exists() and any(".orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())

    def logged(n):
        f = run / "metrics.jsonl"
        return lambda: f.exists() and len(f.read_text().splitlines()) >= n

    killed = [_run(_cmd(run, cache_dir, steps), until=saving, compile_cache=cc)]
    killed.append(_run(_cmd(run, cache_dir, steps), until=logged(3), compile_cache=cc))
    _run(_cmd(run, cache_dir, steps), compile_cache=cc)
    assert any(killed), "neither kill landed before the run finished"
    want, got = read(ref), read(run)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(want, got):
        for k in a:
            if not k.startswith(TIMING):
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("override, message", [
    ("drafter_lr=0", "config.rl.drafter_lr=0.0 must be > 0"),
    ("drafter_warmup_steps=-1", "config.rl.drafter_warmup_steps=-1 must be >= 0"),
])
def test_bad_online_drafter_settings_are_refused_by_name(override, message):
    """check_config refuses an online drafter lr <= 0 or a negative warm-up, naming the field."""
    from tltjax.config import ConfigError
    from tltjax.rl.trainer import check_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(load_config(MICRO, [f"--config.rl.{override}"]))


@pytest.mark.parametrize("value", ["-0.01", "1.0"])
def test_a_spot_guard_tolerance_outside_zero_one_is_refused_by_name(value):
    """controller.spot_guard is the allowed slowdown of the tail: 0 (off) up to below 1."""
    from tltjax.config import ConfigError
    from tltjax.rl.trainer import check_config

    with pytest.raises(ConfigError, match=re.escape("config.controller.spot_guard=") + ".*must be in \\[0, 1\\)"):
        check_config(load_config(MICRO, [f"--config.controller.spot_guard={value}"]))
    check_config(load_config(MICRO, ["--config.controller.spot_guard=0"]))  # off is allowed


def test_online_drafter_optimiser_warms_up_to_its_own_lr(tmp_path, cache_dir):
    """The online drafter's optimiser takes rl.drafter_lr (not the offline drafter.lr) and warms up over
    rl.drafter_warmup_steps updates: its first update is zero, so a fresh Adam state never jolts the
    warm-started drafter. (Constant gradients: each Adam update is the schedule's lr.)"""
    import jax
    import jax.numpy as jnp

    from tltjax.rl.trainer import Trainer

    cfg = micro_config(tmp_path / "run", cache_dir, "--config.rl.drafter_lr=0.002",
                       "--config.rl.drafter_warmup_steps=4", "--config.drafter.lr=0.1")
    trainer = Trainer(cfg, log_fn=lambda *a: None)
    try:
        state = trainer.drafter_state
        grads = jax.tree.map(jnp.ones_like, state.params)
        opt, sizes = state.tx.init(state.params), []
        for _ in range(5):
            upd, opt = state.tx.update(grads, opt, state.params)
            sizes.append(max(float(jnp.abs(u).max()) for u in jax.tree.leaves(upd)))
    finally:
        trainer.close()
    assert sizes == pytest.approx([0.0, 0.0005, 0.001, 0.0015, 0.002], rel=1e-3, abs=1e-9)


@pytest.mark.parametrize("mini_batches", [1, 2, 4])
def test_update_layout_deals_kept_rows_evenly_and_sorts_them_by_length(mini_batches):
    """Every kept rollout row lands in exactly one micro-batch and no dropped row does; the optimiser
    steps get nearly equal numbers of rows (none is left out while another has two or more); within a
    step the micro-batches hold at most micro_rows rows, all full but the last, in order of length."""
    from tltjax.rl.trainer import update_layout

    rng = np.random.default_rng(0)
    for trial in range(200):
        groups, n, micro_rows = 32, 8, 16
        keep = np.repeat(rng.random(groups) < rng.random(), n)
        lengths = rng.integers(20, 400, groups * n)
        plan = update_layout(keep, lengths, mini_batches, micro_rows)
        rows = [np.concatenate(micro) for micro in plan]
        assert sorted(np.concatenate(rows).tolist() if rows else []) == list(np.flatnonzero(keep))
        per_step = [len(r) for r in rows]
        assert len(plan) == min(mini_batches, int(keep.sum()))
        assert not per_step or max(per_step) - min(per_step) <= 1, per_step
        for micro, r in zip(plan, rows):
            assert [len(m) for m in micro[:-1]] == [micro_rows] * (len(micro) - 1) and 1 <= len(micro[-1]) <= micro_rows
            assert np.all(np.diff(lengths[r]) >= 0)


def test_engine_buckets_fit_the_run_s_max_batch():
    """config.rollout.batch_buckets keeps the sizes below max_batch and always ends at max_batch (so
    `--set rollout.max_batch=...` never leaves a bucket the engine refuses); empty stays the powers of two."""
    from tltjax.config import ConfigError
    from tltjax.rl.trainer import engine_buckets

    assert engine_buckets((4, 16, 64, 128), 128) == (4, 16, 64, 128)
    assert engine_buckets((4, 16, 64, 128), 16) == (4, 16)
    assert engine_buckets((4, 16, 64, 128), 32) == (4, 16, 32)
    assert engine_buckets((64, 4), 256) == (4, 64, 256)
    assert engine_buckets((), 128) == ()
    for bad in [(0, 16), ("a", 16)]:
        with pytest.raises(ConfigError, match="batch_buckets"):
            engine_buckets(bad, 16)
