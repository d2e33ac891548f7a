"""Packing training windows of harvested target data into fixed-shape rows.

A `Window` is a contiguous run of one rollout sequence as `DrafterBuffer` stores
it: entry ``i`` holds token ``x_{a+i}``, the target feature ``f_{a+i}`` computed
at that position and (optionally) the target's final normed hidden state
``h_{a+i}``. Consecutive entries ``(i, i+1)`` give one drafter position: input
(``x_{a+i+1}``, ``f_{a+i}``), target ``h_{a+i+1}`` (see `tltjax.drafter.model`),
so a window of ``w`` entries trains ``w - 1`` positions.

`pack_windows` puts several windows side by side in one row of a
`PackedDrafterBatch`. ``segment_ids`` number the windows of a row from 1 (0 is
padding) and ``positions`` restart at 0 in each window, so that

- a drafter position pairs entries ``t`` and ``t + 1`` only if both are real and
  in the same window (`PackedDrafterBatch.aligned`),
- attention is causal *and* same-window (`tltjax.drafter.train.drafter_loss` with
  ``segment_ids``), and RoPE sees each window's own positions,

so a packed row computes, position by position, what the windows would compute
one per row (proved in tests/drafter/test_packing.py). Fixed ``(rows, row_len)``
shapes mean one compilation of `tltjax.drafter.train.drafter_update`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.drafter.model import DrafterConfig, pair_inputs


@dataclasses.dataclass(frozen=True)
class Window:
    """A contiguous run of one stored sequence: entries ``offset .. offset + len - 1`` of it.

    ``tokens[i]`` is the sequence's token at position ``offset + i``,
    ``features[i]`` the target feature at that position and ``hidden[i]`` (when
    the buffer keeps it) the target's final normed hidden state there.
    ``sequence`` is the buffer's running number of the sequence and ``step`` its
    RL step tag.
    """

    tokens: np.ndarray  # [w] int32
    features: np.ndarray  # [w, F]
    hidden: np.ndarray | None  # [w, H] or None
    step: int
    sequence: int
    offset: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def head(self, n: int) -> "Window":
        """The first ``n`` entries (all of them if the window is shorter)."""
        if n >= len(self):
            return self
        return dataclasses.replace(
            self,
            tokens=self.tokens[:n],
            features=self.features[:n],
            hidden=None if self.hidden is None else self.hidden[:n],
        )


@struct.dataclass
class PackedDrafterBatch:
    """Windows of harvested target data packed into ``[rows, row_len]``.

    At packed position ``p`` of a row: ``ids`` the token, ``features`` the target
    feature computed there, ``hidden`` (optional) the target's final normed hidden
    state there, ``segment_ids`` the window's number in the row (1, 2, ...; 0 =
    padding) and ``positions`` the position inside its window (0 at each window's
    first entry). When ``hidden`` is None the final hidden state is read from
    ``features``, which then must contain the final layer (`final_hidden`).
    No logits are stored: the loss applies the live target's LM head to ``h``.
    """

    ids: Int[Array, "batch seq"]
    segment_ids: Int[Array, "batch seq"]
    positions: Int[Array, "batch seq"]
    features: Float[Array, "batch seq feature"]
    hidden: Float[Array, "batch seq hidden"] | None = None

    def final_hidden(self, config: DrafterConfig, num_hidden_layers: int) -> Float[Array, "batch seq hidden"]:
        """The target's final normed hidden state ``h`` at every packed position.

        ``hidden`` if stored; otherwise the slot of ``features`` that holds layer
        ``num_hidden_layers`` (``features`` concatenates ``config.feature_layers``
        in order). EAGLE-1 features *are* ``h``.
        """
        if self.hidden is not None:
            return self.hidden
        layers = config.feature_layers
        if num_hidden_layers not in layers:
            raise ValueError(
                f"this packed batch stores no final hidden states and the drafter's feature_layers {layers} "
                f"do not include the final layer {num_hidden_layers}; build the DrafterBuffer with "
                f"hidden_size={config.hidden_size} and add each sequence's final hidden states"
            )
        h = config.hidden_size
        slot = layers.index(num_hidden_layers)
        return self.features[..., slot * h : (slot + 1) * h]

    def aligned(
        self, config: DrafterConfig, num_hidden_layers: int
    ) -> tuple[
        Int[Array, "batch seq1"],
        Float[Array, "batch seq1 feature"],
        Float[Array, "batch seq1 hidden"],
        None,
        Bool[Array, "batch seq1"],
    ]:
        """`drafter_loss`'s inputs: (``x_{t+1}``, ``f_t``, ``h_{t+1}``, None, valid) for t = 0..row_len-2.

        The target logits are None: the loss computes them from ``h_{t+1}``.
        Position ``t`` is valid only when entries ``t`` and ``t + 1`` are real and
        belong to the same window. Pass `layout` with them.
        """
        tokens, features = pair_inputs(self.ids, self.features)
        seg = self.segment_ids
        valid = (seg[:, :-1] > 0) & (seg[:, :-1] == seg[:, 1:])
        return tokens, features, self.final_hidden(config, num_hidden_layers)[:, 1:], None, valid

    def layout(self) -> dict[str, Int[Array, "batch seq1"]]:
        """``positions`` and ``segment_ids`` of the drafter positions (keyword arguments of `drafter_loss`).

        Drafter position ``t`` lies where feature ``f_t`` does: in entry ``t``'s
        window, at entry ``t``'s position.
        """
        return {"positions": self.positions[:, :-1], "segment_ids": self.segment_ids[:, :-1]}


def first_fit(lengths: Sequence[int], rows: int, row_len: int) -> list[tuple[int, int]]:
    """(row, offset) of each length, placed first-fit in decreasing order of length.

    Raises ``ValueError`` if a length exceeds ``row_len`` or they do not all fit.
    """
    lengths = [int(n) for n in lengths]
    too_long = [n for n in lengths if n > row_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} windows are longer than row_len={row_len} (longest {max(too_long)}); "
            f"sample windows of at most {row_len} entries or use longer rows"
        )
    free = [row_len] * rows
    placed: list[tuple[int, int]] = [(-1, -1)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r in range(rows) if free[r] >= lengths[i]), None)
        if row is None:
            raise ValueError(
                f"{len(lengths)} windows of {sum(lengths)} entries in all do not fit in {rows} rows of {row_len} "
                f"(first-fit left a window of {lengths[i]} without room); pack fewer windows or add rows"
            )
        placed[i] = (row, row_len - free[row])
        free[row] -= lengths[i]
    return placed


def pack_windows(windows: Sequence[Window], rows: int, row_len: int, *, pad_id: int = 0) -> PackedDrafterBatch:
    """A `PackedDrafterBatch` of ``[rows, row_len]`` holding every window, first-fit by decreasing length.

    Host (numpy) arrays, features in the windows' dtype. Raises ``ValueError`` if
    the windows do not fit or disagree in feature width or in having ``hidden``.
    """
    placed = first_fit([len(w) for w in windows], rows, row_len)
    return fill_rows([(w, r, o) for w, (r, o) in zip(windows, placed)], rows, row_len, pad_id=pad_id)


def fill_rows(
    placed: Sequence[tuple[Window, int, int]], rows: int, row_len: int, *, pad_id: int = 0
) -> PackedDrafterBatch:
    """The packed batch with each (window, row, offset) written at its place; the rest is padding.

    Windows in one row get segment ids 1, 2, ... in order of offset. The places
    must not overlap (as `first_fit` gives them).
    """
    if rows < 1 or row_len < 2:
        raise ValueError(f"a packed batch needs rows >= 1 and row_len >= 2; got rows={rows}, row_len={row_len}")
    if not placed:
        raise ValueError("no windows to pack (the feature width is unknown); sample at least one window")
    first = placed[0][0]
    width, with_hidden = first.features.shape[1], first.hidden is not None
    for w, _, _ in placed:
        if w.features.shape[1] != width or (w.hidden is not None) != with_hidden:
            raise ValueError(
                f"windows disagree: feature width {w.features.shape[1]} vs {width}, hidden stored "
                f"{w.hidden is not None} vs {with_hidden}; pack windows of one buffer"
            )
    ids = np.full((rows, row_len), pad_id, np.int32)
    seg = np.zeros((rows, row_len), np.int32)
    pos = np.zeros((rows, row_len), np.int32)
    feats = np.zeros((rows, row_len, width), first.features.dtype)
    hidden = np.zeros((rows, row_len, first.hidden.shape[1]), first.hidden.dtype) if with_hidden else None
    used = np.zeros((rows, row_len), bool)
    for w, r, o in sorted(placed, key=lambda p: (p[1], p[2])):
        n = len(w)
        if not (0 <= r < rows and 0 <= o and o + n <= row_len) or used[r, o : o + n].any():
            raise ValueError(
                f"window of {n} entries at row {r}, offset {o} is outside [{rows}, {row_len}] or overlaps another"
            )
        used[r, o : o + n] = True
        ids[r, o : o + n] = w.tokens
        seg[r, o : o + n] = seg[r].max() + 1
        pos[r, o : o + n] = np.arange(n, dtype=np.int32)
        feats[r, o : o + n] = w.features
        if hidden is not None:
            hidden[r, o : o + n] = w.hidden
    return PackedDrafterBatch(ids=ids, segment_ids=seg, positions=pos, features=feats, hidden=hidden)
