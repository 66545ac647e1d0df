"""Shared pieces of the Pallas-Triton kernels: compiler params, shape rules, the in-kernel online-softmax
update, the row layout (GQA heads x queries folded into M rows) and the split combine.

No NSA math lives here: the kernels are tested against `ssv_jax.nsa`.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

NEG = -1e30  # finite "minus infinity" of the online softmax (exp(NEG - NEG) = 1 stays finite)
NUM_SMS = 132  # H100/H200 streaming multiprocessors: the split heuristics fill this many programs

_POISON = [False]
DIRECT_IO = [True]  # kernels read q / write outputs in the [B, Q, Hq, D] layout where shapes allow (a switch
                    # for falling back to XLA row packing)


@contextlib.contextmanager
def poison_outputs():
    """Within this context every kernel writes into NaN-filled output buffers (aliased inputs), so a test that
    finds no NaN in the result proves every element was written. Takes effect at trace time."""
    _POISON[0] = True
    try:
        yield
    finally:
        _POISON[0] = False


def pallas(kernel, *, grid, in_specs, out_specs, out_shape, args, num_warps: int, num_stages: int,
           interpret: bool, name: str, aliases: dict[int, int] | None = None):
    """`pl.pallas_call` on the Triton lowering with explicit `CompilerParams`. `aliases` maps inputs to the
    outputs they are updated in place as. Under `poison_outputs()` every other output is a NaN-filled buffer
    passed as an aliased input."""
    out_shape = list(out_shape)
    aliases = dict(aliases or {})
    if _POISON[0]:
        def _nan(s):
            fill = jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -(2 ** 31)
            return jnp.full(s.shape, fill, s.dtype)
        fresh = [i for i in range(len(out_shape)) if i not in aliases.values()]
        n_args = len(args)
        aliases.update({n_args + j: i for j, i in enumerate(fresh)})
        in_specs = list(in_specs) + [out_specs[i] for i in fresh]
        args = list(args) + [_nan(out_shape[i]) for i in fresh]
        inner = kernel

        def kernel(*refs):  # noqa: F811 - drop the poison input refs
            return inner(*refs[:n_args], *refs[n_args + len(fresh):])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*args)


# -- shape rules -----------------------------------------------------------------------------------------------
def next_pow2(x: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(x, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def is_pow2(x: int) -> bool:
    """Whether x is a power of two (>= 1)."""
    return x >= 1 and (x & (x - 1)) == 0


def dividing_chunk(n: int, what: str, cap: int = 64) -> int:
    """The largest power of two <= cap that divides n; it must be >= 16 (Pallas-Triton dot contraction)."""
    c = cap
    while c >= 16 and n % c:
        c //= 2
    if c < 16:
        raise ValueError(f"{what}={n} must be a multiple of 16 so that key chunks divide it "
                         f"(no automatic masking of non-dividing blocks); accepted: multiples of 16")
    return c


def check_cfg(cfg: ModelConfig, head_dim: int) -> None:
    """Shape rules of the kernels on top of `ModelConfig`'s own validation."""
    if not (is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"head_dim={head_dim} is invalid for the kernels; accepted: a power of two >= 16")
    if not (is_pow2(cfg.slc_block) and cfg.slc_block >= 16):
        raise ValueError(f"slc_block={cfg.slc_block} is invalid for the kernels; accepted: a power of two >= 16")
    if not is_pow2(cfg.n_slc):
        raise ValueError(f"n_slc={cfg.n_slc} is invalid for the kernels; accepted: a power of two")


def check_group_size(group_size, n_queries: int, g: int, max_rows: int = 256) -> int:
    """C must be a power of two dividing Q with C*G <= max_rows (the kernel loads the group's [C, n] indices)."""
    ok = isinstance(group_size, int) and is_pow2(group_size)
    if not ok or n_queries % group_size or group_size * g > max_rows:
        raise ValueError(f"group_size C={group_size!r} is invalid for Q={n_queries}, G={g}; accepted: a power of "
                         f"two C >= 1 that divides Q with C*G <= {max_rows}")
    return group_size


def is_concrete(x) -> bool:
    """Whether x is a concrete array (not a tracer), so its values can be checked on the host."""
    return not isinstance(x, jax.core.Tracer)


