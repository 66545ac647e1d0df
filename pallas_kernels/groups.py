"""Index work for grouped verification (DESIGN.md, "Kernels") on groups of C consecutive flattened queries:
the mode-B shared selection, each group's merged block list (sorted, unique, padded, with a count; the kernel
itself walks the group's C x n index tile skipping repeats, so this list feeds the overlap statistics and byte
counts) and the per-row visibility of the in-tree (extra) keys.

Everything here is index bookkeeping on [B, Q, Hkv, n] selections; the attention math is in the kernels and the
reference in `ssv_jax.nsa`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import pad_axis, query_rows

_BIG = 2 ** 30


def shared_selection(sel: jax.Array, group_size: int) -> jax.Array:
    """Mode B: every query of a group of `group_size` consecutive queries uses the first query's blocks."""
    B, Q, H, n = sel.shape
    first = sel.reshape(B, Q // group_size, group_size, H, n)[:, :, :1]
    return jnp.broadcast_to(first, (B, Q // group_size, group_size, H, n)).reshape(sel.shape)


def merged_blocks(sel: jax.Array, group_size: int):
    """Sorted unique valid block ids of each group: ([B, Hkv, NG, C*n] ids padded with 0, [B, Hkv, NG] count)."""
    B, Q, H, n = sel.shape
    ng = Q // group_size
    s = jnp.moveaxis(sel.reshape(B, ng, group_size, H, n), 3, 1).reshape(B, H, ng, group_size * n)
    s1 = jnp.sort(jnp.where(s >= 0, s, _BIG), axis=-1)
    first = jnp.concatenate([jnp.ones_like(s1[..., :1], bool), s1[..., 1:] != s1[..., :-1]], -1) & (s1 < _BIG)
    s2 = jnp.sort(jnp.where(first, s1, _BIG), axis=-1)
    return jnp.where(s2 < _BIG, s2, 0).astype(jnp.int32), jnp.sum(first, -1).astype(jnp.int32)


def extra_rows(extra: nsa.Extra, sel, cfg: ModelConfig, group_size: int, g: int, mp: int, ep: int, ecp: int):
    """Per-row extra-key inputs, padded to Ep / Ecp columns (padding is never visible).

    Returns (k, v [B, Ep, Hkv, D], pos [B, Ep], tree-mask rows [B, NG, Mp, Ep], selected-branch visibility rows
    [B, Hkv, NG, Mp, Ep] (the key's block is selected by the row's query for that KV head; None without `sel`),
    compressed extras ck, cv [B, Ecp, Hkv, D] and their visibility rows [B, NG, Mp, Ecp])."""
    E = extra.k.shape[1]
    k, v = pad_axis(extra.k, 1, ep), pad_axis(extra.v, 1, ep)
    pos = pad_axis(extra.pos.astype(jnp.int32), 1, ep, fill=0)
    mask = pad_axis(extra.mask.astype(bool), 2, ep, fill=False) & (jnp.arange(ep) < E)  # [B, Q, Ep]
    xmask = query_rows(mask, group_size, g, mp, fill=False)
    xsel = None
    if sel is not None:
        xblk = pos // cfg.slc_block  # [B, Ep]
        in_sel = jnp.any(xblk[:, None, None, :, None] == sel[:, :, :, None, :], -1)  # [B, Q, Hkv, Ep]
        vis = in_sel & mask[:, :, None, :]
        xsel = jnp.moveaxis(query_rows(vis, group_size, g, mp, fill=False), 3, 1).astype(jnp.int32)
    ck, cv = pad_axis(extra.ck, 1, ecp), pad_axis(extra.cv, 1, ecp)
    cmask = pad_axis(extra.cmask.astype(bool), 2, ecp, fill=False)
    cmask = query_rows(cmask, group_size, g, mp, fill=False)
    return k, v, pos, xmask.astype(jnp.int32), xsel, ck, cv, cmask.astype(jnp.int32)
