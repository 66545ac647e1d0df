"""Native Sparse Attention, the jnp reference. This is the one place the NSA math is written (DESIGN.md,
"NSA semantics"); every kernel in `pallas_kernels/` is tested against these functions.

Shapes (batch always leads):
  q        [B, Q, Hq, D]   post-RoPE queries at absolute positions `q_pos` [B, Q]
  k, v     [B, S, Hkv, D]  the committed cache (post-RoPE keys); key at slot s has position s; the first
                           `kv_len` [B] slots are committed
  kc, vc   [B, Nc, Hkv, D] committed compressed blocks; block c covers tokens [c*d, c*d + l)
  extra    `Extra`         in-flight keys (draft-tree nodes) visible under a per-query mask, plus per-path
                           compressed blocks (DESIGN.md, "Verification semantics")
  gates    [B, Q, Hq, 3]   sigmoid gates ordered (cmp, slc, win)
  sel      [B, Q, Hkv, n]  selected block ids, -1 for an empty slot

The selection is computed from committed and extra compressed blocks and shared by the G heads of a KV head.
Passing `sel` skips routing (a reuse layer inherits the indices of the last refresh layer).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssv_jax.config import ModelConfig

NEG_INF = float("-inf")


class Extra(NamedTuple):
    """Keys that are not in the committed cache, each visible to a subset of the queries.

    `k, v` [B, E, Hkv, D] with positions `pos` [B, E] and visibility `mask` [B, Q, E] (the tree's
    ancestor-or-self mask). `ck, cv` [B, Ec, Hkv, D] are per-path compressed blocks with block ids `cidx` [B, Ec]
    and visibility `cmask` [B, Q, Ec]. Ec may be 0.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    mask: jax.Array
    ck: jax.Array
    cv: jax.Array
    cidx: jax.Array
    cmask: jax.Array


class LayerKV(NamedTuple):
    """Layer `layer` of a stacked cache `stack` [L, B, S, Hkv, D], read in place: gathers index the stack with the
    layer folded into the index, so XLA never materialises the layer's slice (a per-layer copy of the whole cache
    otherwise). Accepted wherever the reference takes `k` or `v`."""

    stack: jax.Array
    layer: jax.Array

    @property
    def shape(self):
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype


def gather_rows(k, pos):
    """k [B, S, ...] (or a `LayerKV`), pos [B, ...] -> k[b, pos] (positions clipped into range)."""
    S = k.shape[1]
    b = jnp.arange(pos.shape[0]).reshape((-1,) + (1,) * (pos.ndim - 1))
    p = jnp.clip(pos, 0, S - 1)
    if isinstance(k, LayerKV):
        return k.stack[k.layer, b, p]
    return k[b, p]


# -- compression -----------------------------------------------------------------------------------------------
def compress(blocks: jax.Array, cfg: ModelConfig, w: jax.Array | None = None, pe: jax.Array | None = None):
    """phi: [..., l, Hkv, D] -> [..., Hkv, D]. `mean` pools; `mlp` maps the flattened block plus an
    intra-block position embedding `pe` [Hkv, l, D] through a per-head linear map `w` [Hkv, l, D, D]."""
    if cfg.compression == "mean":
        return jnp.mean(blocks.astype(jnp.float32), axis=-3).astype(blocks.dtype)
    x = blocks + jnp.swapaxes(pe, 0, 1).astype(blocks.dtype)  # pe broadcast as [l, Hkv, D]
    return jnp.einsum("...lhd,hlde->...he", x, w.astype(blocks.dtype), preferred_element_type=jnp.float32
                      ).astype(blocks.dtype)


def compress_all(k: jax.Array, cfg: ModelConfig, w=None, pe=None) -> jax.Array:
    """Compressed blocks recomputed from scratch: [B, S, Hkv, D] -> [B, S // d, Hkv, D] (slots whose block runs
    past S hold blocks of zero-padded keys and are never visible)."""
    B, S, H, D = k.shape
    l, d = cfg.cmp_len, cfg.cmp_stride
    nc = S // d
    kp = jnp.pad(k, ((0, 0), (0, l), (0, 0), (0, 0)))
    idx = jnp.arange(nc)[:, None] * d + jnp.arange(l)[None, :]  # [Nc, l]
    return compress(kp[:, idx], cfg, w, pe)


def num_complete_blocks(length: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Number of compressed blocks fully inside the first `length` tokens."""
    return jnp.maximum((length - cfg.cmp_len) // cfg.cmp_stride + 1, 0)


# -- masked softmax attention ----------------------------------------------------------------------------------
def _softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `mask`; all-masked rows give zeros."""
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(den > 0, den, 1.0)


def _scores(q, k, spec):
    return jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)


