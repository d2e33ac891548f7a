"""`tltjax.controller.controller`: replicas decode in parallel; idle ones are handed to the spot trainer.

Eight virtual CPU devices as four tensor-parallel replicas of two. The transition
log is the evidence that devices really move between rollout and training, and
that training stops when the rollout ends. One adaptive-rollout `Bandit` passed as
the strategy is shared by every replica (as the RL trainer passes it): its counts
are the evidence that each replica's chunks land in that one bandit.
"""

import collections
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill
from tltjax.controller import Phase, partition_devices
from tltjax.controller.controller import Controller, assign_prompts
from tltjax.controller.spot import SpotTrainer
from tltjax.drafter import Drafter, DrafterConfig
from tltjax.models import CausalLM, ModelConfig
from tltjax.rollout.bandit import Bandit, BanditConfig
from tltjax.rollout.dense import generate
from tltjax.rollout.engine import Engine, EngineConfig
from tltjax.rollout.sampling import SamplingParams

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=256,
)
PROMPTS = [[7, 3, 21, 40], [1, 2, 3, 4, 5, 6], [50, 12, 33], [5, 5], [11, 22, 33, 44], [9, 8, 7], [60, 61], [2]]


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def drafter():
    return fill(nnx.eval_shape(lambda: Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(0))), 1, 0.1)


@pytest.fixture(scope="module")
def replicas():
    return partition_devices(jax.devices(), 2)


@pytest.fixture(scope="module")
def engines(target, drafter, replicas):
    cfg = EngineConfig(max_batch=4, max_seq_len=128, page_size=8, decode_steps=4, spec_rounds=2, spec_threshold=2,
                       strategies=("eagle:depth=3",), prefill_batch=4, prefill_lengths=(8,))
    return [Engine(target, cfg, drafter, mesh=r.mesh) for r in replicas]


def test_prompts_are_split_round_robin_with_whole_groups():
    """Every prompt goes to exactly one replica; shares differ by at most one prompt."""
    shares = assign_prompts(10, 4)
    assert sorted(i for s in shares for i in s) == list(range(10)) and [len(s) for s in shares] == [3, 3, 2, 2]


@pytest.mark.slow
def test_greedy_rollout_over_replicas_equals_one_device(target, replicas, engines):
    """Four TP-2 replicas decode their shares in parallel; merged, the greedy tokens equal the dense
    reference in prompt-major order. Without a spot trainer each replica goes ROLLOUT → IDLE → ROLLOUT."""
    ctl = Controller(replicas, engines)
    res = ctl.rollout(0, PROMPTS, n=2, max_new_tokens=24, sampling=SamplingParams(0.0), strategy="auto")
    ref = generate(target, PROMPTS, max_new_tokens=24, params=SamplingParams(0.0))
    assert [(s.prompt_index, s.sample_index) for s in res.sequences] == [(i, j) for i in range(8) for j in range(2)]
    assert [s.tokens for s in res.sequences] == [r.tokens for r in ref for _ in range(2)]
    for r in range(4):
        assert [(t.src, t.dst) for t in ctl.log.for_step(0) if t.replica == r] == [
            (Phase.ROLLOUT, Phase.IDLE), (Phase.IDLE, Phase.ROLLOUT)]
    assert res.spot is None and res.idle_device_seconds == res.idle_device_seconds_spot >= 0


def _toy_update(state, target_params, batch):
    # stands in for drafter_update: a data-parallel reduction over the batch rows
    return {"w": state["w"] + jnp.mean(batch), "n": state["n"] + 1}, {"loss": jnp.mean(batch ** 2)}


@pytest.fixture(scope="module")
def stop_token(target):
    """A token whose first greedy occurrence differs most between prompts: stopping there gives a tail."""
    ref = generate(target, PROMPTS, max_new_tokens=96, params=SamplingParams(0.0))
    first = lambda toks, v: toks.index(v) if v in toks else 96  # noqa: E731
    return max(range(CONFIG.vocab_size), key=lambda v: np.std([first(r.tokens, v) for r in ref]))


def test_idle_replicas_train_until_the_last_replica_finishes(replicas, engines, stop_token):
    """Stopping at a token that comes early for some prompts and late for others gives a long tail. Each replica that finishes early goes
    IDLE → DRAFT_TRAIN and the spot trainer's mesh grows with them (its devices are theirs); the last one
    goes IDLE → ROLLOUT directly; training stops at the step boundary: at most one update starts after
    the rollout ended, and the state the step returns is the one the trainer produced."""
    seen_devices = []

    def sample(rng, rows):
        seen_devices.append(rows)
        return rng.normal(size=(rows, 8)).astype(np.float32)

    spot = SpotTrainer(jax.jit(_toy_update), sample, rows_per_device=2, max_steps=2000)
    ctl = Controller(replicas, engines, spot=spot)
    done_order = []
    state = {"w": jnp.zeros(()), "n": jnp.zeros((), jnp.int32)}
    for step in range(2):
        res = ctl.rollout(step, PROMPTS, n=2, max_new_tokens=96, sampling=SamplingParams(0.0), stop_ids=(stop_token,),
                          seed=step, drafter_state=state, target_params={},
                          on_replica_done=lambda r, seqs: done_order.append(r))
        trans = ctl.log.for_step(step)
        last = max(range(4), key=lambda r: res.finish_times[r])
        for r in range(4):
            path = [(t.src, t.dst) for t in trans if t.replica == r]
            if r == last:
                assert path == [(Phase.ROLLOUT, Phase.IDLE), (Phase.IDLE, Phase.ROLLOUT)]
            else:
                assert path == [(Phase.ROLLOUT, Phase.IDLE), (Phase.IDLE, Phase.DRAFT_TRAIN),
                                (Phase.DRAFT_TRAIN, Phase.ROLLOUT)]
        assert len(res.sequences) == 16 and all(s.finish_reason in ("stop", "length") for s in res.sequences)
        st = res.spot
        assert st.steps > 0 and int(res.drafter_state["n"]) == int(state["n"]) + st.steps
        # the mesh only grows within a step, in whole replicas, and never holds the last replica's devices
        assert st.mesh_sizes == sorted(st.mesh_sizes) and set(st.mesh_sizes) <= {2, 4, 6}
        # training happened only after the first replica finished; at most one update after the rollout
        t0 = ctl.log.origin
        first_idle = min(t.time for t in trans if t.dst is Phase.IDLE)
        end = max(t.time for t in trans if t.dst is Phase.IDLE)
        assert min(a - t0 for a, _, _ in st.intervals) >= first_idle
        assert sum(a - t0 > end for a, _, _ in st.intervals) <= 1
        assert res.idle_device_seconds_spot < res.idle_device_seconds
        state = res.drafter_state
    assert all(r % 2 == 0 for r in seen_devices)


