"""`tltjax.rollout.bandit` and the engine's adaptive path.

The selector is tested on a synthetic cost model: per bucket, each arm has a known
throughput, and every pull returns it with 10% Gaussian noise. The engine tests run
a tiny model with a bandit as its strategy: greedy output must still equal plain
decoding (speculation is lossless whatever the bandit picks), and the bandit must
see every bucket the rollout ran, including the larger ones a growing batch returns to.
"""

import collections
import dataclasses
import json
import sys
import threading

import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill
from tests.rollout.test_engine import CONFIG, GREEDY, NEW, PROMPTS  # the engine tests' tiny target
from tltjax.drafter import Drafter, DrafterConfig
from tltjax.models import CausalLM
from tltjax.rollout.bandit import POLICIES, Bandit, BanditConfig, arm_name
from tltjax.rollout.dense import generate
from tltjax.rollout.engine import Engine, EngineConfig, fill_pool
from tltjax.rollout.speculative import Strategy

ARMS = [None, Strategy.parse("eagle:depth=2"), Strategy.parse("eagle:depth=4"), Strategy.parse("ngram:depth=4")]
# tokens/s per bucket and arm: plain wins in large buckets, speculation (a different strategy) in small ones
COSTS = {64: [100, 70, 50, 40], 16: [100, 90, 80, 60], 8: [100, 130, 110, 60], 1: [100, 150, 190, 120]}


def _run(bandit, costs, pulls, rng, noise=0.1):
    """``pulls`` chunks per bucket (buckets interleaved); returns the arm index chosen per bucket, in order."""
    chosen = collections.defaultdict(list)
    for _ in range(pulls):
        for bucket, c in costs.items():
            arm = bandit.select(bucket, ARMS)
            k = ARMS.index(arm)
            bandit.update(bucket, arm, tokens=c[k] * (1 + noise * rng.standard_normal()), seconds=1.0)
            chosen[bucket].append(k)
    return chosen


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_converges_to_the_best_arm_of_every_bucket(policy):
    """After 300 chunks per bucket, each bucket's best arm runs >= 90% of its last 100 chunks."""
    bandit = Bandit(BanditConfig(policy=policy, default_threshold=16, seed=1))
    chosen = _run(bandit, COSTS, 300, np.random.default_rng(0))
    for bucket, c in COSTS.items():
        assert np.mean(np.array(chosen[bucket][-100:]) == np.argmax(c)) >= 0.9, (policy, bucket, bandit.table())
        assert bandit.table()[bucket] == arm_name(ARMS[int(np.argmax(c))])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_readapts_when_costs_change(policy):
    """When the best arm of each bucket changes mid-stream, the new best is chosen >= 90% of the time within
    ``horizon`` + 50 chunks (rewards expire after ``horizon`` pulls; the window median follows the rest)."""
    config = BanditConfig(policy=policy, horizon=128, seed=2)
    bandit = Bandit(config)
    rng = np.random.default_rng(3)
    _run(bandit, COSTS, 200, rng)
    changed = {64: [100, 70, 50, 140], 16: [60, 90, 160, 60], 8: [60, 130, 110, 160], 1: [100, 150, 90, 120]}
    chosen = _run(bandit, changed, 400, rng)
    for bucket, c in changed.items():
        hit = np.array(chosen[bucket]) == np.argmax(c)
        settled = next(i for i in range(len(hit) - 50) if hit[i:i + 50].mean() >= 0.9)
        assert settled <= config.horizon + 50, (policy, bucket, settled)
        assert hit[-100:].mean() >= 0.9


def test_hysteresis_prevents_flapping_between_near_equal_arms():
    """Two arms 1% apart under 5% noise: with a 5% margin the greedy arm hardly changes; without, it flaps."""
    arms = ARMS[:2]
    switches = {}
    for h in (0.0, 0.05):
        bandit = Bandit(BanditConfig(policy="egreedy", epsilon=0.2, hysteresis=h, seed=4))
        rng = np.random.default_rng(5)
        for _ in range(600):
            arm = bandit.select(4, arms)
            bandit.update(4, arm, (100 if arm is None else 101) * (1 + 0.05 * rng.standard_normal()), 1.0)
        switches[h] = bandit.metrics()["bandit/switches"]
    assert switches[0.05] <= 3 < 10 <= switches[0.0], switches


