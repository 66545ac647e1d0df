"""Compressed-attention kernel of the refresh layer (issue #3 item 3, launch 1).

It attends a tile of queries (all G heads of a KV head as rows) to the visible compressed blocks, split over the
compressed blocks across programs, and also emits each chunk's probabilities relative to the chunk's running max.
The XLA glue turns those into the exact probabilities `p` of `nsa.compressed_branch` once the split states are
LSE-combined; `nsa.block_importance` and `nsa.route` then give the selection, so routing (including the tie rule)
is the reference's own code. Same signature and results as `nsa.compressed_branch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import (NEG, cache_arg, cache_refs, check_cfg, combine, dividing_chunk, init_state, layer_arg,
                      next_pow2, pad_axis, pallas, query_rows, rows_of, scores, split_count, update)


def _kernel(q_ref, t_ref, meta_ref, kc_ref, vc_ref, *rest, cb: int, per: int, nch: int, stride: int,
            cmp_len: int, scale: float, extra: bool, stacked: bool, probs: bool, logits: bool, offset: int):
    rest = list(rest)
    eck_ref, ecv_ref, xc_ref = (rest.pop(0) for _ in range(3)) if extra else (None,) * 3
    layer_ref = rest.pop(0) if stacked else None
    acc_ref, m_ref, l_ref = rest[:3]
    u_ref, mc_ref, xu_ref, xm_ref = (rest[3:] + [None, None])[:4] if probs else (None,) * 4
    s_ref = rest[3] if logits else None
    kc_ref, vc_ref = cache_refs(layer_ref, (kc_ref, stacked), (vc_ref, stacked))
    split = pl.program_id(2)
    q = q_ref[...]
    t = t_ref[...][:, None]
    kvlen, nvis = meta_ref[0], meta_ref[1]  # nvis: chunks holding a block visible to some row of the tile
    arc = jnp.arange(cb, dtype=jnp.int32)[None, :]
    st = init_state(*q.shape)
    if extra:  # per-path compressed blocks: split 0 only
        valid = (xc_ref[...] != 0) & (split == 0)
        st, p = update(st, scores(q, eck_ref[...], scale), valid, ecv_ref[...])
        if probs:
            xu_ref[...] = p
            xm_ref[...] = st[1]

    lo = split * per
    hi = jnp.minimum(lo + per, nch)

    def body(i, st):
        c0 = pl.multiple_of(i * cb, cb)
        end = (c0 + arc) * stride + cmp_len - 1
        valid = (end <= t) & (end < kvlen)
        s = scores(q, kc_ref.rows(c0, cb), scale)
        st, p = update(st, s, valid, vc_ref.rows(c0, cb))
        if probs:
            u_ref[:, pl.ds(c0, cb)] = p
            mc_ref[i, :] = st[1]
        if logits:
            s_ref[:, pl.ds(offset + c0, cb)] = jnp.where(valid, s, NEG)
        return st

    def zero(i, carry):  # chunks past the last visible block: probability 0 (logit NEG)
        c0 = pl.multiple_of(i * cb, cb)
        if probs:
            u_ref[:, pl.ds(c0, cb)] = jnp.zeros((q.shape[0], cb), jnp.float32)
            mc_ref[i, :] = jnp.full((q.shape[0],), NEG, jnp.float32)
        if logits:
            s_ref[:, pl.ds(offset + c0, cb)] = jnp.full((q.shape[0], cb), NEG, jnp.float32)
        return carry

    if logits and offset:
        @pl.when(split == 0)
        def _():
            s_ref[:, pl.ds(0, offset)] = jnp.full((q.shape[0], offset), NEG, jnp.float32)

    mid = jnp.maximum(jnp.minimum(hi, nvis), lo)
    acc, m, l = jax.lax.fori_loop(lo, mid, body, st)
    if probs or logits:
        jax.lax.fori_loop(mid, hi, zero, 0)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _query_tile(n_queries: int, g: int, max_rows: int = 64) -> int:
    c = max(1, min(n_queries, max_rows // g))
    while n_queries % c:
        c -= 1
    return c


def compressed_splits(programs: int, nc: int, nsplit: int | None = None) -> tuple[int, int]:
    """(splits, chunks per split) of the compressed launch for `programs` (batch x KV head x query tile) over
    `nc` compressed blocks: `nsplit` (default: enough to fill the SMs) rounded so that no split is empty."""
    nch = nc // dividing_chunk(nc, "number of compressed blocks Nc")
    if nsplit is None:
        nsplit = split_count(programs, nch)
    per = -(-nch // nsplit)
    return -(-nch // per), per


def compressed_launch(rows, q_pos, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None, *, ct: int,
                      g: int, nsplit: int | None = None, interpret: bool = False, num_warps: int = 4,
                      num_stages: int = 2, emit: str | None = "probs", logits_width: int | None = None,
                      logits_offset: int = 0, split_slots: int = 1):
    """The compressed kernel on packed query rows `rows` [B, Hkv, QT, Mp, D] (`rows_of` with tiles of `ct`
    queries of `g` heads each). Returns its raw outputs: the split states (acc [B, Hkv, QT, S, Mp, D], m and l
    [B, Hkv, QT, S, Mp]) over S = max(splits, `split_slots`) slots (slots past the splits are left unwritten),
    then by `emit`:

    * "probs": each block's probability relative to its chunk's running max u [B, Hkv, QT, Mp, Nc], those maxima
      [B, Hkv, QT, Nc/cb, Mp], and with `extra` the per-path blocks' ([.., S, Mp, Ec'] and [.., S, Mp]);
    * "logits": the masked logits [B, Hkv, QT, Mp, logits_width], block c in column `logits_offset` + c (NEG
      where a block is not visible and in the first `logits_offset` columns; columns past the blocks unwritten),
      from which a later kernel forms the probabilities once the splits' LSE is known;
    * None: nothing more."""
    B, H, qt, mp, D = rows.shape
    nc = kc.shape[1]
    check_cfg(cfg, D)
    if kc.shape != vc.shape or kc.shape[0] != B or kc.shape[3] != D:
        raise ValueError(f"kc {kc.shape} / vc {vc.shape} must both be [B={B}, Nc, Hkv, D={D}]")
    if emit not in ("probs", "logits", None):
        raise ValueError(f"emit={emit!r} is invalid; accepted: 'probs', 'logits' or None")
    if emit == "logits" and (extra is not None or logits_width is None or logits_width < nc + logits_offset):
        raise ValueError(f"emit='logits' needs extra=None and logits_width >= Nc + logits_offset = "
                         f"{nc + logits_offset}; got {logits_width}")
    cb = dividing_chunk(nc, "number of compressed blocks Nc")
    nch = nc // cb
    nsplit, per = compressed_splits(B * H * qt, nc, nsplit)
    slots = max(nsplit, split_slots)
    has_x = extra is not None and extra.ck.shape[1] > 0
    probs = emit == "probs"

    t = query_rows(q_pos.astype(jnp.int32), ct, g, mp, fill=-1)  # [B, QT, Mp]
    kl = kv_len.astype(jnp.int32)[:, None]
    nvis = nsa.num_complete_blocks(jnp.minimum(jnp.max(q_pos.reshape(B, qt, ct), -1) + 1, kl), cfg)
    meta = jnp.stack([jnp.broadcast_to(kl, (B, qt)), -(-nvis // cb)], -1).astype(jnp.int32)  # [B, QT, 2]

    row = pl.BlockSpec((None, None, None, mp, D), lambda i, j, s: (i // H, i % H, j, 0, 0))
    cache = lambda n: pl.BlockSpec((None, n, None, D), lambda i, j, s: (i // H, 0, i % H, 0))  # noqa: E731
    (kc_arr, kc_spec), (vc_arr, vc_spec) = cache_arg(kc, H), cache_arg(vc, H)
    args = [rows, t, meta, kc_arr, vc_arr]
    specs = [row, pl.BlockSpec((None, None, mp), lambda i, j, s: (i // H, j, 0)),
             pl.BlockSpec((None, None, 2), lambda i, j, s: (i // H, j, 0)), kc_spec, vc_spec]
    hd = lambda *shape: pl.BlockSpec((None, None, None) + shape,  # noqa: E731
                                     lambda i, j, s: (i // H, i % H, j) + (0,) * len(shape))
    hds = lambda *shape: pl.BlockSpec((None, None, None, None) + shape,  # noqa: E731
                                      lambda i, j, s: (i // H, i % H, j, s) + (0,) * len(shape))
    f32 = lambda *shape: jax.ShapeDtypeStruct((B, H, qt) + shape, jnp.float32)  # noqa: E731
    out_shape = [f32(slots, mp, D), f32(slots, mp), f32(slots, mp)]
    out_specs = [hds(mp, D), hds(mp), hds(mp)]
    if probs:
        out_shape += [f32(mp, nc), f32(nch, mp)]
        out_specs += [hd(mp, nc), hd(nch, mp)]
    if emit == "logits":
        out_shape.append(f32(mp, logits_width))
        out_specs.append(hd(mp, logits_width))
    if has_x:
        ecp = next_pow2(extra.ck.shape[1])
        xcm = query_rows(pad_axis(extra.cmask.astype(bool), 2, ecp, fill=False), ct, g, mp, fill=False)
        args += [pad_axis(extra.ck, 1, ecp), pad_axis(extra.cv, 1, ecp), xcm.astype(jnp.int32)]
        specs += [cache(ecp), cache(ecp), pl.BlockSpec((None, None, mp, ecp), lambda i, j, s: (i // H, j, 0, 0))]
        if probs:
            out_shape += [f32(slots, mp, ecp), f32(slots, mp)]
            out_specs += [hds(mp, ecp), hds(mp)]
    layer = layer_arg(kc, vc)
    if layer is not None:
        args.append(layer)
        specs.append(pl.BlockSpec((1,), lambda i, j, s: (0,)))
    kern = functools.partial(_kernel, cb=cb, per=per, nch=nch, stride=cfg.cmp_stride, cmp_len=cfg.cmp_len,
                             scale=D ** -0.5, extra=has_x, stacked=layer is not None, probs=probs,
                             logits=emit == "logits", offset=logits_offset)
    return pallas(kern, grid=(B * H, qt, nsplit), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
                  args=args, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                  name="compressed_attention")


def compressed_attention(q, q_pos, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
                         nsplit: int | None = None, interpret: bool = False, num_warps: int = 4,
                         num_stages: int = 2, probs: bool = True):
    """Compressed branch with probabilities, as `nsa.compressed_branch`: returns (o_cmp [B, Q, Hq, D] fp32,
    p [B, Q, Hkv, G, Nc], px [B, Q, Hkv, G, Ec] or None). With `probs=False` the kernel writes no probabilities
    and returns (o_cmp, None, None): the compressed branch alone, as the two-launch reuse layer uses it."""
    B, Q, Hq, D = q.shape
    H = kc.shape[2]
    G = Hq // H
    ct = _query_tile(Q, G)
    qt, mp = Q // ct, next_pow2(ct * G)
    outs = compressed_launch(rows_of(q, H, ct, mp), q_pos, kc, vc, kv_len, cfg, extra, ct=ct, g=G, nsplit=nsplit,
                             interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                             emit="probs" if probs else None)
    o, mt, lt = combine(*outs[:3], axis=3)  # [B, H, QT, Mp, D], [B, H, QT, Mp]
    o_cmp = jnp.moveaxis(o[:, :, :, : ct * G].reshape(B, H, qt, ct, G, D), 1, 3).reshape(B, Q, Hq, D)
    if not probs:
        return o_cmp, None, None
    u, mc = outs[3:5]
    cb = u.shape[-1] // mc.shape[-2]  # compressed blocks per chunk of the kernel's running max
    lse = jnp.where(lt > 0, mt + jnp.log(jnp.where(lt > 0, lt, 1.0)), jnp.inf)[..., None]  # p = 0 where no key

    def probs(u, m):  # rows [B, H, QT, Mp, K] -> [B, Q, H, G, K]
        p = u * jnp.exp(m - lse)
        K = p.shape[-1]
        p = p[:, :, :, : ct * G].reshape(B, H, qt, ct, G, K)
        return jnp.moveaxis(p, 1, 3).reshape(B, Q, H, G, K)

    p = probs(u, jnp.repeat(jnp.swapaxes(mc, -1, -2), cb, axis=-1))
    px = None
    if extra is not None:  # the per-path blocks' outputs follow when there are any
        px = (probs(outs[5][:, :, :, 0], outs[6][:, :, :, 0][..., None])[..., : extra.ck.shape[1]] if len(outs) > 5
              else jnp.zeros((B, Q, H, G, 0), jnp.float32))
    return o_cmp, p, px
