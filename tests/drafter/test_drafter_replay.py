"""benchmarks/drafter_replay.py: online drafter training replayed on a short micro-config RL trajectory."""

import importlib.util
import json
import pathlib
import statistics
import sys

import numpy as np
import optax
import pytest
from flax import nnx

from tltjax import tiny_policy
from tltjax.config import load_config
from tltjax.drafter import offline
from tltjax.drafter.model import load_drafter
from tltjax.drafter.train import DrafterTrainState, target_features

REPO = pathlib.Path(__file__).resolve().parents[2]
MICRO = str(REPO / "configs/micro.py")
# The micro policy rarely answers right: with the task's reward every group ties and the policy never
# moves. "Does the answer appear anywhere in the response" varies within groups, so it does. No
# speculation and no log-prob check: fewer programs to compile (the rollouts still return features).
TRAJECTORY = ["rl.reward=operator:contains", "rollout.spec_threshold=0", "rl.logprob_check_rows=0"]


@pytest.fixture(scope="module")
def replay():
    """The benchmark script as a module (it imports ``common`` from its own folder)."""
    spec = importlib.util.spec_from_file_location("drafter_replay", REPO / "benchmarks" / "drafter_replay.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        mp.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cache_dir(micro_cache):
    """The session's cache of the micro policy and its offline drafter (tests/conftest.py)."""
    return micro_cache


def test_variants_take_the_config_for_what_they_leave_out(replay):
    """A variant's settings default to the config's online ones; frozen is added when not named; bad specs
    are refused with the spec in the message."""
    rl = load_config(MICRO, ["--config.rl.drafter_lr=0.002", "--config.rl.buffer_steps=3"]).rl
    v = replay.parse_variant("x:updates=4,warmup=0", rl)
    assert v == replay.Variant("x", lr=0.002, warmup=0, updates=4, buffer_steps=3)
    assert replay.parse_variant("plain", rl) == replay.Variant("plain", 0.002, rl.drafter_warmup_steps,
                                                               rl.drafter_steps, 3)
    cfg = load_config(MICRO)
    assert [v.name for v in replay.variants_of(["a:lr=1e-3"], cfg)] == ["frozen", "a"]
    assert [v.name for v in replay.variants_of([], cfg)] == ["frozen", "offline_lr", "default", "more_updates"]
    for spec, message in (("x:lr=0", "lr=0.0 must be > 0"), ("x:steps=2", "'steps=2' is not KEY=VALUE"),
                          ("x:updates=1.5", "updates='1.5' is not an integer"), (":lr=1", "name")):
        with pytest.raises(SystemExit, match=message):
            replay.parse_variant(spec, rl)
    with pytest.raises(SystemExit, match="names must differ"):
        replay.variants_of(["a:updates=1", "a:updates=2"], cfg)


@pytest.mark.slow
def test_replay_scores_each_step_and_only_updates_move_the_drafter(replay, cache_dir, tmp_path):
    """On a 3-step trajectory: every variant has a curve of 3 values in [0, 1] and their means over steps
    2-3; a variant without updates equals frozen exactly; one with updates equals it at step 1 (scored
    before any update) and differs after. The saved policy of a step is the one that generated its
    rollouts (it recomputes their features; the last step's does not), and the frozen curve is what
    `score` gives the unchanged drafter on each step's rollouts under that step's policy."""
    out, saved = tmp_path / "replay.json", tmp_path / "trajectory.pkl"
    replay.main(["--config", MICRO, "--set", f"cache_dir={cache_dir}", *TRAJECTORY, "--steps", "3",
                 "--variant", "zero:updates=0", "--variant", "two:lr=3e-3,warmup=0,updates=2",
                 "--save", str(saved), "--out", str(out)])
    result = json.loads(out.read_text())
    got = result["variants"]
    assert list(got) == ["frozen", "zero", "two"] and result["args"]["steps"] == 3
    for r in got.values():
        for key in ("top1", "p_accept"):
            assert len(r[key]) == 3 and all(0.0 <= x <= 1.0 for x in r[key])
            assert r[f"{key}_mean"] == pytest.approx(statistics.fmean(r[key][1:]))
    frozen, zero, two = got["frozen"], got["zero"], got["two"]
    assert (zero["top1"], zero["p_accept"]) == (frozen["top1"], frozen["p_accept"])
    assert (two["top1"][0], two["p_accept"][0]) == (frozen["top1"][0], frozen["p_accept"][0])
    assert all(a != b for a, b in zip(two["p_accept"][1:], frozen["p_accept"][1:]))

    trajectory = replay.Trajectory.load(saved)
    cfg = load_config(MICRO, [f"--config.cache_dir={cache_dir}"])
    policy_dir = pathlib.Path(trajectory.policy_dir)
    target, _ = tiny_policy.load_policy(policy_dir)
    drafter = load_drafter(offline.get_drafter(cfg, policy_dir, progress=False, log=lambda *a: None), target.config)

    first = trajectory.steps[0]
    tokens, features = first.contexts[0], first.features[0]

    def features_under(params):
        model = nnx.merge(nnx.graphdef(target), params)
        return np.asarray(target_features(model, tokens[None, :-1], drafter.config.feature_layers)[0][0])

    np.testing.assert_allclose(features_under(first.target_params), features, rtol=1e-4, atol=1e-4)
    assert not np.allclose(features_under(trajectory.steps[-1].target_params), features, rtol=1e-4, atol=1e-4)

    state = DrafterTrainState.create(drafter, target, optax.identity())
    for i, rollouts in enumerate(trajectory.steps):
        batches = replay.scoring_batches(rollouts, cfg.rl.drafter_batch, cfg.drafter.seq_len)
        assert replay.score(state, rollouts.target_params, batches) == (frozen["top1"][i], frozen["p_accept"][i])
