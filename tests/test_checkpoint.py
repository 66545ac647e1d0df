"""Bundle save/load round trips, bf16 storage, sharding, atomic replace and clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import checkpoint as ck
from ssv_jax.config import get_config
from ssv_jax.tokenizer import train_tokenizer


def _params(key=0):
    k = jax.random.split(jax.random.key(key), 3)
    return {"embed": jax.random.normal(k[0], (64, 16)),
            "layers": {"wq": jax.random.normal(k[1], (2, 16, 32)), "norm": jnp.ones((2, 16))},
            "d2t": jnp.arange(8, dtype=jnp.int32)}


def test_round_trip_fp32_exact(tmp_path):
    cfg = get_config("tiny")
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
    p = _params()
    ck.save_bundle(tmp_path / "b", get_config("tiny"), p, dtype="bfloat16")
    meta = ck.read_bundle_meta(tmp_path / "b")
    assert meta["tensors"]["target"]["embed"]["dtype"] == "bfloat16"
    assert meta["tensors"]["target"]["d2t"]["dtype"] == "int32"  # integers are never cast
    b = ck.load_bundle(tmp_path / "b", dtype=None)
    assert b.params["embed"].dtype == jnp.bfloat16 and b.params["d2t"].dtype == jnp.int32
    f = ck.load_bundle(tmp_path / "b")
    assert f.params["embed"].dtype == jnp.float32
    np.testing.assert_allclose(f.params["embed"], p["embed"], rtol=1e-2, atol=1e-2)
    assert np.array_equal(f.params["embed"], p["embed"].astype(jnp.bfloat16).astype(jnp.float32))


def test_sharding(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "SHARD_BYTES", 3000)
    p = _params()
    ck.save_bundle(tmp_path / "b", get_config("tiny"), p)
    shards = sorted(x.name for x in (tmp_path / "b").glob("target-*.safetensors"))
    assert len(shards) >= 3
    b = ck.load_bundle(tmp_path / "b")
    assert np.array_equal(b.params["layers"]["wq"], p["layers"]["wq"])


def test_atomic_replace_needs_force(tmp_path):
    cfg = get_config("tiny")
    ck.save_bundle(tmp_path / "b", cfg, _params(0))
    with pytest.raises(FileExistsError, match="force"):
        ck.save_bundle(tmp_path / "b", cfg, _params(1))
    ck.save_bundle(tmp_path / "b", cfg, _params(1), force=True)
    assert np.array_equal(ck.load_bundle(tmp_path / "b").params["embed"], _params(1)["embed"])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b"]  # no temp or old directories left


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="accepted"):
        ck.save_bundle(tmp_path / "b", get_config("tiny"), {"x": [1, 2]})
    assert list(tmp_path.iterdir()) == []


def test_errors_on_missing_and_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load_bundle(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        ck.load_bundle(tmp_path / "empty")
    ck.save_bundle(tmp_path / "b", get_config("tiny"), _params())
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
    ck.save_bundle(tmp_path / "b", get_config("tiny"), _params(0))
    assert ck.load_bundle(tmp_path / "b").params["embed"].dtype == jnp.float32
    assert ck.load_bundle(tmp_path / "b", dtype="bfloat16").params["embed"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8ish' is invalid"):
        ck.inference_dtype("fp8ish")
