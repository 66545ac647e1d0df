"""The draft head's attention kernel computes what the jnp reference `draft.draft_attention` computes, and the tree
builder drafts the same tree through either.

The kernel runs in interpret mode on fresh random inputs with NaN-poisoned outputs (`poison_outputs`): a NaN-free
result that matches the reference proves every element was written. fp32 max error <= 1e-5, bf16 <= 2e-2 (the
kernel feeds bf16 probabilities to its value product). Shapes: Hq=4, Hkv=2, D=16, a 256-slot cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import poison_outputs
from pallas_kernels.draft_attention import MAX_ROWS, draft_attention as kernel
from ssv_jax import draft as dr
from ssv_jax.tree import TreeSpec, build_tree

B, S, HKV, HQ, D = 2, 256, 2, 4, 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, M, E, dtype):
    ks = jax.random.split(jax.random.key(seed), 7)
    r = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)  # noqa: E731
    q, k, v = r(ks[0], (B, M, HQ, D)), r(ks[1], (B, S, HKV, D)), r(ks[2], (B, S, HKV, D))
    ext = (r(ks[3], (B, E, HKV, D)), r(ks[4], (B, E, HKV, D)), jax.random.bernoulli(ks[5], 0.5, (B, M, E)))
    length = jax.random.randint(ks[6], (B,), 1, S - M)
    return q, k, v, length, ext


def _run_kernel(*args, **kw):
    with poison_outputs():
        return kernel(*args, interpret=True, **kw)


def _max_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(x).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    return float(np.max(np.abs(x - ref)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 40, 7, 1024])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_tree_level_equals_the_reference(seed, window, dtype):
    """M nodes at one position (past the committed length) see the cache within their window plus the
    in-flight keys their mask marks; E = 20 is padded by the kernel wrapper."""
    q, k, v, length, ext = _inputs(seed, 4, 20, dtype)
    pos = jnp.broadcast_to(length[:, None] + seed, (B, 4))
    ref = dr.draft_attention(q, k, v, length, pos, window, [ext])
    out = _run_kernel(q, k, v, length, pos, window, [ext])
    assert out.shape == (B, 4, HQ * D) and out.dtype == dtype
    assert _max_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("window", [None, 33])
@pytest.mark.parametrize("nsplit", [None, 1, 3])
def test_consecutive_entries_as_draft_extend_runs_them_equal_the_reference(window, nsplit):
    """The accepted path of a round: entries at length-A .. length-1, each causal over the cache."""
    q, k, v, length, _ = _inputs(7 + (nsplit or 0), 7, 16, jnp.float32)
    length = jnp.maximum(length, 7)
    pos = length[:, None] - 7 + jnp.arange(7)[None]
    ref = dr.draft_attention(q, k, v, length, pos, window)
    assert _max_err(_run_kernel(q, k, v, length, pos, window, nsplit=nsplit), ref) <= TOL[jnp.float32]


def test_an_entry_that_sees_no_key_gets_zeros():
    q, k, v, _, ext = _inputs(3, 4, 16, jnp.float32)
    length = jnp.zeros((B,), jnp.int32)  # nothing committed and an all-false in-flight mask
    ext = (ext[0], ext[1], jnp.zeros_like(ext[2]))
    pos = jnp.zeros((B, 4), jnp.int32)
    out = _run_kernel(q, k, v, length, pos, 16, [ext])
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(dr.draft_attention(q, k, v, length, pos, 16, [ext])), 0.0)


@pytest.mark.parametrize("kw,needle", [
    (dict(window=0), "window=0"),
    (dict(M=MAX_ROWS), "rows"),
    (dict(extra=2), "extra key sets"),
    (dict(length=(B + 1,)), "length"),
])
def test_bad_calls_are_rejected_naming_the_value(kw, needle):
    M = kw.get("M", 4)
    q, k, v, length, ext = _inputs(0, M, 16, jnp.float32)
    if "length" in kw:
        length = jnp.ones(kw["length"], jnp.int32)
    with pytest.raises(ValueError, match=needle):
        kernel(q, k, v, length, jnp.zeros((B, M), jnp.int32), kw.get("window"), [ext] * kw.get("extra", 1),
               interpret=True)


def _head(seed=0):
    dcfg = dr.DraftConfig(hidden=32, n_heads=HQ, n_kv_heads=HKV, head_dim=D, ffn=64, draft_vocab=48,
                          target_vocab=64, feature_layers=(0, 1, 2), max_seq_len=S, window=24)
    params = dr.init_draft_params(dcfg, jax.random.key(seed), d2t=jnp.zeros((48,), jnp.int32))
    return dcfg, params


def test_draft_tree_level_equals_draft_tree_step_with_the_own_entries_appended():
    """The builder's step (own k/v written into the in-flight buffer first) is the public step's math."""
    dcfg, params = _head()
    ks = jax.random.split(jax.random.key(5), 6)
    embed = jax.random.normal(ks[0], (64, 32))
    cache = dr.DraftCache(jax.random.normal(ks[1], (1, S, HKV, D)), jax.random.normal(ks[2], (1, S, HKV, D)),
                          jnp.array([100]))
    hidden, tokens, pos = jax.random.normal(ks[3], (1, 4, 32)), jnp.array([[3, 9, 9, 60]]), jnp.full((1, 4), 100)
    ext_k, ext_v = jax.random.normal(ks[4], (1, 16, HKV, D)), jax.random.normal(ks[5], (1, 16, HKV, D))
    anc = jnp.zeros((1, 4, 16), bool).at[0, :, :4].set(jnp.array([True, False, True, True]))
    h1, lg1, k, v = dr.draft_tree_step(params, dcfg, embed, hidden, tokens, pos, cache, ext_k[:, :4], ext_v[:, :4],
                                       anc[:, :, :4])
    own = anc.at[0, jnp.arange(4), 8 + jnp.arange(4)].set(True)
    h2, lg2, ek, ev = dr.draft_tree_level(params, dcfg, embed, hidden, tokens, pos, cache, ext_k, ext_v, own, 8)
    np.testing.assert_allclose(np.asarray(h2), np.asarray(h1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lg2), np.asarray(lg1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ek[:, 8:12]), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(ev[:, 8:12]), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(ek[:, :8]), np.asarray(ext_k[:, :8]))


@pytest.mark.parametrize("seed", [0, 1])
def test_build_tree_drafts_the_same_tree_through_the_kernel(seed):
    """fp32: the kernel's attention changes no draft token, parent or position of the tree."""
    dcfg, params = _head(seed)
    ks = jax.random.split(jax.random.key(10 + seed), 4)
    embed = jax.random.normal(ks[0], (64, 32))
    T = jnp.array([90, 130])
    cache = dr.DraftCache(jax.random.normal(ks[1], (B, S, HKV, D)), jax.random.normal(ks[2], (B, S, HKV, D)), T)
    root_hidden = jax.random.normal(ks[3], (B, 32))
    spec = TreeSpec(top_k=3, depth=4, budget=10)
    ref = build_tree(params, dcfg, embed, root_hidden, jnp.array([5, 6]), T, cache, spec)
    with poison_outputs():
        out = build_tree(params, dcfg, embed, root_hidden, jnp.array([5, 6]), T, cache, spec,
                         attention=lambda *a: kernel(*a, interpret=True))
    for name in ("tokens", "parents", "depth", "positions", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(out.scores), np.asarray(ref.scores), rtol=1e-5, atol=1e-5)
