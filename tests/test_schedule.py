"""Refresh/reuse schedules: parsing, static segmentation, segmented == unrolled, scans in the jaxpr, and the
schedule as a model variant (greedy SSV == greedy AR under the same schedule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax import schedule as sched
from ssv_jax.config import get_config
from ssv_jax.generate import ar_generate
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import SSVModel, ssv_generate

CFG = get_config("tiny", max_seq_len=1024)


def test_periodic_schedules():
    assert sched.to_string(sched.periodic(8, 1)) == "RRRRRRRR"
    assert sched.to_string(sched.periodic(8, 4)) == "RUUURUUU"
    assert sched.to_string(sched.periodic(8, 3)) == "RUURUURU"
    assert sched.to_string(sched.periodic(8, 4, offset=2)) == "RURUUURU"
    assert sched.to_string(sched.periodic(8, 8)) == "RUUUUUUU"


def test_segments_group_equal_runs_and_keep_tails():
    assert sched.segments(sched.periodic(8, 4)) == (sched.Segment(0, 4, 2),)
    assert sched.segments(sched.periodic(8, 3)) == (sched.Segment(0, 3, 2), sched.Segment(6, 2, 1))
    assert sched.segments(sched.parse("RURUUUUR", 8)) == (sched.Segment(0, 2, 1), sched.Segment(2, 5, 1),
                                                           sched.Segment(7, 1, 1))


@pytest.mark.parametrize("bad,needle", [("URRR", "first layer"), ("RRR", "length"), ("RXRR", "'R', 'U'"),
                                        (0, "period"), (5, "period")])
def test_invalid_schedules_raise_clear_value_errors(bad, needle):
    with pytest.raises(ValueError, match=needle):
        sched.parse(bad, 4)


@pytest.mark.parametrize("bad", [2.0, True, "", [], {"R": 1}, (1, 0, 1, 0)])
def test_a_schedule_of_another_type_is_named_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match=r"schedule.* is invalid; accepted: "):
        sched.canonical(bad)


def test_canonical_schedules_are_none_an_int_period_or_an_rU_string():
    assert sched.canonical(None) is None
    assert sched.canonical(np.int64(4)) == 4 and type(sched.canonical(np.int64(4))) is int
    for form in ("RUUR", ("R", "U", "U", "R"), [True, False, False, True], (np.True_, False, False, True)):
        assert sched.canonical(form) == "RUUR"
    assert sched.parse(np.int64(2), 4) == sched.parse(2, 4) == (True, False, True, False)


@pytest.mark.parametrize("flags", ["RRRRRRRRR", "RUUURUUUR", "RURUURUUU", "RUUUUUUUU"])
def test_segmented_equals_a_plain_layer_loop_exactly(flags):
    """run_layers reproduces a Python loop over layers bit for bit, rolled or unrolled."""
    flags = sched.parse(flags, 9)
    r = np.random.default_rng(0)
    w = jnp.asarray(r.standard_normal((9, 8, 8)), jnp.float32) / 3

    def layer(c, wl, refresh):
        x, inherited = c
        h = jnp.tanh(x @ wl)
        inherited = h.sum() if refresh else inherited
        return (h + inherited, inherited), h[0]

    c0 = (jnp.asarray(r.standard_normal((2, 8)), jnp.float32), jnp.float32(0))
    ref, ys_ref = c0, []
    for i in range(9):
        ref, y = layer(ref, w[i], flags[i])
        ys_ref.append(y)
    for unroll in (True, False):
        out, ys = jax.jit(lambda c, w: sched.run_layers(layer, c, w, flags, unroll=unroll))(c0, w)
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
        np.testing.assert_array_equal(np.asarray(ys), np.asarray(jnp.stack(ys_ref)))


def test_model_unrolled_equals_rolled_exactly():
    params = M.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (1, 64), 0, CFG.vocab_size)
    from ssv_jax import cache as kvc

    outs = [M.forward(params, CFG, toks, kvc.init_cache(CFG, 1, 128), schedule=2, unroll=u)[0] for u in (True, False)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def _count_eqns(jaxpr, name):
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == name
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                if hasattr(sub, "jaxpr"):
                    n += _count_eqns(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr, name)
                elif hasattr(sub, "eqns"):
                    n += _count_eqns(sub, name)
    return n


@pytest.mark.parametrize("P", [1, 4])
def test_jaxpr_holds_scans_not_unrolled_layers(P, monkeypatch):
    """A 16-layer model traces to one refresh layer (and one reuse layer) inside scans, not 16 layer bodies."""
    from ssv_jax import nsa

    monkeypatch.setattr(nsa, "RANK_TOPK_MAX_PAIRS", 0)  # route through lax.top_k, so routing shows as one eqn
    cfg = CFG.replace(n_layers=16, feature_layers=(2, 8, 13))
    params = jax.eval_shape(lambda k: M.init_params(cfg, k), jax.random.key(0))
    from ssv_jax import cache as kvc

    cache = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, 128))
    toks = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t, c: M.forward(p, cfg, t, c, schedule=P, unroll=True))(params, toks, cache)
    n_scans = _count_eqns(jaxpr.jaxpr, "scan")
    n_topk = _count_eqns(jaxpr.jaxpr, "top_k")  # routing runs once per refresh-layer body
    assert n_scans == (1 if P == 1 else 2)
    assert n_topk == 1


@pytest.fixture(scope="module")
def model():
    params = M.init_params(CFG, jax.random.key(0))
    dcfg = dr.DraftConfig.for_target(CFG)
    return SSVModel(CFG, params, dcfg, dr.init_draft_params(dcfg, jax.random.key(1)))


@pytest.mark.parametrize("P", [1, 2, 4, CFG.n_layers])
def test_greedy_ssv_equals_greedy_ar_under_the_same_schedule(model, P):
    # the prompt is longer than n*l' tokens, so that the prompt's own routing depends on the schedule
    prompt = np.asarray(jax.random.randint(jax.random.key(3), (1, 300), 0, CFG.vocab_size))
    assert prompt.shape[1] > CFG.n_slc * CFG.slc_block
    ar = ar_generate((CFG, model.params), prompt, 120, schedule=P, prefill_chunk=64).tokens
    precision = "exact" if P == 1 else "strict"
    res = ssv_generate(model, prompt, max_new_tokens=120, prefill_chunk=64,
                       policy=SSVPolicy(top_k=4, depth=4, budget=16, order="dfs", schedule=P, precision=precision))
    np.testing.assert_array_equal(res.tokens, ar)


def test_schedules_change_the_model():
    """Reuse layers are a different model variant: P = L differs from refresh-every-layer somewhere."""
    params = M.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(4), (1, 300), 0, CFG.vocab_size)
    a, _ = M.forward_train(params, CFG, toks, q_chunk=300)
    b, _ = M.forward_train(params, CFG, toks, q_chunk=300, schedule=CFG.n_layers)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3
