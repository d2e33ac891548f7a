"""Parity of the Flax decoder with Hugging Face `transformers` (PyTorch, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flax import nnx

from tltjax.models import ContiguousKVCache, forward, from_pretrained
from tltjax.rollout.dense import generate
from tltjax.rollout.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair(hf_model):
    family, torch_model, path = hf_model
    return family, torch_model, from_pretrained(path, dtype="float32")


def _ids(shape, seed=0):
    return np.random.RandomState(seed).randint(0, 97, shape)


def test_prefill_logits_and_hidden_states_match_transformers(pair):
    """Prefill logits agree to 1e-4 and every layer's hidden state to 1e-4 (f32)."""
    _, ref, ours = pair
    ids = _ids((3, 37))
    with torch.no_grad():
        r = ref(torch.tensor(ids), output_hidden_states=True)
    n = ours.config.num_hidden_layers
    out = forward(ours, jnp.asarray(ids), hidden_layers=tuple(range(n + 1)))
    assert out.logits.shape == (3, 37, 97)
    np.testing.assert_allclose(np.asarray(out.logits), r.logits.numpy(), atol=1e-4, rtol=0)
    assert len(out.hidden_states) == n + 1
    for ours_h, ref_h in zip(out.hidden_states, r.hidden_states):
        np.testing.assert_allclose(np.asarray(ours_h), ref_h.numpy(), atol=1e-4, rtol=0)


def test_cached_decoding_equals_full_forward(pair):
    """Prefill then one token at a time through the cache gives the full-forward logits."""
    _, _, ours = pair
    ids = jnp.asarray(_ids((2, 24), seed=1))
    full = forward(ours, ids).logits
    cache = ContiguousKVCache.init(ours.config, 2, 32)
    out = forward(ours, ids[:, :10], cache=cache)
    steps = [out.logits]
    cache = out.cache
    for t in range(10, 24):
        out = forward(ours, ids[:, t : t + 1], cache=cache)
        cache = out.cache
        steps.append(out.logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [24, 24]


def test_extend_with_arbitrary_mask_matches_separate_branches(pair):
    """Extending with a tree mask equals running each root-to-leaf branch on its own.

    Block after a 6-token prefix: [a, b, c] where b and c are both children of a
    (siblings that must not see each other), with tree positions.
    """
    _, _, ours = pair
    prefix = jnp.asarray(_ids((1, 6), seed=2))
    a, b, c = 5, 7, 11
    cache = forward(ours, prefix, cache=ContiguousKVCache.init(ours.config, 1, 16)).cache
    mask = jnp.asarray([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    pos = jnp.asarray([[6, 7, 7]])
    tree = forward(ours, jnp.asarray([[a, b, c]]), positions=pos, mask=mask, cache=cache, advance=0)
    assert tree.cache.lengths.tolist() == [6]
    for col, branch in ((1, [a, b]), (2, [a, c])):
        full = forward(ours, jnp.concatenate([prefix, jnp.asarray([branch])], 1)).logits
        np.testing.assert_allclose(np.asarray(tree.logits[0, col]), np.asarray(full[0, -1]), atol=1e-5, rtol=0)
    # keep the accepted path [a, c] and continue decoding: equals the plain forward of that sequence.
    kept = tree.cache.keep(jnp.asarray([[0, 2]]), jnp.asarray([2]))
    nxt = forward(ours, jnp.asarray([[3]]), cache=kept)
    full = forward(ours, jnp.concatenate([prefix, jnp.asarray([[a, c, 3]])], 1)).logits
    np.testing.assert_allclose(np.asarray(nxt.logits[0, 0]), np.asarray(full[0, -1]), atol=1e-5, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    """32 greedy tokens are identical to `transformers` generate, for every prompt of a ragged batch."""
    _, ref, ours = pair
    prompts = [_ids((n,), seed=10 + n).tolist() for n in (5, 9, 13)]
    ref.generation_config.eos_token_id = None  # generate would otherwise stop at the config's eos
    gens = generate(ours, prompts, max_new_tokens=32, params=SamplingParams(temperature=0.0))
    for p, g in zip(prompts, gens):
        with torch.no_grad():
            x = torch.tensor([p])
            r = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        assert g.tokens == r[0, len(p):].tolist()
        assert g.finish_reason == "length"
        assert np.allclose(g.logprobs, 0.0)


def test_bf16_forward_is_close_to_f32(hf_model):
    """bfloat16 params and compute track the float32 logits (loose bound: bf16 has 8 mantissa bits)."""
    _, _, path = hf_model
    ids = jnp.asarray(_ids((2, 16), seed=3))
    f32 = forward(from_pretrained(path, dtype="float32"), ids).logits
    bf16_model = from_pretrained(path, dtype="bfloat16")
    assert bf16_model.model.layers[0].mlp.up_proj.weight[...].dtype == jnp.bfloat16
    bf16 = forward(bf16_model, ids).logits
    assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.1 * float(jnp.max(jnp.abs(f32)))


def test_remat_gives_same_gradients(hf_model):
    """Rematerialised layers change memory, not math: identical loss and gradients."""
    _, _, path = hf_model
    ids = jnp.asarray(_ids((2, 12), seed=4))

    @nnx.jit
    def grads(m):
        def loss(m):
            lp = jax.nn.log_softmax(m(ids[:, :-1]).logits)
            return -jnp.mean(jnp.take_along_axis(lp, ids[:, 1:, None], -1))

        return nnx.grad(loss)(m)

    g0 = grads(from_pretrained(path, dtype="float32"))
    g1 = grads(from_pretrained(path, dtype="float32", remat=True))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
