"""`tltjax.drafter.buffer`: the ring of harvested target features that online drafter training samples.

Host-side numpy only, no model: every stored feature row encodes (sequence number, position)
so that what comes back out can be traced to where it went in.
"""

import warnings

import ml_dtypes
import numpy as np
import pytest

from tltjax.drafter import DrafterBuffer, DrafterConfig
from tltjax.models import ModelConfig

F = 3  # feature width: (sequence number, position, step)


def _seq(num: int, length: int, step: int = 0):
    """(tokens, features) of a sequence of ``length`` tokens; feature row t = (num, t, step)."""
    tokens = (np.arange(length) * 7 + num) % 50
    feats = np.stack([np.full(length - 1, num), np.arange(length - 1), np.full(length - 1, step)], 1)
    return tokens, feats.astype(np.float32)


def _check_window(win, lengths):
    """A window is a contiguous run of one sequence, and its tokens are that sequence's."""
    num = int(win.features[0, 0])
    assert (win.features[:, 0] == num).all(), "window crosses sequences"
    np.testing.assert_array_equal(win.features[:, 1], np.arange(win.offset, win.offset + len(win)))
    assert win.offset + len(win) <= lengths[num] - 1
    np.testing.assert_array_equal(win.tokens, _seq(num, lengths[num])[0][win.offset : win.offset + len(win)])
    assert (win.features[:, 2] == win.step).all()


def test_entries_align_with_the_engines_features():
    """A sequence of L tokens with L - 1 feature rows is stored as L - 1 entries (x_t, f_t); the last token drops."""
    buf = DrafterBuffer(64, F)
    tokens, feats = _seq(0, 10, step=4)
    assert buf.add(4, tokens, feats) == 9
    assert len(buf) == 9 and buf.num_sequences == 1 and buf.steps() == {4: 1}
    win = buf.window(buf.live()[0], 0, 9)
    np.testing.assert_array_equal(win.tokens, tokens[:9])
    np.testing.assert_array_equal(win.features, feats)
    assert win.step == 4 and win.sequence == 0 and win.hidden is None
    assert (buf.token_step[:9] == 4).all()


def test_wrap_around_retires_whole_oldest_sequences_and_reads_back_exactly():
    """Past capacity, the oldest sequences retire whole; the live ones (one wrapping the ring's end) read back intact.

    Many sampled windows come only from live sequences: a half-overwritten sequence is never sampled.
    """
    buf = DrafterBuffer(20, F, max_sequences=16)
    lengths = {}
    for num, length in enumerate([6, 8, 7, 9, 5, 8]):
        lengths[num] = length
        buf.add(num, *_seq(num, length, step=num))
        assert len(buf) <= buf.capacity
    # entries: 5, 7, 6, 8, 4, 7 -> the newest that fit in 20: sequences 3, 4, 5 (8 + 4 + 7 = 19)
    live = [buf.window(s, 0, int(buf.seq_length[s])) for s in buf.live()]
    assert [w.sequence for w in live] == [3, 4, 5] and len(buf) == 19
    assert buf.head == 37 and (buf.seq_start[buf.live()] % 20 + buf.seq_length[buf.live()] > 20).any()  # one wraps
    for w in live:
        np.testing.assert_array_equal(w.features, _seq(w.sequence, lengths[w.sequence], w.sequence)[1])
    for win in buf.sample_windows(0, 300, window=4):
        assert win.sequence in (3, 4, 5)
        _check_window(win, lengths)


def test_record_ring_bounds_the_number_of_live_sequences():
    """With max_sequences = 3, only the newest three sequences stay live, however much token room is left."""
    buf = DrafterBuffer(1000, F, max_sequences=3)
    for num in range(7):
        buf.add(num, *_seq(num, 5, step=num))
    assert buf.num_sequences == 3 and buf.steps() == {4: 1, 5: 1, 6: 1}
    assert {w.sequence for w in buf.sample_windows(1, 100, window=3)} == {4, 5, 6}