def test_one_lucky_chunk_does_not_move_the_table():
    """An arm that looks better on one reward is measured again before it can replace the greedy arm
    (``confirm`` rewards); when the re-measurements are ordinary, the greedy arm stays."""
    bandit = Bandit(BanditConfig(policy="egreedy", epsilon=0.0, confirm=3))
    arms = ARMS[:2]
    for arm, r in [(None, 100.0), (ARMS[1], 150.0)]:  # plain (the default), then one lucky chunk of ARMS[1]
        assert bandit.select(8, arms) == arm
        bandit.update(8, arm, r, 1.0)
    assert bandit.table()[8] == "plain"
    assert bandit.select(8, arms) == ARMS[1]  # the challenger gets the next chunks
    bandit.update(8, ARMS[1], 80.0, 1.0)
    assert bandit.select(8, arms) == ARMS[1]  # median 115 still beats 100: one more
    bandit.update(8, ARMS[1], 70.0, 1.0)
    assert bandit.table()[8] == "plain" and bandit.select(8, arms) is None  # median 80: it lost


@pytest.mark.parametrize("default", [0, 64])
def test_speculation_threshold_comes_from_measured_rewards(default):
    """Whether the default speculates nowhere (0) or everywhere (64), measurements set the threshold at 8:
    speculation on in buckets 1-8, off in 16 and 64; and it turns off again when the batch grows."""
    bandit = Bandit(BanditConfig(default_threshold=default, seed=6))
    _run(bandit, COSTS, 200, np.random.default_rng(7))
    assert bandit.threshold() == 8
    table = bandit.table()
    assert table[64] == table[16] == "plain" and table[8] != "plain" and table[1] != "plain"
    exploit = Bandit(BanditConfig(policy="egreedy", epsilon=0.0, default_threshold=default))
    exploit.load_state_dict(bandit.state_dict())
    picks = [exploit.select(b, ARMS) for b in (64, 16, 8, 1, 8, 16, 64)]  # shrink, then grow (preemption)
    assert [p is not None for p in picks] == [False, False, True, True, True, False, False]


def test_unmeasured_buckets_follow_the_measured_threshold():
    """A bucket's first chunk: speculate if a larger measured bucket does, plain if a smaller one doesn't,
    else the configured default."""
    bandit = Bandit(BanditConfig(default_threshold=2))
    for _ in range(3):
        for bucket, arm, r in [(8, ARMS[1], 200.0), (8, None, 100.0), (32, None, 100.0), (32, ARMS[1], 50.0)]:
            bandit.select(bucket, ARMS[:2])
            bandit.update(bucket, arm, r, 1.0)
    assert bandit.table() == {8: ARMS[1].name, 32: "plain"}
    assert bandit.select(4, ARMS[:2]) == ARMS[1]  # 8 speculates, so does 4 (above the default of 2)
    assert bandit.select(64, ARMS[:2]) is None  # plain wins at 32, so at 64
    assert bandit.select(16, ARMS[:2]) is None  # nothing decides 16: the default (plain above 2)


def test_rewards_are_tokens_per_second_at_a_full_bucket():
    """A chunk with half its rows live counts as twice its raw tokens/s (comparable across fill levels)."""
    bandit = Bandit()
    bandit.select(8, ARMS[:1])
    bandit.update(8, None, tokens=40, seconds=0.5, rows=4)
    assert bandit.estimates() == {8: {"plain": 160.0}}


def test_state_dict_round_trip_continues_identically():
    """A bandit restored from (JSON of) its state_dict makes the same choices as the original from then on."""
    a = Bandit(BanditConfig(policy="egreedy", epsilon=0.3, seed=8))
    _run(a, COSTS, 50, np.random.default_rng(9))
    state = json.loads(json.dumps(a.state_dict()))
    b = Bandit.from_state_dict(state)
    ca = _run(a, COSTS, 100, np.random.default_rng(10))
    cb = _run(b, COSTS, 100, np.random.default_rng(10))
    assert ca == cb
    assert a.state_dict() == b.state_dict()


