"""Attention functions for the baselines, with the signature of `nsa.nsa_attention` so that the same model and
round loop run them:

- `dense_attention`: causal dense attention over the committed cache plus the visible in-flight keys (the dense
  EAGLE-3 SD baseline: the same weights, dense attention; the gates and compressed cache are unused).
- `shared_index_reference`: mode B (shared index) on the jnp path: route as NSA does, then every query of a group
  of C consecutive queries uses the first query's blocks.
"""

from __future__ import annotations

import jax.numpy as jnp

from ssv_jax import nsa
from ssv_jax.config import ModelConfig
from pallas_kernels.groups import shared_selection


def dense_attention(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None,
                    sel=None):
    """Dense causal attention (keys at position <= t among the first kv_len, plus visible extra keys).
    Returns (o, sel) with an all-zero `sel` (dense attention routes nothing)."""
    B, Q, Hq, D = q.shape
    hkv = k.shape[2]
    qg = q.reshape(B, Q, hkv, Hq // hkv, D)
    s = jnp.einsum("bqhgd,bshd->bqhgs", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    kpos = jnp.arange(k.shape[1])
    vis = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])
    mask = jnp.broadcast_to(vis[:, :, None, None, :], s.shape)
    if extra is not None:
        sx = jnp.einsum("bqhgd,behd->bqhge", qg, extra.k, preferred_element_type=jnp.float32) * D ** -0.5
        s = jnp.concatenate([s, sx], -1)
        mask = jnp.concatenate([mask, jnp.broadcast_to(extra.mask[:, :, None, None, :], sx.shape)], -1)
    p = nsa._softmax(s, mask)
    S = k.shape[1]
    o = jnp.einsum("bqhgs,bshd->bqhgd", p[..., :S], v.astype(jnp.float32))
    if extra is not None:
        o = o + jnp.einsum("bqhge,behd->bqhgd", p[..., S:], extra.v.astype(jnp.float32))
    return o.reshape(q.shape).astype(q.dtype), jnp.zeros((B, Q, hkv, cfg.n_slc), jnp.int32)


def shared_index_reference(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None,
                           sel=None, *, group_size: int):
    """Mode B on the reference path. A reuse layer (`sel` given) inherits an already shared selection."""
    if sel is None:
        _, p, px = nsa.compressed_branch(q, q_pos, kc, vc, kv_len, cfg, extra)
        imp = nsa.block_importance(p, px, None if extra is None else extra.cidx, cfg, k.shape[1] // cfg.slc_block)
        sel = shared_selection(nsa.route(imp, q_pos, cfg), group_size)
    return nsa.nsa_attention(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, extra, sel)
