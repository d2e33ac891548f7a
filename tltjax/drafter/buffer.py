"""A bounded ring buffer of the target features that rollouts harvest, for online drafter training.

What is stored. `tltjax.rollout.engine.Engine.generate` with
``return_features=True`` gives, per sequence of ``L = len(prompt) + len(tokens)``
tokens ``x_0 .. x_{L-1}``, ``features`` of ``L - 1`` rows: row ``t`` is the
target feature ``f_t`` computed at position ``t`` (the last token is sampled but
never fed back, so it has none). `DrafterBuffer.add` stores ``L - 1`` *entries*,
entry ``t`` = (``x_t``, ``f_t``[, ``h_t``]); the last token is dropped because no
drafter position uses it (drafter position ``t`` reads ``x_{t+1}``, ``f_t`` and is
trained against ``h_{t+1}``, so the last one, ``t = L - 3``, reads ``x_{L-2}``).
A sequence of ``n = L - 1`` entries thus trains ``n - 1 = L - 2`` positions.

``h_t`` is the target's final normed hidden state. With the default EAGLE-1
features (``feature_layers = (num_hidden_layers,)``), and whenever the feature
layers include the final one, it is a slot of ``f_t`` and is not stored again.
Otherwise build the buffer with ``hidden_size`` and pass ``hidden`` (``[L - 1, H]``,
aligned like ``features``) to `add`; `DrafterBuffer.for_drafter` decides.

Layout. Preallocated host (numpy) arrays: a flat ring of ``capacity`` entries
(``tokens``, ``features``, optional ``hidden``, ``token_step``) and a ring of
``max_sequences`` records (absolute start, length, step). Host memory, not device
memory: rollouts add sequences of every length between device calls and the
buffer can be large, while a training batch is a few windows, gathered on the
host and sent once per update as a fixed-shape `PackedDrafterBatch`.

Overwriting. Positions are absolute (they only grow; ring index = position mod
``capacity``). Adding a sequence that does not fit retires the oldest sequences
first, whole: a sequence is live only while every one of its entries is intact,
so a half-overwritten sequence is never sampled. Retiring by record count works
the same way. A sequence longer than ``capacity`` entries keeps its first
``capacity`` entries, with a warning, and is counted in ``truncated_sequences`` /
``truncated_entries``. Sequences too short to train a position (fewer than 2
entries, i.e. fewer than 3 tokens) are skipped and counted in ``skipped``.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from tltjax.drafter.model import DrafterConfig
from tltjax.drafter.packing import PackedDrafterBatch, Window, fill_rows

_COUNTERS = ("head", "added", "oldest", "truncated_sequences", "truncated_entries", "skipped")


def _rng(rng: np.random.Generator | int) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


class DrafterBuffer:
    """Ring buffer of (token, target feature[, final hidden]) entries of whole sequences, tagged by RL step.

    ``capacity_tokens`` entries and at most ``max_sequences`` live sequences;
    features kept in ``dtype`` (e.g. ``"bfloat16"``). See the module docstring for
    the alignment and the overwrite rule.
    """

    def __init__(
        self,
        capacity_tokens: int,
        feature_size: int,
        dtype: Any = "float32",
        max_sequences: int = 4096,
        *,
        hidden_size: int | None = None,
    ):
        if capacity_tokens < 2 or feature_size < 1 or max_sequences < 1:
            raise ValueError(
                f"DrafterBuffer needs capacity_tokens >= 2, feature_size >= 1 and max_sequences >= 1; got "
                f"{capacity_tokens}, {feature_size}, {max_sequences}"
            )
        if hidden_size is not None and hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size} must be >= 1 (or None when features hold the final layer)")
        self.capacity = int(capacity_tokens)
        self.feature_size = int(feature_size)
        self.hidden_size = None if hidden_size is None else int(hidden_size)
        self.max_sequences = int(max_sequences)
        self.dtype = np.dtype(dtype)
        self.tokens = np.zeros((self.capacity,), np.int32)
        self.features = np.zeros((self.capacity, self.feature_size), self.dtype)
        self.hidden = None if hidden_size is None else np.zeros((self.capacity, self.hidden_size), self.dtype)
        self.token_step = np.zeros((self.capacity,), np.int32)
        self.seq_start = np.zeros((self.max_sequences,), np.int64)  # absolute position of entry 0
        self.seq_length = np.zeros((self.max_sequences,), np.int32)
        self.seq_step = np.zeros((self.max_sequences,), np.int32)
        self.head = 0  # absolute position of the next entry
        self.added = 0  # sequences ever stored; record of sequence i is slot i % max_sequences
        self.oldest = 0  # live sequences are oldest .. added - 1
        self.truncated_sequences = 0
        self.truncated_entries = 0
        self.skipped = 0

    @classmethod
    def for_drafter(
        cls,
        config: DrafterConfig,
        num_hidden_layers: int,
        capacity_tokens: int,
        dtype: Any = "float32",
        max_sequences: int = 4096,
    ) -> "DrafterBuffer":
        """A buffer for ``config``'s features; it keeps final hidden states only if the features lack them."""
        keep_hidden = num_hidden_layers not in config.feature_layers
        return cls(
            capacity_tokens, config.feature_size, dtype, max_sequences,
            hidden_size=config.hidden_size if keep_hidden else None,
        )

    # ------------------------------------------------------------------ adding
    def add(self, step: int, token_ids: Sequence[int], features: np.ndarray, hidden: np.ndarray | None = None) -> int:
        """Stores one sequence of RL step ``step``; returns the entries stored.

        ``token_ids``: the ``L`` tokens (prompt + response); ``features``:
        ``[L - 1, F]``, row ``t`` the target feature at position ``t``, as
        `Engine.generate` returns it; ``hidden``: ``[L - 1, H]`` final hidden
        states, required exactly when the buffer has ``hidden_size``.
        """
        if features is None:
            raise ValueError("the sequence has no features; generate with Engine.generate(..., return_features=True)")
        tokens = np.asarray(token_ids)
        feats = np.asarray(features)
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step must be an integer RL step, got {step!r}")
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(
                f"token_ids must be a 1-D sequence of integer ids, got shape {tokens.shape} {tokens.dtype}"
            )
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"token_ids must be >= 0, got {tokens.min()}")
        if not np.iinfo(np.int32).min <= step <= np.iinfo(np.int32).max:
            raise ValueError(f"step={step} does not fit the int32 step tags")
        if feats.ndim != 2 or feats.shape[1] != self.feature_size:
            raise ValueError(
                f"features have shape {feats.shape}, expected [len(token_ids) - 1, {self.feature_size}]; "
                "the buffer's feature_size must be the drafter's (hidden x number of feature layers)"
            )
        n = max(len(tokens) - 1, 0)
        if feats.shape[0] != n:
            raise ValueError(
                f"{len(tokens)} tokens need {n} feature rows (one per position but the last), got "
                f"{feats.shape[0]}; pass prompt + response tokens with the engine's features"
            )
        if (hidden is None) != (self.hidden is None):
            need = "needs" if self.hidden is not None else "keeps no"
            raise ValueError(
                f"this buffer {need} final hidden states (hidden_size={self.hidden_size}); "
                f"got hidden={'None' if hidden is None else np.shape(hidden)}"
            )
        if hidden is not None:
            hidden = np.asarray(hidden)
            if hidden.shape != (n, self.hidden_size):
                raise ValueError(
                    f"hidden has shape {hidden.shape}, expected {(n, self.hidden_size)} (aligned with features)"
                )
        if n < 2:
            self.skipped += 1
            return 0
        if n > self.capacity:
            self.truncated_sequences += 1
            self.truncated_entries += n - self.capacity
            warnings.warn(
                f"DrafterBuffer: a sequence of {n} entries exceeds capacity_tokens={self.capacity}; kept its first "
                f"{self.capacity} ({self.truncated_sequences} sequences, {self.truncated_entries} entries truncated "
                "so far). Raise capacity_tokens to keep long sequences whole.",
                stacklevel=2,
            )
            n = self.capacity
        start, end = self.head, self.head + n
        # retire whole sequences that the new entries would overwrite, or that the record ring would lose
        while self.oldest < self.added and (
            self.seq_start[self.oldest % self.max_sequences] < end - self.capacity
            or self.added + 1 - self.oldest > self.max_sequences
        ):
            self.oldest += 1
        idx = np.arange(start, end) % self.capacity
        self.tokens[idx] = tokens[:n]
        self.features[idx] = feats[:n].astype(self.dtype)
        if hidden is not None:
            self.hidden[idx] = hidden[:n].astype(self.dtype)
        self.token_step[idx] = step
        slot = self.added % self.max_sequences
        self.seq_start[slot], self.seq_length[slot], self.seq_step[slot] = start, n, step
        self.added += 1
        self.head = end
        return n

    def extend(self, step: int, sequences: Iterable[Any]) -> int:
        """`add` for each generated sequence (``.context``, ``.features``, optional ``.hidden``); total entries."""
        return sum(self.add(step, s.context, s.features, getattr(s, "hidden", None)) for s in sequences)

    # ------------------------------------------------------------------ reading
    def live(self) -> np.ndarray:
        """Record slots of the live sequences, oldest first."""
        return np.arange(self.oldest, self.added) % self.max_sequences

    def __len__(self) -> int:
        """Entries held by live sequences."""
        return int(self.seq_length[self.live()].sum())

    @property
    def num_sequences(self) -> int:
        return self.added - self.oldest

    def steps(self) -> dict[int, int]:
        """Live sequences per RL step tag."""
        tags, counts = np.unique(self.seq_step[self.live()], return_counts=True)
        return {int(t): int(c) for t, c in zip(tags, counts)}

    def window(self, slot: int, offset: int, length: int) -> Window:
        """Entries ``offset .. offset + length - 1`` of the live sequence in record ``slot``."""
        n = int(self.seq_length[slot])
        if not 0 <= offset <= offset + length <= n:
            raise ValueError(f"window [{offset}, {offset + length}) is outside the sequence's {n} entries")
        idx = (self.seq_start[slot] + offset + np.arange(length)) % self.capacity
        seq = int(self.added - ((self.added - 1 - slot) % self.max_sequences) - 1)
        return Window(
            tokens=self.tokens[idx],
            features=self.features[idx],
            hidden=None if self.hidden is None else self.hidden[idx],
            step=int(self.seq_step[slot]),
            sequence=seq,
            offset=int(offset),
        )

    def eligible(self, last_steps: int | None = None) -> np.ndarray:
        """Live record slots whose step is among the last ``last_steps`` (None: all).

        "Last N steps" counts back from the newest step tag held: tags in
        ``(newest - N, newest]``.
        """
        slots = self.live()
        if last_steps is None or not len(slots):
            return slots
        if last_steps < 1:
            raise ValueError(f"last_steps={last_steps} must be >= 1 (or None for every step)")
        newest = int(self.seq_step[slots].max())
        return slots[self.seq_step[slots] > newest - last_steps]

    def sample_windows(
        self, rng: np.random.Generator | int, n: int, window: int = 512, last_steps: int | None = None
    ) -> list[Window]:
        """``n`` windows of at most ``window`` entries from sequences of the last ``last_steps`` RL steps.

        Uniform over positions: each window is drawn around an anchor, a drafter
        position (pair of consecutive entries) drawn uniformly from all those of
        the eligible sequences, so a sequence is picked in proportion to its
        length. The window is ``min(window, sequence entries)`` long, lies inside
        that one sequence and contains the anchor's pair; its start is uniform
        among those that do. Windows never cross sequences.
        """
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 (a drafter position needs two entries)")
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        slots = self.eligible(last_steps)
        if not len(slots):
            raise ValueError(
                f"the buffer has no sequences from the last {last_steps} steps to sample (live steps: {self.steps()}); "
                "add rollouts first"
            )
        rng = _rng(rng)
        lengths = self.seq_length[slots].astype(np.int64)
        cum = np.cumsum(lengths - 1)
        anchors = rng.integers(0, cum[-1], size=n)
        which = np.searchsorted(cum, anchors, side="right")
        q = anchors - (cum[which] - (lengths[which] - 1))  # pair index inside the sequence: 0 .. len-2
        w = np.minimum(window, lengths[which])
        lo = np.maximum(0, q - w + 2)
        hi = np.minimum(q, lengths[which] - w)
        starts = rng.integers(lo, hi + 1)
        return [self.window(int(slots[k]), int(s), int(m)) for k, s, m in zip(which, starts, w)]

    def batch_spec(self, rows: int, row_len: int) -> PackedDrafterBatch:
        """The shapes and dtypes (`jax.ShapeDtypeStruct`s) of a `sample_batch` of ``rows`` x ``row_len``:
        what a program compiled ahead of the first rollout needs, before the buffer holds anything."""
        import jax

        def spec(*shape, dtype=np.int32):
            return jax.ShapeDtypeStruct((rows, row_len, *shape), dtype)

        return PackedDrafterBatch(
            ids=spec(), segment_ids=spec(), positions=spec(), features=spec(self.feature_size, dtype=self.dtype),
            hidden=None if self.hidden_size is None else spec(self.hidden_size, dtype=self.dtype),
        )

    def sample_batch(
        self,
        rng: np.random.Generator | int,
        rows: int,
        row_len: int,
        *,
        window: int | None = None,
        last_steps: int | None = None,
        pad_id: int = 0,
    ) -> PackedDrafterBatch:
        """A full `PackedDrafterBatch` ``[rows, row_len]`` of windows from `sample_windows`.

        Windows (default length ``row_len``) are laid end to end; the one that
        reaches the end of a row is cut to what fits, so rows are full except for
        a last gap of one entry at most.
        """
        if rows < 1 or row_len < 2:
            raise ValueError(f"sample_batch needs rows >= 1 and row_len >= 2; got rows={rows}, row_len={row_len}")
        rng = _rng(rng)
        placed: list[tuple[Window, int, int]] = []
        row, off = 0, 0
        while row < rows:
            for win in self.sample_windows(rng, rows, window or row_len, last_steps):
                while row < rows and row_len - off < 2:
                    row, off = row + 1, 0
                if row == rows:
                    break
                win = win.head(row_len - off)
                placed.append((win, row, off))
                off += len(win)
        return fill_rows(placed, rows, row_len, pad_id=pad_id)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The buffer as a flat dict of numpy arrays (counters as 0-d int64), for a checkpoint's array tree.

        Shapes and dtype are recovered from the arrays by `from_state_dict`;
        ``copy=False`` returns the live arrays themselves (do not add meanwhile).
        """
        out = {
            "tokens": self.tokens, "features": self.features, "token_step": self.token_step,
            "seq_start": self.seq_start, "seq_length": self.seq_length, "seq_step": self.seq_step,
        }
        if self.hidden is not None:
            out["hidden"] = self.hidden
        if copy:
            out = {k: v.copy() for k, v in out.items()}
        out.update({k: np.asarray(getattr(self, k), np.int64) for k in _COUNTERS})
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DrafterBuffer":
        """A buffer equal to the one whose `state_dict` gave ``state``."""
        need = {"tokens", "features", "token_step", "seq_start", "seq_length", "seq_step", *_COUNTERS}
        missing = sorted(need - set(state))
        if missing:
            raise ValueError(f"DrafterBuffer state is missing {missing}; pass what state_dict() returned")
        feats = np.asarray(state["features"])
        hidden = None if state.get("hidden") is None else np.asarray(state["hidden"])
        buf = cls(
            feats.shape[0], feats.shape[1], feats.dtype, np.asarray(state["seq_start"]).shape[0],
            hidden_size=None if hidden is None else hidden.shape[1],
        )
        for name in ("tokens", "features", "token_step", "seq_start", "seq_length", "seq_step") + (
            ("hidden",) if hidden is not None else ()
        ):
            mine, theirs = getattr(buf, name), np.asarray(state[name])
            if theirs.shape != mine.shape:
                raise ValueError(f"DrafterBuffer state {name} has shape {theirs.shape}, expected {mine.shape}")
            mine[...] = theirs
        for k in _COUNTERS:
            setattr(buf, k, int(np.asarray(state[k])))
        return buf
