"""Dynamic draft trees with static shapes (DESIGN.md, "Drafting and acceptance"), following EAGLE-2/3.

A tree has N = budget nodes. Node 0 is the root: the last sampled token, at target position T (it is not
drafted). A node at depth k sits at target position T + k. Parents precede children. The builder:

1. level 1: the top_k draft tokens predicted from the root hidden; all of them form the first frontier;
2. levels 2..depth: run the head on the frontier (top_k nodes), take each node's top_k children, score them by
   cumulative log-prob (parent score + log p), keep the global top_k of those top_k**2 as the next frontier;
3. rerank every candidate (top_k + (depth-1)*top_k**2 of them) by cumulative log-prob and keep budget-1.

Ties in (3) go to the earlier candidate; since a child never scores above its parent, the kept set is closed
under ancestors. The kept nodes are emitted in `bfs` order: by depth, then score (descending), then candidate
index. `flatten_order` gives the `bfs` and `dfs` (pre-order, siblings adjacent) permutations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import nsa
from ssv_jax.config import is_int
from ssv_jax.draft import DraftCache, DraftConfig, draft_logits, draft_tree_level

ORDERS = ("bfs", "dfs")


@dataclass(frozen=True)
class TreeSpec:
    """Static tree shape: `top_k` children per expanded node and frontier width, `depth` drafted levels
    (the deepest node is at depth `depth`), `budget` total nodes N including the root."""

    top_k: int
    depth: int
    budget: int

    def __post_init__(self):
        for f in ("top_k", "depth", "budget"):
            v = getattr(self, f)
            if not is_int(v):
                raise ValueError(f"TreeSpec.{f}={v!r} is invalid; accepted: an integer")
            object.__setattr__(self, f, int(v))  # one hashable form for np.int64 too
        if self.top_k < 1:
            raise ValueError(f"TreeSpec.top_k={self.top_k} is invalid; accepted: an integer >= 1")
        if self.depth < 1:
            raise ValueError(f"TreeSpec.depth={self.depth} is invalid; accepted: an integer >= 1")
        hi = self.max_nodes
        if not 2 <= self.budget <= hi:
            raise ValueError(f"TreeSpec.budget={self.budget} is invalid; accepted: an integer in [2, {hi}] "
                             f"(the root plus top_k + (depth-1)*top_k**2 candidates for top_k={self.top_k}, "
                             f"depth={self.depth})")

    @property
    def n_candidates(self) -> int:
        """Drafted candidates before the final rerank."""
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def max_nodes(self) -> int:
        """The largest valid budget (root + every candidate)."""
        return 1 + self.n_candidates

    @classmethod
    def parse_list(cls, spec: str) -> list["TreeSpec"]:
        """Trees from the command-line form "top_k,depth,budget;top_k,depth,budget;..." (e.g. "4,6,32;8,6,64")."""
        if not isinstance(spec, str):
            raise ValueError(f"trees={spec!r} is invalid; accepted: a string 'top_k,depth,budget;...'")
        out = []
        for part in spec.split(";"):
            fields = part.split(",")
            if len(fields) != 3 or not all(re.fullmatch(r"\s*-?\d+\s*", f) for f in fields):
                raise ValueError(f"tree {part!r} in {spec!r} is invalid; accepted: three integers "
                                 "'top_k,depth,budget', trees separated by ';'")
            out.append(cls(*(int(f) for f in fields)))
        return out


class Tree(NamedTuple):
    """A batch of trees with N nodes each (node 0 = root; parents precede children).

    tokens [B, N] target ids; parents [B, N] (-1 for the root); depth [B, N]; mask [B, N, N] with
    mask[b, i, j] = node j is an ancestor of node i or j == i; positions [B, N] = root position + depth;
    scores [B, N] fp32 cumulative draft log-prob (0 at the root).
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    mask: jax.Array
    positions: jax.Array
    scores: jax.Array


