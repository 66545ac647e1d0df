"""EAGLE-3 draft head: config validation, shapes, shared embedding, d2t, cache consistency (issue 4, (e), (f))."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ssv_jax.config import get_config
from ssv_jax.draft import (DraftConfig, Eagle3Head, check_compatible, draft_extend, draft_logits, draft_to_target,
                           draft_tree_step, init_draft_cache, init_draft_params)

CFG = get_config("tiny")
DCFG = DraftConfig.for_target(CFG, draft_vocab=100, max_seq_len=24)
B, T = 2, 9
extend = jax.jit(draft_extend, static_argnums=1)


@pytest.fixture(scope="module")
def setup():
    params = init_draft_params(DCFG, jax.random.key(0))
    embed = jax.random.normal(jax.random.key(1), (CFG.vocab_size, CFG.hidden))
    feats = jax.random.normal(jax.random.key(2), (B, T, 3 * CFG.hidden))
    nxt = jax.random.randint(jax.random.key(3), (B, T), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    return params, embed, feats, nxt, pos


# -- config ------------------------------------------------------------------------------------------------------
def test_for_target_matches():
    assert DCFG.hidden == CFG.hidden and DCFG.target_vocab == CFG.vocab_size
    assert DCFG.feature_layers == CFG.features and DCFG.n_features == 3
    assert DCFG.rope_theta == 10000.0 and not DCFG.has_embed
    check_compatible(DCFG, CFG)
    hash(DCFG)  # a valid jit static argument


def test_config_dict_roundtrip():
    import json

    d = json.loads(json.dumps(DCFG.to_dict()))
    assert DraftConfig.from_dict(d) == DCFG
    with pytest.raises(ValueError, match="unknown DraftConfig fields"):
        DraftConfig.from_dict(dict(d, bogus=1))


@pytest.mark.parametrize("change,what", [
    (dict(hidden=32), "hidden=32"),
    (dict(target_vocab=300), "target_vocab=300"),
    (dict(feature_layers=(0, 1, 2)), r"feature_layers=\(0, 1, 2\)"),
])
def test_check_compatible_mismatch(change, what):
    d = DCFG.replace(**change)
    with pytest.raises(ValueError, match=f"draft/target mismatch: DraftConfig.{what}"):
        check_compatible(d, CFG)


@pytest.mark.parametrize("change,what", [
    (dict(hidden=0), "hidden=0"),
    (dict(n_heads=3), "n_heads=3"),
    (dict(head_dim=15), "head_dim=15"),
    (dict(draft_vocab=257), "draft_vocab=257"),
    (dict(feature_layers=()), r"feature_layers=\(\)"),
    (dict(rope_theta=0.0), "rope_theta=0.0"),
    (dict(window=0), "window=0"),
])
def test_config_validation(change, what):
    with pytest.raises(ValueError, match=f"DraftConfig.{what} is invalid; accepted"):
        DCFG.replace(**change)


def test_bad_d2t():
    with pytest.raises(ValueError, match="d2t has shape"):
        init_draft_params(DCFG, jax.random.key(0), d2t=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        init_draft_params(DCFG, jax.random.key(0), d2t=jnp.full((100,), 200, jnp.int32))


# -- parameters and shapes ---------------------------------------------------------------------------------------
def test_param_shapes(setup):
    params = setup[0]
    H, D, F, V, Vd = CFG.hidden, CFG.head_dim, CFG.ffn, CFG.vocab_size, 100
    Hq, Hkv = CFG.n_heads, CFG.n_kv_heads
    want = {"fc": (3 * H, H), "hidden_norm": (H,), "input_norm": (H,), "post_norm": (H,), "wq": (2 * H, Hq * D),
            "wk": (2 * H, Hkv * D), "wv": (2 * H, Hkv * D), "wo": (Hq * D, H), "w_gate": (H, F), "w_up": (H, F),
            "w_down": (F, H), "norm": (H,), "lm_head": (H, Vd), "d2t": (Vd,), "t2d": (V,)}
    assert {k: v.shape for k, v in params.items()} == want
    assert params["d2t"].dtype == jnp.int32 and params["t2d"].dtype == jnp.bool_
    assert int(params["t2d"].sum()) == Vd
    p2 = init_draft_params(DCFG, jax.random.key(0))  # (e) seeded
    for k in params:
        np.testing.assert_array_equal(params[k], p2[k])
    pb = init_draft_params(DCFG.replace(has_embed=True), jax.random.key(0), dtype=jnp.bfloat16)
    assert pb["embed"].shape == (V, H) and pb["wq"].dtype == jnp.bfloat16


def test_extend_shapes(setup):
    params, embed, feats, nxt, pos = setup
    h, logits, cache = extend(params, DCFG, embed, feats, nxt, pos, jnp.ones((B, T), bool), init_draft_cache(DCFG, B))
    assert h.shape == (B, T, CFG.hidden) and logits.shape == (B, T, 100) and logits.dtype == jnp.float32
    assert cache.k.shape == (B, 24, CFG.n_kv_heads, CFG.head_dim)
    np.testing.assert_array_equal(cache.length, [T, T])
    np.testing.assert_allclose(logits, draft_logits(params, DCFG, h), rtol=1e-6)
    assert bool(jnp.all(jnp.isfinite(h)))


# -- shared embedding ---------------------------------------------------------------------------------------------
def test_shared_embedding_path(setup):
    """A head without an embedding using the target's table equals the same head owning that table."""
    params, embed, feats, nxt, pos = setup
    valid = jnp.ones((B, T), bool)
    c0 = init_draft_cache(DCFG, B)
    h1, l1, _ = extend(params, DCFG, embed, feats, nxt, pos, valid, c0)
    own = dict(params, embed=embed)
    d_own = DCFG.replace(has_embed=True)
    h2, l2, _ = extend(own, d_own, None, feats, nxt, pos, valid, c0)
    np.testing.assert_allclose(h1, h2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-6, atol=1e-6)
    # the head's own table wins over a passed one
    h3, _, _ = extend(own, d_own, embed * 0.0, feats, nxt, pos, valid, c0)
    np.testing.assert_allclose(h1, h3, rtol=1e-6, atol=1e-6)
    # and the embedding really matters
    h4, _, _ = extend(params, DCFG, embed * 2.0 + 1.0, feats, nxt, pos, valid, c0)
    assert float(jnp.max(jnp.abs(h4 - h1))) > 1e-2
    with pytest.raises(ValueError, match="pass the target's embedding"):
        draft_extend(params, DCFG, None, feats, nxt, pos, valid, c0)


