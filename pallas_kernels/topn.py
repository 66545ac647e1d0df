"""Top-n over the last axis, as `jax.lax.top_k`: values descending, ties broken by the lower index.

The refresh layer's routing picks n = 16 of Nsel selection blocks for every (query, KV head) row. XLA's TopK
custom call takes ~69 µs per layer at a 64-node verify over a 64K cache (512 rows x 1088 blocks; traced on the
H200, `docs/results/verify_trace_64k.json`): 2.2 ms of a 14 ms verify. Here one program holds a tile of rows in
registers and runs n rounds of (row max, first column at that max, retire that column); the rounds are
dependent reductions, so the tiling (`_tiling`) is chosen for latency, not bandwidth. Rows wider than `MAX_TILE`
elements go through two stages: the top-n of each column chunk, then the top-n of those candidates (chunks are in
column order and each chunk's candidates are in (value desc, index asc) order, so ties still go to the lower
index).

The draft tree's selection, the top k of a log-softmax over the draft vocabulary (`top_n_log_softmax`), forms the
log-softmax in the same program when a row fits one tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa

from ._common import NUM_SMS, next_pow2, pallas

RANK_MAX_PAIRS = 1 << 21  # route_top_n: the rank fusion up to here (routing_top_n_h200.json, e2e_routing_check)
MAX_TILE = 4096  # elements of a row tile held by one program (f32: 32 registers per thread at 4 warps)
_BIG = 2 ** 30


def _kernel(s_ref, v_ref, i_ref, *, n: int, m: int, log_softmax: bool):
    s = s_ref[...].astype(jnp.float32)  # [R, Mp]
    col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, v_ref.shape, 1)
    live = col < m  # padding columns are never picked
    if log_softmax:  # the whole row is in the tile: its log-sum-exp, formed as jax.nn.log_softmax forms it
        shifted = s - jnp.max(jnp.where(live, s, -jnp.inf), axis=1, keepdims=True)
        s = shifted - jnp.log(jnp.sum(jnp.where(live, jnp.exp(shifted), 0.0), axis=1, keepdims=True))
    vals = jnp.full(v_ref.shape, -jnp.inf, jnp.float32)
    idxs = jnp.zeros(i_ref.shape, jnp.int32)
    for k in range(n):
        cand = jnp.where(live, s, -jnp.inf)
        best = jnp.max(cand, axis=1, keepdims=True)
        first = jnp.min(jnp.where(live & (cand == best), col, _BIG), axis=1, keepdims=True)
        vals = jnp.where(slot == k, best, vals)
        idxs = jnp.where(slot == k, first, idxs)
        live = live & (col != first)
    v_ref[...] = vals
    i_ref[...] = idxs


def one_launch(width: int) -> bool:
    """Whether rows of `width` elements fit one program's tile (one launch; wider rows take two stages)."""
    return next_pow2(width) <= MAX_TILE


