"""`tltjax.rollout.engine`: the paged, bucketed engine against the dense reference decoder.

Greedy decoding is deterministic, so every engine path (plain, EAGLE chain,
EAGLE-2 tree, n-gram; bucket changes; preemption and resume) must reproduce
`tltjax.rollout.dense.generate` token for token. Sampled tokens differ from
plain decoding's by design; for them the log-probs the engine returns are
checked against a teacher-forced forward of the same tokens, and the
distribution is tested in `test_lossless.py`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill
from tltjax.drafter import Drafter, DrafterConfig
from tltjax.models import CausalLM, ModelConfig, forward
from tltjax.rollout.dense import generate
from tltjax.rollout.engine import Engine, EngineConfig, compile_count
from tltjax.rollout.sampling import SamplingParams, processed_logprobs
from tltjax.rollout.speculative import Strategy

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=256,
)
PROMPTS = [[7, 3, 21, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 12, 33, 9, 9, 60], [5, 5], [11, 22, 33, 44, 55]]
NEW = 40
GREEDY = SamplingParams(0.0)
SAMPLED = SamplingParams(1.0, top_p=0.95)
STRATEGIES = ("eagle:depth=3", "eagle:depth=3,top_k=2,num_verify=4", "ngram:depth=3")


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def drafter():
    cfg = DrafterConfig.for_target(CONFIG)
    return fill(nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0))), 1, 0.1)


@pytest.fixture(scope="module")
def engine(target, drafter):
    """Buckets 1, 2, 4; speculation at buckets 1 and 2 with three strategies; greedy programs compiled once."""
    cfg = EngineConfig(
        max_batch=4, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3, spec_threshold=2,
        strategies=STRATEGIES, prefill_batch=2, prefill_lengths=(16,),
    )
    eng = Engine(target, cfg, drafter)
    eng.warmup(GREEDY)
    return eng


@pytest.fixture(scope="module")
def reference(target):
    return generate(target, PROMPTS, max_new_tokens=NEW, params=GREEDY)


def _tokens(seqs):
    return [s.tokens for s in seqs]


@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_greedy_equals_dense_decoding_for_every_strategy(engine, reference, strategy):
    """Token-for-token equality with plain greedy decoding, whether or not (and how) the engine speculates."""
    for prompts, ref in [(PROMPTS[:1], reference[:1]), (PROMPTS[1:3], reference[1:3]), (PROMPTS, reference)]:
        seqs, stats = engine.generate(prompts, max_new_tokens=NEW, strategy=strategy)
        assert _tokens(seqs) == [r.tokens for r in ref]
        assert all(s.finish_reason == "length" for s in seqs)
        if strategy is not None and len(prompts) <= 2:
            assert stats.spec_calls > 0 and stats.decode_calls == 0
        assert stats.compilations == 0


def test_speculation_switches_on_when_rows_finish(engine, target):
    """Rows finishing at different lengths shrink the bucket: plain at 4, then speculation at 2 and 1,
    with no re-prefill, and the result still equals greedy decoding."""
    ref = generate(target, PROMPTS[:4], max_new_tokens=NEW, params=GREEDY)
    stop = ref[0].tokens[5]  # a token that ends some rows early
    ref_stop = generate(target, PROMPTS[:4], max_new_tokens=NEW, params=GREEDY, stop_ids=[stop])
    seqs, stats = engine.generate(PROMPTS[:4], max_new_tokens=NEW, stop_ids=[stop])
    assert _tokens(seqs) == [r.tokens for r in ref_stop]
    assert [s.finish_reason for s in seqs] == [r.finish_reason for r in ref_stop]
    modes = [m for _, _, m in stats.batch_trace]
    buckets = [b for b, _, _ in stats.batch_trace]
    assert "plain" in modes and any(m != "plain" for m in modes), stats.batch_trace
    assert buckets == sorted(buckets, reverse=True)  # compaction only shrinks here (nothing is admitted later)
    assert stats.prefill_calls == 2  # prefill_batch 2: the rows were prefilled once, never again
    assert stats.compilations == 0


def test_more_sequences_than_slots_wait_and_are_admitted(engine, reference):
    """10 sequences through 4 slots: later ones wait for free slots; output unchanged."""
    prompts = PROMPTS + PROMPTS
    seqs, stats = engine.generate(prompts, max_new_tokens=NEW)
    assert _tokens(seqs) == [r.tokens for r in reference] * 2
    assert max(b for b, _, _ in stats.batch_trace) == 4
    assert stats.compilations == 0


def test_n_samples_per_prompt_are_prompt_major(engine, reference):
    seqs, _ = engine.generate(PROMPTS[:2], n=2, max_new_tokens=NEW)
    assert [(s.prompt_index, s.sample_index) for s in seqs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _tokens(seqs) == [reference[0].tokens] * 2 + [reference[1].tokens] * 2


def test_no_compilation_after_warmup_over_a_long_run(engine):
    """A long mixed run (many admissions, bucket changes, plain and speculative chunks) compiles nothing."""
    before = compile_count()
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(0, 64, size=rng.randint(2, 14))) for _ in range(12)]
    seqs, stats = engine.generate(prompts, max_new_tokens=48, stop_ids=[5, 17])
    assert stats.compilations == 0 and compile_count() == before
    assert len({b for b, _, _ in stats.batch_trace}) >= 2
    assert {m for _, _, m in stats.batch_trace} >= {"plain"}
    assert stats.tokens == sum(len(s.tokens) for s in seqs)


def test_preemption_under_a_tight_memory_budget(target, drafter, reference):
    """With pages for about two rows, rows are preempted and resumed by recompute; never a crash, same tokens."""
    cfg = EngineConfig(
        max_batch=4, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3, spec_threshold=2,
        strategies=("eagle:depth=3",), prefill_batch=2, prefill_lengths=(16,),
    )
    probe = Engine(target, cfg, drafter)
    pages = 2 * cfg.pages_per_seq + 2
    cfg = dataclasses.replace(cfg, memory_budget_mb=pages * probe.page_bytes / 2**20)
    eng = Engine(target, cfg, drafter)
    assert eng.num_pages == pages
    seqs, stats = eng.generate(PROMPTS, max_new_tokens=NEW)
    assert _tokens(seqs) == [r.tokens for r in reference]
    assert stats.preemptions > 0
    assert stats.max_pages_used <= pages - 1


def test_budget_too_small_for_one_sequence_is_a_clear_error(target):
    cfg = EngineConfig(max_batch=2, max_seq_len=64, page_size=8, decode_steps=4, prefill_batch=2,
                       prefill_lengths=(16,), memory_budget_mb=3 * 4096 / 2**20, strategies=())
    eng = Engine(target, cfg)
    with pytest.raises(RuntimeError, match="memory_budget_mb"):
        eng.generate(PROMPTS[:1], max_new_tokens=NEW)


@pytest.fixture(scope="module")
def sampled_engine(target, drafter):
    cfg = EngineConfig(
        max_batch=4, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3, spec_threshold=4,
        strategies=("eagle:depth=3,top_k=2,num_verify=4",), prefill_batch=4, prefill_lengths=(16,),
    )
    eng = Engine(target, cfg, drafter)
    eng.warmup(SAMPLED, with_features=True)
    return eng


def _teacher_forced(target, seq, params):
    """Processed log-probs and final hidden states of the target on prompt + response, one full forward."""
    ids = jnp.asarray([seq.prompt + seq.tokens], jnp.int32)
    out = forward(target, ids, hidden_layers=(CONFIG.num_hidden_layers,))
    lp = processed_logprobs(out.logits[0], params)
    p = len(seq.prompt)
    chosen = np.asarray(lp)[np.arange(p - 1, p - 1 + len(seq.tokens)), seq.tokens]
    return chosen, np.asarray(out.hidden_states[0][0])


@pytest.mark.parametrize("strategy", [None, "eagle:depth=3,top_k=2,num_verify=4"])
def test_sampled_logprobs_and_features_match_a_full_forward(sampled_engine, target, strategy):
    """Per-token log-probs (processed distribution) and features equal a teacher-forced forward, f32 1e-5."""
    seqs, stats = sampled_engine.generate(PROMPTS[:3], n=2, max_new_tokens=30, seed=7, return_features=True,
                                          strategy=strategy, sampling=SAMPLED)
    assert (stats.spec_calls > 0) == (strategy is not None)
    for s in seqs:
        want_lp, hidden = _teacher_forced(target, s, SAMPLED)
        np.testing.assert_allclose(s.logprobs, want_lp, atol=1e-5)
        n = len(s.prompt) + len(s.tokens) - 1
        assert s.features.shape == (n, CONFIG.hidden_size)
        np.testing.assert_allclose(s.features, hidden[:n], atol=1e-5)
    assert stats.compilations == 0


def test_sampling_is_reproducible_from_the_seed(sampled_engine):
    a, _ = sampled_engine.generate(PROMPTS[:2], n=2, max_new_tokens=20, seed=11, return_features=True, sampling=SAMPLED)
    b, _ = sampled_engine.generate(PROMPTS[:2], n=2, max_new_tokens=20, seed=11, return_features=True, sampling=SAMPLED)
    c, _ = sampled_engine.generate(PROMPTS[:2], n=2, max_new_tokens=20, seed=12, return_features=True, sampling=SAMPLED)
    assert _tokens(a) == _tokens(b)
    assert _tokens(a) != _tokens(c)


def test_bad_inputs_are_clear_errors(engine, target):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([list(range(64))], max_new_tokens=4)
    with pytest.raises(ValueError, match="compiled pool"):
        engine.generate(PROMPTS[:1], max_new_tokens=4, strategy="eagle:depth=5")
    with pytest.raises(ValueError, match="drafter"):
        Engine(target, EngineConfig(max_batch=2, spec_threshold=2, strategies=("eagle:depth=2",)))
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(max_batch=6)
    with pytest.raises(ValueError, match="unknown"):
        Strategy.parse("medusa:depth=2")
    with pytest.raises(ValueError, match="keys"):
        Strategy.parse("eagle:depht=2")


@pytest.mark.slow
def test_engine_runs_the_pallas_kernels():
    """The GPU kernels inside the engine's programs give the same greedy tokens (compiled on a GPU, interpret
    mode elsewhere)."""
    config = CONFIG.replace(num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # Triton tiles: dim >= 16
    tgt = fill(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))), 0, 0.3)
    dft = fill(nnx.eval_shape(lambda: Drafter(DrafterConfig.for_target(config), rngs=nnx.Rngs(0))), 1, 0.1)
    ref = generate(tgt, PROMPTS[:1], max_new_tokens=12, params=GREEDY)[0].tokens
    cfg = EngineConfig(
        max_batch=1, max_seq_len=32, page_size=8, decode_steps=4, spec_rounds=2, spec_threshold=1,
        strategies=("eagle:depth=2,top_k=2,num_verify=3",), prefill_batch=1, prefill_lengths=(16,),
        attention_impl="pallas" if jax.default_backend() == "gpu" else "pallas_interpret",
    )
    eng = Engine(tgt, cfg, dft)
    for strategy in (None, "auto"):
        seqs, _ = eng.generate(PROMPTS[:1], max_new_tokens=12, strategy=strategy)
        assert seqs[0].tokens == ref


def test_multi_layer_feature_drafter_is_lossless(target, reference):
    """An EAGLE-3-style drafter reading layers 1 and 2 drafts through the same engine; greedy output unchanged."""
    cfg = DrafterConfig.for_target(CONFIG, feature_layers=(1, 2))
    dft = fill(nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0))), 2, 0.1)
    eng = Engine(target, EngineConfig(max_batch=1, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3,
                                      spec_threshold=1, strategies=("eagle:depth=3,top_k=2,num_verify=4",),
                                      prefill_batch=1, prefill_lengths=(16,)), dft)
    assert eng.feature_layers == (1, 2)
    seqs, stats = eng.generate(PROMPTS[:1], max_new_tokens=NEW)
    assert seqs[0].tokens == reference[0].tokens and stats.spec_calls > 0


def test_engine_on_a_tensor_parallel_replica_mesh_matches_one_device(target, drafter, reference):
    """A replica mesh (devices 2-3, tensor axis 2): weights and KV pages live there, split by heads,
    and greedy outputs of plain and speculative decoding equal the dense reference."""
    from tltjax.sharding import make_mesh

    mesh = make_mesh({"tensor": 2}, jax.devices()[2:4])
    cfg = EngineConfig(
        max_batch=2, max_seq_len=64, page_size=8, decode_steps=4, spec_rounds=3, spec_threshold=2,
        strategies=STRATEGIES[:1], prefill_batch=2, prefill_lengths=(16,),
    )
    eng = Engine(target, cfg, drafter, mesh=mesh)
    q = eng.tparams["model"]["layers"][0]["self_attn"]["q_proj"]["weight"][...]
    assert set(q.devices()) == set(mesh.devices.flat) and not q.sharding.is_fully_replicated
    for strategy in (None, STRATEGIES[0]):
        seqs, _ = eng.generate(PROMPTS[:2], max_new_tokens=NEW, strategy=strategy)
        assert _tokens(seqs) == [r.tokens for r in reference[:2]]
    assert set(eng._state.k_pages.devices()) == set(mesh.devices.flat)
    # new weights from another device land on the mesh, and the programs are reused
    before = compile_count()
    eng.set_params(target=target, drafter=drafter)
    seqs, _ = eng.generate(PROMPTS[:1], max_new_tokens=NEW)
    assert _tokens(seqs) == [reference[0].tokens] and compile_count() == before