# -- d2t ----------------------------------------------------------------------------------------------------------
def test_d2t_mapping():
    d2t = (jnp.arange(100, dtype=jnp.int32) * 2 + 5) - jnp.arange(100, dtype=jnp.int32)  # draft i -> target 2i + 5
    p = init_draft_params(DCFG, jax.random.key(4), d2t=d2t)
    np.testing.assert_array_equal(draft_to_target(p, jnp.array([0, 1, 99])), [5, 7, 203])
    t2d = np.zeros(CFG.vocab_size, bool)
    t2d[np.arange(100) * 2 + 5] = True
    np.testing.assert_array_equal(p["t2d"], t2d)


# -- cache consistency --------------------------------------------------------------------------------------------
def test_extend_one_call_equals_token_by_token(setup):
    params, embed, feats, nxt, pos = setup
    valid = jnp.ones((B, T), bool)
    h_all, l_all, c_all = extend(params, DCFG, embed, feats, nxt, pos, valid, init_draft_cache(DCFG, B))
    c = init_draft_cache(DCFG, B)
    hs, ls = [], []
    for i in range(T):
        h, l, c = extend(params, DCFG, embed, feats[:, i:i + 1], nxt[:, i:i + 1], pos[:, i:i + 1],
                         valid[:, i:i + 1], c)
        hs.append(h)
        ls.append(l)
    np.testing.assert_allclose(jnp.concatenate(hs, 1), h_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(ls, 1), l_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c.k, c_all.k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.v, c_all.v, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(c.length, c_all.length)


def test_extend_valid_mask_chunks(setup):
    """Committing in fixed-width chunks with a padded tail (rows of different lengths) gives the one-call result."""
    params, embed, feats, nxt, pos = setup
    h_all, _, c_all = extend(params, DCFG, embed, feats, nxt, pos, jnp.ones((B, T), bool), init_draft_cache(DCFG, B))
    A = 4
    c = init_draft_cache(DCFG, B)
    done = np.zeros(B, int)
    steps = [np.array([4, 2]), np.array([3, 4]), np.array([2, 3])]  # per-row counts; row sums = 9
    for cnt in steps:
        idx = jnp.asarray(np.minimum(done[:, None] + np.arange(A)[None], T - 1))
        valid = jnp.asarray(np.arange(A)[None] < cnt[:, None])
        g = lambda x: jnp.take_along_axis(x, idx if x.ndim == 2 else idx[..., None], axis=1)
        p = jnp.asarray(done[:, None] + np.arange(A)[None])
        h, _, c = extend(params, DCFG, embed, g(feats), g(nxt), p, valid, c)
        for b in range(B):
            np.testing.assert_allclose(h[b, :cnt[b]], h_all[b, done[b]:done[b] + cnt[b]], rtol=1e-5, atol=1e-5)
        done += cnt
    np.testing.assert_array_equal(c.length, [T, T])
    np.testing.assert_allclose(c.k[:, :T], c_all.k[:, :T], rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(c.k[:, T:]))) == 0.0  # padded entries never written


