"""`tltjax.drafter.packing`: several windows share a row, and compute exactly what they compute alone.

Windows come from a `DrafterBuffer` holding random "harvested" features for a tiny random
target; the model runs once per batch shape (two shapes: packed and one window per row).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill, random_module
from tltjax.data import segment_mask
from tltjax.drafter import Drafter, DrafterBuffer, DrafterConfig, drafter_loss, pack_windows
from tltjax.drafter.packing import fill_rows, first_fit
from tltjax.models import CausalLM, ModelConfig

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=128,
)
DCFG = DrafterConfig.for_target(CONFIG)
LENGTHS = (3, 5, 7, 9, 11, 13)  # entries per window: distinct, so a segment's length names its window
ROWS, ROW_LEN = 2, 26


@pytest.fixture(scope="module")
def windows():
    """One whole-sequence window per length in LENGTHS, with random tokens and features."""
    rng = np.random.default_rng(0)
    buf = DrafterBuffer(256, DCFG.feature_size)
    for n in LENGTHS:
        buf.add(0, rng.integers(0, CONFIG.vocab_size, n + 1), rng.normal(size=(n, DCFG.feature_size)))
    return [buf.window(s, 0, int(buf.seq_length[s])) for s in buf.live()]


@pytest.fixture(scope="module")
def models():
    target = fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)
    return random_module(Drafter, DCFG, 1, 0.1), target


@functools.partial(nnx.jit, static_argnames=("unroll_steps",))
def _run(drafter, target, batch, unroll_steps):
    """Per-position drafter hidden outputs and the loss (sum, count, metric sums) of a packed batch."""
    inputs = batch.aligned(drafter.config, CONFIG.num_hidden_layers)
    layout = batch.layout()
    out = drafter(target, *inputs[:2], positions=layout["positions"], mask=segment_mask(layout["segment_ids"]))
    return out.hidden, drafter_loss(drafter, target, *inputs, unroll_steps=unroll_steps, **layout)


def _places(batch):
    """{window length: (row, offset)} read back from segment ids."""
    out = {}
    for r in range(batch.segment_ids.shape[0]):
        for s in range(1, int(batch.segment_ids[r].max()) + 1):
            at = np.flatnonzero(batch.segment_ids[r] == s)
            out[len(at)] = (r, int(at[0]))
    return out


def test_packed_layout_segments_positions_and_valid_pairs(windows):
    """Windows get segment ids 1, 2, ... per row, positions from 0; only pairs inside one window are valid."""
    batch = pack_windows(windows, ROWS, ROW_LEN)
    assert batch.ids.shape == (ROWS, ROW_LEN) and batch.features.shape == (ROWS, ROW_LEN, DCFG.feature_size)
    places = _places(batch)
    assert sorted(places) == sorted(LENGTHS)
    for w in windows:
        r, o = places[len(w)]
        np.testing.assert_array_equal(batch.ids[r, o : o + len(w)], w.tokens)
        np.testing.assert_array_equal(batch.features[r, o : o + len(w)], w.features)
        np.testing.assert_array_equal(batch.positions[r, o : o + len(w)], np.arange(len(w)))
    assert (batch.segment_ids > 0).sum() == sum(LENGTHS)
    assert (batch.features[batch.segment_ids == 0] == 0).all()
    tokens, feats, hidden, logits, valid = batch.aligned(DCFG, CONFIG.num_hidden_layers)
    assert logits is None and valid.sum() == sum(n - 1 for n in LENGTHS)
    np.testing.assert_array_equal(hidden, batch.features[:, 1:])  # EAGLE-1: h is the feature
    for w in windows:  # the pair at the last entry of a window (with the next window's first) never counts
        r, o = places[len(w)]
        assert valid[r, o : o + len(w) - 1].all() and not valid[r, o + len(w) - 1]


@pytest.mark.parametrize("unroll_steps", [1, 2])
def test_packed_rows_compute_exactly_what_windows_compute_one_per_row(windows, models, unroll_steps):
    """Every window's per-position drafter outputs and the loss sums are the same packed or one window per row.

    So attention, RoPE positions and (unrolled) fed-back features never cross windows.
    """
    drafter, target = models
    packed = pack_windows(windows, ROWS, ROW_LEN)
    alone = fill_rows([(w, i, 0) for i, w in enumerate(windows)], len(windows), ROW_LEN)
    h_packed, (loss_p, count_p, sums_p) = jax.device_get(_run(drafter, target, packed, unroll_steps))
    h_alone, (loss_a, count_a, sums_a) = jax.device_get(_run(drafter, target, alone, unroll_steps))
    places = _places(packed)
    for i, w in enumerate(windows):
        r, o = places[len(w)]
        np.testing.assert_allclose(h_packed[r, o : o + len(w) - 1], h_alone[i, : len(w) - 1], rtol=1e-5, atol=1e-5)
    expected = sum(n - 1 - k for n in LENGTHS for k in range(unroll_steps))  # position t counts from step t on
    assert float(count_p) == float(count_a) == expected
    np.testing.assert_allclose(loss_p, loss_a, rtol=1e-5)
    for k in sums_p:
        np.testing.assert_allclose(sums_p[k], sums_a[k], rtol=1e-5, atol=1e-6)


def test_packing_errors_say_what_does_not_fit(windows):
    with pytest.raises(ValueError, match="longer than row_len=10 .longest 13."):
        pack_windows(windows, 8, 10)
    with pytest.raises(ValueError, match="48 entries in all do not fit in 1 rows of 26"):
        pack_windows(windows, 1, 26)
    with pytest.raises(ValueError, match="no windows to pack"):
        pack_windows([], 1, 26)
    other = windows[0].__class__(**{**windows[0].__dict__, "features": np.zeros((3, 5))})
    with pytest.raises(ValueError, match="windows disagree: feature width 5 vs 32"):
        pack_windows([windows[1], other], 1, 26)
    assert first_fit([4, 9, 4], 2, 10) == [(1, 0), (0, 0), (1, 4)]
