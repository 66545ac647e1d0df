"""The Pallas kernels compute exactly what the `ssv_jax.nsa` reference computes (issue #3).

Every kernel runs in interpret mode on fresh random inputs with NaN-poisoned output buffers
(`poison_outputs`), so a NaN-free result that matches the reference proves every element was written:
fp32 rel-RMS <= 1e-5, bf16 <= 5e-3. Shapes come from the `tiny` preset (Hq=4, Hkv=2, D=16, l=16, d=8, l'=32,
n=4, w=64) with a 512-slot cache, draft queries past the committed length and in-tree extra keys.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import get_config
from pallas_kernels import (commit_blocks, compressed_attention, decode_refresh_layer, effective_selection,
                            grouped_verify, merged_sizes, naive_verify, nsa_attention_kernel, overlap_gamma,
                            poison_outputs, refresh_layer, reuse_layer, synthetic_selection)
from pallas_kernels.grouped_verify import fused_call
from pallas_kernels.groups import merged_blocks, shared_selection
from pallas_kernels import topn

CFG = get_config("tiny")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 5e-3}
S, KV, Q = 512, 400, 8


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(x).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


def make_inputs(seed, dtype=jnp.float32, with_extra=True, cfg=CFG):
    """Random cache, compressed cache, draft queries at kv_len + depth, in-tree extra keys and a routed sel."""
    H, Hq, D = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    ks = jax.random.split(jax.random.key(seed), 13)
    k = jax.random.normal(ks[1], (1, S, H, D), dtype)
    v = jax.random.normal(ks[2], (1, S, H, D), dtype)
    q_pos = KV + jax.random.randint(ks[3], (1, Q), 0, 4)
    a = dict(q=jax.random.normal(ks[0], (1, Q, Hq, D), dtype), q_pos=q_pos,
             gates=jax.nn.sigmoid(jax.random.normal(ks[4], (1, Q, Hq, 3))), k=k, v=v,
             kc=nsa.compress_all(k, cfg), vc=nsa.compress_all(v, cfg), kv_len=jnp.full((1,), KV, jnp.int32),
             extra=None)
    if with_extra:
        E, Ec = 6, 2
        a["extra"] = nsa.Extra(
            k=jax.random.normal(ks[5], (1, E, H, D), dtype), v=jax.random.normal(ks[6], (1, E, H, D), dtype),
            pos=KV + jax.random.randint(ks[7], (1, E), 0, 4), mask=jax.random.bernoulli(ks[8], 0.6, (1, Q, E)),
            ck=jax.random.normal(ks[9], (1, Ec, H, D), dtype), cv=jax.random.normal(ks[10], (1, Ec, H, D), dtype),
            cidx=jnp.full((1, Ec), (KV - cfg.cmp_len) // cfg.cmp_stride + 1, jnp.int32),
            cmask=jax.random.bernoulli(ks[11], 0.5, (1, Q, Ec)))
    sel = nsa.route(jax.random.uniform(ks[12], (1, Q, H, S // cfg.slc_block)), q_pos, cfg)
    return a, sel


def slc_args(a):
    return a["q"], a["q_pos"], a["k"], a["v"], a["kv_len"]


# -- selected branch: naive and grouped ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_naive_verify_equals_reference_selected_branch(dtype):
    a, sel = make_inputs(1, dtype)
    ref = nsa.selected_branch(*slc_args(a), sel, CFG, a["extra"])
    with poison_outputs():
        out = naive_verify(*slc_args(a), sel, CFG, a["extra"], interpret=True)
    assert rel_rms(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("group_size,nsplit", [(1, 1), (2, 3), (4, 2), (8, 1)])
def test_grouped_mode_A_equals_reference_selected_and_window(group_size, nsplit):
    a, sel = make_inputs(2 + group_size)
    ref_s = nsa.selected_branch(*slc_args(a), sel, CFG, a["extra"])
    ref_w = nsa.window_branch(*slc_args(a), CFG, a["extra"])
    with poison_outputs():
        o_s, o_w = grouped_verify(*slc_args(a), sel, CFG, a["extra"], mode="A", group_size=group_size, window=True,
                                  nsplit=nsplit, interpret=True)
    assert rel_rms(o_s, ref_s) <= 1e-5
    assert rel_rms(o_w, ref_w) <= 1e-5


@pytest.mark.parametrize("group_size,nsplit", [(2, 1), (4, 3)])
def test_branch_free_walk_equals_the_skipping_walk_and_the_reference(group_size, nsplit):
    """walk="mask" visits repeated and empty entries too, with every row masked: same result as the reference.
    Queries share most of their blocks here, so repeats are common."""
    a, sel = make_inputs(30 + group_size)
    sel = jnp.where(jnp.arange(CFG.n_slc) < CFG.n_slc - 1, shared_selection(sel, group_size), sel)
    sel = sel.at[:, 0, :, -1].set(-1)  # an empty slot
    ref_s = nsa.selected_branch(*slc_args(a), sel, CFG, a["extra"])
    with poison_outputs():
        o_s, _ = fused_call(*slc_args(a), sel, CFG, a["extra"], group_size=group_size, win=True, nsplit=nsplit,
                            walk="mask", interpret=True)
    assert rel_rms(o_s, ref_s) <= 1e-5


def test_grouped_mode_A_bf16_without_extra_keys():
    a, sel = make_inputs(3, jnp.bfloat16, with_extra=False)
    ref = nsa.selected_branch(*slc_args(a), sel, CFG)
    with poison_outputs():
        out = grouped_verify(*slc_args(a), sel, CFG, mode="A", group_size=4, interpret=True)
    assert rel_rms(out, ref) <= 5e-3


def test_grouped_mode_B_is_the_reference_on_the_group_shared_selection():
    a, sel = make_inputs(4)
    shared = shared_selection(sel, 4)
    assert (shared[:, :4] == sel[:, :1]).all() and (shared[:, 4:] == sel[:, 4:5]).all()
    ref = nsa.selected_branch(*slc_args(a), shared, CFG, a["extra"])
    with poison_outputs():
        out = grouped_verify(*slc_args(a), sel, CFG, a["extra"], mode="B", group_size=4, nsplit=2, interpret=True)
    assert rel_rms(out, ref) <= 1e-5


def test_mode_B_equals_mode_A_when_each_group_shares_its_indices():
    a, sel = make_inputs(5)
    sel = shared_selection(sel, 2)  # every group of 2 queries already shares its blocks
    out_a = grouped_verify(*slc_args(a), sel, CFG, a["extra"], mode="A", group_size=2, interpret=True)
    out_b = grouped_verify(*slc_args(a), sel, CFG, a["extra"], mode="B", group_size=2, interpret=True)
    np.testing.assert_allclose(np.asarray(out_b), np.asarray(out_a), rtol=1e-6, atol=1e-6)


# -- compressed attention (refresh launch 1) and routing ---------------------------------------------------------
@pytest.mark.parametrize("with_extra", [True, False])
def test_compressed_attention_returns_reference_outputs_and_identical_routing(with_extra):
    a, _ = make_inputs(6, with_extra=with_extra)
    ex = a["extra"]
    cargs = (a["q"], a["q_pos"], a["kc"], a["vc"], a["kv_len"], CFG, ex)
    ro, rp, rpx = nsa.compressed_branch(*cargs)
    with poison_outputs():
        o, p, px = compressed_attention(*cargs, nsplit=2, interpret=True)
    assert rel_rms(o, ro) <= 1e-5 and rel_rms(p, rp) <= 1e-5
    assert (px is None) == (rpx is None) and (px is None or rel_rms(px, rpx) <= 1e-5)
    with poison_outputs():
        o_only = compressed_attention(*cargs, nsplit=3, interpret=True, probs=False)
    assert o_only[1] is None and o_only[2] is None and rel_rms(o_only[0], ro) <= 1e-5
    cidx = None if ex is None else ex.cidx
    route = lambda p, px: nsa.route(nsa.block_importance(p, px, cidx, CFG, S // CFG.slc_block), a["q_pos"], CFG)  # noqa
    assert (route(p, px) == route(rp, rpx)).all()


# -- top-n (routing and the draft tree) --------------------------------------------------------------------------
@pytest.mark.parametrize("rows,width,n", [(5, 100, 16), (3, 2000, 16), (2, 9000, 8), (1, 16, 16), (7, 33, 3)])
def test_top_n_kernel_equals_lax_top_k_with_ties_and_infinities(rows, width, n):
    """Same values and indices, in the same order, as `jax.lax.top_k` on fresh scores full of ties, +inf (forced
    blocks) and -inf (absent blocks), including rows with fewer than n finite entries. Widths past
    `MAX_TILE` take the two-stage path (per-chunk top-n, then over the candidates)."""
    r = np.random.default_rng()
    score = r.integers(0, 5, (rows, width)).astype(np.float32)
    score[r.random(score.shape) < 0.05] = np.inf
    score[r.random(score.shape) < 0.4] = -np.inf
    score[0, : width - 1] = -np.inf  # one row with a single finite entry
    with poison_outputs():
        val, idx = topn.top_n(jnp.asarray(score), n, interpret=True)
    ref_val, ref_idx = jax.lax.top_k(jnp.asarray(score), n)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))


def test_top_n_kernel_keeps_leading_axes_and_dtype():
    score = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (2, 3, 4, 50), jnp.bfloat16)
    val, idx = topn.top_n(score, 5, interpret=True)
    ref_val, ref_idx = jax.lax.top_k(score, 5)
    assert val.dtype == jnp.bfloat16 and idx.shape == (2, 3, 4, 5)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))


@pytest.mark.parametrize("rows,width,n,ties", [(4, 2048, 4, False), (1, 2048, 4, True), (3, 100, 7, False),
                                              (2, 9000, 8, False), (5, 33, 3, True)])
def test_top_n_log_softmax_equals_top_k_of_the_log_softmax(rows, width, n, ties):
    """The draft tree's selection: the indices of `jax.lax.top_k(jax.nn.log_softmax(x), n)` in its order (ties to
    the lower index) and its log-probs, on fresh logits, one launch up to `MAX_TILE` ids (the log-softmax formed
    in the kernel) and two stages past it. Integer logits make ties."""
    r = np.random.default_rng()
    x = r.integers(-3, 4, (rows, width)) if ties else r.normal(0.0, 4.0, (rows, width))
    x = jnp.asarray(x, jnp.float32)
    with poison_outputs():
        val, idx = topn.top_n_log_softmax(x, n, interpret=True)
    ref_val, ref_idx = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), n)
    assert val.dtype == jnp.float32 and idx.shape == (rows, n)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_allclose(np.asarray(val), np.asarray(ref_val), rtol=1e-6, atol=1e-6)


def test_top_n_log_softmax_keeps_leading_axes_and_rejects_a_bad_n():
    x = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (2, 3, 64), jnp.bfloat16)
    val, idx = topn.top_n_log_softmax(x, 4, interpret=True)
    assert val.shape == idx.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(jax.lax.top_k(x, 4)[1]))
    for bad in (0, 65, 2.0):
        with pytest.raises(ValueError, match="n="):
            topn.top_n_log_softmax(x, bad, interpret=True)


@pytest.mark.parametrize("n", [0, 11, 2.0])
def test_top_n_kernel_rejects_a_bad_n(n):
    with pytest.raises(ValueError, match="n="):
        topn.top_n(jnp.zeros((2, 10)), n, interpret=True)


def test_refresh_layer_routes_identically_through_the_top_n_kernel(monkeypatch):
    """With the rank fusion's size limit at zero, routing takes the Pallas top-n kernel: same selection, same
    output."""
    monkeypatch.setattr(topn, "RANK_MAX_PAIRS", -1)
    a, _ = make_inputs(int(np.random.default_rng().integers(1 << 30)))
    ref_o, ref_sel = nsa.nsa_attention(**a, cfg=CFG)
    with poison_outputs():
        o, sel = refresh_layer(**a, cfg=CFG, mode="A", group_size=2, interpret=True)
    assert (sel == ref_sel).all()
    assert rel_rms(o, ref_o) <= TOL[jnp.float32]


# -- whole layers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,group_size", [(jnp.float32, 2), (jnp.bfloat16, 8)])
def test_refresh_layer_equals_nsa_attention_and_routes_identically(dtype, group_size):
    a, _ = make_inputs(7, dtype)
    ref_o, ref_sel = nsa.nsa_attention(**a, cfg=CFG)
    with poison_outputs():
        o, sel = refresh_layer(**a, cfg=CFG, mode="A", group_size=group_size, interpret=True)
    assert (sel == ref_sel).all()
    assert o.dtype == dtype and rel_rms(o, ref_o) <= TOL[dtype]


@pytest.mark.parametrize("dtype,mode,group_size", [(jnp.float32, "A", 4), (jnp.bfloat16, "A", 8),
                                                   (jnp.float32, "B", 4), (jnp.float32, "B", 8)])
def test_reuse_layer_one_launch_equals_nsa_attention_with_inherited_sel(dtype, mode, group_size):
    """C*G = 8 rows are padded to 16 and packed by XLA; C*G = 16 rows are read and written in place."""
    a, sel = make_inputs(8, dtype)
    eff = effective_selection(sel, mode, group_size)
    ref_o, _ = nsa.nsa_attention(**a, cfg=CFG, sel=eff)
    with poison_outputs():
        o, out_sel = reuse_layer(**a, sel=sel, cfg=CFG, mode=mode, group_size=group_size, interpret=True)
    assert (out_sel == eff).all()
    assert o.dtype == dtype and rel_rms(o, ref_o) <= TOL[dtype]


@pytest.mark.parametrize("launches,walk", [(1, "skip"), (2, "skip"), (2, "mask")])
def test_reuse_layer_split_and_two_launch_variants_equal_reference(launches, walk):
    a, sel = make_inputs(9)
    ref_o, _ = nsa.nsa_attention(**a, cfg=CFG, sel=sel)
    with poison_outputs():
        o, _ = reuse_layer(**a, sel=sel, cfg=CFG, group_size=2, nsplit=3, interpret=True, launches=launches,
                           walk=walk)
    assert rel_rms(o, ref_o) <= 1e-5


def test_nsa_attention_kernel_has_the_reference_signature():
    ref = list(inspect.signature(nsa.nsa_attention).parameters)
    ours = list(inspect.signature(nsa_attention_kernel).parameters)
    assert ours[: len(ref)] == ref
    assert ours[len(ref):] == ["mode", "group_size", "interpret"]


@pytest.mark.parametrize("mode", ["A", "naive"])
def test_nsa_attention_kernel_dispatches_refresh_without_sel_and_reuse_with_sel(mode):
    a, sel = make_inputs(10)
    ref_o, ref_sel = nsa.nsa_attention(**a, cfg=CFG)
    with poison_outputs():
        o, s = nsa_attention_kernel(**a, cfg=CFG, mode=mode, group_size=2, interpret=True)
    assert (s == ref_sel).all() and rel_rms(o, ref_o) <= 1e-5
    ref_o, _ = nsa.nsa_attention(**a, cfg=CFG, sel=sel)
    with poison_outputs():
        o, s = nsa_attention_kernel(**a, cfg=CFG, sel=sel, mode=mode, group_size=2, interpret=True)
    assert (s == sel).all() and rel_rms(o, ref_o) <= 1e-5


# -- overlap utilities -------------------------------------------------------------------------------------------
def test_overlap_gamma_and_merged_sizes_on_hand_built_selections():
    sel = jnp.array([[[[0, 5, 6, 7]], [[0, 5, 6, 9]], [[1, 2, 3, 4]], [[1, 2, -1, -1]]]], jnp.int32)  # [1,4,1,4]
    np.testing.assert_allclose(np.asarray(overlap_gamma(sel))[0, :, 0], [0.75, 0.0, 0.5])
    np.testing.assert_array_equal(np.asarray(merged_sizes(sel, 2))[0, 0], [5, 4])
    np.testing.assert_array_equal(np.asarray(merged_sizes(sel, 4))[0, 0], [9])
    blocks, count = merged_blocks(sel, 2)
    np.testing.assert_array_equal(np.asarray(blocks)[0, 0, 0, :5], [0, 5, 6, 7, 9])  # sorted, unique
    np.testing.assert_array_equal(np.asarray(blocks)[0, 0, 0, 5:], 0)  # padding
    assert int(count[0, 0, 1]) == 4


@pytest.mark.parametrize("gamma", [0.5, 0.75])
def test_synthetic_selection_has_forced_blocks_and_the_requested_overlap(gamma):
    pos = (4096 + np.arange(16) // 3)[None].astype(np.int32)
    sel = synthetic_selection(0, pos, 2, 80, 16, 64, gamma)
    for i in range(16):
        cur = pos[0, i] // 64
        assert {0, cur, cur - 1} <= set(sel[0, i, 0]) and len(set(sel[0, i, 0])) == 16
    assert abs(float(jnp.mean(overlap_gamma(jnp.asarray(sel)))) - gamma) < 0.07


# -- wrapper validation ------------------------------------------------------------------------------------------
def test_out_of_range_block_ids_are_rejected_with_the_accepted_range():
    a, sel = make_inputs(11, with_extra=False)
    for bad in (S // CFG.slc_block, -2):
        with pytest.raises(ValueError, match=rf"block id {bad} .*-1 \(empty\) or 0 <= id < {S // CFG.slc_block}"):
            grouped_verify(*slc_args(a), sel.at[0, 0, 0, 1].set(bad), CFG, interpret=True)
        with pytest.raises(ValueError, match=rf"block id {bad}"):
            naive_verify(*slc_args(a), sel.at[0, 3, 1, 0].set(bad), CFG, interpret=True)


@pytest.mark.parametrize("group_size", [0, 3, 16, 128, 2.0])
def test_bad_group_size_is_rejected(group_size):
    a, sel = make_inputs(12, with_extra=False)
    with pytest.raises(ValueError, match=r"group_size C=.*power of two C >= 1 that divides Q"):
        grouped_verify(*slc_args(a), sel, CFG, group_size=group_size, interpret=True)


def test_non_dividing_shapes_and_bad_modes_are_rejected():
    a, sel = make_inputs(13, with_extra=False)
    q, t, k, v, kl = slc_args(a)
    with pytest.raises(ValueError, match=r"cache length S=500 must be a multiple of slc_block=32"):
        grouped_verify(q, t, k[:, :500], v[:, :500], kl, sel, CFG, interpret=True)
    with pytest.raises(ValueError, match=r"number of compressed blocks Nc=60 must be a multiple of 16"):
        compressed_attention(q, t, a["kc"][:, :60], a["vc"][:, :60], kl, CFG, interpret=True)
    with pytest.raises(ValueError, match=r"sel has shape .*accepted"):
        grouped_verify(q, t, k, v, kl, sel[..., :2], CFG, interpret=True)
    with pytest.raises(ValueError, match=r"mode='C' is invalid; accepted"):
        nsa_attention_kernel(**a, cfg=CFG, mode="C", interpret=True)
    with pytest.raises(ValueError, match=r"n_slc=6 is invalid for the kernels; accepted: a power of two"):
        grouped_verify(q, t, k, v, kl, jnp.zeros((1, Q, 2, 6), jnp.int32), CFG.replace(n_slc=6), interpret=True)


# -- the one-query refresh layer (decode): routing inside the kernel ---------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_refresh_layer_equals_nsa_attention_and_routes_identically(dtype):
    """For one query per row, at fresh random lengths from the first token to the end of a cache of several
    routing tiles (including fewer than n candidate blocks, and compressed blocks that spill across a tile),
    the three-launch decode layer routes exactly as the reference and matches its output."""
    rng = np.random.default_rng()
    S2, B = 4096, 2  # tiny: 512 compressed blocks = two routing tiles
    H, Hq, D = CFG.n_kv_heads, CFG.n_heads, CFG.head_dim
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 5)
    k = jax.random.normal(ks[0], (B, S2, H, D), dtype)
    v = jax.random.normal(ks[1], (B, S2, H, D), dtype)
    kc, vc = nsa.compress_all(k, CFG), nsa.compress_all(v, CFG)
    f = jax.jit(lambda q, qp, g, kl: decode_refresh_layer(q, qp, g, k, v, kc, vc, kl, CFG, interpret=True,
                                                          per_program=tuple(int(x) for x in rng.integers(1, 6, 2)),
                                                          cmp_nsplit=3,
                                                          combine_columns=int(rng.choice([4, 8, 16]))))
    tile_edge = 2048 + CFG.cmp_len - 1  # the last block of the first tile completes here and spills over
    for lengths in ([1, 2 + int(rng.integers(60))], [tile_edge, S2], list(rng.integers(1, S2 + 1, B))):
        kv_len = jnp.asarray(lengths, jnp.int32)
        q = jax.random.normal(jax.random.fold_in(ks[2], lengths[1]), (B, 1, Hq, D), dtype)
        gates = jax.nn.sigmoid(jax.random.normal(ks[3], (B, 1, Hq, 3)))
        ref_o, ref_sel = nsa.nsa_attention(q, kv_len[:, None] - 1, gates, k, v, kc, vc, kv_len, CFG)
        with poison_outputs():
            o, sel = f(q, kv_len[:, None] - 1, gates, kv_len)
        assert (sel == ref_sel).all(), lengths
        assert o.dtype == dtype and rel_rms(o, ref_o) <= TOL[dtype]


@pytest.mark.parametrize("kw,needle", [(dict(per_program=(0, 2)), "per_program"), (dict(queries=2), "one query")])
def test_decode_refresh_layer_rejects_bad_calls_naming_the_value(kw, needle):
    a, _ = make_inputs(17, with_extra=False)
    Qn = kw.pop("queries", 1)
    a.update(q=a["q"][:, :Qn], q_pos=a["q_pos"][:, :Qn], gates=a["gates"][:, :Qn])
    a.pop("extra")
    with pytest.raises(ValueError, match=needle):
        decode_refresh_layer(**a, cfg=CFG, interpret=True, **kw)


def test_one_query_dispatch_takes_the_decode_layer_on_stacked_views():
    """`nsa_attention_kernel` with one query and no `sel` runs the decode layer; on `nsa.LayerKV` views of
    stacked caches it equals the sliced layer's reference."""
    a, _ = make_inputs(int(np.random.default_rng().integers(1 << 30)), with_extra=False)
    b, _ = make_inputs(16, with_extra=False)
    a.update(q=a["q"][:, :1], q_pos=a["q_pos"][:, :1], gates=a["gates"][:, :1])
    stack = {n: jnp.stack([b[n], a[n]]) for n in ("k", "v", "kc", "vc")}
    views = {n: nsa.LayerKV(stack[n], jnp.int32(1)) for n in stack}
    ref_o, ref_sel = nsa.nsa_attention(**a, cfg=CFG)
    fn = lambda x: nsa_attention_kernel(**{**a, **x}, cfg=CFG, group_size=1, interpret=True)  # noqa: E731
    assert "decode_refresh" in str(jax.make_jaxpr(fn)(views))
    with poison_outputs():
        o, sel = fn(views)
    assert (sel == ref_sel).all() and rel_rms(o, ref_o) <= 1e-5