def test_tree_step_sees_ancestors_not_siblings(setup):
    """Tree-step outputs depend on the masked-in in-flight keys only."""
    params, embed, feats, nxt, pos = setup
    _, _, c = extend(params, DCFG, embed, feats, nxt, pos, jnp.ones((B, T), bool), init_draft_cache(DCFG, B))
    hid = jax.random.normal(jax.random.key(5), (B, 2, CFG.hidden))
    tok = jnp.array([[3, 4], [5, 6]])
    p = jnp.full((B, 2), T + 1)
    ek = jax.random.normal(jax.random.key(6), (B, 3, CFG.n_kv_heads, CFG.head_dim))
    ev = jax.random.normal(jax.random.key(7), (B, 3, CFG.n_kv_heads, CFG.head_dim))
    m = jnp.array([[True, False, False], [False, True, True]])[None].repeat(B, 0)
    step = jax.jit(draft_tree_step, static_argnums=1)
    out, lg, k, v = step(params, DCFG, embed, hid, tok, p, c, ek, ev, m)
    assert out.shape == (B, 2, CFG.hidden) and lg.shape == (B, 2, 100) and k.shape == (B, 2, CFG.n_kv_heads,
                                                                                      CFG.head_dim)
    # node 0 sees only entry 0: perturbing entries 1, 2 leaves it unchanged and changes node 1
    ek2 = ek.at[:, 1:].set(0.0)
    out2, _, _, _ = step(params, DCFG, embed, hid, tok, p, c, ek2, ev, m)
    np.testing.assert_allclose(out2[:, 0], out[:, 0], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(out2[:, 1] - out[:, 1]))) > 1e-4
    # each node computed alone (M = 1) equals its row in the batched step: no leak between siblings
    for j in range(2):
        o1, l1, _, _ = step(params, DCFG, embed, hid[:, j:j + 1], tok[:, j:j + 1], p[:, j:j + 1], c, ek, ev,
                            m[:, j:j + 1])
        np.testing.assert_allclose(o1[:, 0], out[:, j], rtol=1e-5, atol=1e-5)