# -- structure helpers -----------------------------------------------------------------------------------------
def mask_from_parents(parents: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] from parent pointers [B, N] (-1 = none), by transitive closure: squaring
    the one-step relation k times covers paths of up to 2^k edges, so a known bound on the tree's depth
    (`max_depth`, default N - 1) takes ceil(log2(max_depth)) products."""
    B, N = parents.shape
    m = jnp.eye(N, dtype=bool)[None] | jax.nn.one_hot(parents, N, dtype=jnp.bool_)  # one_hot(-1) = zeros
    longest = N - 1 if max_depth is None else min(max_depth, N - 1)
    for _ in range(max(1, (longest - 1).bit_length())):
        m = m | (jnp.einsum("bij,bjk->bik", m.astype(jnp.float32), m.astype(jnp.float32)) > 0)
    return m


def tree_from_parents(tokens, parents, root_pos=0, scores=None) -> Tree:
    """Build a `Tree` from explicit lists (for tests and fixed trees).

    `tokens`, `parents`: [N] or [B, N] (lists or arrays); parents[0] must be -1 and 0 <= parents[i] < i.
    `root_pos`: int or [B]. `scores`: optional [N] / [B, N] (default zeros).
    """
    tokens = jnp.atleast_2d(jnp.asarray(tokens, jnp.int32))
    parents = jnp.atleast_2d(jnp.asarray(parents, jnp.int32))
    if tokens.shape != parents.shape:
        raise ValueError(f"tokens {tokens.shape} and parents {parents.shape} must have the same shape")
    B, N = tokens.shape
    if not isinstance(parents, jax.core.Tracer):
        import numpy as np

        pn = np.asarray(parents)
        ok = (pn[:, 0] == -1).all() and all(((pn[:, i] >= 0) & (pn[:, i] < i)).all() for i in range(1, N))
        if not ok:
            raise ValueError(f"parents={pn.tolist()} is invalid; accepted: parents[0] == -1 and "
                             f"0 <= parents[i] < i (parents precede children)")
    mask = mask_from_parents(parents)
    depth = jnp.sum(mask, axis=-1).astype(jnp.int32) - 1
    root_pos = jnp.broadcast_to(jnp.asarray(root_pos, jnp.int32), (B,))
    sc = jnp.zeros((B, N), jnp.float32) if scores is None else jnp.atleast_2d(jnp.asarray(scores, jnp.float32))
    return Tree(tokens, parents, depth, mask, root_pos[:, None] + depth, jnp.broadcast_to(sc, (B, N)))


def flatten_order(tree: Tree, order: str) -> tuple[jax.Array, jax.Array]:
    """Permutation `perm` [B, N] (new slot -> old node) and its inverse `inv` [B, N] (old node -> new slot).

    `bfs`: by depth, then score descending, then node index (the builder's own order, so identity on its
    output). `dfs`: pre-order, children visited in node-index order, so siblings' subtrees are contiguous.
    Both keep the root at slot 0 and parents before children.
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is invalid; accepted: one of {ORDERS}")
    B, N = tree.tokens.shape
    if order == "bfs":
        return lex_order((tree.depth.astype(jnp.int32), -tree.scores.astype(jnp.float32),
                          jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))))
    if N == 1:
        return lex_order((tree.depth.astype(jnp.int32),))
    # key_d(n) = index of n's ancestor at depth d (-1 when depth(n) < d); lexicographic over d = 1..N-1. The key
    # at n's own depth is n itself, so the keys are distinct.
    at_d = tree.depth[:, None, :] == jnp.arange(1, N)[None, :, None]  # [B, d, m]
    hit = tree.mask[:, None, :, :] & at_d[:, :, None, :]  # [B, d, n, m]
    keys = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)  # [B, d, n]
    return lex_order(tuple(keys[:, d] for d in range(N - 1)))


def lex_order(keys: tuple) -> tuple[jax.Array, jax.Array]:
    """(perm, rank) [B, N] of rows sorted ascending by `keys` (a tuple of [B, N] arrays compared
    lexicographically, distinct per row): perm[b, i] is the i-th smallest, rank = perm's inverse.

    What `jax.lax.sort(keys + (iota,), num_keys=len(keys))[-1]` computes, as all-pairs comparisons instead of a
    sort: for trees of tens of nodes this is one elementwise fusion and a reduction, where XLA's GPU sort is a
    multi-pass kernel (52 µs a round on the H200 for the 32-node dfs order, `round_profile_8k_h200.json`)."""
    B, N = keys[0].shape
    before = jnp.zeros((B, N, N), bool)  # before[b, m, n]: key(m) < key(n)
    tie = jnp.ones((B, N, N), bool)
    for k in keys:
        km, kn = k[:, :, None], k[:, None, :]
        before = before | (tie & (km < kn))
        tie = tie & (km == kn)
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)
    iota = jnp.arange(N, dtype=jnp.int32)
    perm = jnp.sum(jnp.where(rank[:, None, :] == iota[None, :, None], iota[None, None, :], 0), axis=-1,
                   dtype=jnp.int32)
    return perm, rank


