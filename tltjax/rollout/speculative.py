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
    """Attention mask over ``[root, nodes...]``: each position sees itself and its ancestors."""
    b, n = parents.shape
    par = jnp.concatenate([jnp.full((b, 1), -1, parents.dtype), parents + 1], axis=1)  # root at 0
    par = jnp.where(jnp.arange(n + 1)[None] == 0, -1, par)
    eye = jnp.broadcast_to(jnp.eye(n + 1, dtype=bool), (b, n + 1, n + 1))

    def step(mask, _):
        # ancestors(i) ∪= ancestors(parent(i))
        parent_rows = jnp.take_along_axis(mask, jnp.clip(par, 0)[:, :, None], axis=1)
        parent_rows = jnp.where((par >= 0)[:, :, None], parent_rows, False)
        return mask | parent_rows, None

    mask, _ = jax.lax.scan(step, eye, None, length=n)
    return mask


def node_depths(parents: Int[Array, "batch n"]) -> Int[Array, "batch n"]:
    """Depth of each node (children of the root have depth 1)."""
    mask = tree_mask(parents)
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

    def step(acc, _):
        parent_acc = jnp.take_along_axis(acc, jnp.clip(parent_pos, 0), axis=1)  # acc over [root, nodes]
        node_acc = ok & parent_acc
        return jnp.concatenate([jnp.ones((b, 1), bool), node_acc], axis=1), None

    acc0 = jnp.concatenate([jnp.ones((b, 1), bool), jnp.zeros((b, n), bool)], axis=1)
    acc, _ = jax.lax.scan(step, acc0, None, length=max(n, 1))
    accepted = acc[:, 1:]  # [B, N]
    depth = node_depths(parents)
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
