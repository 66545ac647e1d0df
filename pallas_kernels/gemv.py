"""Decode-step GEMVs with their neighbours fused (issue #2: the decode step's small ops).

In a one-token decode step each projection is a GEMV over a few rows, bound by reading the weights. XLA runs
each as a split-K Triton GEMM plus separate fusions around it: the RMSNorm reduction before q/k/v/gate and
gate/up, the split-K reduction after, the SwiGLU product, the residual add (docs/results/decode_profile_8k_h200.json:
~11 such ops per layer). Here one launch does a whole projection with its neighbours:

    y = rms_norm(x, norm) @ w              (norm: the prologue; `model.rms_norm`)
    y = silu(h @ w_gate) * (h @ w_up)      (swiglu: w = [w_gate | w_up] fused column-wise, `model.split_layers`)
    y = residual + x @ w                   (residual: the epilogue)

Each program owns `block_n` output columns and loops over the whole contraction in `block_k` chunks, so there
is no split-K pass. The rows (M <= 16) are padded to 16 in registers for a tensor-core dot, which Triton
pipelines through shared memory (`num_stages`); or, with `dot=False`, reduced on the CUDA cores. 32 rows (a verified
draft tree's nodes) load as one [M, block_k] tile instead (`TILE_ROWS`).
Rounding follows `model`: the normalised input and each product are rounded to x's dtype before their next use.
Reference: `model.rms_norm`, `model._mm`, `jax.nn.silu`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import dividing_chunk, is_pow2, pallas

MAX_ROWS = 16  # rows of the padded dot operand: the rows a launch handles one by one
TILE_ROWS = (32,)  # further row counts, loaded and normalised as one [M, block_k] tile (measured: 32)
NORM_CHUNK = 4096  # columns of x per load of the RMSNorm pass (one row at a time)
NORM_TILE = 8192  # elements of x per load of the tiled RMSNorm pass
# The largest weight (K x N elements) whose tile-of-rows product the model routes here. Measured with 32 rows
# (`tune_gemv.py --rows 32`, docs/results/gemv_h200.json `verify_rows_32`): on the bundled model's <= 0.72M-element
# weights the kernel beats XLA's fusions (7.6-8.7 against 11.8-13.0 us: launch-bound), on the 8B shape's >= 16.8M
# XLA's GEMMs beat it (11.6 / 58.7 / 32.4 against 14.3 / 72.3 / 39.7 us for wo / gate-up / w_down).
TILE_MAX_WEIGHT = 1 << 22


def _rows(x_ref, m: int, k0, bk: int):
    return [x_ref[r, pl.ds(k0, bk)].astype(jnp.float32) for r in range(m)]


def _pad16(hs, dtype):
    """Rows [bk] each -> [16, bk] in `dtype`, row r holding hs[r] (all rows hs[0] when there is one)."""
    if len(hs) == 1:
        return jnp.broadcast_to(hs[0].astype(dtype)[None, :], (MAX_ROWS, hs[0].shape[0]))
    rid = jax.lax.broadcasted_iota(jnp.int32, (MAX_ROWS, hs[0].shape[0]), 0)
    out = jnp.zeros((MAX_ROWS, hs[0].shape[0]), jnp.float32)
    for r, h in enumerate(hs):
        out = jnp.where(rid == r, h[None, :], out)
    return out.astype(dtype)


def _row_of(acc, r: int):
    """Row r of a [16, bn] accumulator (exact: a sum of zeros and one value)."""
    rid = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where(rid == r, acc, 0.0), axis=0)


def _kernel(*refs, m: int, bk: int, n_k: int, norm: bool, eps: float, residual: bool, swiglu: bool, dot: bool,
            nk: bool):
    refs = list(refs)
    x_ref, w_refs = refs.pop(0), [refs.pop(0) for _ in range(1 + swiglu)]
    nw_ref = refs.pop(0) if norm else None
    r_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    dt = x_ref.dtype
    bn = o_ref.shape[-1]
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

    if m in TILE_ROWS:
        return _tile_kernel(x_ref, w_refs, nw_ref, r_ref, o_ref, bk=bk, n_k=n_k, eps=eps, swiglu=swiglu, nk=nk)
    if norm:  # 1 / rms of each row, from loads of up to NORM_CHUNK columns (one for a 4096-wide row): a chunk
        # loop of block_k would put its load latencies in series before the first weight tile is used
        K = n_k * bk
        nc = dividing_chunk(K, "K", NORM_CHUNK)

        def sumsq(i, ss):
            return tuple(s + jnp.sum(h * h) for s, h in zip(ss, _rows(x_ref, m, pl.multiple_of(i * nc, nc), nc)))
        ss = jax.lax.fori_loop(0, K // nc, sumsq, tuple(jnp.float32(0) for _ in range(m)))
        scale = [jax.lax.rsqrt(s / K + eps) for s in ss]

    def body(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        hs = _rows(x_ref, m, k0, bk)
        if norm:
            nw = nw_ref[pl.ds(k0, bk)].astype(jnp.float32)
            hs = [((h * s) * nw).astype(dt).astype(jnp.float32) for h, s in zip(hs, scale)]
        h16 = _pad16(hs, dt) if dot else None  # shared by both weight tiles with swiglu
        out = []
        for w_ref, acc in zip(w_refs, accs):
            w = w_ref[:, pl.ds(k0, bk)] if nk else w_ref[pl.ds(k0, bk), :]  # [bn, bk] or [bk, bn]
            if dot:
                out.append(acc + plgpu.dot(h16, w.astype(dt), trans_b=nk, precision=prec))
            else:
                wf = w.astype(jnp.float32)
                kx = 1 if nk else 0
                out.append(tuple(a + jnp.sum(jnp.expand_dims(h, 1 - kx) * wf, axis=kx) for a, h in zip(acc, hs)))
        return tuple(out)

    zero = jnp.zeros((MAX_ROWS, bn), jnp.float32) if dot else tuple(jnp.zeros((bn,), jnp.float32) for _ in range(m))
    accs = jax.lax.fori_loop(0, n_k, body, tuple(zero for _ in w_refs))
    for r in range(m):
        ys = [_row_of(a, r) if dot else a[r] for a in accs]
        o_ref[r, :] = _epilogue(ys, r_ref[r, :] if residual else None, dt, swiglu).astype(o_ref.dtype)


def _epilogue(accs, res, dt, swiglu: bool):
    """The product(s) rounded to dt, SwiGLU'd (gate, up) when `swiglu`, plus the residual `res` (or None); f32."""
    ys = [a.astype(dt).astype(jnp.float32) for a in accs]
    y = (ys[0] * jax.nn.sigmoid(ys[0])).astype(dt).astype(jnp.float32) * ys[1] if swiglu else ys[0]
    return y if res is None else res.astype(jnp.float32) + y