def test_metrics_report_arm_reward_switches_and_threshold():
    bandit = Bandit(BanditConfig(seed=11))
    _run(bandit, COSTS, 60, np.random.default_rng(12))
    m = bandit.metrics()
    assert m["bandit/b64/arm"] == 0.0 and m["bandit/b64/speculates"] == 0.0
    assert m["bandit/b1/arm"] == 2.0 and m["bandit/b1/speculates"] == 1.0
    assert 170 < m["bandit/b1/reward"] < 210
    assert m["bandit/threshold"] == 8.0 and m["bandit/pulls"] == 240.0
    assert bandit.metrics()["bandit/pulls"] == 0.0  # counters run from the previous call (one per RL step)
    assert all(isinstance(v, float) for v in m.values())


def test_concurrent_select_and_update_lose_no_chunk():
    """Eight threads (rollout replicas) select and update one bandit at once, over shared buckets, while a
    ninth reads its metrics and state: every update is counted once (pulls per bucket and per arm add up to
    the chunks recorded), each bucket's pull numbers in the reward windows are distinct and the latest is
    its last pull, and the state still round-trips through JSON."""
    bandit = Bandit(BanditConfig(policy="egreedy", epsilon=0.3, window=8, confirm=2, seed=13))
    threads, per_thread, buckets = 8, 400, (1, 8, 64)
    recorded = [collections.Counter() for _ in range(threads)]  # (bucket, arm name) -> updates, per thread
    start, stop, errors = threading.Barrier(threads + 1), threading.Event(), []

    def replica(r):
        try:
            rng = np.random.default_rng(100 + r)
            start.wait()
            for i in range(per_thread):
                bucket = buckets[(i + r) % len(buckets)]
                arm = bandit.select(bucket, ARMS)
                c = COSTS[bucket][ARMS.index(arm)]
                bandit.update(bucket, arm, tokens=c * (1 + 0.1 * rng.standard_normal()), seconds=1.0)
                recorded[r][bucket, arm_name(arm)] += 1
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def reader():
        start.wait()
        while not stop.is_set():
            try:
                bandit.metrics(), bandit.table(), bandit.estimates(), json.dumps(bandit.state_dict())
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up if there are any
    try:
        workers = [threading.Thread(target=replica, args=(r,)) for r in range(threads)]
        watcher = threading.Thread(target=reader)
        for t in [*workers, watcher]:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        watcher.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    total = sum(recorded, collections.Counter())
    assert sum(total.values()) == threads * per_thread
    state = bandit.state_dict()["buckets"]
    assert set(state) == {str(b) for b in buckets}
    for b in buckets:
        s = state[str(b)]
        assert s["pulls"] == sum(n for (k, _), n in total.items() if k == b)
        assert s["counts"] == {name: n for (k, name), n in total.items() if k == b}
        assert all(len(w) <= 8 for w in s["rewards"].values())
        ts = [t for w in s["rewards"].values() for t, _ in w]
        assert len(ts) == len(set(ts)) and max(ts) == s["pulls"] - 1 and min(ts) >= 0
        assert s["greedy"] in {arm_name(a) for a in ARMS}
    m = bandit.metrics()  # the reader's calls moved the mark; the pulls per bucket are totals
    assert sum(m[f"bandit/b{b}/pulls"] for b in buckets) == threads * per_thread
    assert Bandit.from_state_dict(json.loads(json.dumps(bandit.state_dict()))).state_dict() == bandit.state_dict()


def test_bad_config_and_state_are_clear_errors():
    with pytest.raises(ValueError, match="unknown"):
        BanditConfig(policy="thompson")
    with pytest.raises(ValueError, match="epsilon"):
        BanditConfig(epsilon=1.5)
    with pytest.raises(ValueError, match="window"):
        BanditConfig(window=0)
    with pytest.raises(ValueError, match="hysteresis"):
        BanditConfig(hysteresis=-0.1)
    with pytest.raises(ValueError, match="horizon"):
        BanditConfig(horizon=0)
    with pytest.raises(ValueError, match="confirm"):
        BanditConfig(confirm=20, window=16)
    with pytest.raises(ValueError, match="state_dict"):
        Bandit().load_state_dict({"buckets": {}})
    with pytest.raises(ValueError, match="no arms"):
        Bandit().select(4, [])
    with pytest.raises(ValueError, match="spec_max_bucket"):
        EngineConfig(max_batch=4, spec_threshold=4, spec_max_bucket=2)


