"""Naive per-query selected-branch kernel: the "naive SD+NSA" baseline (issue #3 item 1).

One program per (query, KV head), no sharing between queries: it walks that query's own n selected blocks with
the G query heads of the KV head as rows (padded to 16). Reference: `ssv_jax.nsa.selected_branch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from . import groups
from ._common import (cache_arg, cache_refs, check_cache, check_cfg, check_sel, finish, init_state, layer_arg,
                      next_pow2, pallas, query_rows, rows_of, scores, unrows, update)


def _kernel(q_ref, t_ref, kvlen_ref, sel_ref, k_ref, v_ref, *rest, n: int, ls: int, scale: float,
            extra: bool, stacked: bool):
    rest = list(rest)
    ek_ref, ev_ref, xs_ref = (rest.pop(0) for _ in range(3)) if extra else (None,) * 3
    layer_ref = rest.pop(0) if stacked else None
    (o_ref,) = rest
    k_ref, v_ref = cache_refs(layer_ref, (k_ref, stacked), (v_ref, stacked))
    q = q_ref[...]
    t = t_ref[...][:, None]
    kvlen = kvlen_ref[0]
    ar = jnp.arange(ls, dtype=jnp.int32)[None, :]

    def body(i, st):
        blk = sel_ref[i]
        start = pl.multiple_of(jnp.maximum(blk, 0) * ls, ls)
        pos = start + ar
        valid = (blk >= 0) & (pos <= t) & (pos < kvlen)
        s = scores(q, k_ref.rows(start, ls), scale)
        return update(st, s, valid, v_ref.rows(start, ls))[0]

    st = jax.lax.fori_loop(0, n, body, init_state(*q.shape))
    if extra:
        st = update(st, scores(q, ek_ref[...], scale), xs_ref[...] != 0, ev_ref[...])[0]
    o_ref[...] = finish(st)


def naive_verify(q, q_pos, k, v, kv_len, sel, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
                 interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """Selected-branch attention, one program per (query, KV head). Same arguments and fp32 result
    [B, Q, Hq, D] as `nsa.selected_branch`."""
    B, Q, Hq, D = q.shape
    S, H = k.shape[1], k.shape[2]
    G = Hq // H
    check_cfg(cfg, D)
    check_cache(k, v, None, cfg)
    check_sel(sel, S // cfg.slc_block, (B, Q, H, cfg.n_slc))
    mp = next_pow2(G)
    has_x = extra is not None and extra.k.shape[1] > 0
    row = pl.BlockSpec((None, None, None, mp, D), lambda i, j: (i // H, i % H, j, 0, 0))
    cache = lambda n: pl.BlockSpec((None, n, None, D), lambda i, j: (i // H, 0, i % H, 0))  # noqa: E731
    (k_arr, k_spec), (v_arr, v_spec) = cache_arg(k, H), cache_arg(v, H)
    args = [rows_of(q, H, 1, mp), query_rows(q_pos.astype(jnp.int32), 1, G, mp, fill=-1),
            kv_len.astype(jnp.int32)[:, None], sel.astype(jnp.int32), k_arr, v_arr]
    specs = [row, pl.BlockSpec((None, None, mp), lambda i, j: (i // H, j, 0)),
             pl.BlockSpec((None, 1), lambda i, j: (i // H, 0)),
             pl.BlockSpec((None, None, None, cfg.n_slc), lambda i, j: (i // H, j, i % H, 0)), k_spec, v_spec]
    if has_x:
        ep = next_pow2(extra.k.shape[1])
        xk, xv, _, _, xsel, *_ = groups.extra_rows(extra, sel, cfg, 1, G, mp, ep, next_pow2(extra.ck.shape[1]))
        args += [xk, xv, xsel]
        specs += [cache(ep), cache(ep), pl.BlockSpec((None, None, None, mp, ep),
                                                     lambda i, j: (i // H, i % H, j, 0, 0))]
    layer = layer_arg(k, v)
    if layer is not None:
        args.append(layer)
        specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
    kern = functools.partial(_kernel, n=cfg.n_slc, ls=cfg.slc_block, scale=D ** -0.5, extra=has_x,
                             stacked=layer is not None)
    (o,) = pallas(kern, grid=(B * H, Q), in_specs=specs, out_specs=[row],
                  out_shape=[jax.ShapeDtypeStruct((B, H, Q, mp, D), jnp.float32)], args=args,
                  num_warps=num_warps, num_stages=num_stages, interpret=interpret, name="naive_verify")
    return unrows(o, Q, G)
