"""Decode step cost at the 8B layer shape with few layers: one jitted forward per token (no while_loop) vs the
_ar_chunk while_loop. `python scripts/profile_step.py --layers 4`"""
import argparse, time
import jax, jax.numpy as jnp
from ssv_jax import cache as kvc, model as M
from ssv_jax.config import get_config

ap = argparse.ArgumentParser(); ap.add_argument("--layers", type=int, default=4); ap.add_argument("--steps", type=int, default=16)
a = ap.parse_args()
cfg = get_config("llama31-8b-nsa").replace(n_layers=a.layers, feature_layers=(0, a.layers // 2, a.layers - 1))
params = jax.jit(lambda k: M.init_params(cfg, k, jnp.bfloat16))(jax.random.key(0))
cap = kvc.cache_capacity(cfg, 8192 + 256)
ks = jax.random.split(jax.random.key(1), 4)
c0 = kvc.init_cache(cfg, 1, cap, jnp.bfloat16)
cache = kvc.KVCache(*(jax.random.normal(k_, x.shape, x.dtype) for k_, x in zip(ks, c0[:4])), jnp.full((1,), 8192, jnp.int32))
tok = jnp.array([[7]], jnp.int32)
for _ in range(2):
    lg, _, cache = M.forward(params, cfg, tok, cache)
jax.block_until_ready(lg)
t = time.perf_counter()
for _ in range(a.steps):
    lg, _, cache = M.forward(params, cfg, tok, cache)
    tok = jnp.argmax(lg, -1).astype(jnp.int32)
jax.block_until_ready(tok)
print(f"per-call forward: {(time.perf_counter() - t) * 1e3 / a.steps:.3f} ms/step for {a.layers} layers", flush=True)
