"""Verify-layer prologue: RMSNorm, the fused q/k/v/gate projection, RoPE and the gates' sigmoid in one launch.

A verification round starts each target layer with XLA's RMSNorm, the `w_qkvg` GEMM and its cast, the column
split and one RoPE fusion each for q and k: about six launches a layer on the bundled model, each a few
microseconds on a tree's 32 rows (docs/results/round_ops_15k_h200.json). Here one launch computes

    y = rms_norm(x, norm) @ w_qkvg                    (columns [q | k | v | gates], `model._qkvg_widths`)
    q, k = RoPE(y_q), RoPE(y_k);  v = y_v;  g = sigmoid(y_g)

and writes q, k, v and g into their own arrays. Each program owns one unit of D output columns: a query head or
a key head (roped), a value head, or D columns of gates (the last unit is masked past the gate columns). A unit
is shared by `col_split` programs: each multiplies all rows by matching slices of the unit's two half-heads of
weight columns, so the rotate-half pairs sit in two accumulators of the same program. The contraction loops over `block_k` chunks (no split-K pass).

Rounding follows `model._qkv`: the normalised input and the product are rounded to x's dtype, RoPE and the
sigmoid run in f32 on the rounded product; q, k, v are stored in x's dtype and the gates in f32.
Reference: `model._qkv` (with `model.rms_norm`, `model._mm`, `model.apply_rope`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import dividing_chunk, is_pow2, pallas
from .gemv import NORM_TILE, tile_rms_scale

MIN_ROWS, MAX_ROWS = 16, 64  # rows (B * nodes) a launch loads as one tile: a power of two in this range
# The largest fused weight (K x N elements) routed here, as `gemv.TILE_MAX_WEIGHT`: one program per head loads
# its whole [K, D] slice, which pays on the bundled model (0.4M elements) and not on the 8B shape (25.6M).
MAX_WEIGHT = 1 << 22


def _kernel(x_ref, nw_ref, w_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, g_ref, *, hq: int, hkv: int, d: int,
            bk: int, n_k: int, eps: float):
    u, part = pl.program_id(0), pl.program_id(1)
    dt = x_ref.dtype
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    m = x_ref.shape[0]
    half = d // 2
    n = half // pl.num_programs(1)  # this program's columns in each half of the unit
    n_cols = w_ref.shape[1]
    scale = tile_rms_scale(x_ref, n_k * bk, eps)

    f0 = part * n  # the first feature within each half
    col = [u * d + f0, u * d + half + f0]  # the first column of w of each half's slice
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    live = [c + iota < n_cols for c in col]  # all true but in the gates' last unit

    def body(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        h = x_ref[:, pl.ds(k0, bk)].astype(jnp.float32) * scale
        h = (h * nw_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]).astype(dt)
        out = []
        for c, ok, acc in zip(col, live, accs):
            w = plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(c, n)], mask=ok, other=0)
            out.append(acc + plgpu.dot(h, w.astype(dt), precision=prec))
        return tuple(out)

    a1, a2 = jax.lax.fori_loop(0, n_k, body, (jnp.zeros((m, n), jnp.float32),) * 2)
    y1, y2 = a1.astype(dt).astype(jnp.float32), a2.astype(dt).astype(jnp.float32)
    c, s = cos_ref[:, pl.ds(f0, n)], sin_ref[:, pl.ds(f0, n)]
    r1, r2 = y1 * c - y2 * s, y2 * c + y1 * s

    def store(o_ref, base, z1, z2):  # the unit's two slices at column `base` of o
        o_ref[:, pl.ds(base + f0, n)] = z1.astype(o_ref.dtype)
        o_ref[:, pl.ds(base + half + f0, n)] = z2.astype(o_ref.dtype)

    @pl.when(u < hq)
    def _():
        store(q_ref, u * d, r1, r2)

    @pl.when((u >= hq) & (u < hq + hkv))
    def _():
        store(k_ref, (u - hq) * d, r1, r2)

    @pl.when((u >= hq + hkv) & (u < hq + 2 * hkv))
    def _():
        store(v_ref, (u - hq - hkv) * d, y1, y2)

    @pl.when(u >= hq + 2 * hkv)
    def _():
        base = (u - hq - 2 * hkv) * d
        for off, y in ((f0, y1), (half + f0, y2)):
            plgpu.store(g_ref.at[:, pl.ds(base + off, n)], jax.nn.sigmoid(y), mask=base + off + iota < g_ref.shape[1])


def supports(x_shape, w_shape, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Rows (all leading axes of x) a power of two in [MIN_ROWS, MAX_ROWS]; w [K, N] the fused q/k/v/gate matrix
    of these heads (N = (n_heads + 2 n_kv_heads) * head_dim + 3 n_heads) with K a multiple of 16; head_dim a power
    of two >= 32 (two half-head tiles of >= 16 columns)."""
    rows = math.prod(x_shape[:-1])
    if len(w_shape) != 2 or not (is_pow2(rows) and MIN_ROWS <= rows <= MAX_ROWS):
        return False
    K, N = w_shape
    n = (n_heads + 2 * n_kv_heads) * head_dim + 3 * n_heads
    return x_shape[-1] == K and K % 16 == 0 and N == n and is_pow2(head_dim) and head_dim >= 32