def test_last_n_steps_sampling_returns_only_those_steps_and_never_crosses_sequences():
    """Windows of last_steps=N come from the N newest step tags only; each is one run of one sequence, <= window."""
    buf = DrafterBuffer(10_000, F, max_sequences=100)
    rng = np.random.default_rng(0)
    lengths = {}
    for num in range(40):
        step = num // 10  # steps 0..3, ten sequences each
        lengths[num] = int(rng.integers(3, 60))
        buf.add(step, *_seq(num, lengths[num], step))
    for last, allowed in ((1, {3}), (2, {2, 3}), (None, {0, 1, 2, 3})):
        wins = buf.sample_windows(rng, 400, window=16, last_steps=last)
        assert {w.step for w in wins} == allowed
        for w in wins:
            assert 2 <= len(w) == min(16, lengths[w.sequence] - 1)
            _check_window(w, lengths)


def test_windows_are_drawn_uniformly_over_positions():
    """A sequence is picked in proportion to its drafter positions (99 vs 9), not per sequence (1/2 each)."""
    buf = DrafterBuffer(1000, F)
    buf.add(0, *_seq(0, 11))  # 10 entries: 9 positions
    buf.add(0, *_seq(1, 101))  # 100 entries: 99 positions
    wins = buf.sample_windows(np.random.default_rng(3), 4000, window=512)
    share = np.mean([w.sequence == 1 for w in wins])
    assert abs(share - 99 / 108) < 0.02, share
    assert all(len(w) == (10 if w.sequence == 0 else 100) and w.offset == 0 for w in wins)


def test_sample_batch_fills_rows_with_windows_of_the_buffer():
    """sample_batch fills [rows, row_len] but for at most one entry a row; each segment is one window's run."""
    buf = DrafterBuffer(1000, F)
    lengths = {}
    for num, length in enumerate([12, 30, 7, 45]):
        lengths[num] = length
        buf.add(num, *_seq(num, length, step=num))
    batch = buf.sample_batch(np.random.default_rng(5), rows=4, row_len=24, window=10)
    assert batch.ids.shape == (4, 24) and batch.features.shape == (4, 24, F)
    assert ((batch.segment_ids > 0).sum(1) >= 23).all()
    for r in range(4):
        for s in range(1, batch.segment_ids[r].max() + 1):
            at = batch.segment_ids[r] == s
            f = batch.features[r, at]
            assert (f[:, 0] == f[0, 0]).all() and (np.diff(f[:, 1]) == 1).all()  # one contiguous run
            np.testing.assert_array_equal(batch.positions[r, at], np.arange(at.sum()))
            assert 2 <= at.sum() <= 10


@pytest.mark.parametrize("dtype,hidden", [("float32", None), ("bfloat16", 2)])
def test_batch_spec_has_the_shapes_and_dtypes_of_sample_batch(dtype, hidden):
    """batch_spec (known before the buffer holds anything) describes exactly what sample_batch returns."""
    import jax

    buf = DrafterBuffer(200, F, dtype, hidden_size=hidden)
    spec = buf.batch_spec(3, 16)
    for num, length in enumerate([12, 30, 9]):
        tokens, feats = _seq(num, length)
        buf.add(0, tokens, feats, hidden=None if hidden is None else feats[:, :hidden])
    batch = buf.sample_batch(np.random.default_rng(0), rows=3, row_len=16)
    got = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), batch)
    want = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), spec)
    assert got == want and (spec.hidden is None) == (hidden is None)


def test_state_dict_round_trip_restores_the_same_buffer():
    """from_state_dict(state_dict()) holds the same arrays and counters, samples the same windows and ages alike."""
    buf = DrafterBuffer(30, F, "bfloat16", max_sequences=5, hidden_size=2)
    for num in range(8):
        tokens, feats = _seq(num, 4 + num, step=num)
        buf.add(num, tokens, feats, hidden=feats[:, :2] + 0.5)
    state = buf.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    copy = DrafterBuffer.from_state_dict(state)
    assert copy.features.dtype == ml_dtypes.bfloat16 and copy.hidden_size == 2
    for k, v in buf.state_dict().items():
        np.testing.assert_array_equal(np.asarray(v, np.float64), np.asarray(copy.state_dict()[k], np.float64), k)
    a, b = buf.sample_windows(7, 20, window=5), copy.sample_windows(7, 20, window=5)
    for wa, wb in zip(a, b):
        assert (wa.sequence, wa.offset, wa.step) == (wb.sequence, wb.offset, wb.step)
        np.testing.assert_array_equal(wa.hidden, wb.hidden)
    tokens, feats = _seq(99, 12, step=9)
    for x in (buf, copy):
        x.add(9, tokens, feats, hidden=feats[:, :2])
    assert [w.sequence for w in buf.sample_windows(1, 10)] == [w.sequence for w in copy.sample_windows(1, 10)]
    with pytest.raises(ValueError, match="missing"):
        DrafterBuffer.from_state_dict({"tokens": state["tokens"]})


