"""NSA reference == an independent brute-force per-query NumPy loop, branch by branch (DESIGN.md semantics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import nsa
from ssv_jax.config import get_config

CFG = get_config("tiny")  # l=16, d=8, l'=32, n=4, w=64


# -- brute force, one query at a time -------------------------------------------------------------------------
def _softmax_np(s):
    if len(s) == 0:
        return s
    e = np.exp(s - s.max())
    return e / e.sum()


def brute_force(q, t, k, v, T, gates, cfg, sel_override=None):
    """q [Hq, D] at position t; k, v [S, Hkv, D] with T committed keys. Returns o [Hq, D] and sel [Hkv, n]."""
    Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    l, d, ls, n, w = cfg.cmp_len, cfg.cmp_stride, cfg.slc_block, cfg.n_slc, cfg.window
    scale = 1 / np.sqrt(D)
    blocks = [c for c in range(k.shape[0] // d) if c * d + l - 1 <= min(t, T - 1)]
    kc = {c: k[c * d: c * d + l].mean(0) for c in blocks}
    vc = {c: v[c * d: c * d + l].mean(0) for c in blocks}
    out = np.zeros((Hq, D))
    sels = []
    for h in range(Hkv):
        nblk = k.shape[0] // ls
        imp = np.zeros(nblk)
        o_cmp = np.zeros((G, D))
        for g in range(G):
            qh = q[h * G + g]
            s = np.array([qh @ kc[c][h] * scale for c in blocks])
            p = _softmax_np(s)
            for pc, c in zip(p, blocks):
                o_cmp[g] += pc * vc[c][h]
                for j in range(nblk):  # spans intersect
                    if c * d < (j + 1) * ls and c * d + l > j * ls:
                        imp[j] += pc
        cur = t // ls
        forced = sorted({0, cur, max(cur - 1, 0)})
        rest = sorted((j for j in range(cur + 1) if j not in forced), key=lambda j: (-imp[j], j))
        sel = (forced + rest)[:n]
        sel = sel + [-1] * (n - len(sel))
        if sel_override is not None:
            sel = list(sel_override[h])
        sels.append(sel)
        for g in range(G):
            qh = q[h * G + g]
            keys = [s for j in sel if j >= 0 for s in range(j * ls, (j + 1) * ls) if s <= t and s < T]
            p = _softmax_np(np.array([qh @ k[s, h] * scale for s in keys]))
            o_slc = sum(pp * v[s, h] for pp, s in zip(p, keys))
            keys = [s for s in range(max(t - w + 1, 0), t + 1) if s < T]
            p = _softmax_np(np.array([qh @ k[s, h] * scale for s in keys]))
            o_win = sum(pp * v[s, h] for pp, s in zip(p, keys))
            gt = gates[h * G + g]
            out[h * G + g] = gt[0] * o_cmp[g] + gt[1] * o_slc + gt[2] * o_win
    return out, np.array(sels)


def _inputs(seed, S=256, Q=6, T=230, cfg=CFG):
    r = np.random.default_rng(seed)
    k = r.standard_normal((1, S, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    v = r.standard_normal((1, S, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    q = r.standard_normal((1, Q, cfg.n_heads, cfg.head_dim)).astype(np.float32)
    gates = r.uniform(size=(1, Q, cfg.n_heads, 3)).astype(np.float32)
    pos = np.sort(r.choice(np.arange(T), Q, replace=False))[None].astype(np.int32)
    pos[0, 0] = min(pos[0, 0], 5)  # one query before any compressed block is complete
    return q, pos, gates, k, v, np.array([T], np.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_attention_equals_brute_force(seed):
    q, pos, gates, k, v, T = _inputs(seed)
    kc, vc = nsa.compress_all(jnp.asarray(k), CFG), nsa.compress_all(jnp.asarray(v), CFG)
    o, sel = nsa.nsa_attention(jnp.asarray(q), jnp.asarray(pos), jnp.asarray(gates), jnp.asarray(k),
                               jnp.asarray(v), kc, vc, jnp.asarray(T), CFG)
    for i in range(q.shape[1]):
        ref, ref_sel = brute_force(q[0, i], pos[0, i], k[0], v[0], T[0], gates[0, i], CFG)
        np.testing.assert_array_equal(np.asarray(sel[0, i]), ref_sel)
        np.testing.assert_allclose(np.asarray(o[0, i]), ref, rtol=1e-5, atol=1e-5)


def test_each_branch_equals_brute_force():
    """Gates one-hot on each branch in turn isolate the compressed, selected and window branches."""
    q, pos, _, k, v, T = _inputs(7)
    kc, vc = nsa.compress_all(jnp.asarray(k), CFG), nsa.compress_all(jnp.asarray(v), CFG)
    for b in range(3):
        gates = np.zeros(q.shape[:3] + (3,), np.float32)
        gates[..., b] = 1.0
        o, _ = nsa.nsa_attention(jnp.asarray(q), jnp.asarray(pos), jnp.asarray(gates), jnp.asarray(k),
                                 jnp.asarray(v), kc, vc, jnp.asarray(T), CFG)
        for i in range(q.shape[1]):
            ref, _ = brute_force(q[0, i], pos[0, i], k[0], v[0], T[0], gates[0, i], CFG)
            np.testing.assert_allclose(np.asarray(o[0, i]), ref, rtol=1e-5, atol=1e-5, err_msg=f"branch {b}")


def test_no_visible_compressed_block_gives_zero():
    q, pos, _, k, v, T = _inputs(3)
    pos[:] = np.arange(pos.shape[1])  # all before the first block completes at position l-1 = 15
    gates = np.zeros(q.shape[:3] + (3,), np.float32)
    gates[..., 0] = 1.0
    kc, vc = nsa.compress_all(jnp.asarray(k), CFG), nsa.compress_all(jnp.asarray(v), CFG)
    o, _ = nsa.nsa_attention(jnp.asarray(q), jnp.asarray(pos), jnp.asarray(gates), jnp.asarray(k),
                             jnp.asarray(v), kc, vc, jnp.asarray(T), CFG)
    assert np.all(np.asarray(o) == 0)


def test_forced_blocks_come_first_and_count_toward_n():
    """Block 0, the current and the previous block are always selected, whatever their importance."""
    nsel = 8
    imp = np.zeros((1, 3, 1, nsel), np.float32)
    imp[..., 1] = imp[..., 2] = imp[..., 3] = 5.0  # high importance elsewhere
    pos = np.array([[200, 100, 40]], np.int32)  # current blocks 6, 3, 1
    sel = np.asarray(nsa.route(jnp.asarray(imp), jnp.asarray(pos), CFG))[0, :, 0]
    assert list(sel[0]) == [0, 5, 6, 1]  # forced {0,5,6} then the most important, lowest index
    assert list(sel[1]) == [0, 2, 3, 1]  # forced {0,2,3}, then block 1
    assert list(sel[2]) == [0, 1, -1, -1]  # only blocks 0 and 1 exist at t=40: empty slots are -1


def test_tie_rule_prefers_lower_block_index():
    imp = np.zeros((1, 1, 1, 8), np.float32)
    imp[..., [2, 3, 4]] = 1.0
    sel = np.asarray(nsa.route(jnp.asarray(imp), jnp.asarray([[255]], np.int32), CFG))[0, 0, 0]
    assert list(sel) == [0, 6, 7, 2]  # 2, 3, 4 tie: the lowest index wins the last slot


def test_candidates_exclude_future_blocks():
    imp = np.full((1, 1, 1, 8), 3.0, np.float32)
    sel = np.asarray(nsa.route(jnp.asarray(imp), jnp.asarray([[70]], np.int32), CFG))[0, 0, 0]
    assert set(sel.tolist()) == {0, 1, 2, -1}  # blocks 3.. start after t=70


def test_importance_counts_blocks_spanning_two_selection_blocks():
    """With l=16, d=8, l'=32 compressed block c=3 covers [24, 40): it counts for selection blocks 0 and 1."""
    p = np.zeros((1, 1, 1, 2, 32), np.float32)
    p[..., 3] = [0.25, 0.5]
    imp = np.asarray(nsa.block_importance(jnp.asarray(p), None, None, CFG, 8))[0, 0, 0]
    np.testing.assert_allclose(imp[:3], [0.75, 0.75, 0.0])


