"""Tensor parallelism over KV heads with JAX's own SPMD (meshes, `NamedSharding`, `shard_map`).

One mesh axis, "tp", splits: attention projections by heads (query heads follow their KV head, so routing, which
is per KV head, stays shard-local), the FFN by columns, the embedding and LM head by vocabulary, and the KV and
compressed caches by KV head. The draft head is small and stays replicated. XLA's partitioner runs the jnp
reference path as is; Pallas kernels, which it cannot partition, run per shard under `shard_map`
(`shard_attention`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import ModelConfig

AXIS = "tp"

_LAYER_SPECS = {
    "wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS), "wg": P(None, None, AXIS),
    "wo": P(None, AXIS, None), "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS),
    "w_down": P(None, AXIS, None), "cmp_wk": P(None, AXIS), "cmp_wv": P(None, AXIS), "cmp_pek": P(None, AXIS),
    "cmp_pev": P(None, AXIS),
}


def make_mesh(n_devices: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh named "tp" over the first `n_devices` devices (default: all)."""
    devs = list(devices if devices is not None else jax.devices())
    n = len(devs) if n_devices is None else n_devices
    if not 1 <= n <= len(devs):
        raise ValueError(f"n_devices={n} is invalid; accepted: 1..{len(devs)} (devices present)")
    return Mesh(np.asarray(devs[:n]), (AXIS,))


def check_divisible(cfg: ModelConfig, mesh: Mesh) -> None:
    """Every sharded dimension must divide by the mesh size."""
    n = mesh.shape[AXIS]
    for name, v in (("n_kv_heads", cfg.n_kv_heads), ("ffn", cfg.ffn), ("vocab_size", cfg.vocab_size)):
        if v % n:
            raise ValueError(f"ModelConfig.{name}={v} does not divide over a mesh of {n} devices; accepted: a "
                             f"mesh size dividing n_kv_heads, ffn and vocab_size")


def param_specs(params: dict) -> dict:
    """PartitionSpecs for the target's params pytree (see the module docstring)."""
    out = {k: P() for k in params if k != "layers"}
    out["embed"] = P(AXIS, None)
    if "lm_head" in params:
        out["lm_head"] = P(None, AXIS)
    out["layers"] = {k: _LAYER_SPECS.get(k, P()) for k in params["layers"]}
    return out


def cache_specs() -> kvc.KVCache:
    """PartitionSpecs of a `KVCache`: KV heads split over the tensor-parallel axis, lengths replicated."""
    kv = P(None, None, None, AXIS, None)
    return kvc.KVCache(kv, kv, kv, kv, P())


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place the target's params on the mesh."""
    check_divisible(cfg, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, param_specs(params))


def shard_cache(cache: kvc.KVCache, mesh: Mesh) -> kvc.KVCache:
    """Place a KV cache on the mesh (split over KV heads)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), cache, cache_specs())


def replicate(tree, mesh: Mesh):
    """Every array of `tree` copied to all devices of `mesh`."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)


@functools.lru_cache(maxsize=None)
def shard_attention(attn, mesh: Mesh):
    """Run an attention function with the signature of `nsa.nsa_attention` per shard under `shard_map`: each
    device holds Hkv/n KV heads with their G query heads, routes them itself and returns its heads' output."""
    heads = P(None, None, AXIS, None)  # q [B,Q,Hq,D], gates [B,Q,Hq,3], k/v/kc/vc [B,S,Hkv,D], sel [B,Q,Hkv,n]

    @functools.wraps(attn)
    def run(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, extra=None, sel=None):
        n = mesh.shape[AXIS]
        local_cfg = cfg.replace(n_heads=cfg.n_heads // n, n_kv_heads=cfg.n_kv_heads // n)  # one shard's heads

        def body(q, gates, k, v, kc, vc, extra, sel):
            return attn(q, q_pos, gates, k, v, kc, vc, kv_len, local_cfg, extra=extra, sel=sel)

        def kv_spec(x):
            if isinstance(x, nsa.LayerKV):
                return nsa.LayerKV(P(None, None, None, AXIS, None), P())
            return heads

        ex_spec = None if extra is None else nsa.Extra(heads, heads, P(), P(), heads, heads, P(), P())
        sel_spec = None if sel is None else heads
        f = jax.shard_map(body, mesh=mesh,
                          in_specs=(heads, heads, kv_spec(k), kv_spec(v), kv_spec(kc), kv_spec(vc), ex_spec, sel_spec),
                          out_specs=(heads, heads), check_vma=False)
        return f(q, gates, k, v, kc, vc, extra, sel)

    for flag in ("reads_layer_views", "reads_compressed_views"):
        setattr(run, flag, getattr(getattr(attn, "func", attn), flag, False))
    return run


def attention_on(attn, mesh: Mesh | None):
    """`attn` for a mesh: the jnp reference is left to XLA's partitioner; anything else (Pallas kernels) runs per
    shard under `shard_map`. Cached, so one (attention, mesh) is one compiled variant."""
    if mesh is None or mesh.size == 1:
        return attn
    if getattr(attn, "func", attn) is nsa.nsa_attention:
        return attn
    return shard_attention(attn, mesh)


def split_layers(params: dict, mesh: Mesh | None) -> dict:
    """The decode weight layout (`model.split_layers`) for a mesh: per-layer buffers with the projections fused
    per shard ([in, n, out / n], split over "tp" on dim 1), so each device runs one q/k/v/gate and one gate/up
    GEMM over its own heads and FFN columns. Without a mesh, the single-device fused layout."""
    if mesh is None or mesh.size == 1:
        return M.split_layers(params)
    out = M.split_layers(params, shards=mesh.shape[AXIS])
    fused = NamedSharding(mesh, P(None, AXIS, None))
    layers = [{k: jax.device_put(a, fused) if k in M.FUSED_PROJECTIONS else a for k, a in lp.items()}
              for lp in out["layers"]]
    return {**out, "layers": layers}


def place(params: dict, cfg: ModelConfig, cache: kvc.KVCache, mesh: Mesh | None):
    """(params, cache) on the mesh, or unchanged without one."""
    if mesh is None:
        return params, cache
    return shard_params(params, cfg, mesh), shard_cache(cache, mesh)