def test_for_drafter_keeps_final_hidden_states_only_when_features_lack_them():
    """EAGLE-1 and multi-layer features that include the final layer store no extra array; others do."""
    target = ModelConfig(model_type="qwen2", vocab_size=48, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    for layers, hidden in (((2,), None), ((1, 2), None), ((1,), 8), ((0, 1), 8)):
        buf = DrafterBuffer.for_drafter(DrafterConfig.for_target(target, layers), 2, 64)
        assert buf.feature_size == 8 * len(layers) and buf.hidden_size == hidden
        assert (buf.hidden is None) == (hidden is None)


def test_too_long_and_too_short_sequences():
    """A sequence over capacity keeps its first capacity entries with a counted warning; < 2 entries are skipped."""
    buf = DrafterBuffer(10, F)
    buf.add(0, *_seq(0, 6))
    with pytest.warns(UserWarning, match=r"exceeds capacity_tokens=10; kept its first 10 \(1 sequences, 5 entries"):
        assert buf.add(1, *_seq(1, 16, step=1)) == 10
    assert buf.truncated_sequences == 1 and buf.truncated_entries == 5
    assert buf.num_sequences == 1 and buf.steps() == {1: 1}  # the first sequence was retired whole
    np.testing.assert_array_equal(buf.window(buf.live()[0], 0, 10).features, _seq(1, 16, 1)[1][:10])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert buf.add(2, *_seq(2, 2)) == 0 and buf.add(2, [], np.zeros((0, F))) == 0
    assert buf.skipped == 2 and buf.num_sequences == 1


def test_bad_input_is_a_clear_error():
    buf = DrafterBuffer(100, F)
    tokens, feats = _seq(0, 8)
    with pytest.raises(ValueError, match=r"features have shape \(7, 4\), expected \[len\(token_ids\) - 1, 3\]"):
        buf.add(0, tokens, np.zeros((7, 4)))
    with pytest.raises(ValueError, match="8 tokens need 7 feature rows .* got 8"):
        buf.add(0, tokens, np.zeros((8, F)))
    with pytest.raises(ValueError, match="keeps no final hidden states"):
        buf.add(0, tokens, feats, hidden=np.zeros((7, 2)))
    with pytest.raises(ValueError, match="needs final hidden states"):
        DrafterBuffer(100, F, hidden_size=2).add(0, tokens, feats)
    with pytest.raises(ValueError, match=r"hidden has shape \(6, 2\), expected \(7, 2\)"):
        DrafterBuffer(100, F, hidden_size=2).add(0, tokens, feats, hidden=np.zeros((6, 2)))
    with pytest.raises(ValueError, match=r"no features; generate with .*return_features=True"):
        buf.add(0, tokens, None)
    with pytest.raises(ValueError, match="step must be an integer"):
        buf.add(1.5, tokens, feats)
    with pytest.raises(ValueError, match="token_ids must be >= 0"):
        buf.add(0, -tokens - 1, feats)
    with pytest.raises(ValueError, match="no sequences from the last"):
        buf.sample_windows(0, 4)
    buf.add(0, tokens, feats)
    with pytest.raises(ValueError, match="window=1 must be >= 2"):
        buf.sample_windows(0, 4, window=1)
    with pytest.raises(ValueError, match="last_steps=0 must be >= 1"):
        buf.sample_windows(0, 4, last_steps=0)
    with pytest.raises(ValueError, match="capacity_tokens >= 2"):
        DrafterBuffer(1, F)
