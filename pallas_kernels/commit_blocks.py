"""Decode-step block compression with an early exit (issue #2: the decode step's small ops).

A decode step appends one key per layer, and a compressed block completes only on one step in d (16 for the 8B
preset). XLA's path (`cache.completed_blocks`) computes the candidate block on every step regardless and
scatters it out of range when it did not complete: with MLP compression that is a gather, a reduction over
2 x 8.4 MB of compression weights and a scatter for each of K and V, every layer, every step
(docs/results/decode_profile_8k_h200.json). Here one launch per layer does it for K and V: each program first
checks whether its batch row's new key completes a block and otherwise exits; the program that continues
compresses its share of the block's output features and writes them in place into the compressed cache (the
caches are aliased inputs and outputs).

phi is `nsa.compress`: mean pooling, or for "mlp" (k + pe) flattened times w [Hkv, l, D, D] per head, in fp32,
stored in the cache's dtype. Reference: `cache.append_blocks` (one new key per row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import is_pow2

ROWS_PER_STEP = 4  # block rows (of D features) multiplied per loop step


def _kernel(meta_ref, layer_ref, *refs, cfg_l: int, stride: int, mlp: bool, eb: int, new: bool):
    refs = list(refs)
    new_refs = [refs.pop(0), refs.pop(0)] if new else None  # the new key and value rows [D]
    p_refs = [refs.pop(0) for _ in range(4)] if mlp else ()
    k_refs = [refs.pop(0), refs.pop(0)]  # the K/V stacks (aliased to the first outputs when `new`)
    outs = refs[-(4 if new else 2):]  # past the aliased inputs: ([K, V,] KC, VC)
    c = meta_ref[0]  # the block this row's new key completes, or -1
    pos = meta_ref[1]
    li = layer_ref[0]
    e = pl.program_id(1)
    d = k_refs[0].shape[-1]
    feats = pl.ds(e * eb, eb)

    if new:  # write this program's features of the new rows (dropped past the cache, as the XLA scatter)
        @pl.when(pos < k_refs[0].shape[1])
        def _():
            for kv in range(2):
                outs[kv][li, pos, feats] = new_refs[kv][feats]
        outs = outs[2:]

    def rows(kv, start, n: int, cols):
        """Rows [start, start + n) of the layer, the new row taken from its input (another program of this
        row writes its other features: reading it back from the stack would race)."""
        x = k_refs[kv][li, pl.ds(start, n), cols]
        if not new:
            return x
        at = start + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        return jnp.where(at == pos, new_refs[kv][cols][None, :], x)

    for kv in range(2):  # keys, then values: one program does both for its (row, head, features)
        @pl.when(c >= 0)
        def _(kv=kv):
            out = outs[kv]
            start = c * stride
            if not mlp:
                x = rows(kv, start, cfg_l, feats).astype(jnp.float32)
                out[li, c, feats] = (jnp.sum(x, axis=0) / cfg_l).astype(out.dtype)
                return
            w_ref, pe_ref = p_refs[2 * kv], p_refs[2 * kv + 1]
            rs = ROWS_PER_STEP

            def body(j, acc):
                j0 = pl.multiple_of(j * rs, rs)
                x = rows(kv, start + j0, rs, slice(None)) + pe_ref[pl.ds(j0, rs), :].astype(k_refs[kv].dtype)
                w = w_ref[pl.ds(j0 * d, rs * d), :].astype(jnp.float32)  # [rs*D, eb]
                return acc + jnp.sum(x.astype(jnp.float32).reshape(rs * d)[:, None] * w, axis=0)

            acc = jax.lax.fori_loop(0, cfg_l // rs, body, jnp.zeros((eb,), jnp.float32))
            out[li, c, feats] = acc.astype(out.dtype)


def supports(cfg: ModelConfig, head_dim: int) -> bool:
    """Block length and head dim powers of two, l a multiple of `ROWS_PER_STEP` (the kernel's tiles)."""
    return is_pow2(cfg.cmp_len) and cfg.cmp_len % ROWS_PER_STEP == 0 and is_pow2(head_dim) and head_dim >= 16


def commit_blocks(k: nsa.LayerKV, v: nsa.LayerKV, kc: jax.Array, vc: jax.Array, pos: jax.Array,
                  cfg: ModelConfig, wk=None, pek=None, wv=None, pev=None, *, new=None,
                  features_per_program: int = 16, interpret: bool = False, num_warps: int = 4):
    """After one key per batch row was written at `pos` [B] into layer `k.layer` of the stacks, append the
    compressed block it completes (if any) to that layer of `kc`/`vc` [L, B, Nc, Hkv, D] in place. w* [Hkv, l,
    D, D] and pe* [Hkv, l, D] are the layer's MLP compression parameters (None for mean compression). Returns
    (kc, vc), as `cache.append_blocks`.

    With `new` = (k_new, v_new) [B, 1, Hkv, D] the launch also writes those rows at `pos` into the stacks (in
    place; rows past the cache are dropped) and returns (K stack, V stack, kc, vc): the XLA scatters of the new
    rows and the commit in one launch."""
    L, B, S, H, D = k.stack.shape
    nc = kc.shape[2]
    if not supports(cfg, D):
        raise ValueError(f"commit_blocks needs cmp_len a power of two multiple of {ROWS_PER_STEP} and head_dim a "
                         f"power of two >= 16; got cmp_len={cfg.cmp_len}, head_dim={D}")
    if new is not None and any(x.shape != (B, 1, H, D) for x in new):
        raise ValueError(f"new rows {[tuple(x.shape) for x in new]} are invalid; accepted: two [B, 1, Hkv, D] = "
                         f"{(B, 1, H, D)}")
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
    if new is not None:
        args += [x.astype(k.stack.dtype) for x in new]
        specs += [pl.BlockSpec((None, None, None, D), lambda i, e: (i // H, 0, i % H, 0))] * 2
    if mlp:
        for w, pe in ((wk, pek), (wv, pev)):
            args += [w.reshape(H, cfg.cmp_len * D, D), pe]
            specs += [pl.BlockSpec((None, cfg.cmp_len * D, eb), lambda i, e: (i % H, 0, e)),
                      pl.BlockSpec((None, cfg.cmp_len, D), lambda i, e: (i % H, 0, 0))]
    outputs = ([k.stack, v.stack] if new is not None else []) + [kc, vc]
    out_specs = ([stack, stack] if new is not None else []) + [cstack, cstack]
    n_in = len(args)
    if new is None:  # read-only stacks
        args += [k.stack, v.stack]
        specs += [stack, stack]
        n_in += 2
    args += outputs
    specs += out_specs
    kern = functools.partial(_kernel, cfg_l=cfg.cmp_len, stride=cfg.cmp_stride, mlp=mlp, eb=eb,
                             new=new is not None)
    return tuple(pl.pallas_call(
        kern, grid=(B * H, D // eb), in_specs=specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        input_output_aliases={n_in + i: i for i in range(len(outputs))}, interpret=interpret,
        name="commit_blocks", compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))(*args))


commit_blocks.supports = supports
