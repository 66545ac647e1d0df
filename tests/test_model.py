"""The NSA target model: decode == prefill, the incremental compressed cache, verify mode == AR, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import ModelConfig, RopeScaling, get_config

CFG = get_config("tiny", max_seq_len=1152)
PARAMS = M.init_params(CFG, jax.random.key(0))


def _decode_all(params, cfg, tokens, cache):
    """Teacher-forced decode, one token per step, in one compiled scan."""

    def step(c, tok):
        lg, ft, c = M.forward(params, cfg, tok[:, None], c)
        return c, lg[:, 0]

    cache, logits = jax.lax.scan(step, cache, tokens.T)
    return jnp.swapaxes(logits, 0, 1), cache


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_decode_equals_prefill_at_every_position_up_to_1040():
    S = 1040
    toks = jax.random.randint(jax.random.key(1), (1, S), 0, CFG.vocab_size)
    full, _ = M.forward_train(PARAMS, CFG, toks, q_chunk=S // 4 if S % 4 == 0 else S)
    dec, cache = jax.jit(_decode_all, static_argnums=1)(PARAMS, CFG, toks, kvc.init_cache(CFG, 1, S))
    err = np.max(np.abs(np.asarray(dec - full)), axis=-1)[0] / float(jnp.max(jnp.abs(full)))
    assert err.shape == (S,)
    assert err.max() <= 1e-5, f"worst position {err.argmax()}: {err.max():.2e}"
    assert int(cache.length[0]) == S


def test_chunked_prefill_equals_full_sequence_and_decode_continues():
    toks = np.asarray(jax.random.randint(jax.random.key(2), (1, 333), 0, CFG.vocab_size))
    full, feats = M.forward_train(PARAMS, CFG, jnp.asarray(toks), q_chunk=333)
    cache = kvc.init_cache(CFG, 1, 512)
    lg, ft, cache = M.prefill(PARAMS, CFG, toks[:, :300], cache, chunk=64)  # last chunk padded
    assert _rel(lg, full[:, 299]) <= 1e-5
    assert _rel(ft, feats[:, 299]) <= 1e-5
    assert ft.shape == (1, 3 * CFG.hidden)
    dec, _ = _decode_all(PARAMS, CFG, jnp.asarray(toks[:, 300:]), cache)
    assert _rel(dec, full[:, 300:]) <= 1e-5


@pytest.mark.parametrize("compression", ["mean", "mlp"])
def test_decode_on_the_pallas_kernels_equals_the_reference_decode(compression):
    """Decode steps through the Pallas path (interpret mode: the decode prologue writing the new rows, blocks,
    query and gates, the decode refresh layer, the fused wo / w_down projections; with stacked weights and in the
    fused decode layout, and with reuse layers taking the prologue's query as plain arrays) give the reference
    decode's logits and the same cache, across several block completions, from a prompt of fresh random
    length."""
    from ssv_jax.policy import attention_for

    cfg = CFG.replace(compression=compression)
    params = M.init_params(cfg, jax.random.key(5))
    P = int(np.random.default_rng().integers(150, 193))
    toks = jax.random.randint(jax.random.key(P), (2, P + 20), 0, cfg.vocab_size)
    _, _, cache = M.prefill(params, cfg, np.asarray(toks[:, :P]), kvc.init_cache(cfg, 2, 256), chunk=64)
    kernel = attention_for("kernel", "A", 1, True)
    outs = {}
    for name, prm, attn, schedule in (("reference", params, nsa.nsa_attention, None),
                                      ("kernel", params, kernel, None),
                                      ("kernel, decode layout", M.split_layers(params), kernel, None),
                                      ("reference", params, nsa.nsa_attention, 2),
                                      ("kernel, decode layout", M.split_layers(params), kernel, 2)):
        c, lgs = jax.tree.map(jnp.copy, cache), []
        for i in range(P, P + 20):  # 20 steps: at least one block completes (d = 8)
            lg, _, c = M.forward(prm, cfg, toks[:, i:i + 1], c, attn=attn, schedule=schedule)
            lgs.append(lg)
        outs[name, schedule] = (jnp.concatenate(lgs, 1), c)
    for (name, schedule), (got, gc) in outs.items():
        ref, rc = outs["reference", schedule]
        assert _rel(got, ref) <= 1e-5, (name, schedule)
        for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(rc)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # past n selected blocks of context, reuse layers (inheriting the selection) change the model
    assert _rel(outs["reference", 2][0], outs["reference", None][0]) > 1e-3


@pytest.mark.parametrize("compression", ["mean", "mlp"])
def test_incremental_compressed_cache_equals_recomputed(compression):
    cfg = CFG.replace(compression=compression)
    params = M.init_params(cfg, jax.random.key(3))
    toks = np.asarray(jax.random.randint(jax.random.key(4), (1, 261), 0, cfg.vocab_size))
    cache = kvc.init_cache(cfg, 1, 320)
    _, _, cache = M.prefill(params, cfg, toks[:, :150], cache, chunk=32)
    _, cache = _decode_all(params, cfg, jnp.asarray(toks[:, 150:]), cache)
    n = int(nsa.num_complete_blocks(jnp.int32(261), cfg))
    for li in range(cfg.n_layers):
        w = None if compression == "mean" else (params["layers"]["cmp_wk"][li], params["layers"]["cmp_pek"][li])
        ref = nsa.compress_all(cache.k[li], cfg, *(w or ()))
        np.testing.assert_allclose(np.asarray(cache.kc[li, :, :n]), np.asarray(ref[:, :n]), rtol=1e-5, atol=1e-6)


def _prefilled_tree(seed: int, T: int, parents):
    """A random committed context of T tokens in a fresh cache and a random-token tree with the given parents:
    (cache, TreeInputs, node tokens, depth, ancestor-or-self mask)."""
    r = np.random.default_rng(seed)
    N = len(parents)
    depth = np.zeros(N, np.int32)
    mask = np.zeros((N, N), bool)
    for i in range(N):
        depth[i] = 0 if parents[i] < 0 else depth[parents[i]] + 1
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    ctx = r.integers(0, CFG.vocab_size, (1, T))
    node_tok = r.integers(0, CFG.vocab_size, N)
    _, _, cache = M.prefill(PARAMS, CFG, ctx, kvc.init_cache(CFG, 1, 256), chunk=64)
    tree = M.TreeInputs(jnp.asarray(node_tok[None], jnp.int32), jnp.asarray(depth[None]), jnp.asarray(mask[None]))
    return cache, tree, node_tok, depth, mask


@pytest.mark.parametrize("T", [100, 143, 159])
def test_verify_mode_equals_ar_on_every_path(T):
    """Every node's logits equal the AR logits after appending its root-to-node path (mode A, refresh always),
    including paths that complete compressed blocks (d=8) and cross selection blocks (l'=32)."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 6, 8, 9, 10, 11, 12, 13, 14]
    cache, tree, node_tok, depth, mask = _prefilled_tree(T, T, parents)
    logits, feats, _, _ = M.forward_tree(PARAMS, CFG, tree, cache)
    for a in range(len(parents)):
        c = jax.tree.map(jnp.copy, cache)
        for tok in node_tok[mask[a]]:  # AR decoding of the root-to-node path
            ref, ref_f, c = M.forward(PARAMS, CFG, jnp.asarray([[tok]], jnp.int32), c)
        assert _rel(logits[0, a], ref[0, -1]) <= 1e-5, f"node {a} depth {depth[a]}"
        assert _rel(feats[0, a], ref_f[0, -1]) <= 1e-5


def test_commit_tree_equals_decoding_the_path():
    cache, tree, node_tok, _, _ = _prefilled_tree(9, 117, [-1, 0, 1, 2, 0, 4, 5, 6, 7])
    _, _, nk, nv = M.forward_tree(PARAMS, CFG, tree, cache)
    path = np.array([[0, 4, 5, 6, 7, -1]])
    ref_cache = jax.tree.map(jnp.copy, cache)
    cache = M.commit_tree(PARAMS, CFG, cache, nk, nv, jnp.asarray(path), jnp.asarray([5]))
    _, ref_cache = _decode_all(PARAMS, CFG, jnp.asarray(node_tok[[0, 4, 5, 6, 7]][None]), ref_cache)
    assert int(cache.length[0]) == int(ref_cache.length[0]) == 122
    n = int(nsa.num_complete_blocks(jnp.int32(122), CFG))
    np.testing.assert_allclose(np.asarray(cache.k[:, :, :122]), np.asarray(ref_cache.k[:, :, :122]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.kc[:, :, :n]), np.asarray(ref_cache.kc[:, :, :n]), atol=1e-5)


def test_llama31_8b_instantiates_abstractly_with_8b_parameters():
    cfg = get_config("llama31-8b-nsa")
    shapes = jax.eval_shape(lambda k: M.init_params(cfg, k, jnp.bfloat16), jax.random.key(0))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    print(f"llama31-8b-nsa parameters: {n:,}")
    assert n == cfg.param_count()
    assert 7.9e9 < n < 8.2e9
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(shapes))


def test_param_count_matches_init_for_every_preset_shape():
    for cfg in (CFG, CFG.replace(compression="mlp", tie_embeddings=True), get_config("small")):
        shapes = jax.eval_shape(lambda k: M.init_params(cfg, k), jax.random.key(0))
        assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == cfg.param_count()


@pytest.mark.parametrize("field,value,needle", [
    ("slc_block", 36, "multiple of cmp_stride"),
    ("n_slc", 2, ">= 3"),
    ("window", 16, ">= slc_block"),
    ("head_dim", 8, ">= 16"),
    ("n_heads", 5, "multiple of n_kv_heads"),
    ("compression", "max", "'mean' or 'mlp'"),
    ("feature_layers", (0, 9), "layer indices"),
])
def test_bad_config_raises_clear_value_error(field, value, needle):
    with pytest.raises(ValueError, match=field) as e:
        get_config("tiny", **{field: value})
    assert needle in str(e.value)


def test_numpy_integers_and_floats_are_accepted_and_stored_as_python_numbers():
    """Sizes read from a config file or computed with NumPy: the config stays hashable and JSON-able."""
    import json

    cfg = get_config("tiny", hidden=np.int64(64), n_layers=np.int32(4), rope_theta=np.float32(1e4),
                     feature_layers=[np.int64(1), 2, 3])
    assert cfg == get_config("tiny", feature_layers=(1, 2, 3)) and hash(cfg) == hash(cfg.replace())
    assert type(cfg.hidden) is int and type(cfg.rope_theta) is float and cfg.feature_layers == (1, 2, 3)
    assert json.loads(json.dumps(cfg.to_dict()))["hidden"] == 64


@pytest.mark.parametrize("field,value,accepted", [
    ("vocab_size", True, "an integer >= 1"),
    ("n_layers", True, "an integer >= 1"),
    ("hidden", 64.0, "an integer >= 1"),
    ("tie_embeddings", "no", "True or False"),
    ("feature_layers", (1.5,), r"None or a non-empty tuple of integer layer indices in \[0, 4\)"),
    ("feature_layers", (True,), r"integer layer indices in \[0, 4\)"),
    ("feature_layers", 2, r"integer layer indices in \[0, 4\)"),
    ("feature_layers", (), r"non-empty tuple"),
    ("rope_theta", "abc", "a finite number > 0"),
    ("rope_theta", float("inf"), "a finite number > 0"),
    ("norm_eps", None, "a finite number > 0"),
    ("rope_scaling", 8.0, "None, a RopeScaling or a dict of its fields"),
])
def test_bad_config_types_raise_value_error_naming_value_and_accepted(field, value, accepted):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=.* is invalid; accepted: .*{accepted}"):
        get_config("tiny", **{field: value})


def test_repeated_feature_taps_stay_accepted():
    """The default taps (2, L//2, L-3), clipped, repeat a layer below 6 layers (tiny: (2, 2, 1)), and bundles store
    them explicitly, so repeated indices must round-trip."""
    cfg = get_config("tiny")
    assert cfg.features == (2, 2, 1)
    assert ModelConfig.from_dict(cfg.to_dict()).features == (2, 2, 1)


@pytest.mark.parametrize("kw,needle", [
    (dict(factor=-1), r"RopeScaling.factor=-1 is invalid; accepted: a finite number > 0"),
    (dict(factor="x"), r"RopeScaling.factor='x' is invalid; accepted: a finite number > 0"),
    (dict(low_freq_factor=0.0), r"RopeScaling.low_freq_factor=0.0 is invalid; accepted: a finite number > 0"),
    (dict(high_freq_factor=1.0), r"RopeScaling.high_freq_factor=1.0 is invalid; accepted: a finite number > "
                                 r"low_freq_factor=1.0"),
    (dict(original_max_position=0), r"RopeScaling.original_max_position=0 is invalid; accepted: an integer >= 1"),
    (dict(original_max_position=True), r"RopeScaling.original_max_position=True is invalid; accepted: an integer"),
])
def test_rope_scaling_fields_are_validated(kw, needle):
    with pytest.raises(ValueError, match=needle):
        RopeScaling(**kw)


def test_a_rope_scaling_dict_becomes_a_rope_scaling():
    """A plain dict would otherwise reach jax.jit as an unhashable static argument."""
    cfg = get_config("tiny", rope_scaling=dict(factor=2.0, original_max_position=64))
    assert cfg.rope_scaling == RopeScaling(factor=2.0, original_max_position=64) and hash(cfg)
    with pytest.raises(ValueError, match=r"unknown RopeScaling fields \['foo'\]; accepted: \[.*'factor'"):
        ModelConfig.from_dict({"rope_scaling": {"foo": 1}})


def test_unknown_fields_in_get_config_and_replace_raise_value_error():
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['bogus'\]; accepted: \[.*'vocab_size'"):
        get_config("tiny", bogus=1)
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['bogus'\]; accepted: \[.*'vocab_size'"):
        CFG.replace(bogus=1)


def test_check_params_accepts_init_params_in_any_floating_dtype():
    M.check_params(CFG, PARAMS)
    M.check_params(CFG, jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS))
    mlp_tied = CFG.replace(compression="mlp", tie_embeddings=True)
    M.check_params(mlp_tied, jax.eval_shape(lambda: M.init_params(mlp_tied, jax.random.key(0))))


@pytest.mark.parametrize("cfg,params,needle", [
    (get_config("tiny", hidden=128), PARAMS,
     r"params\['embed'\] has shape \(256, 64\); accepted: shape \(256, 128\) = \[vocab_size, hidden\]"),
    (CFG.replace(tie_embeddings=True), PARAMS,
     r"params has unexpected keys \['lm_head'\] .*accepted: exactly the keys .*tie_embeddings=True"),
    (CFG.replace(vocab_size=512), PARAMS, r"params\['embed'\] has shape \(256, 64\); accepted: shape \(512, 64\)"),
    (CFG, {}, r"params lacks keys \['embed', 'layers', 'lm_head', 'norm'\] .*accepted"),
    (CFG.replace(compression="mlp"), PARAMS, r"params\['layers'\] lacks keys \['cmp_pek', 'cmp_pev', 'cmp_wk', "
                                             r"'cmp_wv'\] .*accepted.*compression='mlp'"),
    (CFG.replace(ffn=256), PARAMS, r"params\['layers/w_down'\] has shape \(4, 128, 64\); accepted: shape "
                                   r"\(4, 256, 64\) = \[n_layers, ffn, hidden\]"),
    (CFG, {**PARAMS, "embed": PARAMS["embed"].astype(jnp.int32)},
     r"params\['embed'\] has dtype int32; accepted: a floating dtype"),
    (CFG, {**PARAMS, "norm": [1.0] * 64}, r"params\['norm'\] is a list; accepted: a floating array of shape"),
    (CFG, M.split_layers(PARAMS), r"decode layout of split_layers\); accepted: the init_params layout .*stack_layers"),
])
def test_check_params_names_the_first_mismatch(cfg, params, needle):
    with pytest.raises(ValueError, match=needle):
        M.check_params(cfg, params)


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("gpt5")


def test_config_round_trips_through_dict():
    cfg = get_config("llama31-8b-nsa")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg.replace(feature_layers=cfg.features)
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['bogus'\]; accepted: \[.*'vocab_size'"):
        ModelConfig.from_dict(dict(cfg.to_dict(), bogus=1))


def test_prompt_longer_than_cache_is_rejected():
    cache = kvc.init_cache(CFG, 1, 128)
    with pytest.raises(ValueError, match="does not fit"):
        M.prefill(PARAMS, CFG, np.zeros((1, 200), np.int32), cache, chunk=64)


def test_empty_prompt_and_out_of_vocab_ids_are_rejected():
    cache = kvc.init_cache(CFG, 1, 128)
    with pytest.raises(ValueError, match="empty"):
        M.prefill(PARAMS, CFG, np.zeros((1, 0), np.int32), cache)
    with pytest.raises(ValueError, match=r"out of vocabulary.*\[0, 256\)"):
        M.prefill(PARAMS, CFG, np.array([[1, 2, 256]]), cache)
    with pytest.raises(ValueError, match="out of vocabulary"):
        M.prefill(PARAMS, CFG, np.array([[1, -1]]), cache)
    with pytest.raises(ValueError, match="dtype float64; accepted: an integer dtype"):
        M.prefill(PARAMS, CFG, np.array([[1.5, 2.0]]), cache)


@pytest.mark.parametrize("fuse,shards", [(False, 1), (True, 1), (True, 2)])
def test_decode_weight_layout_gives_the_same_model(fuse, shards):
    """`split_layers` (one buffer per layer, a Python layer loop; with `fuse`, q/k/v/gate and gate/up as single
    matrices, laid out per tensor-parallel shard when shards > 1) computes what the stacked scans do, in commit
    mode, verify mode and commit_tree."""
    split = M.split_layers(PARAMS, fuse=fuse, shards=shards)
    if fuse:
        assert split["layers"][0]["w_qkvg"].ndim == (2 if shards == 1 else 3)
    assert isinstance(split["layers"], list) and len(split["layers"]) == CFG.n_layers
    assert ("w_qkvg" in split["layers"][0]) == fuse and ("wq" in split["layers"][0]) != fuse
    toks = jax.random.randint(jax.random.key(8), (1, 64), 0, CFG.vocab_size)
    a = M.forward(PARAMS, CFG, toks, kvc.init_cache(CFG, 1, 128), schedule=2)
    b = M.forward(split, CFG, toks, kvc.init_cache(CFG, 1, 128), schedule=2)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a[2].k), np.asarray(b[2].k), rtol=1e-5, atol=1e-5)
    cache, tree, *_ = _prefilled_tree(3, 101, [-1, 0, 1, 1, 2])
    ta = M.forward_tree(PARAMS, CFG, tree, cache)
    tb = M.forward_tree(split, CFG, tree, cache)
    for x, y in zip(ta, tb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, M.stack_layers(split, CFG), PARAMS)


def test_verify_on_the_pallas_kernels_equals_the_reference_verify():
    """A 16-node tree of fresh random shape verified through the Pallas path in the fused layout (interpret mode:
    the refresh and reuse layers with the tree's keys and per-path blocks, the fused projections) gives the
    reference verify's logits, features and node K/V in fp32, across a refresh/reuse schedule."""
    from ssv_jax.policy import attention_for

    r = np.random.default_rng()
    T = int(r.integers(100, 160))
    parents = [-1] + [int(r.integers(0, i)) for i in range(1, 16)]
    cache, tree, *_ = _prefilled_tree(int(r.integers(1 << 30)), T, parents)
    ref = M.forward_tree(PARAMS, CFG, tree, cache, schedule=2)
    got = M.forward_tree(M.split_layers(PARAMS), CFG, tree, cache, schedule=2,
                         attn=attention_for("kernel", "A", 1, True))
    for name, a, b in zip(("logits", "feats", "node_k", "node_v"), got, ref):
        assert _rel(a, b) <= 1e-5, name