COMMIT_L, COMMIT_B, COMMIT_S = 3, 4, 256


def _commit_case(compression: str, rng):
    """Random stacks [L, B, S, Hkv, D] (K, V, KC, VC), MLP compression parameters (or Nones), a new token's fused
    q/k/v/gate product [B, 1, N], positions of two rows that complete a block, and a random layer."""
    cfg = CFG.replace(compression=compression)
    L, B, S2, H, D, l, d = COMMIT_L, COMMIT_B, COMMIT_S, cfg.n_kv_heads, cfg.head_dim, cfg.cmp_len, cfg.cmp_stride
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 10)
    stacks = [jax.random.normal(ks[i], (L, B, S2 // (1 if i < 2 else d), H, D)) for i in range(4)]
    w = (jax.random.normal(ks[4], (H, l, D, D)) / D, jax.random.normal(ks[5], (H, l, D)),
         jax.random.normal(ks[6], (H, l, D, D)) / D, jax.random.normal(ks[7], (H, l, D))) \
        if compression == "mlp" else (None,) * 4
    qkvg = jax.random.normal(ks[8], (B, 1, sum(M._qkvg_widths(cfg))))
    completing = l - 1 + d * rng.integers(0, (S2 - l) // d + 1, 2)
    return cfg, stacks, w, qkvg, completing, jnp.int32(int(rng.integers(L)))


@pytest.mark.parametrize("compression", ["mlp", "mean"])
def test_commit_blocks_appends_exactly_the_completed_blocks_and_touches_nothing_else(compression):
    """After one key per row at fresh random positions (some completing a block, some not, one at the cache's
    end), the in-place commit equals `cache.append_blocks` (`completed_blocks` scattered at its slots): the
    completed block is written to its layer and slot, every other element of both compressed stacks keeps its
    value."""
    from ssv_jax import cache as kvc

    rng = np.random.default_rng()
    cfg, (K, V, KC, VC), w, _, completing, li = _commit_case(compression, rng)
    l, d, S2 = cfg.cmp_len, cfg.cmp_stride, COMMIT_S
    pos = jnp.asarray(np.concatenate([completing, [S2 - 1, l - 1 + d * int(rng.integers(1, 8)) + 1]]), jnp.int32)
    views = nsa.LayerKV(K, li), nsa.LayerKV(V, li)
    kc, vc = commit_blocks(*views, KC, VC, pos, cfg, *w, interpret=True)
    slot, _ = kvc.completed_blocks(views[0], pos, jnp.ones((COMMIT_B,), jnp.int32), 1, cfg, w[0], w[1])
    assert int((slot < S2 // d).sum()) >= 2  # the two completing rows (and the end of the cache) write
    ref_kc, ref_vc = kvc.append_blocks(*views, KC, VC, pos, cfg, *w)
    np.testing.assert_allclose(kc, ref_kc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vc, ref_vc, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["mlp", "mean"])
@pytest.mark.parametrize("features_per_program", [4, 16])  # a slice of one RoPE half per program; the whole head
def test_the_decode_prologue_equals_rope_scatter_commit_and_the_query_layout(compression, features_per_program):
    """Given a new token's fused q/k/v/gate product, one launch writes its roped key and its value at `pos` into
    the K/V stacks (a row past the cache is dropped) and commits the blocks they complete, equal to XLA's RoPE,
    scatter and `cache.append_blocks` on every element of all four stacks; and it returns the roped query and
    the sigmoid gates, equal to `model.apply_rope` and `jax.nn.sigmoid` of the product's columns."""
    from ssv_jax import cache as kvc

    rng = np.random.default_rng()
    cfg, (K, V, KC, VC), w, y, completing, li = _commit_case(compression, rng)
    B, H, Hq, D = COMMIT_B, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    pos = jnp.asarray(np.concatenate([completing, [COMMIT_S, int(rng.integers(0, COMMIT_S))]]), jnp.int32)
    inv_freq = M.rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling)
    q, k, v, g = M._split_columns(y, M._qkvg_widths(cfg), 1)
    q, k = (M.apply_rope(a.reshape(B, 1, -1, D), pos[:, None], inv_freq) for a in (q, k))
    rows = jnp.arange(B)
    ref_k = K.at[li, rows, pos].set(k[:, 0], mode="drop")
    ref_v = V.at[li, rows, pos].set(v.reshape(B, H, D), mode="drop")
    ref_kc, ref_vc = kvc.append_blocks(nsa.LayerKV(ref_k, li), nsa.LayerKV(ref_v, li), KC, VC, pos, cfg, *w)
    cos, sin = M.rope_cos_sin(pos[:, None], inv_freq)
    with poison_outputs():
        *got, query = commit_blocks(nsa.LayerKV(K, li), nsa.LayerKV(V, li), KC, VC, pos, cfg, *w, qkvg=y,
                                    rope=(cos[:, 0], sin[:, 0]), features_per_program=features_per_program,
                                    interpret=True)
    for a, b in zip(got, (ref_k, ref_v, ref_kc, ref_vc)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got_q, got_g = query.as_arrays()
    np.testing.assert_allclose(got_q, q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_g, jax.nn.sigmoid(g).reshape(B, 1, Hq, 3), rtol=1e-6)
    assert (query.rows[:, :, :, Hq // H:] == 0).all()  # the row tile's padding (poisoned before the launch)


def test_the_decode_prologue_rejects_a_product_of_the_wrong_shape():
    K = jnp.zeros((2, 1, 64, CFG.n_kv_heads, CFG.head_dim))
    KC = jnp.zeros((2, 1, 64 // CFG.cmp_stride, CFG.n_kv_heads, CFG.head_dim))
    rope = (jnp.zeros((1, CFG.head_dim // 2)),) * 2
    with pytest.raises(ValueError, match=r"qkvg \(1, 1, 100\).*accepted: qkvg \[B, 1, N\] = \(1, 1, 140\)"):
        commit_blocks(nsa.LayerKV(K, 0), nsa.LayerKV(K, 0), KC, KC, jnp.zeros((1,), jnp.int32), CFG,
                      qkvg=jnp.zeros((1, 1, 100)), rope=rope, interpret=True)


# -- stacked caches read in place ------------------------------------------------------------------------------
@pytest.mark.parametrize("with_sel", [False, True])
def test_layer_views_of_stacked_caches_give_the_sliced_layer_result(with_sel):
    """`nsa.LayerKV(stack, layer)` operands are read in place (no per-layer copy) and equal the sliced layer."""
    a, sel = make_inputs(14)
    b, _ = make_inputs(15)
    stack = {n: jnp.stack([b[n], a[n], b[n]]) for n in ("k", "v", "kc", "vc")}  # layer 1 holds a's cache
    views = {n: nsa.LayerKV(stack[n], jnp.int32(1)) for n in stack}
    assert nsa_attention_kernel.reads_layer_views
    s = sel if with_sel else None
    ref_o, ref_sel = nsa.nsa_attention(**a, cfg=CFG, sel=s)
    for mode in ("A", "naive"):
        with poison_outputs():
            o, out_sel = nsa_attention_kernel(**{**a, **views}, cfg=CFG, sel=s, mode=mode, group_size=8,
                                              interpret=True)
        assert (out_sel == ref_sel).all() and rel_rms(o, ref_o) <= 1e-5


@pytest.mark.parametrize("n", [1, 3, 16, 20])
def test_split_combine_is_the_lse_merge_of_the_partial_states(n):
    """`combine` (elementwise over the splits up to COMBINE_UNROLL_MAX, reductions beyond) against the merge written
    out in float64, with one split that saw no key (m = NEG, l = 0, acc = 0) and a row no split saw."""
    from pallas_kernels._common import NEG, combine

    ks = jax.random.split(jax.random.key(n), 3)
    m = jax.random.normal(ks[0], (2, n, 5)) * 3
    l = jax.random.uniform(ks[1], (2, n, 5), minval=0.5, maxval=4.0)
    acc = jax.random.normal(ks[2], (2, n, 5, 8))
    m, l, acc = m.at[:, 0].set(NEG), l.at[:, 0].set(0.0), acc.at[:, 0].set(0.0)
    m, l, acc = m.at[1, :, 4].set(NEG), l.at[1, :, 4].set(0.0), acc.at[1, :, 4].set(0.0)
    o, mt, lt = combine(acc, m, l, axis=1)
    m64, l64, a64 = (np.asarray(x, np.float64) for x in (m, l, acc))
    w = np.exp(m64 - m64.max(1, keepdims=True))
    want_l = (w * l64).sum(1)
    want_o = (w[..., None] * a64).sum(1) / np.where(want_l > 0, want_l, 1.0)[..., None]
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lt), want_l, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mt).reshape(2, 5), m64.max(1), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(o)[1, 4], 0.0)
