"""The device programs of the rollout engine: prefill, plain decode chunk, speculative chunk.

Each is a pure function of pytrees. The engine (`tltjax.rollout.engine`) lowers
and compiles one per (batch bucket, strategy) at warm-up and only calls the
compiled executables afterwards, so nothing is ever traced again.

Device state lives in `EngineState`: the page pools of the target's and the
drafter's paged caches, and `RowState`, per-slot arrays of ``slots + 1`` rows
(the last slot is a permanently empty row that padding rows of a bucket read).
A program gathers its bucket's rows by slot index (``idx``), runs several
steps, and scatters them back; padding rows' writes are dropped. Page tables
come from the host allocator each call; pages never move.

Row invariants (``L = length``): the target cache holds tokens ``x_0..x_{L-1}``;
``last_token`` is ``x_L`` (emitted, not yet run through the target);
``history[:L+1]`` is ``x_0..x_L``. With a drafter, its cache holds
``draft_length`` positions and ``pend_*`` the positions to commit next: the
target's features ``f_t`` paired with the token ``x_{t+1}`` emitted after them,
for ``t`` from ``draft_length`` to ``L - 1``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.rollout.paged_cache import PagedKVCache
from tltjax.rollout.sampling import SamplingParams, sample
from tltjax.rollout.speculative import Strategy, eagle_draft, ngram_draft, verify


@struct.dataclass
class RowState:
    """Per-slot decoding state; leading axis ``slots + 1`` (see the module docstring)."""

    last_token: Int[Array, " slots"]
    length: Int[Array, " slots"]
    draft_length: Int[Array, " slots"]
    pend_tokens: Int[Array, "slots pend"]
    pend_features: Float[Array, "slots pend feature"]
    pend_count: Int[Array, " slots"]
    history: Int[Array, "slots seq"]
    generated: Int[Array, " slots"]
    budget: Int[Array, " slots"]
    done: Bool[Array, " slots"]

    @classmethod
    def init(cls, slots: int, pend: int, feature: int, seq: int, dtype) -> "RowState":
        n = slots + 1
        z = lambda: jnp.zeros((n,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
        return cls(
            last_token=z(),
            length=z(),
            draft_length=z(),
            pend_tokens=jnp.zeros((n, pend), jnp.int32),
            pend_features=jnp.zeros((n, pend, feature), dtype),
            pend_count=z(),
            history=jnp.zeros((n, seq), jnp.int32),
            generated=z(),
            budget=z(),
            done=jnp.ones((n,), bool),
        )


@struct.dataclass
class EngineState:
    """Everything the programs donate and return: page pools and row state."""

    k_pages: Float[Array, "layers kv_heads pages page dim"]
    v_pages: Float[Array, "layers kv_heads pages page dim"]
    dk_pages: Float[Array, "dlayers dkv_heads pages page ddim"]
    dv_pages: Float[Array, "dlayers dkv_heads pages page ddim"]
    rows: RowState


@struct.dataclass
class StepOutput:
    """Tokens a call emitted per row: ``tokens[b, s, :count[b, s]]`` at step (or round) ``s``.

    ``features[b, s, j]`` is the target feature of the position just before
    emitted token ``j`` (empty when not requested).
    """

    tokens: Int[Array, "batch steps width"]
    logprobs: Float[Array, "batch steps width"]
    count: Int[Array, "batch steps"]
    features: Float[Array, "batch steps width feature"]
    done: Bool[Array, " batch"]


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """Static description shared by all programs of one engine (hashable)."""

    target_graph: object
    drafter_graph: object | None
    feature_layers: tuple[int, ...]
    sampling: SamplingParams
    impl: str
    with_features: bool

    @property
    def has_drafter(self) -> bool:
        return self.drafter_graph is not None


def _gather(rows: RowState, idx) -> RowState:
    return jax.tree.map(lambda a: a[idx], rows)


def _scatter(rows: RowState, idx, new: RowState, valid) -> RowState:
    dest = jnp.where(valid, idx, rows.length.shape[0])  # padding rows → dropped
    return jax.tree.map(lambda a, b: a.at[dest].set(b, mode="drop"), rows, new)


def _caches(spec: ProgramSpec, state: EngineState, table, rows: RowState):
    tcache = PagedKVCache(state.k_pages, state.v_pages, table, rows.length, impl=spec.impl)
    dcache = PagedKVCache(state.dk_pages, state.dv_pages, table, rows.draft_length, impl=spec.impl)
    return tcache, dcache


def _features(out) -> Float[Array, "batch seq feature"]:
    return jnp.concatenate(out.hidden_states, axis=-1)


def _pad_to(x, width: int, axis: int = 1):
    pad = width - x.shape[axis]
    if pad <= 0:
        return jax.lax.slice_in_dim(x, 0, width, axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _write_history(history, start, tokens, count):
    """history[b, start[b] + j] = tokens[b, j] for j < count[b]."""
    j = jnp.arange(tokens.shape[1])[None]
    pos = jnp.where(j < count[:, None], start[:, None] + j, history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], pos].set(tokens, mode="drop")


def _finish(rows: RowState, tokens, count, stops) -> RowState:
    """Counts emitted tokens and marks rows that hit a stop token or their budget."""
    j = jnp.arange(tokens.shape[1])[None]
    hit = (jnp.isin(tokens, stops) & (j < count[:, None])).any(axis=1)
    generated = rows.generated + count
    done = rows.done | ((count > 0) & (hit | (generated >= rows.budget)))
    return rows.replace(generated=generated, done=done)


def prefill(spec: ProgramSpec, tparams, dparams, state: EngineState, idx, table, ids, lens, budget, stops, key):
    """Runs prompts (or resumed contexts) ``ids[b, :lens[b]]`` and samples each row's first new token.

    Rows with ``lens == 0`` are padding. Returns (state, `StepOutput` with one step).
    """
    valid = lens > 0
    target = nnx.merge(spec.target_graph, tparams)
    rows = _gather(state.rows, idx)
    zero = jnp.zeros_like(lens)
    tcache, dcache = _caches(spec, state, table, rows.replace(length=zero, draft_length=zero))
    out = target(ids, cache=tcache, advance=lens, hidden_layers=spec.feature_layers)
    feats = _features(out)
    last = jnp.clip(lens - 1, 0)
    logits = jnp.take_along_axis(out.logits, last[:, None, None], axis=1)[:, 0]
    tok, lp = sample(key, logits, spec.sampling)
    f_last = jnp.take_along_axis(feats, last[:, None, None], axis=1)[:, 0]
    s = rows.history.shape[1]
    history = _pad_to(ids, s).at[jnp.arange(ids.shape[0]), lens].set(tok, mode="drop")
    new = rows.replace(
        last_token=tok,
        length=out.cache.lengths,
        history=history,
        generated=zero,
        budget=budget,
        done=~valid,
        pend_tokens=jnp.zeros_like(rows.pend_tokens).at[:, 0].set(tok),
        pend_features=jnp.zeros_like(rows.pend_features).at[:, 0].set(f_last.astype(rows.pend_features.dtype)),
        pend_count=valid.astype(jnp.int32),
        draft_length=zero,
    )
    if spec.has_drafter:
        drafter = nnx.merge(spec.drafter_graph, dparams)
        nxt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
        nxt = nxt.at[jnp.arange(ids.shape[0]), last].set(tok)
        dout = drafter(target, nxt, feats, cache=dcache, advance=last, return_logits=False)
        dcache = dout.cache
        new = new.replace(draft_length=dout.cache.lengths)
    one = valid.astype(jnp.int32)
    new = _finish(new, tok[:, None], one, stops)
    state = state.replace(
        k_pages=out.cache.k_pages, v_pages=out.cache.v_pages, dk_pages=dcache.k_pages, dv_pages=dcache.v_pages,
        rows=_scatter(state.rows, idx, new, valid),
    )
    feat_out = f_last[:, None, None] if spec.with_features else jnp.zeros((ids.shape[0], 1, 1, 0), f_last.dtype)
    emitted = StepOutput(
        tokens=tok[:, None, None], logprobs=lp[:, None, None], count=one[:, None], features=feat_out, done=new.done
    )
    # prompt features come back whole: the host needs them for drafter training
    prompt_feats = feats if spec.with_features else jnp.zeros((ids.shape[0], 0, feats.shape[-1]), feats.dtype)
    return state, emitted, prompt_feats


def _commit_pending(spec, target, dparams, dcache, rows: RowState, active):
    """Advances the drafter over the pending positions (no logits needed)."""
    drafter = nnx.merge(spec.drafter_graph, dparams)
    out = drafter(
        target, rows.pend_tokens, rows.pend_features, cache=dcache,
        advance=jnp.where(active, rows.pend_count, 0), return_logits=False,
    )
    return out.cache


def decode_chunk(spec: ProgramSpec, steps: int, tparams, dparams, state: EngineState, idx, table, stops, key):
    """``steps`` plain decoding steps for a bucket of rows, on device. Returns (state, `StepOutput`)."""
    valid = idx < state.rows.length.shape[0] - 1
    target = nnx.merge(spec.target_graph, tparams)
    rows = _gather(state.rows, idx)
    tcache, dcache = _caches(spec, state, table, rows)
    if spec.has_drafter:
        dcache = _commit_pending(spec, target, dparams, dcache, rows, ~rows.done)

    def step(carry, key):
        tcache, rows = carry
        active = ~rows.done
        out = target(rows.last_token[:, None], cache=tcache, advance=active.astype(jnp.int32),
                     hidden_layers=spec.feature_layers)
        tok, lp = sample(key, out.logits[:, 0], spec.sampling)
        count = active.astype(jnp.int32)
        history = _write_history(rows.history, tcache.lengths + 1, tok[:, None], count)
        rows = rows.replace(last_token=jnp.where(active, tok, rows.last_token), history=history)
        rows = _finish(rows, tok[:, None], count, stops)
        return (out.cache, rows), (tok, lp, count, _features(out)[:, 0])

    (tcache, rows), (tok, lp, count, feat) = jax.lax.scan(step, (tcache, rows), jax.random.split(key, steps))
    tok, lp, count, feat = tok.T, lp.T, count.T, feat.transpose(1, 0, 2)  # [B, steps, ...]
    p = rows.pend_tokens.shape[1]
    rows = rows.replace(length=tcache.lengths, draft_length=dcache.lengths)
    if spec.has_drafter:
        rows = rows.replace(
            pend_tokens=_pad_to(tok, p),
            pend_features=_pad_to(feat.astype(rows.pend_features.dtype), p),
            pend_count=count.sum(1),
        )
    state = state.replace(
        k_pages=tcache.k_pages, v_pages=tcache.v_pages, dk_pages=dcache.k_pages, dv_pages=dcache.v_pages,
        rows=_scatter(state.rows, idx, rows, valid),
    )
    out = StepOutput(
        tokens=tok[:, :, None],
        logprobs=lp[:, :, None],
        count=count,
        features=feat[:, :, None] if spec.with_features else jnp.zeros(tok.shape + (1, 0), feat.dtype),
        done=rows.done,
    )
    return state, out


def spec_chunk(
    spec: ProgramSpec, strategy: Strategy, rounds: int, tparams, dparams, state: EngineState, idx, table, group,
    stops, key,
):
    """``rounds`` draft → verify → accept rounds for a bucket of rows, on device.

    ``group[b]`` lists slots of row ``b``'s sibling responses (padding: the
    empty slot) for the n-gram drafter. Lossless: every emitted token is
    distributed exactly as in `decode_chunk` (see `tltjax.rollout.speculative`).
    """
    n_slots = state.rows.length.shape[0] - 1
    valid = idx < n_slots
    target = nnx.merge(spec.target_graph, tparams)
    rows = _gather(state.rows, idx)
    tcache, dcache = _caches(spec, state, table, rows)
    width = strategy.max_emitted
    p = rows.pend_tokens.shape[1]
    if strategy.drafter == "ngram":
        sib_hist = state.rows.history[group]  # chunk-start snapshot of the siblings
        sib_len = jnp.where(group < n_slots, state.rows.length[group] + 1, 0)
    if strategy.drafter == "eagle" and not spec.has_drafter:
        raise ValueError("an eagle strategy needs an engine with a drafter")

    def round_(carry, key):
        tcache, dcache, rows = carry
        active = ~rows.done
        if strategy.drafter == "eagle":
            drafter = nnx.merge(spec.drafter_graph, dparams)
            tree, dcache = eagle_draft(
                drafter, target, dcache, rows.pend_tokens, rows.pend_features,
                jnp.where(active, rows.pend_count, 0), strategy,
            )
        else:
            if spec.has_drafter:
                dcache = _commit_pending(spec, target, dparams, dcache, rows, active)
            tree = ngram_draft(rows.history, tcache.lengths + 1, sib_hist, sib_len, strategy)
        start = tcache.lengths + 1
        ver, tcache = verify(target, tcache, rows.last_token, tree, key, spec.sampling, spec.feature_layers, active)
        acc = ver.acceptance
        tok, lp = acc.tokens[:, :width], acc.logprobs[:, :width]
        count = acc.count  # 0 for inactive rows
        feat = ver.features[:, :width]
        last = jnp.take_along_axis(tok, jnp.clip(count - 1, 0)[:, None], axis=1)[:, 0]
        rows = rows.replace(
            last_token=jnp.where(count > 0, last, rows.last_token),
            history=_write_history(rows.history, start, tok, count),
            pend_tokens=_pad_to(tok, p),
            pend_features=_pad_to(feat.astype(rows.pend_features.dtype), p),
            pend_count=count,
        )
        rows = _finish(rows, tok, count, stops)
        return (tcache, dcache, rows), (tok, lp, count, feat)

    (tcache, dcache, rows), (tok, lp, count, feat) = jax.lax.scan(
        round_, (tcache, dcache, rows), jax.random.split(key, rounds)
    )
    rows = rows.replace(length=tcache.lengths, draft_length=dcache.lengths)
    state = state.replace(
        k_pages=tcache.k_pages, v_pages=tcache.v_pages, dk_pages=dcache.k_pages, dv_pages=dcache.v_pages,
        rows=_scatter(state.rows, idx, rows, valid),
    )
    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  [rounds, B, ...] → [B, rounds, ...]
    out = StepOutput(
        tokens=sw(tok),
        logprobs=sw(lp),
        count=sw(count),
        features=sw(feat) if spec.with_features else jnp.zeros(sw(tok).shape + (0,), feat.dtype),
        done=rows.done,
    )
    return state, out