def test_mlp_compression_is_a_per_head_linear_map_of_the_block():
    cfg = CFG.replace(compression="mlp")
    r = np.random.default_rng(0)
    blocks = r.standard_normal((3, cfg.cmp_len, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    w = r.standard_normal((cfg.n_kv_heads, cfg.cmp_len, cfg.head_dim, cfg.head_dim)).astype(np.float32)
    pe = r.standard_normal((cfg.n_kv_heads, cfg.cmp_len, cfg.head_dim)).astype(np.float32)
    out = np.asarray(nsa.compress(jnp.asarray(blocks), cfg, jnp.asarray(w), jnp.asarray(pe)))
    for b in range(3):
        for h in range(cfg.n_kv_heads):
            ref = (blocks[b, :, h] + pe[h]).reshape(-1) @ w[h].reshape(-1, cfg.head_dim)
            np.testing.assert_allclose(out[b, h], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_top_n_equals_lax_top_k_with_ties_and_infinities(seed):
    """The pairwise-rank top-n used for few queries returns exactly lax.top_k's values and indices (same order,
    same tie rule), on fresh inputs full of ties, +inf (forced blocks) and -inf (absent blocks)."""
    r = np.random.default_rng(seed)
    score = r.integers(0, 6, (2, 3, 4, 40)).astype(np.float32)  # many ties
    score[r.random(score.shape) < 0.1] = np.inf
    score[r.random(score.shape) < 0.3] = -np.inf
    val, idx = nsa.top_n(jnp.asarray(score), 16)
    ref_val, ref_idx = jax.lax.top_k(jnp.asarray(score), 16)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))