def _tiling(rows: int, mp: int) -> tuple[int, int]:
    """(rows per program, warps). Each of the n rounds is two dependent row reductions, so the kernel is
    latency-bound: one row per program until the grid fills the SMs, and as few warps as hold the tile (one warp
    reduces with shuffles alone, no shared-memory round trip)."""
    r = 1
    while r * 2 * mp <= MAX_TILE and rows // (r * 2) >= NUM_SMS:
        r *= 2
    return r, min(4, max(1, r * mp // 1024))


def _one_stage(x: jax.Array, n: int, interpret: bool, num_warps: int | None, log_softmax: bool = False):
    rows, m = x.shape
    mp, npad = next_pow2(m), next_pow2(n)
    r, warps = _tiling(rows, mp)
    num_warps = num_warps or warps
    rows_p = -(-rows // r) * r
    x = jnp.pad(x, ((0, rows_p - rows), (0, mp - m)))
    v, i = pallas(functools.partial(_kernel, n=n, m=m, log_softmax=log_softmax), grid=(rows_p // r,),
                  in_specs=[pl.BlockSpec((r, mp), lambda g: (g, 0))],
                  out_specs=[pl.BlockSpec((r, npad), lambda g: (g, 0))] * 2,
                  out_shape=[jax.ShapeDtypeStruct((rows_p, npad), jnp.float32),
                             jax.ShapeDtypeStruct((rows_p, npad), jnp.int32)],
                  args=[x], num_warps=num_warps, num_stages=1, interpret=interpret, name="top_n")
    return v[:rows, :n], i[:rows, :n]


def _check_n(n, m: int) -> None:
    """n must be a Python int in [1, min(m, MAX_TILE / 2)] for rows of m elements."""
    top = min(m, MAX_TILE // 2)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= top:
        raise ValueError(f"n={n!r} is invalid for rows of {m} elements; accepted: an int in [1, {top}]")


def top_n(score: jax.Array, n: int, *, interpret: bool = False, num_warps: int | None = None):
    """`jax.lax.top_k(score, n)` over the last axis with the same tie rule: returns (values [..., n] in score's
    dtype, indices [..., n] int32). Rows of at most `MAX_TILE` elements take one launch, wider rows two.
    `num_warps` (default: by tile size, see `_tiling`) overrides the warps per program."""
    *lead, m = score.shape
    _check_n(n, m)
    x = score.reshape(-1, m)
    rows = x.shape[0]
    if one_launch(m):
        v, i = _one_stage(x, n, interpret, num_warps)
    else:  # chunks of c columns: top-n per chunk, then over the n * chunks candidates
        c = MAX_TILE // 2 if n <= MAX_TILE // 8 else MAX_TILE
        nch = -(-m // c)
        xc = jnp.pad(x, ((0, 0), (0, nch * c - m)), constant_values=-jnp.inf).reshape(rows * nch, c)
        v1, i1 = _one_stage(xc, min(n, c), interpret, num_warps)
        i1 = i1.reshape(rows, nch, -1) + (jnp.arange(nch, dtype=jnp.int32) * c)[None, :, None]
        v, j = top_n(v1.reshape(rows, -1), n, interpret=interpret, num_warps=num_warps)
        i = jnp.take_along_axis(i1.reshape(rows, -1), j, axis=1)
    lead_shape = tuple(lead) + (n,)
    return v.astype(score.dtype).reshape(lead_shape), i.reshape(lead_shape)


def top_n_log_softmax(logits: jax.Array, n: int, *, interpret: bool = False):
    """`jax.lax.top_k(jax.nn.log_softmax(logits), n)` over the last axis: (log-probs [..., n] float32, indices
    [..., n] int32). The draft tree's selection over the draft vocabulary. Rows of at most `MAX_TILE` elements take
    one launch that also forms the row's log-sum-exp (XLA would run the log-softmax as fusions of its own before
    its TopK); wider rows take XLA's log-softmax and the two-stage `top_n`."""
    logits = logits.astype(jnp.float32)
    *lead, m = logits.shape
    _check_n(n, m)
    if not one_launch(m):
        return top_n(jax.nn.log_softmax(logits, axis=-1), n, interpret=interpret)
    v, i = _one_stage(logits.reshape(-1, m), n, interpret, None, log_softmax=True)
    return v.reshape(tuple(lead) + (n,)), i.reshape(tuple(lead) + (n,))


def route_top_n(score: jax.Array, n: int, *, interpret: bool = False):
    """Routing's top-n on the kernel path (`nsa.route(..., select=)`): the reference's one-fusion rank top-n for
    small problems (rows x width^2 <= `RANK_MAX_PAIRS`: decode rows, the launch-bound bundled model, where one
    fused op beats pad + launch), this kernel otherwise. Both equal `jax.lax.top_k`."""
    if math.prod(score.shape[:-1]) * score.shape[-1] ** 2 <= RANK_MAX_PAIRS:
        return nsa.top_n(score, n)
    return top_n(score, n, interpret=interpret)
