"""Plain batched generation with a contiguous cache: the reference decoder.

One prefill call and one decode call (a `lax.while_loop` over the new tokens
that ends when every row has stopped, no host round-trips). Rows keep decoding
padding after they stop while others run; it is the
simple baseline that the paged, bucketed engine is measured against and the
oracle its outputs are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tltjax.models.kv_cache import ContiguousKVCache
from tltjax.rollout.sampling import SamplingParams, sample


@dataclasses.dataclass
class Generation:
    """One generated sequence: new tokens, their log-probs, and why it stopped (``stop`` or ``length``)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts to one length; returns (ids [B, P], lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lens = np.array([len(p) for p in prompts], np.int32)
    ids = np.full((len(prompts), int(lens.max())), pad_id, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, lens


@functools.partial(jax.jit, static_argnums=(0,))
def prefill(graphdef, state, ids, lens, cache):
    """Runs the prompts; returns (logits of each row's last prompt token, cache with prompts committed)."""
    model = nnx.merge(graphdef, state)
    out = model(ids, cache=cache, advance=lens)
    last = jnp.take_along_axis(out.logits, (lens - 1)[:, None, None], axis=1)[:, 0]
    return last, out.cache


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def decode(graphdef, state, cache, logits, key, steps: int, params: SamplingParams, stop_ids: tuple[int, ...]):
    """Samples ``steps`` tokens per row on device; returns (tokens, logprobs, done-before-step mask)."""
    model = nnx.merge(graphdef, state)
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    b = logits.shape[0]

    keys = jax.random.split(key, steps)

    def running(carry):
        i, done = carry[0], carry[3]
        return (i < steps) & ~jnp.all(done)

    def step(carry):
        i, cache, logits, done, toks, lps, dones = carry
        tok, lp = sample(keys[i], logits, params)
        out = model(tok[:, None], cache=cache)
        new_done = done | jnp.isin(tok, stops)
        return i + 1, out.cache, out.logits[:, 0], new_done, toks.at[i].set(tok), lps.at[i].set(lp), dones.at[i].set(done)

    # Stops early once every row is done; steps never run read as done (their tokens are never returned).
    init = (jnp.int32(0), cache, logits, jnp.zeros((b,), bool), jnp.zeros((steps, b), jnp.int32),
            jnp.zeros((steps, b), jnp.float32), jnp.ones((steps, b), bool))
    *_, toks, lps, done = jax.lax.while_loop(running, step, init)
    return toks.T, lps.T, done.T


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(temperature=0.0),
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    pad_id: int = 0,
) -> list[Generation]:
    """Generates up to ``max_new_tokens`` per prompt; a stop token is kept and ends its row."""
    ids, lens = pad_prompts(prompts, pad_id)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = model.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}); got ids in [{ids.min()}, {ids.max()}]")
    graphdef, state = nnx.split(model)
    cache = ContiguousKVCache.init(model.config, len(prompts), ids.shape[1] + max_new_tokens)
    logits, cache = prefill(graphdef, state, jnp.asarray(ids), jnp.asarray(lens), cache)
    toks, lps, done = decode(
        graphdef, state, cache, logits, jax.random.key(seed), max_new_tokens, params, tuple(int(s) for s in stop_ids)
    )
    toks, lps, done = np.asarray(toks), np.asarray(lps), np.asarray(done)
    out = []
    stop_set = set(int(s) for s in stop_ids)
    for r in range(len(prompts)):
        n = int((~done[r]).sum())
        t = toks[r, :n].tolist()
        reason = "stop" if t and t[-1] in stop_set else "length"
        out.append(Generation(tokens=t, logprobs=lps[r, :n].tolist(), finish_reason=reason))
    return out