def test_chunked_attention_equals_dense(setup, monkeypatch):
    """Long caches run over key chunks with an online softmax; it must match the dense pass."""
    import ssv_jax.draft as draft_mod

    params, embed, feats, nxt, pos = setup
    valid = jnp.ones((B, T), bool).at[1, 6:].set(False)
    c0 = init_draft_cache(DCFG, B)
    dense = draft_extend(params, DCFG, embed, feats, nxt, pos, valid, c0)
    monkeypatch.setattr(draft_mod, "DENSE_SCORES_MAX", B * CFG.n_heads * T * 6)  # chunks of 6 slots (24 = 4 x 6)
    assert draft_mod._chunk(24, B * CFG.n_heads * T) == 6
    chunked = draft_extend(params, DCFG, embed, feats, nxt, pos, valid, c0)
    np.testing.assert_allclose(chunked[0][0], dense[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked[0][1, :6], dense[0][1, :6], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(chunked[2].length, [T, 6])


@pytest.mark.parametrize("window", [None, 5])
def test_tree_steps_equal_committing_the_path(setup, window):
    """A chain of tree steps (each seeing the earlier chain entries in flight) computes what `draft_extend`
    computes when it commits the same entries: with fc = [I; 0; 0] the extend's h equals the given hidden, so
    positions, masks and the self key must agree exactly. With an attention window shorter than the context, the
    tree step (which reads a slice of the cache) and the extend (which masks the whole cache) agree too."""
    params, embed, feats, nxt, pos = setup
    dcfg = DCFG.replace(window=window)
    H = CFG.hidden
    p = dict(params, fc=jnp.concatenate([jnp.eye(H), jnp.zeros((2 * H, H))], 0))
    _, _, c = extend(p, dcfg, embed, feats, nxt, pos, jnp.ones((B, T), bool), init_draft_cache(dcfg, B))
    L = 3
    hs = jax.random.normal(jax.random.key(8), (B, L, H))
    toks = jax.random.randint(jax.random.key(9), (B, L), 0, CFG.vocab_size)
    cpos = T + jnp.broadcast_to(jnp.arange(L), (B, L))
    f = jnp.concatenate([hs, jnp.zeros((B, L, 2 * H))], -1)
    h_ext, l_ext, _ = extend(p, dcfg, embed, f, toks, cpos, jnp.ones((B, L), bool), c)
    step = jax.jit(draft_tree_step, static_argnums=1)
    ks, vs = jnp.zeros((B, 0, CFG.n_kv_heads, CFG.head_dim)), jnp.zeros((B, 0, CFG.n_kv_heads, CFG.head_dim))
    for j in range(L):
        out, lg, k, v = step(p, dcfg, embed, hs[:, j:j + 1], toks[:, j:j + 1], cpos[:, j:j + 1], c, ks, vs,
                             jnp.ones((B, 1, j), bool))
        np.testing.assert_allclose(out[:, 0], h_ext[:, j], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lg[:, 0], l_ext[:, j], rtol=1e-5, atol=1e-5)
        ks, vs = jnp.concatenate([ks, k], 1), jnp.concatenate([vs, v], 1)
    if window is not None:  # the window changed what the entries see
        h_all, _, _ = extend(p, DCFG, embed, f, toks, cpos, jnp.ones((B, L), bool), c)
        assert float(jnp.max(jnp.abs(h_all - h_ext))) > 1e-3


def test_shape_validation(setup):
    params, embed, feats, nxt, pos = setup
    c0 = init_draft_cache(DCFG, B)
    with pytest.raises(ValueError, match="feats"):
        draft_extend(params, DCFG, embed, feats[..., :-1], nxt, pos, jnp.ones((B, T), bool), c0)
    with pytest.raises(ValueError, match="embed"):
        draft_extend(params, DCFG, embed[:, :-1], feats, nxt, pos, jnp.ones((B, T), bool), c0)


# -- the NNX module -----------------------------------------------------------------------------------------------
def test_nnx_head_roundtrip(setup):
    params, embed, feats, nxt, pos = setup
    head = Eagle3Head(DCFG, params=params)
    graphdef, state = nnx.split(head)
    head2 = nnx.merge(graphdef, state)
    for k, v in head2.params().items():
        np.testing.assert_array_equal(v, params[k])
    valid = jnp.ones((B, T), bool)
    c0 = init_draft_cache(DCFG, B)
    h1, _, _ = jax.jit(lambda st: nnx.merge(graphdef, st).extend(embed, feats, nxt, pos, valid, c0))(state)
    h2, _, _ = extend(params, DCFG, embed, feats, nxt, pos, valid, c0)
    np.testing.assert_allclose(h1, h2, rtol=1e-6, atol=1e-6)
    assert len(jax.tree.leaves(nnx.state(head2, nnx.Param))) == 13  # d2t/t2d are buffers, not trainable
    fresh = Eagle3Head(DCFG.replace(has_embed=True), rngs=nnx.Rngs(0))
    assert "embed" in fresh.params()
    with pytest.raises(ValueError, match="rngs"):
        Eagle3Head(DCFG)
