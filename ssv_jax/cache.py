"""The target's KV cache: per-layer keys/values and compressed keys/values (DESIGN.md, NSA semantics 1).

Keys are stored post-RoPE. Compressed blocks are appended incrementally as blocks complete and are never
recomputed from scratch during decode. Slot s of `k`/`v` holds the key at absolute position s; the first
`length[b]` slots are committed. Positions are int32; the largest index formed is S*Hkv*D per layer
(131K * 8 * 128 = 2^27 for the 8B shape), well inside int32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssv_jax import nsa
from ssv_jax.config import ModelConfig


class KVCache(NamedTuple):
    """The target's KV cache: per layer the raw keys/values and the compressed block keys/values (one per
    stride d), and the committed length of each batch row."""

    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]
    kc: jax.Array  # [L, B, S // d, Hkv, D]
    vc: jax.Array  # [L, B, S // d, Hkv, D]
    length: jax.Array  # [B] int32 committed tokens

    @property
    def capacity(self) -> int:
        """Slots per row (S): the most tokens the cache can hold."""
        return self.k.shape[2]


def cache_capacity(cfg: ModelConfig, max_len: int | None = None) -> int:
    """Slots needed for `max_len` tokens, rounded up to a multiple of the selection block and of 16 compressed
    blocks (the kernels walk keys and compressed keys in chunks of 16 that must divide the cache)."""
    n = cfg.max_seq_len if max_len is None else max_len
    ls = cfg.slc_block
    unit = math.lcm(ls, 16 * cfg.cmp_stride)
    cap = -(-n // unit) * unit
    if cap // ls < cfg.n_slc:
        cap = cfg.n_slc * ls  # routing needs at least n selection blocks to choose from
    return cap


def init_cache(cfg: ModelConfig, batch: int, max_len: int | None = None, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for `max_len` tokens (default `cfg.max_seq_len`)."""
    if batch < 1:
        raise ValueError(f"batch={batch} is invalid; accepted: >= 1")
    shp, cshp = _shapes(cfg, batch, cache_capacity(cfg, max_len))
    z = jnp.zeros
    return KVCache(z(shp, dtype), z(shp, dtype), z(cshp, dtype), z(cshp, dtype), jnp.zeros((batch,), jnp.int32))


def random_cache(cfg: ModelConfig, batch: int, capacity: int, length: int, key: jax.Array,
                 dtype=jnp.bfloat16) -> KVCache:
    """A cache of `capacity` slots (a multiple of `cache_capacity`'s granule) filled with random K/V and
    compressed blocks, holding `length` committed tokens: what benchmarks use instead of a long prefill (a step's
    cost depends on the cache's shapes and length, not on its values)."""
    shp, cshp = _shapes(cfg, batch, capacity)
    ks = jax.random.split(key, 4)
    r = jax.random.normal
    return KVCache(r(ks[0], shp, dtype), r(ks[1], shp, dtype), r(ks[2], cshp, dtype), r(ks[3], cshp, dtype),
                   jnp.full((batch,), length, jnp.int32))


def _shapes(cfg: ModelConfig, batch: int, capacity: int):
    """(K/V shape [L, B, S, Hkv, D], compressed shape [L, B, S/d, Hkv, D])."""
    return ((cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim),
            (cfg.n_layers, batch, capacity // cfg.cmp_stride, cfg.n_kv_heads, cfg.head_dim))


def write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, S, ...] <- rows [B, A, ...] at per-batch offsets `start` [B] (caller guarantees start + A <= S)."""
    return jax.vmap(lambda b, r, s: jax.lax.dynamic_update_slice_in_dim(b, r.astype(b.dtype), s, 0))(
        buf, rows, start)


def completed_blocks(k: jax.Array, start: jax.Array, n_new: jax.Array, max_new: int, cfg: ModelConfig,
                     w=None, pe=None) -> tuple[jax.Array, jax.Array]:
    """The compressed blocks that complete among the `n_new` [B] tokens just written at `start` [B].

    k [B, S, Hkv, D] (or an `nsa.LayerKV`) is the updated key buffer. Returns (slot [B, K], block [B, K, Hkv, D]) with slot = Nc
    (= S // d, out of range: to be dropped) where no block completes. At most max_new // d + 1 blocks complete, so
    the work is static and proportional to the new tokens, never to the context."""
    l, d = cfg.cmp_len, cfg.cmp_stride
    nc = k.shape[1] // d
    K = max_new // d + 1
    c_lo = nsa.num_complete_blocks(start, cfg)  # first block that was not complete before
    c = c_lo[:, None] + jnp.arange(K)[None, :]  # [B, K]
    ok = (c * d + l - 1 <= (start + n_new - 1)[:, None]) & (c < nc)
    pos = c[..., None] * d + jnp.arange(l)  # [B, K, l]
    blocks = nsa.gather_rows(k, pos)  # [B, K, l, Hkv, D]
    new = nsa.compress(blocks, cfg, w, pe)
    return jnp.where(ok, c, nc), new


def append_blocks(k: nsa.LayerKV, v: nsa.LayerKV, kc: jax.Array, vc: jax.Array, start: jax.Array, cfg: ModelConfig,
                  wk=None, pek=None, wv=None, pev=None, *, n_new: jax.Array | None = None, max_new: int = 1):
    """After `n_new` [B] (default 1) keys per row were written at `start` [B] into layer `k.layer` of the K/V
    stacks, write the compressed blocks they complete into that layer of `kc`/`vc` [L, B, Nc, Hkv, D]
    (`completed_blocks` for K and V, scattered at their slots). Returns (kc, vc). `pallas_kernels.commit_blocks`
    is the one-key kernel of the same contract."""
    n_new = jnp.ones_like(start) if n_new is None else n_new
    bidx = jnp.arange(start.shape[0])[:, None]
    slot, ck = completed_blocks(k, start, n_new, max_new, cfg, wk, pek)
    _, cv = completed_blocks(v, start, n_new, max_new, cfg, wv, pev)
    return (kc.at[k.layer, bidx, slot].set(ck.astype(kc.dtype), mode="drop"),
            vc.at[v.layer, bidx, slot].set(cv.astype(vc.dtype), mode="drop"))
