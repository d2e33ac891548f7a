"""Speculative decoding: accept a drafted token tree against the target, losslessly.

A draft tree per row has ``N`` nodes below a root. The root is the row's last
emitted token (not yet in the cache); node ``i`` holds ``tokens[i]`` and its
parent ``parents[i]`` (``-1`` = root). Siblings hold distinct tokens. The
target runs once over ``[root, nodes...]`` under the tree mask, which yields
the target's processed distribution ``p_u`` at every node ``u``.

Acceptance (target-only tree walk). Every node ``u`` draws one independent
sample ``s_u ~ p_u``. Starting at the root, the walk moves to the child whose
token equals ``s_u``; when no child matches, ``s_u`` itself is emitted and the
walk stops. Every emitted token is therefore an independent draw from the
target's distribution given everything before it, whatever the drafter
proposed: the output distribution is exactly the target's (lossless). For a
deterministic (top-k) draft this is the best possible acceptance for the
children drafted: child ``c`` of ``u`` is accepted with probability ``p_u(c)``.
Greedy decoding is the special case where ``p_u`` is one-hot on the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int


@struct.dataclass
class Acceptance:
    """Result of verifying one draft tree per row.

    ``tokens[b, :count[b]]`` are the emitted tokens: the accepted path, then one
    token sampled by the target (correction or bonus). ``path[b, :count[b]-1]``
    are the accepted node indices (into the draft), in order;
    ``logprobs`` are the processed target log-probs of the emitted tokens.
    """

    tokens: Int[Array, "batch n1"]
    logprobs: Float[Array, "batch n1"]
    path: Int[Array, "batch n"]
    count: Int[Array, " batch"]


def tree_mask(parents: Int[Array, "batch n"]) -> Bool[Array, "batch n1 n1"]:
    """Attention mask over ``[root, nodes...]``: each position sees itself and its ancestors.

    The ancestor relation is the transitive closure of "is the parent of",
    computed by repeated squaring (log2 of the tree size steps, no loop on device).
    """
    b, n = parents.shape
    par = jnp.concatenate([jnp.full((b, 1), -1, parents.dtype), jnp.where(parents >= -1, parents + 1, -1)], axis=1)
    eye = jnp.broadcast_to(jnp.eye(n + 1, dtype=bool), (b, n + 1, n + 1))
    mask = eye | (par[:, :, None] == jnp.arange(n + 1)[None, None, :])  # self or parent (root's par is -1)
    for _ in range(max(n, 1).bit_length()):  # paths of length up to 2^k after k squarings
        m = mask.astype(jnp.float32)
        mask = mask | (jnp.einsum("bij,bjk->bik", m, m) > 0)
    return mask


def node_depths(parents: Int[Array, "batch n"], mask: Bool[Array, "batch n1 n1"] | None = None) -> Int[Array, "batch n"]:
    """Depth of each node (children of the root have depth 1); ``mask`` = `tree_mask` if already computed."""
    mask = tree_mask(parents) if mask is None else mask
    return mask[:, 1:, :].sum(-1).astype(jnp.int32) - 1


def accept(
    key: jax.Array,
    logp: Float[Array, "batch n1 vocab"],
    tokens: Int[Array, "batch n"],
    parents: Int[Array, "batch n"],
) -> Acceptance:
    """Walks each row's draft tree against the target's processed log-probs at ``[root, nodes...]``.

    ``logp`` is `processed_logprobs` of the target's logits (greedy makes it
    one-hot, so the draw below is the argmax). Lossless: the emitted tokens are
    distributed exactly as target sampling with the same processing (see the
    module docstring). Padding nodes are marked ``parents == -2``; they are
    never accepted.
    """
    b, n1, v = logp.shape
    n = n1 - 1
    samples = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)  # one draw per node
    parent_pos = parents + 1  # position of the parent in [root, nodes...]
    valid = parents >= -1
    ok = valid & (tokens == jnp.take_along_axis(samples, jnp.clip(parent_pos, 0), axis=1))
    mask = tree_mask(parents)
    # a node is accepted when it and every ancestor below the root matched its parent's draw
    accepted = ~(mask[:, 1:, 1:] & ~ok[:, None, :]).any(-1)  # [B, N]
    depth = node_depths(parents, mask)
    n_acc = accepted.sum(-1).astype(jnp.int32)  # accepted nodes form one root path
    # order the accepted nodes by depth: slot d-1 holds the accepted node at depth d
    slot = jnp.where(accepted, depth - 1, n)  # unaccepted → dropped
    path = jnp.zeros((b, n + 1), jnp.int32).at[jnp.arange(b)[:, None], slot].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    )[:, :n]
    last_pos = jnp.where(n_acc > 0, jnp.take_along_axis(path, jnp.clip(n_acc - 1, 0)[:, None], 1)[:, 0] + 1, 0)
    final_tok = jnp.take_along_axis(samples, last_pos[:, None], axis=1)[:, 0]
    path_tok = jnp.take_along_axis(tokens, path, axis=1)
    idx = jnp.arange(n + 1)[None]
    out_tok = jnp.concatenate([path_tok, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out_tok = jnp.where(idx == n_acc[:, None], final_tok[:, None], out_tok)
    out_tok = jnp.where(idx <= n_acc[:, None], out_tok, 0)
    # log-prob of emitted token j is taken at its parent's position: root for j = 0, else path[j-1] + 1
    src = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path + 1], axis=1)
    lp_rows = jnp.take_along_axis(logp, src[:, :, None], axis=1)  # [B, N+1, V]
    out_lp = jnp.take_along_axis(lp_rows, out_tok[:, :, None], axis=2)[..., 0]
    out_lp = jnp.where(idx <= n_acc[:, None], out_lp, 0.0)
    return Acceptance(tokens=out_tok, logprobs=out_lp, path=path, count=n_acc + 1)


# ----------------------------------------------------------------------------- strategies
@dataclasses.dataclass(frozen=True)
class Strategy:
    """How to draft one tree per row: a static argument of the draft-verify program.

    ``drafter``: "eagle" (the learned drafter; ``top_k == 1`` is a chain,
    ``top_k > 1`` an EAGLE-2 dynamic tree) or "ngram" (model-free suffix
    matching over the row's own tokens and its sibling responses; always a
    chain). ``depth`` is the number of drafted levels; ``num_verify`` the nodes
    the target verifies (0: all ``depth * top_k`` candidates), chosen by
    cumulative draft log-probability.
    """

    drafter: str = "eagle"
    depth: int = 4
    top_k: int = 1
    num_verify: int = 0
    ngram_max: int = 3

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"strategy drafter {self.drafter!r} is unknown; choose one of {sorted(DRAFTERS)}")
        if self.depth < 1 or self.top_k < 1 or self.num_verify < 0 or self.ngram_max < 1:
            raise ValueError(
                f"strategy {self}: depth, top_k and ngram_max must be >= 1 and num_verify >= 0 (0 = all drafted nodes)"
            )
        if self.drafter == "ngram" and self.top_k != 1:
            raise ValueError(f"the ngram drafter proposes a chain: top_k must be 1, got {self.top_k}")
        if self.num_verify > self.depth * self.top_k:
            raise ValueError(
                f"num_verify={self.num_verify} exceeds the {self.depth * self.top_k} nodes that depth={self.depth} "
                f"x top_k={self.top_k} drafts"
            )

    @property
    def num_nodes(self) -> int:
        """Nodes in the verified tree (excluding the root)."""
        return self.num_verify or self.depth * self.top_k

    @property
    def max_emitted(self) -> int:
        """Most tokens one round can emit: an accepted root path, then one target token."""
        return min(self.depth, self.num_nodes) + 1

    @property
    def name(self) -> str:
        if self.drafter == "ngram":
            return f"ngram-d{self.depth}"
        return f"eagle-d{self.depth}-k{self.top_k}-n{self.num_nodes}"

    @classmethod
    def parse(cls, spec: "str | Strategy") -> "Strategy":
        """Reads ``"eagle:depth=4,top_k=2,num_verify=6"`` or ``"ngram:depth=4"`` (fields of `Strategy`)."""
        if isinstance(spec, Strategy):
            return spec
        name, _, rest = str(spec).partition(":")
        kw = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in ("depth", "top_k", "num_verify", "ngram_max"):
                raise ValueError(
                    f"bad strategy item {item!r} in {spec!r}; write e.g. 'eagle:depth=4,top_k=2,num_verify=6' "
                    "(keys: depth, top_k, num_verify, ngram_max)"
                )
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"strategy {spec!r}: {key} must be an int, got {value!r}") from None
        return cls(drafter=name.strip(), **kw)


@struct.dataclass
class DraftTree:
    """One draft tree per row: ``tokens[b, i]`` below ``parents[b, i]`` (-1 root, -2 padding).

    Parents precede their children; siblings hold distinct tokens.
    """

    tokens: Int[Array, "batch n"]
    parents: Int[Array, "batch n"]


def select_tree(
    tokens: Int[Array, "batch m"],
    parents: Int[Array, "batch m"],
    scores: Float[Array, "batch m"],
    num: int,
) -> DraftTree:
    """The ``num`` best-scoring candidate nodes that form a tree, compacted in candidate order.

    Candidates must list parents before children, and a child must not score
    above its parent (cumulative log-probs); a node whose parent is not
    selected is dropped too, so the result is always a tree rooted at -1.
    """
    b, m = tokens.shape
    valid = parents >= -1
    ranked = jnp.where(valid, scores, -jnp.inf)
    if num < m:
        kth = jax.lax.top_k(ranked, num)[0][:, -1:]
        keep = valid & (ranked >= kth)
        # ties at the threshold could keep more than num: keep the earliest ones
        keep = keep & (jnp.cumsum(keep, axis=1) <= num)
    else:
        keep = valid
    for _ in range(m):  # closure: a node stays only if its parent does (static, tiny)
        parent_kept = jnp.take_along_axis(keep, jnp.clip(parents, 0), axis=1)
        keep = keep & ((parents == -1) | parent_kept)
    new_index = jnp.cumsum(keep, axis=1) - 1  # position of each kept candidate
    new_parent = jnp.where(parents >= 0, jnp.take_along_axis(new_index, jnp.clip(parents, 0), axis=1), -1)
    dest = jnp.where(keep, new_index, num)  # dropped → out of range
    rows = jnp.arange(b)[:, None]
    out_tok = jnp.zeros((b, num), jnp.int32).at[rows, dest].set(tokens, mode="drop")
    out_par = jnp.full((b, num), -2, jnp.int32).at[rows, dest].set(new_parent.astype(jnp.int32), mode="drop")
    return DraftTree(tokens=out_tok, parents=out_par)


def eagle_draft(
    drafter,
    target,
    cache,
    pend_tokens: Int[Array, "batch p"],
    pend_features: Float[Array, "batch p feature"],
    pend_count: Int[Array, " batch"],
    strategy: Strategy,
) -> tuple[DraftTree, object]:
    """Drafts a tree per row with the EAGLE drafter; returns (tree, drafter cache).

    First the row's pending positions (target features of tokens the target has
    committed since the last call, each paired with the token that followed)
    are committed to the drafter's cache: that advances the drafter over
    accepted tokens without a re-prefill. The last pending position's output
    predicts the first drafted level. Each further level runs the drafter over
    the tree so far under the tree mask (nothing of it is committed), feeding
    each node its parent's predicted hidden state as feature (EAGLE-1; with
    several feature layers it fills every layer's slot), and keeps the
    ``top_k`` children of best cumulative log-probability (EAGLE-2).
    """
    b, p = pend_tokens.shape
    k, depth = strategy.top_k, strategy.depth
    out = drafter(target, pend_tokens, pend_features, cache=cache, advance=pend_count)
    cache = out.cache
    last = jnp.clip(pend_count - 1, 0, p - 1)[:, None, None]
    h_root = jnp.take_along_axis(out.hidden, last, axis=1)[:, 0]  # [B, H]
    lp_root = jax.nn.log_softmax(jnp.take_along_axis(out.logits, last, axis=1)[:, 0], axis=-1)
    score, tok = jax.lax.top_k(lp_root, k)  # [B, k]
    toks, pars, scores = [tok.astype(jnp.int32)], [jnp.full((b, k), -1, jnp.int32)], [score]
    reps = pend_features.shape[-1] // h_root.shape[-1]  # >1 with several feature layers (EAGLE-3 style)

    def as_feature(h):  # a drafted node's feature: its parent's predicted final hidden state, per layer slot
        return h if reps == 1 else jnp.concatenate([h] * reps, axis=-1)

    feats = [as_feature(jnp.broadcast_to(h_root[:, None], (b, k, h_root.shape[-1])))]
    base = cache.lengths  # drafter position of depth-1 nodes
    for d in range(2, depth + 1):
        all_tok = jnp.concatenate(toks, axis=1)
        all_par = jnp.concatenate(pars, axis=1)
        all_feat = jnp.concatenate(feats, axis=1)
        n = all_tok.shape[1]
        depth_of = jnp.repeat(jnp.arange(d - 1, dtype=jnp.int32), k)[None]
        o = drafter(
            target,
            all_tok,
            all_feat.astype(pend_features.dtype),
            positions=base[:, None] + depth_of,
            mask=tree_mask(all_par)[:, 1:, 1:],
            cache=cache,
            advance=0,
        )
        cache = o.cache  # same committed length; keeping the written pages avoids copying the pool
        front = slice(n - k, n)  # the previous level's nodes
        lp = jax.nn.log_softmax(o.logits[:, front], axis=-1)  # [B, k, V]
        cand_score, cand_tok = jax.lax.top_k(lp, k)  # [B, k, k]
        cand_score = cand_score + scores[-1][:, :, None]
        best, flat = jax.lax.top_k(cand_score.reshape(b, k * k), k)
        parent_local = flat // k
        toks.append(jnp.take_along_axis(cand_tok.reshape(b, k * k), flat, axis=1).astype(jnp.int32))
        pars.append((n - k + parent_local).astype(jnp.int32))
        scores.append(best)
        feats.append(as_feature(jnp.take_along_axis(o.hidden[:, front], parent_local[:, :, None], axis=1)))
    tree = select_tree(
        jnp.concatenate(toks, 1), jnp.concatenate(pars, 1), jnp.concatenate(scores, 1), strategy.num_nodes
    )
    return tree, cache


def ngram_draft(
    history: Int[Array, "batch seq"],
    length: Int[Array, " batch"],
    sibling_history: Int[Array, "batch group seq"],
    sibling_length: Int[Array, "batch group"],
    strategy: Strategy,
) -> DraftTree:
    """Model-free chain: the tokens that followed the latest earlier occurrence of the row's suffix.

    ``history[b, :length[b]]`` is the row's context (prompt, generated tokens,
    last emitted token). The query is its last ``n`` tokens, for the largest
    ``n <= ngram_max`` that occurs earlier in the row itself or anywhere in a
    sibling response (same prompt group); the ``depth`` tokens after the match
    are proposed. Rows without any match get an empty (all-padding) tree.
    """
    b, s = history.shape
    depth, nmax = strategy.depth, strategy.ngram_max
    cands = jnp.concatenate([history[:, None], sibling_history], axis=1)  # [B, C, S]
    cand_len = jnp.concatenate([length[:, None], sibling_length], axis=1)  # [B, C]
    pos = jnp.arange(s)[None, None]
    query_end = length - 1
    # a match ends at j and needs a continuation (j + 1 < len); in the row itself that also
    # keeps it before the query, which ends at len - 1
    ok_end = pos < (cand_len - 1)[:, :, None]
    match = ok_end
    best_n = jnp.zeros((b, cands.shape[1], s), jnp.int32)
    for i in range(nmax):  # match[.., j] holds while the last i+1 tokens agree
        q = jnp.take_along_axis(history, jnp.clip(query_end - i, 0)[:, None], axis=1)[:, 0]
        shifted = jnp.roll(cands, i, axis=2)  # shifted[..., j] = cands[..., j - i]
        match = match & (pos >= i) & (query_end >= i)[:, None, None] & (shifted == q[:, None, None])
        best_n = jnp.where(match, i + 1, best_n)
    # prefer longer matches, then later positions (the latest context), then the row itself
    key = best_n * (2 * s) + jnp.where(best_n > 0, pos, 0)
    flat = key.reshape(b, -1)
    arg = jnp.argmax(flat, axis=1)
    found = jnp.take_along_axis(flat, arg[:, None], axis=1)[:, 0] > 0
    c, j = arg // s, arg % s
    src = j[:, None] + 1 + jnp.arange(depth)[None]  # [B, depth]
    cand_row = jnp.take_along_axis(cands, c[:, None, None], axis=1)[:, 0]  # [B, S]
    toks = jnp.take_along_axis(cand_row, jnp.clip(src, 0, s - 1), axis=1)
    avail = found[:, None] & (src < jnp.take_along_axis(cand_len, c[:, None], axis=1))
    avail = jnp.cumprod(avail, axis=1).astype(bool)
    parents = jnp.where(avail, jnp.arange(depth)[None] - 1, -2).astype(jnp.int32)
    return DraftTree(tokens=jnp.where(avail, toks, 0).astype(jnp.int32), parents=parents)


DRAFTERS = ("eagle", "ngram")


@struct.dataclass
class Verified:
    """What one verification returns besides the cache.

    ``acceptance`` as `accept` returns it; ``features[b, :count[b]]`` are the
    target features of the committed tokens (the root and the accepted path),
    each the drafter's pending input for the token emitted after it.
    """

    acceptance: Acceptance
    features: Float[Array, "batch n1 feature"]


def verify(
    target,
    cache,
    root: Int[Array, " batch"],
    tree: DraftTree,
    key: jax.Array,
    params,
    feature_layers: tuple[int, ...],
    active: Bool[Array, " batch"],
) -> tuple[Verified, object]:
    """One target forward over ``[root, tree...]`` under the tree mask, then the lossless walk.

    The root (the row's last emitted token) and the accepted path are committed
    to the cache in order; rejected entries stay scratch. Inactive rows commit
    nothing. ``params`` (`SamplingParams`) are applied to the target's logits
    before the walk, so emitted tokens and log-probs are exactly those of plain
    sampling with the same params.
    """
    from tltjax.rollout.sampling import processed_logprobs

    ids = jnp.concatenate([root[:, None], tree.tokens], axis=1)
    mask = tree_mask(tree.parents)
    depth = jnp.concatenate([jnp.zeros_like(root)[:, None], node_depths(tree.parents, mask)], axis=1)
    out = target(
        ids,
        positions=cache.lengths[:, None] + depth,
        mask=mask,
        cache=cache,
        advance=0,
        hidden_layers=feature_layers,
    )
    logp = processed_logprobs(out.logits, params)
    acc = accept(key, logp, tree.tokens, tree.parents)
    keep_idx = jnp.concatenate([jnp.zeros_like(acc.path[:, :1]), acc.path + 1], axis=1)
    count = jnp.where(active, acc.count, 0)
    cache = out.cache.keep(keep_idx, count)
    feats = jnp.concatenate(out.hidden_states, axis=-1)
    feats = jnp.take_along_axis(feats, keep_idx[:, :, None], axis=1)
    return Verified(acceptance=acc.replace(count=count), features=feats), cache
