"""Supervised fine-tuning batches for decoder LMs, formatted exactly as prompts are at rollout.

A training row is

    [<bos>] + chat(user=prompt, add_generation_prompt=True) + response + <eos> + <pad>...

`encode_prompts` returns the first part (everything up to the response), so generation starts
from the very prefix the model was trained on. `<bos>` is prepended only when the tokenizer has
one and the chat template did not already emit it (Qwen has none; Llama 3's template writes it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from tltjax.models.tokenizer import Tokenizer


class PromptResponse(Protocol):
    """Anything with a `prompt` and a reference `response`, e.g. `tltjax.rl.tasks.Example`."""

    prompt: str
    response: str


def _prompt_ids(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of one prompt as a user turn, ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    bos = tokenizer.bos_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def encode_prompts(prompts: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """The token prefix of each prompt, identical to the prompt part of an `sft_batches` row."""
    return [_prompt_ids(p, tokenizer) for p in prompts]


class SFTBatches:
    """Shuffled, right-padded SFT batches; iterate to get them, restartable and deterministic.

    Each batch is a dict of numpy arrays:
      tokens:    int32 [batch_size, seq_len], rows right-padded with the pad id.
      loss_mask: float32 [batch_size, seq_len], 1 where `tokens[b, t]` is a response token or the
                 final <eos> (the targets), 0 on prompt tokens and padding.

    Examples that do not fit in `seq_len` are skipped, never truncated; `num_skipped` counts
    them. Every epoch is a fresh permutation drawn from `seed`; its last incomplete batch is
    dropped so that every batch has the same static shape. `epochs=None` repeats forever.
    """

    def __init__(
        self,
        examples: Sequence[PromptResponse],
        tokenizer: Tokenizer,
        batch_size: int,
        seq_len: int,
        seed: int,
        epochs: int | None = 1,
    ):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(
                f"need batch_size >= 1 and seq_len >= 2, got batch_size={batch_size}, "
                f"seq_len={seq_len}."
            )
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1, or None to repeat forever; got {epochs}.")
        eos = tokenizer.eos_id
        if eos is None:
            raise ValueError(
                f"{tokenizer!r} has no eos token, so responses cannot be terminated; set "
                "`tokenizer.special_tokens['eos_token']`."
            )
        # Padding always carries loss_mask 0, so any id would do; prefer the real pad token.
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos

        rows_tokens, rows_mask = [], []
        for example in examples:
            prompt = _prompt_ids(example.prompt, tokenizer)
            target = [*tokenizer.encode(example.response), eos]
            if len(prompt) + len(target) > seq_len:
                continue
            pad_len = seq_len - len(prompt) - len(target)
            rows_tokens.append(prompt + target + [pad] * pad_len)
            rows_mask.append([0.0] * len(prompt) + [1.0] * len(target) + [0.0] * pad_len)

        self.num_examples = len(examples)
        self.num_skipped = self.num_examples - len(rows_tokens)
        if len(rows_tokens) < batch_size:
            raise ValueError(
                f"only {len(rows_tokens)} of {self.num_examples} examples fit in "
                f"seq_len={seq_len} ({self.num_skipped} too long), fewer than "
                f"batch_size={batch_size}; raise seq_len or lower batch_size."
            )
        self.tokens = np.asarray(rows_tokens, dtype=np.int32).reshape(-1, seq_len)
        self.loss_mask = np.asarray(rows_mask, dtype=np.float32).reshape(-1, seq_len)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.epochs = epochs

    @property
    def batches_per_epoch(self) -> int:
        return len(self.tokens) // self.batch_size

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(self.seed)
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = rng.permutation(len(self.tokens))
            for i in range(self.batches_per_epoch):
                rows = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield {"tokens": self.tokens[rows], "loss_mask": self.loss_mask[rows]}
            epoch += 1

    def __len__(self) -> int:
        if self.epochs is None:
            raise TypeError("SFTBatches with epochs=None is infinite and has no length.")
        return self.batches_per_epoch * self.epochs


def sft_batches(
    examples: Sequence[PromptResponse],
    tokenizer: Tokenizer,
    batch_size: int,
    seq_len: int,
    seed: int,
    epochs: int | None = 1,
) -> SFTBatches:
    """SFT batches of `<bos> + chat prompt + response + <eos>` rows; see `SFTBatches`.

    Encodes every example up front, so `num_skipped` (examples longer than `seq_len`) is known
    before the first batch.
    """
    return SFTBatches(examples, tokenizer, batch_size, seq_len, seed, epochs)


class PackedSFTBatches:
    """Like `SFTBatches`, but several examples share a row, so little compute goes to padding.

    Each batch adds, to ``tokens`` and ``loss_mask``:
      segment_ids: int32 [rows, width], 1, 2, ... per example in the row, 0 on padding;
      positions:   int32 [rows, width], restarting at 0 for each example.
    Attention and positions never cross examples when the model is given the mask from
    `segment_mask` and these positions, so a packed row trains exactly like separate rows.

    ``widths`` (default: just ``seq_len``) are row widths; each example goes to the narrowest
    that holds it and is packed with examples of that width only, so a short example never pays
    for attention over a long row. A batch holds ``batch_size * seq_len // width`` rows, i.e. the
    same number of token slots for every width, and only ``len(widths)`` shapes are compiled.
    Rows are filled greedily in a fresh random order each epoch and batches of all widths are
    interleaved at random; examples longer than the widest row are skipped and counted in
    `num_skipped`.
    """

    def __init__(
        self,
        examples,
        tokenizer: Tokenizer,
        batch_size: int,
        seq_len: int,
        seed: int,
        epochs: int | None = 1,
        widths: Sequence[int] | None = None,
    ):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}.")
        self.widths = tuple(sorted(widths or (seq_len,)))
        if self.widths[-1] != seq_len or self.widths[0] < 2:
            raise ValueError(f"widths {self.widths} must lie in [2, seq_len={seq_len}] and include seq_len.")
        eos = tokenizer.eos_id
        if eos is None:
            raise ValueError(f"{tokenizer!r} has no eos token, so responses cannot be terminated.")
        self.pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos
        self.rows: list[tuple[list[int], list[float]]] = []
        for example in examples:
            prompt = _prompt_ids(example.prompt, tokenizer)
            target = [*tokenizer.encode(example.response), eos]
            if len(prompt) + len(target) <= seq_len:
                self.rows.append((prompt + target, [0.0] * len(prompt) + [1.0] * len(target)))
        self.num_examples = len(examples)
        self.num_skipped = self.num_examples - len(self.rows)
        if not self.rows:
            raise ValueError(f"none of {self.num_examples} examples fits in seq_len={seq_len}; raise seq_len.")
        lens = np.array([len(r[0]) for r in self.rows])
        self.bucket = np.searchsorted(np.asarray(self.widths), lens)  # narrowest width that holds each
        self.batch_size, self.seq_len, self.seed, self.epochs = batch_size, seq_len, seed, epochs

    def _pack(self, order, width: int) -> list[dict[str, np.ndarray]]:
        packed, cur, fill = [], [], 0
        for i in order:
            n = len(self.rows[i][0])
            if fill + n > width:
                packed.append(cur)
                cur, fill = [], 0
            cur.append(i)
            fill += n
        if cur:
            packed.append(cur)
        b = max(1, self.batch_size * self.seq_len // width)
        batches = []
        for start in range(0, len(packed) - b + 1, b):
            tokens = np.full((b, width), self.pad, np.int32)
            mask = np.zeros((b, width), np.float32)
            seg = np.zeros((b, width), np.int32)
            pos = np.zeros((b, width), np.int32)
            for r, members in enumerate(packed[start : start + b]):
                at = 0
                for s, i in enumerate(members, start=1):
                    ids, m = self.rows[i]
                    n = len(ids)
                    tokens[r, at : at + n] = ids
                    mask[r, at : at + n] = m
                    seg[r, at : at + n] = s
                    pos[r, at : at + n] = np.arange(n)
                    at += n
            batches.append({"tokens": tokens, "loss_mask": mask, "segment_ids": seg, "positions": pos})
        return batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(self.seed)
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = rng.permutation(len(self.rows))
            batches = []
            for k, width in enumerate(self.widths):
                batches += self._pack(order[self.bucket[order] == k], width)
            if not batches:
                raise ValueError(
                    f"{len(self.rows)} examples fill fewer than one batch of {self.batch_size} rows of "
                    f"seq_len={self.seq_len}; use more examples or a smaller batch."
                )
            for j in rng.permutation(len(batches)):
                yield batches[j]
            epoch += 1


def segment_mask(segment_ids: np.ndarray):
    """Causal attention mask [batch, seq, seq] that never crosses segments (0 = padding, sees nothing)."""
    import jax.numpy as jnp

    seg = jnp.asarray(segment_ids)
    t = seg.shape[-1]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return same & jnp.tril(jnp.ones((t, t), bool))[None]