def check_sel(sel: jax.Array, n_sel_blocks: int, expect_shape: tuple) -> None:
    """`sel` must have shape [B, Q, Hkv, n] and (when concrete) ids in [-1, n_sel_blocks)."""
    if tuple(sel.shape) != tuple(expect_shape):
        raise ValueError(f"sel has shape {tuple(sel.shape)}; accepted: {tuple(expect_shape)} = [B, Q, Hkv, n_slc]")
    if is_concrete(sel):
        lo, hi = int(jnp.min(sel)), int(jnp.max(sel))
        if lo < -1 or hi >= n_sel_blocks:
            bad = lo if lo < -1 else hi
            raise ValueError(f"selected block id {bad} is out of range; accepted: -1 (empty) or "
                             f"0 <= id < {n_sel_blocks} (= S / slc_block)")


def check_cache(k, v, kc, cfg: ModelConfig) -> None:
    """The committed cache must hold whole selection blocks (k, v, kc may be `nsa.LayerKV` views)."""
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    if k.shape[1] % cfg.slc_block:
        raise ValueError(f"cache length S={k.shape[1]} must be a multiple of slc_block={cfg.slc_block}")
    if kc is not None and kc.shape[2:] != k.shape[2:]:
        raise ValueError(f"kc {kc.shape} must be [B, Nc, Hkv, D] with Hkv, D of k {k.shape}")


