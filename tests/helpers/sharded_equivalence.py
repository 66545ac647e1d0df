"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=2 (see tests/test_sharding.py): compares sharded and
single-device outputs and prints one JSON line."""
import json

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import cache as kvc
from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax import sharding
from ssv_jax.config import get_config
from ssv_jax.generate import ar_generate
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import SSVModel, ssv_generate

cfg = get_config("tiny", max_seq_len=512)
params = M.init_params(cfg, jax.random.key(0))
dcfg = dr.DraftConfig.for_target(cfg)
m = SSVModel(cfg, params, dcfg, dr.init_draft_params(dcfg, jax.random.key(1)))
mesh = sharding.make_mesh(2)
prompt = np.asarray(jax.random.randint(jax.random.key(2), (1, 120), 0, cfg.vocab_size))

toks = jnp.asarray(prompt[:, :64])
ref, _, _ = M.forward(params, cfg, toks, kvc.init_cache(cfg, 1, 128))
sp, sc = sharding.place(params, cfg, kvc.init_cache(cfg, 1, 128), mesh)
got, _, cache = M.forward(sp, cfg, toks, sc)
out = dict(
    devices=len(jax.devices()),
    forward_rel=float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))),
    wq_sharded=str(sp["layers"]["wq"].sharding.spec), cache_sharded=str(cache.k.sharding.spec),
)
lay = sharding.split_layers(sp, mesh)  # the decode layout on the mesh: projections fused per shard
got_l, _, _ = M.forward(lay, cfg, toks, sharding.shard_cache(kvc.init_cache(cfg, 1, 128), mesh))
out["fused_forward_rel"] = float(jnp.max(jnp.abs(got_l - ref)) / jnp.max(jnp.abs(ref)))
out["fused_sharded"] = str(lay["layers"][0]["w_qkvg"].sharding.spec)
ar1 = ar_generate((cfg, params), prompt, 40, prefill_chunk=64).tokens
ar2 = ar_generate((cfg, params), prompt, 40, prefill_chunk=64, mesh=mesh).tokens
out["ar_equal"] = bool(np.array_equal(ar1, ar2))
for backend in ("reference", "kernel"):
    pol = SSVPolicy(top_k=4, depth=4, budget=16, order="dfs", group_size=4, backend=backend)
    s2 = ssv_generate(m, prompt, max_new_tokens=40, policy=pol, prefill_chunk=64, mesh=mesh).tokens
    out[f"ssv_{backend}_equals_ar"] = bool(np.array_equal(s2, ar1))
try:
    sharding.check_divisible(cfg.replace(vocab_size=255), mesh)
    out["odd_vocab_error"] = None
except ValueError as e:
    out["odd_vocab_error"] = str(e)
print("RESULT " + json.dumps(out))