class _ThreadRecordingBandit(Bandit):
    """A `Bandit` that also notes which thread (controller replica) made each update."""

    def __init__(self, config):
        super().__init__(config)
        self.updates_by_thread = collections.Counter()
        self._threads_lock = threading.Lock()

    def update(self, bucket, arm, tokens, seconds, rows=None):
        with self._threads_lock:
            self.updates_by_thread[threading.current_thread().name] += 1
        super().update(bucket, arm, tokens, seconds, rows)


def test_replicas_share_one_bandit(replicas, engines, stop_token):
    """One bandit as the strategy of a four-replica rollout (what the RL trainer passes): every replica's
    thread updates it, its pulls per (bucket, arm) equal the chunks the replicas' traces list, summed over
    replicas (no chunk lost or counted twice under concurrent updates; the reward windows' pull numbers are
    distinct), and the greedy tokens equal a plain rollout's with the same seed (lossless whatever the
    shared bandit picked)."""
    ctl = Controller(replicas, engines)
    bandit = _ThreadRecordingBandit(BanditConfig(policy="egreedy", epsilon=0.3, default_threshold=2, seed=3))
    kw = dict(n=2, max_new_tokens=96, sampling=SamplingParams(0.0), stop_ids=(stop_token,), seed=5)
    res = ctl.rollout(0, PROMPTS, strategy=bandit, **kw)
    plain = ctl.rollout(1, PROMPTS, strategy=None, **kw)
    assert [s.tokens for s in res.sequences] == [s.tokens for s in plain.sequences]
    assert [(s.prompt_index, s.sample_index) for s in res.sequences] == [(i, j) for i in range(8) for j in range(2)]

    chunks = [collections.Counter((b, arm) for b, _, arm in st.batch_trace) for st in res.stats]
    assert all(chunks), "a replica ran no chunk"
    assert any(arm != "plain" for c in chunks for _, arm in c), "no replica speculated"
    assert bandit.updates_by_thread == {f"replica-{r}": sum(chunks[r].values()) for r in range(4)}
    total = sum(chunks, collections.Counter())
    state = bandit.state_dict()["buckets"]
    assert {(int(b), arm): n for b, s in state.items() for arm, n in s["counts"].items()} == dict(total)
    for s in state.values():
        assert s["pulls"] == sum(s["counts"].values())
        ts = [t for w in s["rewards"].values() for t, _ in w]
        assert len(ts) == len(set(ts)) and max(ts) == s["pulls"] - 1
    assert bandit.metrics()["bandit/pulls"] == sum(total.values()) == sum(len(st.batch_trace) for st in res.stats)
    assert Bandit.from_state_dict(json.loads(json.dumps(bandit.state_dict()))).table() == bandit.table()


def test_the_guard_hears_the_decoding_replicas_and_the_caller_still_gets_progress(replicas, engines, stop_token):
    """With a `ContentionGuard` on the spot trainer, every decode call of every replica reaches it, keyed by
    (bucket, strategy, replicas still decoding); only calls made while some replica was idle count,
    and it hears calls both clear of training and overlapped with it (a batch takes 20 ms to prepare, so the
    trainer is busy for that long at a time). The caller's own progress hook still sees every call."""
    from tltjax.controller.guard import ContentionGuard

    def sample(rng, rows):
        time.sleep(0.02)
        return rng.normal(size=(rows, 8)).astype(np.float32)

    guard = ContentionGuard(0.02)
    spot = SpotTrainer(jax.jit(_toy_update), sample, rows_per_device=2, guard=guard)
    ctl = Controller(replicas, engines, spot=spot)
    calls = []
    state = {"w": jnp.zeros(()), "n": jnp.zeros((), jnp.int32)}
    for step in range(2):
        before = len(calls)
        res = ctl.rollout(step, PROMPTS, n=2, max_new_tokens=96, sampling=SamplingParams(0.0),
                          stop_ids=(stop_token,), seed=step, drafter_state=state, target_params={},
                          progress=calls.append)
        state = res.drafter_state
        assert len(calls) - before == sum(len(st.batch_trace) for st in res.stats)  # one per decode call
        assert res.metrics()["spot/guard_duty"] == res.spot.guard["duty"] > 0
    assert all(c["call_end"] > c["call_start"] and isinstance(c["strategy"], str) for c in calls)
    keys = list(guard._calls)
    assert keys and all(k[0] in engines[0].config.buckets and 1 <= k[2] < 4 for k in keys)
    assert guard.counts["clear"] > 0 and guard.counts["overlapped"] + guard.counts["mixed"] > 0
