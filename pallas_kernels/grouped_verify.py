"""Grouped verification kernel (DESIGN.md, "Kernels"; issue #3 items 2 and 4).

One program serves a group of C consecutive flattened queries for one KV head: its M = C*G rows (GQA heads x
queries) are padded to a power of two >= 16, so every selected KV block is loaded once for the whole group.

* mode "A" (exact merge): the program walks the union of the group's selected blocks (each block once: an entry
  already seen earlier in the group's C x n index tile is skipped) and masks each row to its own query's blocks;
* mode "B" (shared index): every query of the group uses the first query's blocks (an approximation).

The same kernel body, with static branch flags, serves three callers:
* `grouped_verify`: the selected branch (optionally the window branch too), split over the merged blocks across
  programs when the grid is too small for the SMs, with a flash-decoding LSE combine in XLA;
* the refresh layer's second launch: selected + window, then the gates (`refresh_layer.py`);
* the reuse layer: compressed + selected + window in one launch with three online-softmax states, writing only
  the gated output (`reuse_layer.py`).

In-tree keys (`nsa.Extra`) enter as one extra masked key segment per branch. Reference: `ssv_jax.nsa`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from . import groups
from ._common import (DIRECT_IO, cache_arg, cache_refs, check_cache, check_cfg, check_group_size, check_sel,
                      combine, dividing_chunk, finish, init_state, layer_arg, next_pow2, pallas, reduce_all, rows_of,
                      scores, split_count, unrows, update)


WALKS = ("skip", "mask")


@dataclasses.dataclass(frozen=True)
class _Spec:
    c: int
    g: int
    n: int
    mp: int
    d: int
    ls: int
    window: int
    cmp_len: int
    cmp_stride: int
    cb: int
    nsplit: int
    shared: bool
    slc: bool
    win: bool
    cmp: bool
    extra: bool
    xcmp: bool
    gated: bool
    direct: bool  # q read and outputs written in the [.., Q, Hq, D] layout (needs C*G == Mp)
    kv_stacked: bool = False  # k, v are nsa.LayerKV views (read in place from the stack)
    c_stacked: bool = False  # kc, vc likewise
    walk: str = "mask"  # mode A's merged walk: "skip" repeated entries (lax.cond), or "mask" them branch-free

    @property
    def scale(self) -> float:
        return self.d ** -0.5


def _any(x, axis=None):
    """Boolean any as an int max (axis=None: over every axis)."""
    y = jnp.where(x, 1, 0)
    return (reduce_all(y, jnp.max) if axis is None else jnp.max(y, axis=axis)) > 0


def _kernel(*refs, sp: _Spec):
    it = iter(refs)
    q_ref, qpos_ref, kvlen_ref, sel_ref, k_ref, v_ref = (next(it) for _ in range(6))
    if sp.extra:
        ek_ref, ev_ref, epos_ref, xm_ref = (next(it) for _ in range(4))
        xs_ref = next(it) if sp.slc else None
    if sp.cmp:
        kc_ref, vc_ref = next(it), next(it)
        if sp.xcmp:
            eck_ref, ecv_ref, xc_ref = (next(it) for _ in range(3))
    g_ref = next(it) if sp.gated else None
    layer_ref = next(it) if (sp.kv_stacked or (sp.cmp and sp.c_stacked)) else None
    outs = list(it)
    k_ref, v_ref = cache_refs(layer_ref, (k_ref, sp.kv_stacked), (v_ref, sp.kv_stacked))
    if sp.cmp:
        kc_ref, vc_ref = cache_refs(layer_ref, (kc_ref, sp.c_stacked), (vc_ref, sp.c_stacked))

    split = pl.program_id(2)
    first = split == 0
    q = q_ref[...].reshape(sp.mp, sp.d) if sp.direct else q_ref[...]
    kvlen = kvlen_ref[0]
    # rows r = c * G + g; padding rows (r >= C*G) have position -1 and see nothing
    r = jnp.arange(sp.mp, dtype=jnp.int32)
    row_ok = r < sp.c * sp.g
    onehot = ((r // sp.g)[:, None] == jnp.arange(sp.c, dtype=jnp.int32)[None, :]) & row_ok[:, None]  # [Mp, C]
    t1 = jnp.where(row_ok, jnp.sum(jnp.where(onehot, qpos_ref[...][None, :], 0), axis=1), -1)
    t = t1[:, None]  # [Mp, 1]
    tmax = jnp.max(t1)
    tmin = jnp.min(jnp.where(row_ok, t1, 2 ** 30))
    ar = jnp.arange(sp.ls, dtype=jnp.int32)[None, :]
    states = []

    def span(count):  # this program's share [lo, hi) of `count` work items
        per = (count + sp.nsplit - 1) // sp.nsplit
        lo = split * per
        return lo, jnp.minimum(count, lo + per)

    if sp.cmp:  # compressed branch
        cb = sp.cb
        arc = jnp.arange(cb, dtype=jnp.int32)[None, :]
        seen = jnp.minimum(tmax + 1, kvlen)  # keys any row of the group may see
        nvis = jnp.where(seen >= sp.cmp_len, (seen - sp.cmp_len) // sp.cmp_stride + 1, 0)

        def cmp_body(i, st):
            c0 = pl.multiple_of(i * cb, cb)
            end = (c0 + arc) * sp.cmp_stride + sp.cmp_len - 1
            valid = (end <= t) & (end < kvlen)
            return update(st, scores(q, kc_ref.rows(c0, cb), sp.scale), valid, vc_ref.rows(c0, cb))[0]

        st = jax.lax.fori_loop(*span((nvis + cb - 1) // cb), cmp_body, init_state(sp.mp, sp.d))
        if sp.xcmp:
            st = update(st, scores(q, eck_ref[...], sp.scale), (xc_ref[...] != 0) & first, ecv_ref[...])[0]
        states.append(st)

    if sp.slc:  # selected branch: the union of the group's blocks, each row masked to its own query's blocks
        selt = sel_ref[...]  # [C, n]
        flat = jnp.arange(sp.c, dtype=jnp.int32)[:, None] * sp.n + jnp.arange(sp.n, dtype=jnp.int32)[None, :]

        def visit(blk, dup, st):
            start = pl.multiple_of(blk * sp.ls, sp.ls)
            pos = start + ar
            if sp.shared:
                member = row_ok
            else:
                member = _any(onehot & _any(selt == blk, axis=1)[None, :], axis=1)
            valid = member[:, None] & (pos <= t) & (pos < kvlen)
            if dup is not None:
                valid = valid & ~dup
            s = scores(q, k_ref.rows(start, sp.ls), sp.scale)
            return update(st, s, valid, v_ref.rows(start, sp.ls))[0]

        def slc_body(e, st):
            if sp.walk == "mask":  # branch-free: a repeated or empty entry loads a block and masks every row,
                # and the id comes from the tile in registers, so the loop has no dependent scalar load
                blk = reduce_all(jnp.where(flat == e, selt, 0), jnp.sum)
                dup = (blk < 0) | _any((selt == blk) & (flat < e))
                return visit(jnp.maximum(blk, 0), dup, st)
            blk = sel_ref[e // sp.n, e % sp.n]
            skip = (blk < 0) | _any((selt == blk) & (flat < e))  # empty slot, or already walked
            return jax.lax.cond(skip, lambda st: st, lambda st: visit(blk, None, st), st)

        # mode B walks the first query's blocks only
        st = jax.lax.fori_loop(*span(sp.n if sp.shared else sp.c * sp.n), slc_body, init_state(sp.mp, sp.d))
        if sp.extra:
            st = update(st, scores(q, ek_ref[...], sp.scale), (xs_ref[...] != 0) & first, ev_ref[...])[0]
        states.append(st)

    if sp.win:  # window branch over the group's window chunks
        w0 = jnp.maximum(tmin - sp.window + 1, 0) // sp.ls
        last = jnp.minimum(tmax, kvlen - 1)
        wcnt = jnp.maximum(jnp.where(last >= 0, last // sp.ls, -1) - w0 + 1, 0)

        def win_body(i, st):
            start = pl.multiple_of((w0 + i) * sp.ls, sp.ls)
            pos = start + ar
            valid = (pos > t - sp.window) & (pos <= t) & (pos < kvlen)
            s = scores(q, k_ref.rows(start, sp.ls), sp.scale)
            return update(st, s, valid, v_ref.rows(start, sp.ls))[0]

        st = jax.lax.fori_loop(*span(wcnt), win_body, init_state(sp.mp, sp.d))
        if sp.extra:
            valid = (xm_ref[...] != 0) & (epos_ref[...][None, :] > t - sp.window) & first
            st = update(st, scores(q, ek_ref[...], sp.scale), valid, ev_ref[...])[0]
        states.append(st)

    shape = (lambda x: x.reshape((sp.c, sp.g) + x.shape[1:])) if sp.direct else (lambda x: x)
    if sp.gated:
        o = sum(g_ref[b, :][:, None] * finish(st) for b, st in enumerate(states))
        outs[0][...] = shape(o.astype(outs[0].dtype))
    else:
        acc_ref, m_ref, l_ref = outs
        for b, (acc, m, l) in enumerate(states):
            acc_ref[b] = shape(acc)
            m_ref[b] = shape(m)
            l_ref[b] = shape(l)


def fused_call(q, q_pos, k, v, kv_len, sel, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
               group_size: int, shared: bool = False, slc: bool = True, win: bool = False, kc=None, vc=None,
               gates=None, nsplit: int | None = None, interpret: bool = False, num_warps: int = 4,
               num_stages: int = 3, name: str = "grouped_verify", direct_io: bool | None = None,
               cmp_chunk: int = 64, walk: str | None = None):
    """Launches the grouped kernel for the chosen branches; `shared=True` is mode B (the group's first query's
    blocks for every query), else mode A.

    With `gates` [B, Q, Hq, 3] and one split, the single launch returns the gated sum of its branches
    (compressed when `kc`/`vc` are given, selected, window) in q's dtype. Otherwise it returns the fp32 branch
    outputs [B, Q, Hq, D] in the order (compressed, selected, window), LSE-combined over the splits in XLA.
    `cmp_chunk`: compressed keys per loop step (the largest power of two <= it dividing Nc).
    `direct_io` (default: whenever C*G is already a power of two >= 16) reads q and writes the outputs in their
    [B, Q, Hq, ...] layout, with no row-packing pass in XLA.
    `walk`: "skip" visits each distinct block of the group once behind a `lax.cond`; "mask" visits every entry
    unconditionally and masks repeats (more blocks, but a loop the compiler can pipeline). Default: "mask" in mode
    A, "skip" in mode B, whose walk over one query's distinct blocks has no repeats to mask (Q=16, 64K: 7.98 µs
    skipping against 12.31 masked, kernels_h200.json and its predecessor)."""
    walk = walk or ("skip" if shared else "mask")
    if walk not in WALKS:
        raise ValueError(f"walk={walk!r} is invalid; accepted: {WALKS}")
    B, Q, Hq, D = q.shape
    S, H = k.shape[1], k.shape[2]
    G = Hq // H
    check_cfg(cfg, D)
    check_cache(k, v, kc, cfg)
    c = check_group_size(group_size, Q, G)
    check_sel(sel, S // cfg.slc_block, (B, Q, H, cfg.n_slc))
    mp = next_pow2(c * G)
    ng = Q // c
    has_cmp = kc is not None
    cb = dividing_chunk(kc.shape[1], "number of compressed blocks Nc", cap=cmp_chunk) if has_cmp else 16
    has_x = extra is not None and extra.k.shape[1] > 0
    has_xc = has_cmp and extra is not None and extra.ck.shape[1] > 0
    if nsplit is None:
        # Blocks a program walks: the group's C*n entries in mode A, the first query's n in mode B (DESIGN_NOTES).
        nsplit = 1 if (gates is not None or has_cmp) else split_count(B * H * ng, (1 if shared else c) * cfg.n_slc)
    gated = gates is not None and nsplit == 1
    direct = c * G == mp and (DIRECT_IO[0] if direct_io is None else direct_io)
    stacked = lambda x: isinstance(x, nsa.LayerKV)  # noqa: E731
    sp = _Spec(c=c, g=G, n=cfg.n_slc, mp=mp, d=D, ls=cfg.slc_block, window=cfg.window, cmp_len=cfg.cmp_len,
               cmp_stride=cfg.cmp_stride, cb=cb, nsplit=int(nsplit), shared=shared, slc=slc, win=win,
               cmp=has_cmp, extra=has_x, xcmp=has_xc, gated=gated,
               direct=direct, kv_stacked=stacked(k), c_stacked=has_cmp and stacked(kc), walk=walk)

    bh = lambda i: (i // H, i % H)  # noqa: E731
    row = pl.BlockSpec((None, None, None, mp, D), lambda i, g, s: (*bh(i), g, 0, 0))
    cache = lambda n: pl.BlockSpec((None, n, None, D), lambda i, g, s: (i // H, 0, i % H, 0))  # noqa: E731
    (k_arr, k_spec), (v_arr, v_spec) = cache_arg(k, H), cache_arg(v, H)
    per_group = lambda *shape: pl.BlockSpec((None, None, None) + shape,  # noqa: E731
                                            lambda i, g, s: (*bh(i), g) + (0,) * len(shape))
    per_bgroup = lambda *shape: pl.BlockSpec((None, None) + shape,  # noqa: E731
                                             lambda i, g, s: (i // H, g) + (0,) * len(shape))
    qkv = pl.BlockSpec((None, c, G, D), lambda i, g, s: (i // H, g, i % H, 0))  # [B, Q, Hq, D] layout
    args = [q if direct else rows_of(q, H, c, mp), q_pos.astype(jnp.int32), kv_len.astype(jnp.int32)[:, None],
            sel.astype(jnp.int32), k_arr, v_arr]
    specs = [qkv if direct else row, pl.BlockSpec((None, c), lambda i, g, s: (i // H, g)),
             pl.BlockSpec((None, 1), lambda i, g, s: (i // H, 0)),
             pl.BlockSpec((None, c, None, cfg.n_slc), lambda i, g, s: (i // H, g, i % H, 0)), k_spec, v_spec]
    if has_x:
        ep = next_pow2(extra.k.shape[1])
        sel_eff = groups.shared_selection(sel, c) if shared else sel
        xk, xv, xpos, xmask, xsel, xck, xcv, xcm = groups.extra_rows(
            extra, sel_eff, cfg, c, G, mp, ep, next_pow2(extra.ck.shape[1]))
        args += [xk, xv, xpos, xmask]
        specs += [cache(ep), cache(ep), pl.BlockSpec((None, ep), lambda i, g, s: (i // H, 0)), per_bgroup(mp, ep)]
        if slc:
            args.append(xsel)
            specs.append(per_group(mp, ep))
    if has_cmp:
        (kc_arr, kc_spec), (vc_arr, vc_spec) = cache_arg(kc, H), cache_arg(vc, H)
        args += [kc_arr, vc_arr]
        specs += [kc_spec, vc_spec]
        if has_xc:
            args += [xck, xcv, xcm]
            specs += [cache(xck.shape[1]), cache(xck.shape[1]), per_bgroup(mp, xck.shape[1])]
    nb = int(has_cmp) + int(slc) + int(win)
    if gated:
        gsel = jnp.asarray([0] * has_cmp + [1] * slc + [2] * win)
        g_rows = rows_of(gates.astype(jnp.float32)[..., gsel], H, c, mp)  # [B, H, NG, Mp, nb]
        args.append(jnp.swapaxes(g_rows, -1, -2))
        specs.append(per_group(nb, mp))
    layer = layer_arg(k, v, *((kc, vc) if has_cmp else ()))
    if layer is not None:
        args.append(layer)
        specs.append(pl.BlockSpec((1,), lambda i, g, s: (0,)))
    if gated:
        out_shape = [jax.ShapeDtypeStruct(q.shape if direct else (B, H, ng, mp, D), q.dtype)]
        out_specs = [qkv if direct else row]
    elif direct:
        out_shape = [jax.ShapeDtypeStruct((B, sp.nsplit, nb, Q, Hq, D), jnp.float32),
                     jax.ShapeDtypeStruct((B, sp.nsplit, nb, Q, Hq), jnp.float32),
                     jax.ShapeDtypeStruct((B, sp.nsplit, nb, Q, Hq), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, nb, c, G, D), lambda i, g, s: (i // H, s, 0, g, i % H, 0)),
                     pl.BlockSpec((None, None, nb, c, G), lambda i, g, s: (i // H, s, 0, g, i % H)),
                     pl.BlockSpec((None, None, nb, c, G), lambda i, g, s: (i // H, s, 0, g, i % H))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, H, ng, sp.nsplit, nb, mp, D), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, ng, sp.nsplit, nb, mp), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, ng, sp.nsplit, nb, mp), jnp.float32)]
        out_specs = [pl.BlockSpec((None,) * 4 + (nb, mp, D), lambda i, g, s: (*bh(i), g, s, 0, 0, 0)),
                     pl.BlockSpec((None,) * 4 + (nb, mp), lambda i, g, s: (*bh(i), g, s, 0, 0)),
                     pl.BlockSpec((None,) * 4 + (nb, mp), lambda i, g, s: (*bh(i), g, s, 0, 0))]
    outs = pallas(functools.partial(_kernel, sp=sp), grid=(B * H, ng, sp.nsplit), in_specs=specs,
                  out_specs=out_specs, out_shape=out_shape, args=args, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret, name=name)
    if gated:
        return outs[0] if direct else unrows(outs[0], Q, G)
    if direct:
        o, _, _ = combine(*outs, axis=1)  # [B, nb, Q, Hq, D]
        return tuple(o[:, b] for b in range(nb))
    o, _, _ = combine(*outs, axis=3)  # [B, H, NG, nb, Mp, D]
    return tuple(unrows(o[:, :, :, b], Q, G) for b in range(nb))


def effective_selection(sel: jax.Array, mode: str, group_size: int) -> jax.Array:
    """The selection a mode actually attends to: `sel` for "A" (and "naive"), the group-shared one for "B"."""
    if mode in ("A", "naive"):
        return sel
    if mode == "B":
        return groups.shared_selection(sel, group_size)
    raise ValueError(f"mode={mode!r} is invalid; accepted: 'A' (exact merge), 'B' (shared index), 'naive'")


def grouped_verify(q, q_pos, k, v, kv_len, sel, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
                   mode: str = "A", group_size: int = 4, window: bool = False, nsplit: int | None = None,
                   interpret: bool = False, num_warps: int = 4, num_stages: int = 3):
    """Selected-branch attention of Q queries grouped C = `group_size` at a time (mode "A" exact merge, "B"
    shared index). Same arguments as `nsa.selected_branch` (plus mode and tuning knobs); returns the fp32
    selected-branch output [B, Q, Hq, D], or (selected, window) outputs with `window=True`.

    Mode "A" equals `nsa.selected_branch(..., sel)`; mode "B" equals it with `groups.shared_selection(sel, C)`."""
    effective_selection(sel, mode, group_size)  # validates mode
    out = fused_call(q, q_pos, k, v, kv_len, sel, cfg, extra, group_size=group_size, shared=mode == "B",
                     slc=True, win=window, nsplit=nsplit, interpret=interpret, num_warps=num_warps,
                     num_stages=num_stages)
    return out if window else out[0]
