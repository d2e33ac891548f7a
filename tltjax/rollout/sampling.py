"""The one sampling function: temperature, top-k and top-p on logits, then a draw.

`processed_logprobs` returns the log-probabilities of the distribution tokens
are actually drawn from (after temperature, top-k, top-p). Those are the
per-token log-probs a rollout reports, and the distribution speculative
verification must reproduce exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to draw tokens. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1`` disable those filters. Hashable, so it can
    be a static argument of a jitted step.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_logprobs(logits: Float[Array, "... vocab"], params: SamplingParams) -> Float[Array, "... vocab"]:
    """log p of the sampling distribution; tokens outside its support get -inf.

    Greedy gives a one-hot distribution on the argmax (log-prob 0 there).
    Top-k keeps the k largest logits; top-p keeps the smallest prefix of
    tokens sorted by probability whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept). Both keep every token tied with the last
    one kept, so equal logits always get equal probability.
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        top = jnp.argmax(logits, axis=-1)
        return jnp.where(jax.nn.one_hot(top, logits.shape[-1], dtype=bool), 0.0, -jnp.inf)
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if params.top_p < 1.0:
        sorted_x = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        n_keep = jnp.sum(before < params.top_p, axis=-1, keepdims=True)  # >= 1: before[0] == 0
        cutoff = jnp.take_along_axis(sorted_x, n_keep - 1, axis=-1)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample(
    key: jax.Array, logits: Float[Array, "batch vocab"], params: SamplingParams
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Draws one token per row; returns (tokens, their log-probs under the processed distribution)."""
    logp = processed_logprobs(logits, params)
    if params.greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        tok = jax.random.categorical(key, logp, axis=-1)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[..., None], axis=-1)[..., 0]
