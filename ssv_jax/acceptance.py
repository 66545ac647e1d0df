"""Target-side acceptance of a verified draft tree (DESIGN.md, "Drafting and acceptance"). Model-independent.

`target_logits[b, i]` are the target's next-token logits after the root->node-i path, i.e. the distribution of
the token at depth(i)+1. Both rules walk down from the root; siblings are tried in node-index order.

Outputs (all static shapes, A = max_depth + 1):
  accept_idx  [B, A]  node ids of the accepted path, root first (accept_idx[:, 0] == 0), padded with -1;
  n_accepted  [B]     accepted *drafted* nodes (0..max_depth); the round emits n_accepted + 1 tokens;
  bonus_token [B]     the token sampled (or argmax) at the last accepted node.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssv_jax.tree import Tree


def _max_depth(tree: Tree, max_depth: int | None) -> int:
    N = tree.tokens.shape[1]
    md = N - 1 if max_depth is None else max_depth
    if not isinstance(md, int) or md < 0:
        raise ValueError(f"max_depth={max_depth!r} is invalid; accepted: an integer >= 0 (normally TreeSpec.depth)")
    return md


def _node_rows(x: jax.Array, node: jax.Array) -> jax.Array:
    """x [B, N, ...] at node [B] -> [B, ...]."""
    return jnp.take_along_axis(x, node.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def greedy_accept(tree: Tree, target_logits: jax.Array, max_depth: int | None = None):
    """Greedy acceptance: the longest root path whose every child token equals the target argmax at its parent;
    the bonus is the argmax at the last accepted node.

    Args: tree (N nodes), target_logits [B, N, V], max_depth (static; default N-1, pass TreeSpec.depth for an
    [B, depth+1] result). Returns (accept_idx [B, max_depth+1], n_accepted [B], bonus_token [B]).
    """
    md = _max_depth(tree, max_depth)
    B, N = tree.tokens.shape
    # The walk, for all nodes at once: node i is "good" when its token is the target argmax after its parent,
    # "chosen" when it is also its parent's first good child (node-index order), and accepted when it and all
    # its ancestors are chosen (depth <= md). One argmax over every node instead of one per level.
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    par = tree.parents
    good = (par >= 0) & (tree.tokens == jnp.take_along_axis(best, jnp.maximum(par, 0), axis=1))
    idx = jnp.arange(N)
    earlier_good_sibling = ((par[:, :, None] == par[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
                            & good[:, None, :])  # [B, i, j]
    chosen = (good & ~jnp.any(earlier_good_sibling, axis=-1)) | (par < 0)
    accepted = jnp.all(~tree.mask | chosen[:, None, :], axis=-1) & (tree.depth <= md)  # [B, N]
    at = accepted[:, None, :] & (tree.depth[:, None, :] == jnp.arange(md + 1)[None, :, None])  # [B, md+1, N]
    path = jnp.where(jnp.any(at, axis=-1), jnp.argmax(at, axis=-1), -1).astype(jnp.int32)
    n = (jnp.sum(accepted, axis=1) - 1).astype(jnp.int32)
    cur = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0]
    return path, n, bonus


def stochastic_accept(tree: Tree, target_logits: jax.Array, temperature, key: jax.Array,
                      max_depth: int | None = None):
    """Stochastic acceptance, lossless for deterministic (top-k) drafts.

    At the current node, p = softmax(logits / temperature). Its children x_1, x_2, ... (node-index order) are
    tried in turn: x_j is accepted with probability p(x_j) under the current residual p; on rejection p(x_j) is set
    to 0 and p renormalised. If a child is accepted the walk continues there with that node's fresh p; otherwise
    (or at a leaf, or at max_depth) the bonus is sampled from the residual. The uniform for x_j is compared with
    p(x_j) / (1 - sum of p over the earlier rejected siblings), which is the same rule, computed for all siblings
    at once. A token repeated among siblings has residual mass 0 on its second try.

    Args: tree, target_logits [B, N, V], temperature (> 0; scalar or [B]), key, max_depth (see `greedy_accept`).
    Returns (accept_idx [B, max_depth+1], n_accepted [B], bonus_token [B]).
    """
    md = _max_depth(tree, max_depth)
    B, N = tree.tokens.shape
    V = target_logits.shape[-1]
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32).reshape(-1), (B,))
    earlier = jnp.tril(jnp.ones((N, N), bool), -1)  # earlier[c, c'] = c' < c
    same_tok = tree.tokens[:, :, None] == tree.tokens[:, None, :]  # [B, N, N]
    path = jnp.full((B, md + 1), -1, jnp.int32).at[:, 0].set(0)
    cur = jnp.zeros((B,), jnp.int32)
    done = jnp.zeros((B,), bool)
    n = jnp.zeros((B,), jnp.int32)
    bonus = jnp.zeros((B,), jnp.int32)
    for level in range(md + 1):
        k_u, k_b = jax.random.split(jax.random.fold_in(key, level))
        p = jax.nn.softmax(_node_rows(target_logits, cur).astype(jnp.float32) / temp[:, None], axis=-1)  # [B, V]
        if level < md:
            child = tree.parents == cur[:, None]  # [B, N]
        else:
            child = jnp.zeros((B, N), bool)
        # a sibling whose token already appeared among earlier siblings has zero residual mass
        dup = jnp.any(same_tok & earlier[None] & child[:, None, :], axis=-1)
        eff = jnp.where(child & ~dup, jnp.take_along_axis(p, jnp.clip(tree.tokens, 0, V - 1), axis=1), 0.0)
        prefix = jnp.einsum("bm,nm->bn", eff, earlier.astype(jnp.float32))  # mass rejected before c
        ratio = eff / jnp.maximum(1.0 - prefix, 1e-30)
        u = jax.random.uniform(k_u, (B, N))
        acc = child & (u < ratio)
        found = jnp.any(acc, axis=1) & ~done
        nxt = jnp.argmax(acc, axis=1).astype(jnp.int32)  # the first accepted sibling
        # residual after rejecting every child: zero the children's tokens, renormalise
        tok_hit = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], jnp.clip(tree.tokens, 0, V - 1)].max(child)
        res = jnp.where(tok_hit, 0.0, p)
        res = jnp.where(jnp.sum(res, -1, keepdims=True) > 0, res, p)  # mass ~0 only through rounding
        sample = jax.random.categorical(k_b, jnp.where(res > 0, jnp.log(res), -jnp.inf), axis=-1).astype(jnp.int32)
        stop = ~done & ~found
        bonus = jnp.where(stop, sample, bonus)
        if level < md:
            path = path.at[:, level + 1].set(jnp.where(found, nxt, -1))
        cur = jnp.where(found, nxt, cur)
        n = n + found
        done = done | stop
    return path, n, bonus


def accepted_inputs(tree: Tree, accept_idx: jax.Array, n_accepted: jax.Array, bonus_token: jax.Array):
    """What to commit after acceptance, as fixed-size arrays of width A = accept_idx.shape[1].

    Returns (node_idx [B, A], new_tokens [B, A], positions [B, A], valid [B, A]):
      node_idx: accepted path nodes (root first; padding clipped to 0), to gather the target features / KV;
      new_tokens: the tokens this round emits, in order: the accepted drafted tokens then the bonus (-1 padded);
      positions: target positions of the path nodes (T, T+1, ...);
      valid: j <= n_accepted.
    For the draft head: `draft_extend(feats[node_idx], new_tokens, positions, valid)`; then the next root is
    (hidden[b, n_accepted[b]], bonus_token, T + n_accepted + 1).
    """
    B, A = accept_idx.shape
    j = jnp.arange(A)[None, :]
    valid = j <= n_accepted[:, None]
    node_idx = jnp.maximum(accept_idx, 0)
    nxt = jnp.concatenate([accept_idx[:, 1:], jnp.full((B, 1), -1, accept_idx.dtype)], 1)
    tok = jnp.take_along_axis(tree.tokens, jnp.maximum(nxt, 0), axis=1)
    new_tokens = jnp.where(j < n_accepted[:, None], tok, jnp.where(j == n_accepted[:, None], bonus_token[:, None], -1))
    positions = jnp.take_along_axis(tree.positions, node_idx, axis=1)
    positions = jnp.where(valid, positions, tree.positions[:, :1] + j)
    return node_idx, new_tokens.astype(jnp.int32), positions.astype(jnp.int32), valid