def permute_tree(tree: Tree, perm: jax.Array, inv: jax.Array | None = None) -> Tree:
    """Reorder nodes: new node i is old node perm[b, i]; parents and the mask are remapped consistently."""
    B, N = perm.shape
    if inv is None:
        inv = jnp.zeros_like(perm).at[jnp.arange(B)[:, None], perm].set(jnp.arange(N, dtype=perm.dtype))
    take = lambda x: jnp.take_along_axis(x, perm, axis=1)
    par = take(tree.parents)
    par = jnp.where(par >= 0, jnp.take_along_axis(inv, jnp.maximum(par, 0), axis=1), -1)
    mask = jnp.take_along_axis(tree.mask, perm[:, :, None], axis=1)
    mask = jnp.take_along_axis(mask, perm[:, None, :], axis=2)
    return Tree(take(tree.tokens), par, take(tree.depth), mask, take(tree.positions), take(tree.scores))


# -- the builder -----------------------------------------------------------------------------------------------
StepFn = Callable[[object, int, jax.Array, jax.Array, jax.Array], tuple[object, jax.Array]]


def build_tree_with(step_fn: StepFn, state, root_scores: jax.Array, root_token: jax.Array, root_pos: jax.Array,
                    spec: TreeSpec, d2t: jax.Array | None = None, select=None) -> Tree:
    """The EAGLE-2/3 dynamic tree over any drafter (the head in `build_tree`, toy tables in tests).

    Args:
      step_fn: `(state, level, tokens [B, K], rows [B, K], anc [B, K, E]) -> (state, scores [B, K, Vd])`, called
        for level = 1 .. depth-1 on the current frontier (K = top_k nodes at depth `level`, target ids `tokens`).
        `rows` are the frontier slots (of the previous call; zeros at level 1 = the root) the nodes descend from,
        `anc` marks, over E = (depth-1)*K in-flight slots, the node's ancestors among earlier frontiers (frontier
        node r of level l owns slot (l-1)*K + r). `scores` rank the node's children: draft log-probs, or logits
        when `select` normalises them.
      state: anything `step_fn` threads through.
      root_scores: [B, Vd] the same for the depth-1 tokens.
      root_token, root_pos: [B] the root's target id and target position T.
      d2t: optional [Vd] draft -> target offsets (None: the ids are already target ids).
      select: `(scores [..., Vd], k) -> (log-probs [..., k] fp32, ids [..., k])`, the top k of the draft
        log-probs that the scores stand for, with `jax.lax.top_k`'s order and ties (default: `jax.lax.top_k`,
        scores already log-probs). `build_tree` passes logits with `log_softmax_top_k` or its kernel.
    Returns the `Tree` with N = spec.budget nodes in `bfs` order.
    """
    K, L = spec.top_k, spec.depth
    B, Vd = root_scores.shape
    if K > Vd:
        raise ValueError(f"TreeSpec.top_k={K} is invalid for a draft vocabulary of {Vd}; accepted: [1, {Vd}]")
    to_t = (lambda i: i) if d2t is None else (lambda i: i + d2t[i])
    E = (L - 1) * K
    select = select or jax.lax.top_k
    s, i = select(root_scores.astype(jnp.float32), K)
    c_score, c_tok = [s], [to_t(i).astype(jnp.int32)]
    c_parent, c_depth = [jnp.full((B, K), -1, jnp.int32)], [1] * K
    f_tok, f_score, f_cid = c_tok[0], s, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
    rows = jnp.zeros((B, K), jnp.int32)
    anc = jnp.zeros((B, K, E), bool)
    offset = K
    for level in range(1, L):
        state, scores = step_fn(state, level, f_tok, rows, anc)
        s, i = select(scores.astype(jnp.float32), K)  # [B, K, K]
        cu = (f_score[:, :, None] + s).reshape(B, K * K)
        tok = to_t(i).astype(jnp.int32).reshape(B, K * K)
        c_score.append(cu)
        c_tok.append(tok)
        c_parent.append(jnp.repeat(f_cid, K, axis=1))
        c_depth += [level + 1] * (K * K)
        f_score, sel = nsa.top_n(cu, K)  # lax.top_k's result as one fused rank count (XLA sorts K*K here)
        rows = (sel // K).astype(jnp.int32)
        f_tok = jnp.take_along_axis(tok, sel, axis=1)
        f_cid = (offset + sel).astype(jnp.int32)
        anc = jnp.take_along_axis(anc, rows[:, :, None], axis=1) | jax.nn.one_hot(
            (level - 1) * K + rows, E, dtype=jnp.bool_)
        offset += K * K
    c_score = jnp.concatenate(c_score, 1)
    c_tok = jnp.concatenate(c_tok, 1)
    c_parent = jnp.concatenate(c_parent, 1)
    C = c_score.shape[1]
    c_depth = jnp.broadcast_to(jnp.asarray(c_depth, jnp.int32), (B, C))

    n_keep = spec.budget - 1
    _, kept = nsa.top_n(c_score, n_keep)  # ties -> lower candidate index (ancestor-closed)
    take = lambda x: jnp.take_along_axis(x, kept, axis=1)
    kd, ks = take(c_depth), take(c_score)
    kept = jnp.take_along_axis(kept.astype(jnp.int32), lex_order((kd, -ks, kept.astype(jnp.int32)))[0], axis=1)
    bidx = jnp.arange(B)[:, None]
    cand_to_node = jnp.full((B, C), -1, jnp.int32).at[bidx, kept].set(jnp.arange(1, n_keep + 1, dtype=jnp.int32))
    par_c = take(c_parent)
    par = jnp.where(par_c < 0, 0, jnp.take_along_axis(cand_to_node, jnp.maximum(par_c, 0), axis=1))
    tokens = jnp.concatenate([root_token.astype(jnp.int32)[:, None], take(c_tok)], 1)
    parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), par], 1)
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), take(c_depth)], 1)
    scores = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), take(c_score)], 1)
    mask = mask_from_parents(parents, L)
    positions = root_pos.astype(jnp.int32)[:, None] + depth
    return Tree(tokens, parents, depth, mask, positions, scores)


