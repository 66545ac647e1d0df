"""Bundle save/load round trips, bf16 storage, sharding, atomic replace and clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import checkpoint as ck
from ssv_jax import draft as dr
from ssv_jax.config import get_config
from ssv_jax.model import init_params
from ssv_jax.tokenizer import train_tokenizer

CFG = get_config("tiny")
DCFG = dr.DraftConfig.for_target(CFG, draft_vocab=64)


def _params(key=0):
    """Target params of the tiny config, as `model.init_params` makes them."""
    return init_params(CFG, jax.random.key(key))


def _draft_params(key=1):
    """EAGLE-3 head params for the tiny target (int32 d2t and bool t2d buffers besides the weights)."""
    return dr.init_draft_params(DCFG, jax.random.key(key), d2t=jnp.arange(64, dtype=jnp.int32))


def test_round_trip_fp32_exact(tmp_path):
    cfg = CFG
    p = _params()
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300, show_progress=False)
    ck.save_bundle(tmp_path / "b", cfg, p, tokenizer=tok, extra_meta={"steps": 3})
    b = ck.load_bundle(tmp_path / "b")
    # ModelConfig.to_dict resolves feature_layers=None to the explicit taps, so compare the dicts.
    assert b.cfg.to_dict() == cfg.to_dict() and b.draft_cfg is None and b.draft_params is None
    assert jax.tree.structure(b.params) == jax.tree.structure(p)
    for a, c in zip(jax.tree.leaves(p), jax.tree.leaves(b.params)):
        assert a.dtype == c.dtype and np.array_equal(np.asarray(a), np.asarray(c))
    assert b.tokenizer.encode("return x") == tok.encode("return x")
    assert ck.read_bundle_meta(tmp_path / "b")["meta"] == {"steps": 3}


def test_bf16_storage_and_load_dtype(tmp_path):
    p, dp = _params(), _draft_params()
    ck.save_bundle(tmp_path / "b", CFG, p, draft_cfg=DCFG, draft_params=dp, dtype="bfloat16")
    meta = ck.read_bundle_meta(tmp_path / "b")
    assert meta["tensors"]["target"]["embed"]["dtype"] == "bfloat16"
    assert meta["tensors"]["draft"]["d2t"]["dtype"] == "int32"  # integers are never cast
    assert meta["tensors"]["draft"]["t2d"]["dtype"] == "bool"
    b = ck.load_bundle(tmp_path / "b", dtype=None)
    assert b.params["embed"].dtype == jnp.bfloat16 and b.draft_params["d2t"].dtype == jnp.int32
    assert b.draft_cfg == DCFG and np.array_equal(b.draft_params["d2t"], dp["d2t"])
    f = ck.load_bundle(tmp_path / "b")
    assert f.params["embed"].dtype == jnp.float32
    np.testing.assert_allclose(f.params["embed"], p["embed"], rtol=1e-2, atol=1e-2)
    assert np.array_equal(f.params["embed"], p["embed"].astype(jnp.bfloat16).astype(jnp.float32))


def test_sharding(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "SHARD_BYTES", 3000)
    p = _params()
    ck.save_bundle(tmp_path / "b", CFG, p)
    shards = sorted(x.name for x in (tmp_path / "b").glob("target-*.safetensors"))
    assert len(shards) >= 3
    b = ck.load_bundle(tmp_path / "b")
    assert np.array_equal(b.params["layers"]["wq"], p["layers"]["wq"])


def test_atomic_replace_needs_force(tmp_path):
    cfg = CFG
    ck.save_bundle(tmp_path / "b", cfg, _params(0))
    with pytest.raises(FileExistsError, match="force"):
        ck.save_bundle(tmp_path / "b", cfg, _params(1))
    ck.save_bundle(tmp_path / "b", cfg, _params(1), force=True)
    assert np.array_equal(ck.load_bundle(tmp_path / "b").params["embed"], _params(1)["embed"])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b"]  # no temp or old directories left


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"unexpected keys \['x'\].*accepted"):
        ck.save_bundle(tmp_path / "b", CFG, {"x": [1, 2]})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cfg,needle", [
    (CFG.replace(hidden=128), r"params\['embed'\] has shape \(256, 64\); accepted: shape \(256, 128\)"),
    (CFG.replace(tie_embeddings=True), r"unexpected keys \['lm_head'\].*accepted.*tie_embeddings=True"),
    (CFG.replace(vocab_size=512), r"params\['embed'\] has shape \(256, 64\); accepted: shape \(512, 64\)"),
])
def test_save_bundle_rejects_params_that_do_not_match_the_config(tmp_path, cfg, needle):
    """A config/params mismatch would write a bundle that loads and generates nonsense: nothing is written."""
    with pytest.raises(ValueError, match=needle):
        ck.save_bundle(tmp_path / "b", cfg, _params())
    assert list(tmp_path.iterdir()) == []


def test_save_bundle_rejects_a_draft_head_for_another_target(tmp_path):
    other = dr.DraftConfig.for_target(CFG.replace(vocab_size=512), draft_vocab=64)
    with pytest.raises(ValueError, match=r"DraftConfig.target_vocab=512 .* vocab_size is 256; accepted"):
        ck.save_bundle(tmp_path / "b", CFG, _params(), draft_cfg=other, draft_params=_draft_params())
    with pytest.raises(ValueError, match=r"draft params lack keys \['fc'\]; accepted"):
        dp = {k: v for k, v in _draft_params().items() if k != "fc"}
        ck.save_bundle(tmp_path / "b", CFG, _params(), draft_cfg=DCFG, draft_params=dp)
    with pytest.raises(ValueError, match=r"draft_cfg is a dict; accepted: ssv_jax.draft.DraftConfig"):
        ck.save_bundle(tmp_path / "b", CFG, _params(), draft_cfg=DCFG.to_dict(), draft_params=_draft_params())
    assert list(tmp_path.iterdir()) == []


def test_save_bundle_checks_force_and_tokenizer(tmp_path):
    ck.save_bundle(tmp_path / "b", CFG, _params(0))
    with pytest.raises(ValueError, match=r"force='no' is invalid; accepted: True or False"):
        ck.save_bundle(tmp_path / "b", CFG, _params(1), force="no")
    assert np.array_equal(ck.load_bundle(tmp_path / "b").params["embed"], _params(0)["embed"])  # not replaced
    with pytest.raises(ValueError, match=r"tokenizer='x' is invalid; accepted: None or an ssv_jax.tokenizer"):
        ck.save_bundle(tmp_path / "c", CFG, _params(), tokenizer="x")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("key", ["model", "tensors", "sha256"])
def test_load_bundle_names_a_key_missing_from_config_json(tmp_path, key):
    ck.save_bundle(tmp_path / "b", CFG, _params())
    cj = tmp_path / "b" / "config.json"
    meta = json.loads(cj.read_text())
    del meta[key]
    cj.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"is corrupt: config.json lacks \['{key}'\]"):
        ck.load_bundle(tmp_path / "b")


def test_load_bundle_rejects_a_tensor_removed_from_the_index(tmp_path):
    ck.save_bundle(tmp_path / "b", CFG, _params())
    cj = tmp_path / "b" / "config.json"
    meta = json.loads(cj.read_text())
    del meta["tensors"]["target"]["layers/wq"]
    cj.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"is corrupt: .*params\['layers'\] lacks keys \['wq'\].*accepted"):
        ck.load_bundle(tmp_path / "b")


@pytest.mark.parametrize("dtype", ["int32", "bool", "float64", jnp.int8])
def test_load_bundle_accepts_only_float16_bfloat16_float32(tmp_path, dtype):
    """An integer dtype would truncate the weights; float64 would silently be float32 (x64 is off)."""
    ck.save_bundle(tmp_path / "b", CFG, _params())
    with pytest.raises(ValueError, match=r"dtype=.* is invalid; accepted: 'auto', 'float32', 'bfloat16', 'float16'"):
        ck.load_bundle(tmp_path / "b", dtype=dtype)
    assert ck.load_bundle(tmp_path / "b", dtype="float16").params["embed"].dtype == jnp.float16


def test_errors_on_missing_and_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load_bundle(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        ck.load_bundle(tmp_path / "empty")
    ck.save_bundle(tmp_path / "b", CFG, _params())
    shard = next((tmp_path / "b").glob("target-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="SHA-256"):
        ck.load_bundle(tmp_path / "b")
    shard.unlink()
    with pytest.raises(ValueError, match="missing"):
        ck.load_bundle(tmp_path / "b")
    cj = tmp_path / "b" / "config.json"
    cj.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a bundle"):
        ck.load_bundle(tmp_path / "b")


def test_train_checkpointer_resumes(tmp_path):
    state = {"params": _params(), "step": jnp.asarray(7)}
    c = ck.TrainCheckpointer(tmp_path / "ckpt", keep=1)
    assert c.restore(state) == (0, None)
    c.save(7, state)
    c.save(9, jax.tree.map(lambda x: x + 1, state))
    step, got = c.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    c.close()
    assert step == 9 and int(got["step"]) == 8
    assert np.array_equal(got["params"]["embed"], _params()["embed"] + 1)
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()] == ["9"]


def test_bundled_checkpoint_loads_and_matches_the_small_preset():
    from pathlib import Path

    from ssv_jax import draft as DR
    from ssv_jax.model import param_shapes

    path = Path(__file__).resolve().parents[1] / "checkpoints" / "ssv-small"
    meta = ck.read_bundle_meta(path)
    assert meta["dtype"] == "bfloat16"
    assert sum(f.stat().st_size for f in path.iterdir() if f.name != "README.md") <= 60e6
    b = ck.load_bundle(path, dtype=None)
    small = get_config("small")
    assert b.cfg.to_dict() == small.to_dict()
    shapes = jax.tree.map(lambda a: tuple(a.shape), b.params)
    assert shapes == param_shapes(small)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(b.params))
    DR.check_compatible(b.draft_cfg, b.cfg)
    assert b.tokenizer.vocab_size == small.vocab_size
    text = "def f(x):\n    return x\n"
    assert b.tokenizer.decode(b.tokenizer.encode(text)) == text
    for k in ("target_training", "draft_training"):
        assert meta["meta"][k]["steps"] > 0 and np.isfinite(meta["meta"][k]["val_loss"])


def test_inference_dtype_is_fp32_on_the_cpu_and_names_a_bad_value(tmp_path):
    """load_bundle's default "auto" is bf16 on a GPU and fp32 here (the exactness tests' dtype); a named dtype is
    taken as given; anything else is a ValueError naming the value."""
    import jax.numpy as jnp

    assert ck.inference_dtype("auto") == jnp.float32  # this suite runs on the CPU
    assert ck.inference_dtype("bfloat16") == jnp.bfloat16 and ck.inference_dtype(None) is None
    ck.save_bundle(tmp_path / "b", CFG, _params(0))
    assert ck.load_bundle(tmp_path / "b").params["embed"].dtype == jnp.float32
    assert ck.load_bundle(tmp_path / "b", dtype="bfloat16").params["embed"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8ish' is invalid"):
        ck.inference_dtype("fp8ish")
