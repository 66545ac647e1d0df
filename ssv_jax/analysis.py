"""The paper's two observations, measured on a model:

1. **Query overlap.** Adjacent draft-tree queries, flattened in an order, select mostly the same KV blocks. γ is
   |S_i ∩ S_{i+1}| / n.
2. **Layout stability.** The blocks that layer j selects overlap those that layer j+k selects for the same query.
   This is what lets reuse layers inherit routing.

Selections come from the model's own routing (`forward_train(..., with_selection=True)` and
`forward_tree(..., with_selection=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import model as M
from ssv_jax.config import ModelConfig
from pallas_kernels.overlap import overlap_gamma


def set_overlap(a: jax.Array, b: jax.Array) -> jax.Array:
    """|A ∩ B| / |A| for block sets [..., n] (-1 = empty slot), elementwise over leading axes (NaN where A is
    empty)."""
    hit = (a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)
    inter = jnp.sum(jnp.any(hit, -1), -1)
    size = jnp.sum(a >= 0, -1)
    return jnp.where(size > 0, inter / jnp.maximum(size, 1), jnp.nan)


def layer_stability(sels: jax.Array, max_offset: int, min_pos: int = 0) -> np.ndarray:
    """Mean overlap between layer j's and layer j+k's selection for the same query and KV head.

    sels [L, B, S, Hkv, n] (one sequence's routing per layer). Queries before `min_pos` are skipped (there, the
    forced blocks are all there is). Returns [L, max_offset] with NaN where j + k >= L; entry [j, k-1] is the
    mean overlap of layer j with layer j+k."""
    L = sels.shape[0]
    out = np.full((L, max_offset), np.nan)
    s = sels[:, :, min_pos:]
    for k in range(1, max_offset + 1):
        if k >= L:
            break
        ov = set_overlap(s[:-k], s[k:])  # [L-k, B, S', Hkv]
        out[: L - k, k - 1] = np.nanmean(np.asarray(ov).reshape(L - k, -1), axis=1)
    return out


def query_overlap(sel: jax.Array) -> np.ndarray:
    """Mean γ between adjacent flattened queries, per layer: sel [L, B, Q, Hkv, n] -> [L]."""
    g = jax.vmap(overlap_gamma)(sel)  # [L, B, Q-1, Hkv]
    return np.asarray(jnp.mean(g, axis=(1, 2, 3)))


def sequence_selections(params, cfg: ModelConfig, tokens, schedule=None) -> jax.Array:
    """Every layer's routing for a whole sequence [B, S]: [L, B, S, Hkv, n]."""
    S = tokens.shape[1]
    qc = 512 if S % 512 == 0 else S
    return M.forward_train(params, cfg, jnp.asarray(tokens), schedule=schedule, remat=False, q_chunk=qc,
                           with_selection=True)[2]


def tree_selections(params, cfg: ModelConfig, tree: M.TreeInputs, cache, schedule=None) -> jax.Array:
    """Every layer's routing for the nodes of a verified tree: [L, B, N, Hkv, n]."""
    return M.forward_tree(params, cfg, tree, cache, schedule=schedule, with_selection=True)[4]
