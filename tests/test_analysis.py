"""Overlap measures behind the paper's observations."""

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import analysis
from ssv_jax import model as M
from ssv_jax.config import get_config


def test_set_overlap_counts_shared_valid_blocks():
    a = jnp.asarray([[0, 3, 5, -1], [1, 2, 3, 4], [-1, -1, -1, -1]])
    b = jnp.asarray([[5, 0, 9, -1], [4, 3, 2, 1], [0, 1, 2, 3]])
    np.testing.assert_allclose(np.asarray(analysis.set_overlap(a, b))[:2], [2 / 3, 1.0])
    assert np.isnan(np.asarray(analysis.set_overlap(a, b))[2])


def test_layer_stability_is_one_for_identical_layers_and_lower_for_shuffled():
    r = np.random.default_rng(0)
    base = jnp.asarray(r.permutation(64)[:8].reshape(1, 1, 1, 1, 8)).repeat(3, 0)
    out = analysis.layer_stability(base, 2)
    np.testing.assert_allclose(out[:2, 0], 1.0)
    assert np.isnan(out[2, 0]) and np.isnan(out[1, 1])
    moved = base.at[1].set(base[1] + 64)  # layer 1 picks disjoint blocks
    assert analysis.layer_stability(moved, 1)[0, 0] == 0.0


def test_model_selections_have_the_routing_shape_and_forced_blocks():
    cfg = get_config("tiny")
    params = M.init_params(cfg, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (1, 256), 0, cfg.vocab_size)
    sels = analysis.sequence_selections(params, cfg, toks)
    assert sels.shape == (cfg.n_layers, 1, 256, cfg.n_kv_heads, cfg.n_slc)
    t = 200
    assert {0, t // cfg.slc_block, t // cfg.slc_block - 1} <= set(np.asarray(sels[0, 0, t, 0]).tolist())
    stab = analysis.layer_stability(sels, 2, min_pos=128)
    assert np.all((stab[:-2, :] >= 0) & (stab[:-2, :] <= 1))