def log_softmax_top_k(logits: jax.Array, k: int):
    """The top k of the draft log-probs `log_softmax(logits)` over the last axis, in `jax.lax.top_k`'s order:
    (log-probs [..., k] fp32, ids [..., k] int32). The reference of the head's selection (`build_tree`)."""
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)


class _HeadState(NamedTuple):
    hidden: jax.Array  # [B, K, H] outputs of the previous step (the root hidden at level 1)
    ext_k: jax.Array  # [B, slots >= E, Hkv, D]: frontier node r of level l at slot (l-1)*K + r
    ext_v: jax.Array


def build_tree(params: dict, dcfg: DraftConfig, embed: jax.Array | None, root_hidden: jax.Array,
               root_token: jax.Array, root_pos: jax.Array, cache: DraftCache, spec: TreeSpec, select=None,
               attention=None) -> Tree:
    """Draft a tree with the EAGLE-3 head (see the module docstring for the algorithm).

    Args:
      root_hidden: [B, H] the head's pre-norm output at the entry that consumed the root token, i.e.
        `draft_extend(...)[0][b, j]` where `next_tokens[b, j] == root_token[b]`; its logits give depth 1.
      root_token: [B] target id of the root (the last sampled token); root_pos: [B] its target position T.
      cache: the head cache with slots 0..T-1 committed (`cache.length == root_pos`).
      select: the top-k of the log-softmax over the draft vocabulary, `log_softmax_top_k`'s contract (the
        default, the reference); the GPU rounds pass `pallas_kernels.topn.top_n_log_softmax`.
      attention: the head's attention primitive (see `draft.draft_extend`).
    A node at depth k runs the head at head position T + k - 1, attending to the committed cache and its
    in-tree ancestors. Returns a `Tree` with N = spec.budget nodes (bfs order); nothing is committed.
    """
    K, L = spec.top_k, spec.depth
    if root_hidden.ndim != 2 or root_hidden.shape[1] != dcfg.hidden:
        raise ValueError(f"root_hidden has shape {tuple(root_hidden.shape)}; accepted: [B, {dcfg.hidden}]")
    B, H = root_hidden.shape
    E = (L - 1) * K
    slots = max(16, 1 << max(0, (E - 1).bit_length()))  # E rounded up to a power of two >= 16: the kernel's key
    dt = cache.k.dtype                                    # tile, so no padding copy per level (never visible)
    z = jnp.zeros((B, slots, dcfg.n_kv_heads, dcfg.head_dim), dt)
    state = _HeadState(jnp.broadcast_to(root_hidden[:, None, :], (B, K, H)), z, z)

    def step(st: _HeadState, level, tokens, rows, anc):
        h_in = jnp.take_along_axis(st.hidden, rows[:, :, None], axis=1)
        pos = jnp.broadcast_to(root_pos.astype(jnp.int32)[:, None] + (level - 1), (B, K))
        off = (level - 1) * K
        own = jax.nn.one_hot(off + jnp.arange(K), slots, dtype=jnp.bool_)[None]  # each node sees itself
        mask = jnp.pad(anc, ((0, 0), (0, 0), (0, slots - E))) | own
        out, logits, ek, ev = draft_tree_level(params, dcfg, embed, h_in, tokens, pos, cache, st.ext_k, st.ext_v,
                                               mask, off, attention=attention)
        return _HeadState(out, ek, ev), logits

    return build_tree_with(step, state, draft_logits(params, dcfg, root_hidden), root_token, root_pos, spec,
                           d2t=params["d2t"], select=select or log_softmax_top_k)