def test_pool_budget_keeps_small_buckets_first():
    """Speculative programs enter from the smallest bucket up; one that overflows the budget is left out,
    with the larger buckets of its strategy, while cheaper strategies still fill the room."""
    big, small = ARMS[2], ARMS[1]
    built = []

    def build(bucket, strategy):
        built.append((bucket, strategy))
        return f"{strategy.name}@{bucket}", bucket * (3 if strategy is big else 1)

    progs, sizes, left_out = fill_pool([1, 2, 4, 8], [big, small], build, room=16)
    assert list(progs) == [(1, big), (1, small), (2, big), (2, small), (4, small)]
    assert sum(sizes.values()) == 3 + 1 + 6 + 2 + 4
    assert left_out == [(4, big), (8, big), (8, small)]
    assert (8, big) not in built  # a strategy left out at 4 is not even compiled at 8


# ----------------------------------------------------------------------------- the adaptive engine


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def engine(target):
    """Buckets 1, 2, 3, 4, speculative programs in all of them, pages for about three rows (so rows are
    preempted and re-admitted: the batch grows again); greedy programs compiled once."""
    drafter = fill(nnx.eval_shape(lambda: Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(0))), 1, 0.1)
    cfg = EngineConfig(
        max_batch=4, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3, spec_threshold=1,
        spec_max_bucket=4, strategies=("eagle:depth=3", "ngram:depth=3"), prefill_batch=2, prefill_lengths=(16,),
        batch_buckets=(1, 2, 3, 4),
    )
    pages = 2 * cfg.pages_per_seq + 2
    probe = Engine(target, cfg, drafter)
    eng = Engine(target, dataclasses.replace(cfg, memory_budget_mb=pages * probe.page_bytes / 2**20), drafter)
    eng.warmup(GREEDY)
    return eng


@pytest.fixture(scope="module")
def reference(target):
    return [r.tokens for r in generate(target, PROMPTS, max_new_tokens=NEW, params=GREEDY)]


@pytest.mark.slow
def test_adaptive_engine_is_lossless_and_feeds_the_bandit(engine, reference):
    """Whatever arm the bandit picks per chunk, greedy tokens equal plain decoding's; every bucket the rollout
    ran got rewards, and nothing compiled after warm-up."""
    pool = engine.pool_summary()
    assert pool["spec_programs"] == 8 and pool["mb"] > 0 and not pool["left_out"]
    assert engine.arms(4) == (None, *engine.config.strategies)
    bandit = Bandit(BanditConfig(policy="egreedy", epsilon=0.3, default_threshold=1, seed=0))
    for _ in range(2):  # two "RL steps": the bandit carries over
        seqs, stats = engine.generate(PROMPTS + PROMPTS, max_new_tokens=NEW, strategy=bandit)
        assert [s.tokens for s in seqs] == reference + reference
        assert stats.compilations == 0 and stats.preemptions > 0
    state = bandit.state_dict()["buckets"]
    assert {str(b) for b, _, _ in stats.batch_trace} <= set(state)
    assert {m for _, _, m in stats.batch_trace} - {"plain"}, "no chunk speculated"
    for bucket in {b for b, _, _ in stats.batch_trace}:
        assert sum(state[str(bucket)]["counts"].values()) >= 1


@pytest.mark.slow
def test_speculation_turns_off_when_the_batch_grows(engine, reference):
    """A bandit that has measured speculation paying up to bucket 3 and plain winning at 4: when a preempted
    row is re-admitted and the batch grows from 3 rows to 4, the engine decodes plainly again (and speculates
    when it shrinks); output unchanged."""
    bandit = Bandit(BanditConfig(policy="egreedy", epsilon=0.0, hysteresis=100.0, default_threshold=3))  # fixed
    for bucket in engine.config.buckets:
        for arm in engine.arms(bucket):
            bandit.select(bucket, engine.arms(bucket))
            bandit.update(bucket, arm, 200.0 if (bucket <= 3) == (arm is not None) else 100.0, 1.0)
    assert bandit.threshold() == 3
    seqs, stats = engine.generate(PROMPTS + PROMPTS, max_new_tokens=NEW, strategy=bandit)
    assert [s.tokens for s in seqs] == reference + reference
    assert stats.preemptions > 0
    trace = stats.batch_trace
    assert all((m != "plain") == (b <= 3) for b, _, m in trace), trace
    grew = [i for i in range(1, len(trace)) if trace[i - 1][0] == 3 and trace[i][0] == 4]
    assert grew, f"the batch never grew from bucket 3 to 4: {trace}"
    assert all(trace[i - 1][2] != "plain" and trace[i][2] == "plain" for i in grew)
