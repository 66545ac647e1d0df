"""Overlap measures behind the paper's observations, and mode B's cost against mode A."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


# Mode B against mode A (DESIGN.md: mode B has no AR twin; its cost is acceptance length and next-token agreement)

def _tiny_ssv():
    from ssv_jax import draft as dr
    from ssv_jax.speculative import SSVModel

    cfg = get_config("tiny", max_seq_len=1024)
    dcfg = dr.DraftConfig.for_target(cfg)
    model = SSVModel(cfg, M.init_params(cfg, jax.random.key(0)), dcfg, dr.init_draft_params(dcfg, jax.random.key(1)))
    prompt = np.asarray(jax.random.randint(jax.random.key(2), (1, 150), 0, cfg.vocab_size))
    return model, prompt


def _mode_b(group_size: int):
    from ssv_jax.policy import SSVPolicy

    return SSVPolicy(top_k=4, depth=4, budget=16, order="dfs", mode="B", group_size=group_size, precision="approx")


def test_mode_b_in_groups_of_one_is_mode_a():
    model, prompt = _tiny_ssv()
    r = analysis.mode_b_agreement(model, prompt, _mode_b(1), rounds=3, prefill_chunk=64)
    np.testing.assert_allclose(r["max_logit_gap"], 0.0, atol=1e-5)  # a group of one routes with its own blocks
    np.testing.assert_array_equal(r["node_agreement"], 1.0)
    np.testing.assert_array_equal(r["emitted_agreement"], 1.0)
    np.testing.assert_array_equal(r["accepted_a"], r["accepted_b"])


def test_mode_b_agreement_scores_shared_routing_along_mode_as_greedy_text():
    from ssv_jax.generate import ar_generate

    model, prompt = _tiny_ssv()
    rounds = 3
    r = analysis.mode_b_agreement(model, prompt, _mode_b(16), rounds=rounds, prefill_chunk=64)
    for k in ("node_agreement", "emitted_agreement", "accepted_a", "accepted_b", "max_logit_gap"):
        assert r[k].shape == (rounds, 1), k
    # one group of 16 queries shares the root's blocks: the logits move, though the argmax mostly holds
    assert np.all(r["max_logit_gap"] > 1e-3)
    assert np.all((r["node_agreement"] >= 0) & (r["node_agreement"] <= 1))
    assert np.all((r["emitted_agreement"] >= 0) & (r["emitted_agreement"] <= 1))
    assert np.all((r["accepted_a"] >= 1) & (r["accepted_a"] <= 5) & (r["accepted_b"] >= 1) & (r["accepted_b"] <= 5))
    # the rounds advance along mode A, whose greedy text is greedy AR's
    n = r["tokens"].shape[1]
    assert n == 1 + int(r["accepted_a"].sum())
    np.testing.assert_array_equal(r["tokens"], ar_generate(model[:2], prompt, n, prefill_chunk=64).tokens)


def test_mode_b_agreement_rejects_bad_input():
    model, prompt = _tiny_ssv()
    with pytest.raises(ValueError, match="mode='B'"):
        analysis.mode_b_agreement(model, prompt, _mode_b(4).replace(mode="A", precision="exact"), rounds=2)
    with pytest.raises(ValueError, match="rounds=0"):
        analysis.mode_b_agreement(model, prompt, _mode_b(4), rounds=0)
    with pytest.raises(ValueError, match="prefill_chunk=0 is invalid"):
        analysis.mode_b_agreement(model, prompt, _mode_b(4), rounds=2, prefill_chunk=0)


# Refresh/reuse schedules against refresh-every-layer, teacher-forced on the same text

def test_schedules_agree_until_routing_has_blocks_to_choose_and_then_part():
    cfg = get_config("tiny")  # n = 4 selected blocks of l' = 32: routing chooses from position 128 on
    params = M.init_params(cfg, jax.random.key(0))
    short = jax.random.randint(jax.random.key(1), (2, cfg.n_slc * cfg.slc_block), 0, cfg.vocab_size)
    rows = analysis.schedule_agreement(params, cfg, short, [None, 2, "RUUU"])
    assert [r["schedule"] for r in rows] == [None, 2, "RUUU"]
    for r in rows:  # every query selects every block: reuse inherits the same selection, the same model
        assert r["agree"] == r["tokens_scored"] == 2 * (short.shape[1] - 1) and r["tokens_routed"] == 0
        assert r["nll_sum"] == rows[0]["nll_sum"]
    long = jax.random.randint(jax.random.key(2), (2, 300), 0, cfg.vocab_size)
    ref, p2 = analysis.schedule_agreement(params, cfg, long, [None, 2])
    assert ref["agree"] == ref["tokens_scored"] and ref["agree_routed"] == ref["tokens_routed"] == 2 * (299 - 128)
    assert p2["nll_sum"] != ref["nll_sum"]  # past position 128 the reuse layers' inherited blocks differ
    assert p2["agree"] - p2["agree_routed"] == 2 * 128  # before it, P=2 still agrees everywhere
    assert p2["agree_routed"] <= p2["tokens_routed"]
    # the reference's argmax margin, at every routed position and where P=2's argmax differs
    assert ref["margins_routed"].shape == (ref["tokens_routed"],) and np.all(ref["margins_routed"] >= 0)
    assert ref["margins_changed"].size == 0
    assert p2["margins_changed"].size == p2["tokens_routed"] - p2["agree_routed"]
    assert set(p2["margins_changed"].tolist()) <= set(ref["margins_routed"].tolist())


def test_schedule_agreement_rejects_bad_input():
    cfg = get_config("tiny")
    params = M.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="refresh period P=8 is invalid"):
        analysis.schedule_agreement(params, cfg, np.zeros((1, 16), np.int32), [None, 8])
    with pytest.raises(ValueError, match=r"accepted: \[B, S\]"):
        analysis.schedule_agreement(params, cfg, np.zeros(16, np.int32), [None])
