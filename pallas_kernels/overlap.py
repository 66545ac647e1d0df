"""Overlap utilities (issue #3 item 5): overlap gamma between adjacent flattened queries, merged-set sizes per
group, and synthetic selections with a controlled gamma for the benchmarks. Used by the benchmarks and the
planner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .groups import merged_blocks


def _check_sel(sel) -> None:
    if sel.ndim != 4:
        raise ValueError(f"sel has shape {tuple(sel.shape)}; accepted: [B, Q, Hkv, n]")


def overlap_gamma(sel: jax.Array) -> jax.Array:
    """gamma_i = |S_i ∩ S_{i+1}| / n between adjacent flattened queries, per KV head: [B, Q-1, Hkv] (empty
    slots, -1, never count)."""
    _check_sel(sel)
    a, b = sel[:, :-1], sel[:, 1:]
    hit = jnp.any(a[..., :, None] == b[..., None, :], -1) & (a >= 0)
    return jnp.sum(hit, -1) / sel.shape[-1]


def merged_sizes(sel: jax.Array, group_size: int) -> jax.Array:
    """Size of each group's merged (union) block set: [B, Hkv, NG] for groups of `group_size` consecutive
    queries; the blocks a mode-A program loads."""
    _check_sel(sel)
    if not (isinstance(group_size, int) and group_size >= 1 and sel.shape[1] % group_size == 0):
        raise ValueError(f"group_size={group_size!r} is invalid for Q={sel.shape[1]}; accepted: an integer >= 1 "
                         f"dividing Q")
    return merged_blocks(sel, group_size)[1]


def synthetic_selection(seed: int, q_pos: np.ndarray, n_kv_heads: int, n_sel_blocks: int, n: int, slc_block: int,
                        gamma: float) -> np.ndarray:
    """Host-side selections [B, Q, Hkv, n] with the forced blocks (0, current, previous) of each query and
    round(gamma * n) blocks kept from the previous query (the rest drawn fresh among blocks <= current), so the
    adjacent overlap is about gamma. Every slot holds a distinct valid block (needs current block >= n)."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} is invalid; accepted: 0 <= gamma <= 1")
    rng = np.random.default_rng(seed)
    q_pos = np.asarray(q_pos)
    B, Q = q_pos.shape
    out = np.zeros((B, Q, n_kv_heads, n), np.int32)
    keep = int(round(gamma * n))
    for b in range(B):
        for h in range(n_kv_heads):
            prev: list[int] = []
            for i in range(Q):
                cur = int(q_pos[b, i]) // slc_block
                if cur + 1 < n or cur >= n_sel_blocks:
                    raise ValueError(f"query position {q_pos[b, i]} needs {n} <= current block + 1 <= "
                                     f"{n_sel_blocks}")
                s = [0, cur, cur - 1] if cur >= 1 else [0]
                s = list(dict.fromkeys(s))
                for j in prev:
                    if len(s) >= max(keep, len(s)):
                        break
                    if j not in s and j <= cur:
                        s.append(j)
                while len(s) < n:
                    j = int(rng.integers(0, cur + 1))
                    if j not in s and j not in prev:
                        s.append(j)
                out[b, i, h] = sorted(s)
                prev = list(rng.permutation(s))
    return out
