"""Decode-step block compression with an early exit (issue #2: the decode step's small ops).

A decode step appends one key per layer, and a compressed block completes only on one step in d (16 for the 8B
preset). XLA's path (`cache.completed_blocks`) computes the candidate block on every step regardless and
scatters it out of range when it did not complete: with MLP compression that is a gather, a reduction over
2 x 8.4 MB of compression weights and a scatter for each of K and V, every layer, every step
(docs/results/decode_profile_8k_h200.json). Here one launch per layer does it for K and V: each program first
checks whether its batch row's new key completes a block and otherwise exits; the program that continues
compresses its share of the block's output features and writes them in place into the compressed cache (the
caches are aliased inputs and outputs).

Given the new token's fused q/k/v/gate product, the same launch is the whole prologue of the decode layer: it
applies RoPE to the new key and writes the K/V rows in place, and writes the query rows (roped, padded to the
attention kernels' row tile) and the sigmoid gates that `decode_refresh_layer` reads (`DecodeQuery`). That
replaces XLA's RoPE, padding, slicing and sigmoid fusions (four launches per layer at the 8B shape).

phi is `nsa.compress`: mean pooling, or for "mlp" (k + pe) flattened times w [Hkv, l, D, D] per head, in fp32,
stored in the cache's dtype. Reference: `cache.append_blocks` (one new key per row), `model._qkv`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import is_pow2, next_pow2, pallas
from .decode_layer import DecodeQuery

ROWS_PER_STEP = 4  # block rows (of D features) multiplied per loop step


def _rope(y_ref, cos_ref, sin_ref, base, lo, n: int):
    """Features [lo, lo + n) of the rotate-half RoPE of the head at y[base:base + D], in f32, as
    `model.apply_rope`: n = D (lo = 0) or a slice within one half (n <= D/2, lo a multiple of n)."""
    half = cos_ref.shape[0]
    if n == 2 * half:  # the whole head: [x1 c - x2 s | x2 c + x1 s], assembled as [2, D/2] rows
        x1 = y_ref[pl.ds(base, half)].astype(jnp.float32)
        x2 = y_ref[pl.ds(base + half, half)].astype(jnp.float32)
        c, s = cos_ref[...], sin_ref[...]
        top = jax.lax.broadcasted_iota(jnp.int32, (2, half), 0) == 0
        return jnp.where(top, (x1 * c - x2 * s)[None, :], (x2 * c + x1 * s)[None, :]).reshape(n)
    first = lo < half  # the slice's partner feature is half a head to the right (first half) or to the left
    f = jnp.where(first, lo, lo - half)
    x = y_ref[pl.ds(base + lo, n)].astype(jnp.float32)
    p = y_ref[pl.ds(base + jnp.where(first, lo + half, f), n)].astype(jnp.float32)
    c, s = cos_ref[pl.ds(f, n)], sin_ref[pl.ds(f, n)]
    return jnp.where(first, x * c - p * s, x * c + p * s)


def _kernel(meta_ref, layer_ref, *refs, cfg_l: int, stride: int, mlp: bool, eb: int, hkv: int, g: int,
            new: bool):
    refs = list(refs)
    tok = [refs.pop(0) for _ in range(3)] if new else None  # the fused product [N] and the RoPE cos, sin [D/2]
    p_refs = [refs.pop(0) for _ in range(4)] if mlp else ()
    k_refs = [refs.pop(0), refs.pop(0)]  # the K/V stacks (aliased to the first outputs when `new`)
    outs = refs[-(6 if new else 2):]  # past the aliased inputs: ([K, V,] KC, VC[, query rows, gates])
    c = meta_ref[0]  # the block this row's new key completes, or -1
    pos = meta_ref[1]
    li = layer_ref[0]
    e = pl.program_id(1)
    h = pl.program_id(0) % hkv
    d = k_refs[0].shape[-1]
    lo = e * eb
    feats = pl.ds(lo, eb)
    dtype = k_refs[0].dtype

    def new_row(kv, start, n: int):
        """Features [start, start + n) of the new key (roped) or value, rounded as the model rounds them."""
        qd = hkv * g * d
        if kv == 0:
            x = _rope(*tok, qd + h * d, start, n).astype(tok[0].dtype)
        else:
            x = tok[0][pl.ds(qd + (hkv + h) * d + start, n)]
        return x.astype(dtype)

    if new:
        @pl.when(pos < k_refs[0].shape[1])  # the new rows' features (dropped past the cache, as XLA's scatter)
        def _():
            for kv in range(2):
                outs[kv][li, pos, feats] = new_row(kv, lo, eb)

        rows_ref, gates_ref = outs[4:]
        rid = jax.lax.broadcasted_iota(jnp.int32, rows_ref.shape[:1] + (eb,), 0)
        q = jnp.zeros(rid.shape, rows_ref.dtype)  # rows past the G heads stay zero (the kernels' padding)
        for j in range(g):
            q = jnp.where(rid == j, _rope(*tok, (h * g + j) * d, lo, eb).astype(rows_ref.dtype)[None, :], q)
        rows_ref[:, feats] = q

        @pl.when(e == 0)
        def _():
            g0 = (g + 2) * hkv * d + 3 * g * h  # this KV head's [G, 3] gate logits
            for b in range(3):
                gates_ref[b, :] = jax.nn.sigmoid(tok[0][pl.ds(g0 + b, g, stride=3)].astype(jnp.float32))
        outs = outs[2:4]

    def rows(kv, start, n: int, f0, nf: int):
        """Rows [start, start + n), features [f0, f0 + nf) of the layer, the new row computed from its input
        (another program of this row writes its other features: reading it back from the stack would race)."""
        x = k_refs[kv][li, pl.ds(start, n), pl.ds(f0, nf)]
        if not new:
            return x
        at = start + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        return jnp.where(at == pos, new_row(kv, f0, nf)[None, :], x)

    for kv in range(2):  # keys, then values: one program does both for its (row, head, features)
        @pl.when(c >= 0)
        def _(kv=kv):
            out = outs[kv]
            start = c * stride
            if not mlp:
                x = rows(kv, start, cfg_l, lo, eb).astype(jnp.float32)
                out[li, c, feats] = (jnp.sum(x, axis=0) / cfg_l).astype(out.dtype)
                return
            w_ref, pe_ref = p_refs[2 * kv], p_refs[2 * kv + 1]
            rs = ROWS_PER_STEP

            def body(j, acc):
                j0 = pl.multiple_of(j * rs, rs)
                x = rows(kv, start + j0, rs, 0, d) + pe_ref[pl.ds(j0, rs), :].astype(dtype)
                w = w_ref[pl.ds(j0 * d, rs * d), :].astype(jnp.float32)  # [rs*D, eb]
                return acc + jnp.sum(x.astype(jnp.float32).reshape(rs * d)[:, None] * w, axis=0)

            acc = jax.lax.fori_loop(0, cfg_l // rs, body, jnp.zeros((eb,), jnp.float32))
            out[li, c, feats] = acc.astype(out.dtype)


def supports(cfg: ModelConfig, head_dim: int) -> bool:
    """Block length and head dim powers of two, l a multiple of `ROWS_PER_STEP` (the kernel's tiles), and a
    power-of-two number of query heads per KV head (the prologue's gate rows)."""
    return (is_pow2(cfg.cmp_len) and cfg.cmp_len % ROWS_PER_STEP == 0 and is_pow2(head_dim) and head_dim >= 16
            and is_pow2(cfg.n_heads // cfg.n_kv_heads))


def commit_blocks(k: nsa.LayerKV, v: nsa.LayerKV, kc: jax.Array, vc: jax.Array, pos: jax.Array,
                  cfg: ModelConfig, wk=None, pek=None, wv=None, pev=None, *, qkvg=None, rope=None,
                  features_per_program: int = 16, interpret: bool = False, num_warps: int = 4):
    """After one key per batch row was written at `pos` [B] into layer `k.layer` of the stacks, append the
    compressed block it completes (if any) to that layer of `kc`/`vc` [L, B, Nc, Hkv, D] in place. w* [Hkv, l,
    D, D] and pe* [Hkv, l, D] are the layer's MLP compression parameters (None for mean compression). Returns
    (kc, vc), as `cache.append_blocks`.

    With the new token's fused product `qkvg` [B, 1, Hq*D + 2*Hkv*D + 3*Hq] (q | k | v | gate logits, before
    RoPE; `model._qkvg_widths`) and `rope` = (cos, sin) [B, D/2] at `pos`, the launch is the decode layer's
    whole prologue: it also writes the new K (roped) and V rows at `pos` into the stacks (in place; rows past
    the cache are dropped) and returns (K stack, V stack, kc, vc, `DecodeQuery`): the roped query rows and
    the sigmoid gates in the layout `decode_refresh_layer` reads. XLA's RoPE, gate and scatter ops and the
    commit, in one launch."""
    L, B, S, H, D = k.stack.shape
    nc = kc.shape[2]
    if not supports(cfg, D):
        raise ValueError(f"commit_blocks needs cmp_len a power of two multiple of {ROWS_PER_STEP}, head_dim a "
                         f"power of two >= 16 and n_heads / n_kv_heads a power of two; got cmp_len={cfg.cmp_len}, "
                         f"head_dim={D}, {cfg.n_heads} / {cfg.n_kv_heads}")
    new = qkvg is not None
    G = cfg.n_heads // H
    if new:
        n = (G + 2) * H * D + 3 * G * H
        if qkvg.shape != (B, 1, n) or rope is None or any(x.shape != (B, D // 2) for x in rope):
            raise ValueError(f"qkvg {tuple(qkvg.shape)} / rope {[tuple(x.shape) for x in rope or ()]} are "
                             f"invalid; accepted: qkvg [B, 1, N] = {(B, 1, n)} and rope two [B, D/2] = "
                             f"{(B, D // 2)}")
    mlp = cfg.compression == "mlp"
    eb = min(features_per_program, D)
    pos = pos.astype(jnp.int32)
    start = pos - cfg.cmp_len + 1  # first key of the block this key would complete
    done = (start >= 0) & (start % cfg.cmp_stride == 0) & (start // cfg.cmp_stride < nc)
    meta = jnp.stack([jnp.where(done, start // cfg.cmp_stride, -1), pos], -1)  # [B, 2]
    layer = jnp.asarray(k.layer, jnp.int32).reshape(1)

    stack = pl.BlockSpec((L, None, S, None, D), lambda i, e: (0, i // H, 0, i % H, 0))
    cstack = pl.BlockSpec((L, None, nc, None, D), lambda i, e: (0, i // H, 0, i % H, 0))
    args = [meta, layer]
    specs = [pl.BlockSpec((None, 2), lambda i, e: (i // H, 0)), pl.BlockSpec((1,), lambda i, e: (0,))]
    if new:
        args += [qkvg, *(x.astype(jnp.float32) for x in rope)]
        specs += [pl.BlockSpec((None, None, qkvg.shape[-1]), lambda i, e: (i // H, 0, 0))]
        specs += [pl.BlockSpec((None, D // 2), lambda i, e: (i // H, 0))] * 2
    if mlp:
        for w, pe in ((wk, pek), (wv, pev)):
            args += [w.reshape(H, cfg.cmp_len * D, D), pe]
            specs += [pl.BlockSpec((None, cfg.cmp_len * D, eb), lambda i, e: (i % H, 0, e)),
                      pl.BlockSpec((None, cfg.cmp_len, D), lambda i, e: (i % H, 0, 0))]
    outputs = ([k.stack, v.stack] if new else []) + [kc, vc]
    out_specs = ([stack, stack] if new else []) + [cstack, cstack]
    if not new:  # read-only stacks
        args += [k.stack, v.stack]
        specs += [stack, stack]
    n_in = len(args)
    args += outputs
    specs += out_specs
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs]
    if new:
        mp = next_pow2(G)
        out_shape += [jax.ShapeDtypeStruct((B, H, 1, mp, D), qkvg.dtype),
                      jax.ShapeDtypeStruct((B, H, 3, G), jnp.float32)]
        out_specs += [pl.BlockSpec((None, None, None, mp, D), lambda i, e: (i // H, i % H, 0, 0, 0)),
                      pl.BlockSpec((None, None, 3, G), lambda i, e: (i // H, i % H, 0, 0))]
    kern = functools.partial(_kernel, cfg_l=cfg.cmp_len, stride=cfg.cmp_stride, mlp=mlp, eb=eb, hkv=H, g=G,
                             new=new)
    res = pallas(kern, grid=(B * H, D // eb), in_specs=specs, out_specs=out_specs, out_shape=out_shape, args=args,
                 aliases={n_in + i: i for i in range(len(outputs))}, num_warps=num_warps, num_stages=1,
                 interpret=interpret, name="commit_blocks")
    return (*res[:4], DecodeQuery(*res[4:])) if new else tuple(res)


commit_blocks.supports = supports