def _group(q: jax.Array, hkv: int) -> jax.Array:
    B, Q, Hq, D = q.shape
    return q.reshape(B, Q, hkv, Hq // hkv, D)


# -- branches --------------------------------------------------------------------------------------------------
def compressed_branch(q, q_pos, kc, vc, kv_len, cfg: ModelConfig, extra: Extra | None = None):
    """Attention over the visible compressed blocks.

    Returns `o_cmp` [B, Q, Hq, D] (zero where nothing is visible), and the probabilities `p` [B, Q, Hkv, G, Nc]
    over committed blocks and `px` [B, Q, Hkv, G, Ec] over the extra blocks (None without extras)."""
    hkv = kc.shape[2]
    qg = _group(q, hkv)
    end = jnp.arange(kc.shape[1]) * cfg.cmp_stride + cfg.cmp_len - 1  # completion position of each block
    vis = (end[None, None, :] <= q_pos[:, :, None]) & (end[None, None, :] < kv_len[:, None, None])  # [B,Q,Nc]
    s = _scores(qg, kc, "bqhgd,bchd->bqhgc")
    masks = [jnp.broadcast_to(vis[:, :, None, None, :], s.shape)]
    if extra is not None:
        sx = _scores(qg, extra.ck, "bqhgd,bchd->bqhgc")
        s = jnp.concatenate([s, sx], -1)
        masks.append(jnp.broadcast_to(extra.cmask[:, :, None, None, :], sx.shape))
    p = _softmax(s, jnp.concatenate(masks, -1))
    nc = kc.shape[1]
    vals = vc if extra is None else jnp.concatenate([vc, extra.cv], 1)
    o = jnp.einsum("bqhgc,bchd->bqhgd", p, vals.astype(jnp.float32))
    return o.reshape(q.shape), p[..., :nc], (None if extra is None else p[..., nc:])


def block_importance(p, px, cidx, cfg: ModelConfig, n_sel_blocks: int) -> jax.Array:
    """Importance of each selection block [B, Q, Hkv, Nsel]: the sum over the G heads and over the visible
    compressed blocks whose span meets the selection block, of their probability."""
    d, l, ls = cfg.cmp_stride, cfg.cmp_len, cfg.slc_block
    r = ls // d
    pg = jnp.sum(p, axis=3)  # [B, Q, Hkv, Nc]
    nc = pg.shape[-1]
    pad = n_sel_blocks * r - nc
    pg = jnp.pad(pg, ((0, 0),) * 3 + ((0, max(pad, 0)),))[..., : n_sel_blocks * r]
    c = jnp.arange(n_sel_blocks * r)
    span = (c * d + l - 1) // ls - (c * d) // ls  # how many blocks past its first one block c reaches
    imp = jnp.zeros(pg.shape[:-1] + (n_sel_blocks,), jnp.float32)
    for o in range((l - 1) // ls + 2):
        part = jnp.sum(jnp.where(span >= o, pg, 0.0).reshape(pg.shape[:-1] + (n_sel_blocks, r)), -1)
        imp = imp + jnp.pad(part, ((0, 0),) * 3 + ((o, 0),))[..., :n_sel_blocks]
    if px is not None:
        pxg = jnp.sum(px, axis=3)  # [B, Q, Hkv, Ec]
        j0 = (cidx * d) // ls
        j1 = (cidx * d + l - 1) // ls
        j = jnp.arange(n_sel_blocks)
        hit = (j[None, None, :] >= j0[:, :, None]) & (j[None, None, :] <= j1[:, :, None])  # [B, Ec, Nsel]
        imp = imp + jnp.einsum("bqhe,bej->bqhj", pxg, hit.astype(jnp.float32))
    return imp


def route(imp: jax.Array, q_pos: jax.Array, cfg: ModelConfig, select=None) -> jax.Array:
    """Top-n selection [B, Q, Hkv, n]: forced blocks (0, current, previous) first, then the candidates
    j*l' <= t by (importance desc, block index asc); -1 where fewer than n blocks exist. `select(score, n)`
    (default `top_n`) is the top-n primitive; the kernel path passes its own with the same contract."""
    nsel = imp.shape[-1]
    j = jnp.arange(nsel)[None, None, None, :]
    cur = (q_pos // cfg.slc_block)[:, :, None, None]
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    cand = j <= cur
    score = jnp.where(forced, jnp.inf, jnp.where(cand, imp, NEG_INF))
    val, idx = (select or top_n)(score, cfg.n_slc)  # ties: lower index first
    return jnp.where(val > NEG_INF, idx, -1).astype(jnp.int32)


RANK_TOPK_MAX_PAIRS = 1 << 26


def top_n(score: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(score, n)` over the last axis: values descending, ties broken by the lower index.

    With few rows (decode and small verify trees) it is computed from pairwise ranks instead (rank_i = #{j: s_j >
    s_i, or s_j == s_i and j < i}), one fused compare-and-count that is far cheaper on the GPU than XLA's top-k
    kernel for these shapes (docs/DESIGN_NOTES.md, "Routing top-n for few queries"). Both give the same output."""
    m = score.shape[-1]
    if math.prod(score.shape[:-1]) * m * m > RANK_TOPK_MAX_PAIRS:
        return jax.lax.top_k(score, n)
    i = jnp.arange(m)
    si, sj = score[..., :, None], score[..., None, :]
    rank = jnp.sum((sj > si) | ((sj == si) & (i[None, :] < i[:, None])), -1)  # [..., m], a permutation of 0..m-1
    idx = jnp.argmax(rank[..., None, :] == jnp.arange(n)[:, None], -1).astype(jnp.int32)  # [..., n]
    return jnp.take_along_axis(score, idx, -1), idx


def _gather_keys(k, pos):
    """k [B, S, Hkv, D], pos [B, Q, Hkv, K] -> [B, Q, Hkv, K, D] (positions clipped into range). One gather on
    the cache's own layout: no transposed copy of the cache."""
    B, S, H, D = k.shape
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(H)[None, None, :, None]
    p = jnp.clip(pos, 0, S - 1)
    if isinstance(k, LayerKV):
        return k.stack[k.layer, b, p, h]
    return k[b, p, h]


def _branch_with_extra(q, kpos, kvalid, k, v, extra: Extra | None, xvis):
    """Attention of grouped queries over gathered cache keys at `kpos` [B,Q,Hkv,K] (valid where `kvalid`)
    plus extra keys visible where `xvis` [B, Q, Hkv, E]."""
    hkv = k.shape[2]
    qg = _group(q, hkv)
    kg, vg = _gather_keys(k, kpos), _gather_keys(v, kpos)
    s = _scores(qg, kg, "bqhgd,bqhkd->bqhgk")
    mask = jnp.broadcast_to(kvalid[:, :, :, None, :], s.shape)
    if extra is not None:
        sx = _scores(qg, extra.k, "bqhgd,behd->bqhge")
        s = jnp.concatenate([s, sx], -1)
        mask = jnp.concatenate([mask, jnp.broadcast_to(xvis[:, :, :, None, :], sx.shape)], -1)
    p = _softmax(s, mask)
    K = kpos.shape[-1]
    o = jnp.einsum("bqhgk,bqhkd->bqhgd", p[..., :K], vg.astype(jnp.float32))
    if extra is not None:
        o = o + jnp.einsum("bqhge,behd->bqhgd", p[..., K:], extra.v.astype(jnp.float32))
    return o.reshape(q.shape)


def selected_branch(q, q_pos, k, v, kv_len, sel, cfg: ModelConfig, extra: Extra | None = None):
    """Attention over the keys of the selected blocks with position <= t (cache keys, and extra keys visible to
    the query whose block is selected)."""
    ls = cfg.slc_block
    pos = sel[..., None] * ls + jnp.arange(ls)  # [B, Q, Hkv, n, l']
    t = q_pos[:, :, None, None, None]
    valid = (sel[..., None] >= 0) & (pos <= t) & (pos < kv_len[:, None, None, None, None])
    B, Q, H, n = sel.shape
    xvis = None
    if extra is not None:
        xblk = extra.pos // ls  # [B, E]
        in_sel = jnp.any(xblk[:, None, None, :, None] == sel[:, :, :, None, :], -1)  # [B, Q, Hkv, E]
        xvis = in_sel & extra.mask[:, :, None, :]
    return _branch_with_extra(q, pos.reshape(B, Q, H, n * ls), valid.reshape(B, Q, H, n * ls), k, v, extra, xvis)


def window_branch(q, q_pos, k, v, kv_len, cfg: ModelConfig, extra: Extra | None = None):
    """Attention over the keys at positions [t - w + 1, t]."""
    w, hkv = cfg.window, k.shape[2]
    B, Q = q_pos.shape
    pos = q_pos[:, :, None] - w + 1 + jnp.arange(w)  # [B, Q, w]
    valid = (pos >= 0) & (pos < kv_len[:, None, None])
    pos = jnp.broadcast_to(pos[:, :, None, :], (B, Q, hkv, w))
    valid = jnp.broadcast_to(valid[:, :, None, :], (B, Q, hkv, w))
    xvis = None
    if extra is not None:
        inwin = extra.pos[:, None, :] >= q_pos[:, :, None] - w + 1
        xvis = jnp.broadcast_to((inwin & extra.mask)[:, :, None, :], (B, Q, hkv, extra.pos.shape[1]))
    return _branch_with_extra(q, pos, valid, k, v, extra, xvis)


def nsa_attention(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, extra: Extra | None = None,
                  sel: jax.Array | None = None):
    """The full NSA attention of DESIGN.md for a block of queries at arbitrary positions.

    Routing runs unless `sel` is given (reuse layer). Returns (o [B, Q, Hq, D] in q's dtype, sel)."""
    o_cmp, p, px = compressed_branch(q, q_pos, kc, vc, kv_len, cfg, extra)
    if sel is None:
        imp = block_importance(p, px, None if extra is None else extra.cidx, cfg, k.shape[1] // cfg.slc_block)
        sel = route(imp, q_pos, cfg)
    o_slc = selected_branch(q, q_pos, k, v, kv_len, sel, cfg, extra)
    o_win = window_branch(q, q_pos, k, v, kv_len, cfg, extra)
    g = gates.astype(jnp.float32)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
    return o.astype(q.dtype), sel


# -- the same attention as dense masked attention (full-sequence training) ------------------------------------
def _masked_softmax_values(s, mask, v):
    """softmax(s) over `mask` times v. s [B,Hkv,G,Q,K], v [B,K,Hkv,D] -> [B,Q,Hkv,G,D]."""
    return jnp.einsum("bhgqk,bkhd->bqhgd", _softmax(s, mask), v.astype(jnp.float32))


def nsa_attention_dense(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, extra=None, sel=None, q_block: int = 2048):
    """`nsa_attention` for full-sequence training, with the selected and window branches as dense masked
    attention instead of per-query key gathers (the reference gathers [Q, n*l'] keys per query, which runs at
    ~3.4K tokens/s on an H200 for the small preset at 8K). Same semantics, no extras:

    * compressed branch and routing: the reference functions (`compressed_branch`, `block_importance`, `route`);
    * per block of `q_block` queries, one QK^T over the causal key prefix serves both the selected branch (keys
      whose selection block is selected and position <= t) and the window branch (a static slice of the same
      scores, keys in [t-w+1, t]).
    Tested against `nsa_attention` in tests/test_train_smoke.py. Returns (o [B, Q, Hq, D], sel)."""
    if extra is not None:
        raise ValueError("nsa_attention_dense has no draft-tree extras; accepted: extra=None (training only)")
    o_cmp, p, _ = compressed_branch(q, q_pos, kc, vc, kv_len, cfg)
    S = k.shape[1]
    ls, w = cfg.slc_block, cfg.window
    if sel is None:
        sel = route(block_importance(p, None, None, cfg, S // ls), q_pos, cfg)
    B, Q, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    blk = jnp.any(sel[..., None] == jnp.arange(S // ls), -2)  # [B, Q, Hkv, S/l'] selected blocks
    qb = min(q_block, Q)
    outs_s, outs_w = [], []
    for c0 in range(0, Q, qb):  # static query blocks; keys up to the block's last query (queries at 0..Q-1)
        c1 = min(c0 + qb, Q)
        end = min(S, c1) if Q == S else S
        lo = max(0, c0 - w + 1) if Q == S else 0
        qg = q[:, c0:c1].reshape(B, c1 - c0, Hkv, G, D)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k[:, :end], preferred_element_type=jnp.float32) * D ** -0.5
        t = q_pos[:, c0:c1][:, None, None, :, None]
        kpos = jnp.arange(end)
        vis = (kpos <= t) & (kpos < kv_len[:, None, None, None, None])
        in_sel = jnp.swapaxes(jnp.repeat(blk[:, c0:c1, :, : -(-end // ls)], ls, -1)[..., :end], 1, 2)[:, :, None]
        outs_s.append(_masked_softmax_values(s, vis & in_sel, v[:, :end]))
        win = vis[..., lo:] & (kpos[lo:] > t - w)
        outs_w.append(_masked_softmax_values(s[..., lo:], win, v[:, lo:end]))
    o_slc = jnp.concatenate(outs_s, 1).reshape(B, Q, Hq, D)
    o_win = jnp.concatenate(outs_w, 1).reshape(B, Q, Hq, D)
    g = gates.astype(jnp.float32)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
    return o.astype(q.dtype), sel


nsa_attention.reads_layer_views = True  # gathers only: see LayerKV