def _tile_kernel(x_ref, w_refs, nw_ref, r_ref, o_ref, *, bk: int, n_k: int, eps: float, swiglu: bool, nk: bool):
    """`_kernel` for M in TILE_ROWS: the rows are one [M, bk] tile, the norm a vector of M scales."""
    dt = x_ref.dtype
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    m, bn = o_ref.shape
    scale = None
    if nw_ref is not None:
        K = n_k * bk
        nc = dividing_chunk(K, "K", max(16, NORM_TILE // m))

        def sumsq(i, ss):
            x = x_ref[:, pl.ds(pl.multiple_of(i * nc, nc), nc)].astype(jnp.float32)
            return ss + jnp.sum(x * x, axis=1)
        ss = jax.lax.fori_loop(0, K // nc, sumsq, jnp.zeros((m,), jnp.float32))
        scale = jax.lax.rsqrt(ss / K + eps)[:, None]

    def body(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        h = x_ref[:, pl.ds(k0, bk)]
        if scale is not None:
            h = ((h.astype(jnp.float32) * scale) * nw_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :])
        h = h.astype(dt)
        out = []
        for w_ref, acc in zip(w_refs, accs):
            w = w_ref[:, pl.ds(k0, bk)] if nk else w_ref[pl.ds(k0, bk), :]
            out.append(acc + plgpu.dot(h, w.astype(dt), trans_b=nk, precision=prec))
        return tuple(out)

    accs = jax.lax.fori_loop(0, n_k, body, tuple(jnp.zeros((m, bn), jnp.float32) for _ in w_refs))
    o_ref[...] = _epilogue(accs, None if r_ref is None else r_ref[...], dt, swiglu).astype(o_ref.dtype)


def supports(x_shape, w_shape, *, swiglu: bool = False, transposed: bool = False) -> bool:
    """Rows (all leading axes of x) <= 16 or in `TILE_ROWS`, a 2-D weight [K, N] ([N, K] when `transposed`) whose
    contraction K is a multiple of 16 and whose output columns (per half with swiglu) are a multiple of 16."""
    rows = math.prod(x_shape[:-1])
    if len(w_shape) != 2 or (rows > MAX_ROWS and rows not in TILE_ROWS):
        return False
    K, N = w_shape[::-1] if transposed else w_shape
    n = N // 2 if swiglu else N
    return x_shape[-1] == K and K % 16 == 0 and n % 16 == 0 and (not swiglu or N % 2 == 0)


def serves(x_shape, w_shape, *, swiglu: bool = False, transposed: bool = False) -> bool:
    """Where the model routes a projection here: `supports`, and a tile of rows only for a weight of at most
    `TILE_MAX_WEIGHT` elements (above it XLA's GEMM is faster)."""
    if not supports(x_shape, w_shape, swiglu=swiglu, transposed=transposed):
        return False
    return math.prod(x_shape[:-1]) <= MAX_ROWS or math.prod(w_shape) <= TILE_MAX_WEIGHT


def fused_gemv(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 1e-5,
               residual: jax.Array | None = None, swiglu: bool = False, block_n: int = 32, block_k: int = 256,
               dot: bool = True, num_warps: int = 4, num_stages: int = 3, transposed: bool = False,
               interpret: bool = False) -> jax.Array:
    """One-launch projection of a few rows: x [..., K] times w [K, N] with the optional fused steps of the
    module docstring. Returns [..., N] (or [..., N / 2] with `swiglu`) in x's dtype. With `transposed`, w is
    stored as [N, K] (each output column's weights contiguous); the product is the same x @ w.T.

    `block_n` / `block_k` are caps: the launch uses the largest powers of two within them that divide the
    output columns and K."""
    if not supports(x.shape, w.shape, swiglu=swiglu, transposed=transposed):
        raise ValueError(f"fused_gemv got x {tuple(x.shape)} and w {tuple(w.shape)}; accepted: x [..., K] with at "
                         f"most {MAX_ROWS} rows or {' or '.join(map(str, TILE_ROWS))}, "
                         f"w {'[N, K]' if transposed else '[K, N]'} with K and N{' / 2' if swiglu else ''} multiples "
                         f"of 16")
    if not (is_pow2(block_n) and is_pow2(block_k) and block_n >= 16 and block_k >= 16):
        raise ValueError(f"block_n={block_n}, block_k={block_k} are invalid; accepted: powers of two >= 16")
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0] if transposed else w.shape[1]
    n = N // 2 if swiglu else N
    if residual is not None and tuple(residual.shape) != lead + (n,):
        raise ValueError(f"residual {tuple(residual.shape)} must match the output {lead + (n,)}")
    m = math.prod(lead)
    if m in TILE_ROWS:
        if not dot:
            raise ValueError(f"dot=False is invalid for {m} rows; accepted: dot=True (tiles of {TILE_ROWS} rows run "
                             f"on the tensor cores)")
        block_k = min(block_k, max(16, NORM_TILE // m))  # keep the [M, block_k] tile within NORM_TILE elements
    bn, bk = dividing_chunk(n, "output columns", block_n), dividing_chunk(K, "K", block_k)
    nb = n // bn
    x2 = x.reshape(m, K)
    args = [x2, w] + ([w] if swiglu else [])
    if transposed:
        w_spec = lambda off: pl.BlockSpec((bn, K), lambda j: (j + off, 0))  # noqa: E731
    else:
        w_spec = lambda off: pl.BlockSpec((K, bn), lambda j: (0, j + off))  # noqa: E731
    specs = [pl.BlockSpec((m, K), lambda j: (0, 0)), w_spec(0)] + ([w_spec(nb)] if swiglu else [])
    if norm is not None:
        args.append(norm)
        specs.append(pl.BlockSpec((K,), lambda j: (0,)))
    if residual is not None:
        args.append(residual.reshape(m, n))
        specs.append(pl.BlockSpec((m, bn), lambda j: (0, j)))
    kern = functools.partial(_kernel, m=m, bk=bk, n_k=K // bk, norm=norm is not None, eps=float(eps),
                             residual=residual is not None, swiglu=swiglu, dot=dot, nk=transposed)
    (y,) = pallas(kern, grid=(nb,), in_specs=specs, out_specs=[pl.BlockSpec((m, bn), lambda j: (0, j))],
                  out_shape=[jax.ShapeDtypeStruct((m, n), x.dtype)], args=args, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret, name="fused_gemv")
    return y.reshape(lead + (n,))


# The decode-step projections `model.forward` routes through `fused_gemv`, with their launch configs (tuned at the
# 8B shapes: scripts/tune_gemv.py, docs/results/gemv_h200.json). q/k/v/gate (the fused `w_qkvg`) and gate/up
# (`w_gu`) take their RMSNorm as the prologue, gate/up its SwiGLU as the epilogue; wo and w_down take the
# residual add. Each beat XLA's GEMV plus the fusions around it there.
PROJECTIONS = {
    "w_qkvg": dict(block_n=64, block_k=256, num_warps=4, num_stages=3),
    "wo": dict(block_n=32, block_k=256, num_warps=4, num_stages=4),
    "w_gu": dict(block_n=64, block_k=256, num_warps=8, num_stages=2),
    "w_down": dict(block_n=64, block_k=512, num_warps=4, num_stages=4),
}

fused_gemv.supports = supports
fused_gemv.serves = serves
fused_gemv.projections = PROJECTIONS