# -- row layout: rows r = c * G + g of a group of C queries, padded to Mp ----------------------------------------
def rows_of(x: jax.Array, hkv: int, c: int, mp: int, fill=0) -> jax.Array:
    """[B, Q, Hq, ...] -> [B, Hkv, NG, Mp, ...]."""
    B, Q, Hq = x.shape[:3]
    g = Hq // hkv
    rest = x.shape[3:]
    y = x.reshape((B, Q // c, c, hkv, g) + rest)
    y = jnp.moveaxis(y, 3, 1).reshape((B, hkv, Q // c, c * g) + rest)
    pad = [(0, 0)] * 3 + [(0, mp - c * g)] + [(0, 0)] * len(rest)
    return jnp.pad(y, pad, constant_values=fill)


def query_rows(x: jax.Array, c: int, g: int, mp: int, fill=0) -> jax.Array:
    """Per-query data [B, Q, ...] -> per-row [B, NG, Mp, ...] (each query repeated for its G heads)."""
    B, Q = x.shape[:2]
    y = jnp.repeat(x.reshape((B, Q // c, c) + x.shape[2:]), g, axis=2)
    return jnp.pad(y, [(0, 0), (0, 0), (0, mp - c * g)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def unrows(o: jax.Array, n_queries: int, g: int) -> jax.Array:
    """[B, Hkv, NG, Mp, D] -> [B, Q, Hq, D]."""
    B, hkv, ng, mp, D = o.shape
    c = n_queries // ng
    y = o[:, :, :, : c * g].reshape(B, hkv, ng, c, g, D)
    return jnp.moveaxis(y, 1, 3).reshape(B, n_queries, hkv * g, D)


def pad_axis(x: jax.Array, axis: int, size: int, fill=0) -> jax.Array:
    """`x` padded at the end of `axis` to `size` with `fill`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=fill)


def split_count(programs: int, work: int, max_split: int = 16, waves: int = 4) -> int:
    """Splits so that programs * splits covers the SMs `waves` times over (several small programs per SM hide
    load latency), with at least two work items per split."""
    want = -(-waves * NUM_SMS // max(programs, 1))
    return int(max(1, min(max_split, want, work // 2)))


# -- cache operands: [B, n, Hkv, D] arrays or nsa.LayerKV views of [L, B, n, Hkv, D] stacks --------------------
def cache_arg(x, hkv: int):
    """(array, BlockSpec) of a cache operand for a grid whose first axis is b * Hkv + h: a program sees [n, D],
    or [L, n, D] of the whole stack for an `nsa.LayerKV` (read in place, no per-layer copy of the cache)."""
    if isinstance(x, nsa.LayerKV):
        L, _, n, _, d = x.stack.shape
        return x.stack, pl.BlockSpec((L, None, n, None, d), lambda i, *_: (0, i // hkv, 0, i % hkv, 0))
    _, n, _, d = x.shape
    return x, pl.BlockSpec((None, n, None, d), lambda i, *_: (i // hkv, 0, i % hkv, 0))


def layer_arg(*xs):
    """The layer index [1] int32 shared by the `nsa.LayerKV` operands among xs (None when there are none)."""
    views = [x for x in xs if isinstance(x, nsa.LayerKV)]
    if not views:
        return None
    return jnp.asarray(views[0].layer, jnp.int32).reshape(1)


class CacheRef:
    """In-kernel view of a cache operand: `rows(start, size)` loads [size, D] (of layer `layer` for a stack)."""

    def __init__(self, ref, layer=None):
        self.ref, self.layer = ref, layer

    def rows(self, start, size: int):
        sl = pl.ds(start, size)
        return self.ref[sl, :] if self.layer is None else self.ref[self.layer, sl, :]


def cache_refs(layer_ref, *refs_and_flags):
    """Wraps (ref, stacked) pairs as `CacheRef`s, reading the layer index once."""
    layer = layer_ref[0] if layer_ref is not None else None
    return [CacheRef(r, layer if stacked else None) for r, stacked in refs_and_flags]


def reduce_all(x, op):
    """`op` over every axis, one at a time (the Triton lowering's reductions take one axis)."""
    while x.ndim:
        x = op(x, axis=-1)
    return x


# -- in-kernel online softmax ------------------------------------------------------------------------------------
def init_state(mp: int, d: int):
    """(acc [Mp, D], m [Mp], l [Mp]) of an empty online softmax."""
    return (jnp.zeros((mp, d), jnp.float32), jnp.full((mp,), NEG, jnp.float32), jnp.zeros((mp,), jnp.float32))


def scores(q, k, scale: float):
    """[M, D] x [K, D] -> [M, K] fp32 logits (fp32 inputs stay fp32: no tf32)."""
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    return plgpu.dot(q, k, trans_b=True, precision=prec) * scale


def update(state, s, valid, v):
    """One online-softmax step over a key chunk: logits s [M, K], visibility valid [M, K], values v [K, D].
    Returns (new state, p [M, K] relative to the new running max)."""
    acc, m, l = state
    s = jnp.where(valid, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1)
    prec = jax.lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    acc_new = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=prec)
    return (acc_new, m_new, l_new), p


def finish(state):
    """Normalised output of an online-softmax state; rows that saw no key give 0."""
    acc, _, l = state
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


COMBINE_UNROLL_MAX = 16  # splits up to which `combine` is written elementwise over the split slices


def combine(acc, m, l, axis: int):
    """LSE combine of split partial states along `axis` (acc has a trailing D axis). Returns (o, m, l).

    Up to `COMBINE_UNROLL_MAX` splits the split axis is unrolled into elementwise maxima and sums of its slices:
    XLA then emits one loop fusion (which also takes in elementwise consumers such as the branch gates) where
    the max-then-sum reductions take separate exp and reduce fusions, each a launch on the small verify and
    drafting shapes."""
    n = m.shape[axis]
    if n <= COMBINE_UNROLL_MAX:
        ms = [jax.lax.index_in_dim(m, i, axis, keepdims=False) for i in range(n)]
        mt = functools.reduce(jnp.maximum, ms)
        ws = [jnp.exp(mi - mt) for mi in ms]
        lt = functools.reduce(jnp.add, [w * jax.lax.index_in_dim(l, i, axis, keepdims=False)
                                        for i, w in enumerate(ws)])
        o = functools.reduce(jnp.add, [w[..., None] * jax.lax.index_in_dim(acc, i, axis, keepdims=False)
                                       for i, w in enumerate(ws)])
        return o / jnp.where(lt > 0, lt, 1.0)[..., None], mt, lt
    mt = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - mt)
    lt = jnp.sum(w * l, axis=axis)
    o = jnp.sum(w[..., None] * acc, axis=axis)
    return o / jnp.where(lt > 0, lt, 1.0)[..., None], jnp.squeeze(mt, axis), lt


def gate(gates, o_cmp, o_slc, o_win, dtype):
    """o = g_c * o_cmp + g_s * o_slc + g_w * o_win with gates [B, Q, Hq, 3] ordered (cmp, slc, win)."""
    g = gates.astype(jnp.float32)
    return (g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win).astype(dtype)