def serves(x_shape, w_shape, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Where the model routes a tree's prologue here: `supports`, and a weight of at most `MAX_WEIGHT` elements."""
    return supports(x_shape, w_shape, n_heads, n_kv_heads, head_dim) and math.prod(w_shape) <= MAX_WEIGHT


def qkv_prologue(x: jax.Array, norm: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *, n_heads: int,
                 n_kv_heads: int, eps: float = 1e-5, block_k: int = 512, col_split: int = 2, num_warps: int = 4,
                 num_stages: int = 1, interpret: bool = False):
    """The attention prologue of a verify layer in one launch: x [..., K] (a tree's rows), its RMSNorm weight
    norm [K], the fused w [K, N] (columns q | k | v | gates), and the rows' RoPE cos / sin [..., D/2] (f32, as
    `model.rope_cos_sin`). Returns q [..., Hq, D] and k, v [..., Hkv, D] in x's dtype (q and k roped) and the
    gates' sigmoid [..., Hq, 3] in f32: what `model._qkv` returns.

    `col_split` programs share each unit of D columns (each takes D / (2 col_split) columns of either half), for
    more programs reading fewer weights each; it is capped so that a slice keeps >= 16 columns."""
    lead, K = x.shape[:-1], x.shape[-1]
    d = 2 * cos.shape[-1]
    if not supports(x.shape, w.shape, n_heads, n_kv_heads, d):
        raise ValueError(f"qkv_prologue got x {tuple(x.shape)}, w {tuple(w.shape)}, head_dim {d}; accepted: "
                         f"{MIN_ROWS} to {MAX_ROWS} rows (a power of two), w [K, (Hq + 2 Hkv) * D + 3 Hq] with "
                         f"Hq={n_heads}, Hkv={n_kv_heads}, K a multiple of 16, D a power of two >= 32")
    if tuple(cos.shape) != tuple(sin.shape) or tuple(cos.shape[:-1]) != tuple(lead):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [{', '.join(map(str, lead))}"
                         f", D/2]")
    if not (is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"block_k={block_k} is invalid; accepted: a power of two >= 16")
    if not (isinstance(col_split, int) and is_pow2(col_split)):
        raise ValueError(f"col_split={col_split!r} is invalid; accepted: a power of two")
    col_split = min(col_split, d // 32)
    m = math.prod(lead)
    bk = dividing_chunk(K, "K", min(block_k, max(16, NORM_TILE // m)))
    units = n_heads + 2 * n_kv_heads + -(-3 * n_heads // d)
    full = lambda shape: pl.BlockSpec(shape, lambda u, p: (0,) * len(shape))  # noqa: E731
    f32 = lambda a: a.reshape(m, d // 2).astype(jnp.float32)  # noqa: E731
    args = [x.reshape(m, K), norm, w, f32(cos), f32(sin)]
    out_shape = [jax.ShapeDtypeStruct((m, n_heads * d), x.dtype), jax.ShapeDtypeStruct((m, n_kv_heads * d), x.dtype),
                 jax.ShapeDtypeStruct((m, n_kv_heads * d), x.dtype), jax.ShapeDtypeStruct((m, 3 * n_heads), jnp.float32)]
    kern = functools.partial(_kernel, hq=n_heads, hkv=n_kv_heads, d=d, bk=bk, n_k=K // bk, eps=float(eps))
    q, k, v, g = pallas(kern, grid=(units, col_split), in_specs=[full(a.shape) for a in args],
                        out_specs=[full(s.shape) for s in out_shape], out_shape=out_shape, args=args,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret, name="qkv_prologue")
    return (q.reshape(lead + (n_heads, d)), k.reshape(lead + (n_kv_heads, d)), v.reshape(lead + (n_kv_heads, d)),
            g.reshape(lead + (n_heads, 3)))


qkv_prologue.supports = supports
qkv_prologue.serves = serves
