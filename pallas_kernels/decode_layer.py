"""One-query refresh layer (decode): routing inside the attention kernel.

On the generic path a decode step's refresh layer is the compressed kernel, about ten small XLA ops of routing
glue (split combine, probabilities, block importance, forced blocks, rank top-n) and the selected + window
kernel. With one query per KV head those glue ops cost more than both kernels together
(docs/results/decode_profile_8k_h200.json). Here the layer is three launches:

1. the compressed kernel (split over compressed-block chunks) writes its split states and the masked logits
   (`compressed_launch(emit="logits")`, shifted right by one selection block's worth of columns);
2. `_kernel` runs two kinds of programs per (query, KV head). Window programs attend their share of the window
   blocks at once. Selected programs first route (`_route`): they LSE-combine the compressed splits' (m, l),
   form the probabilities exp(s - lse) of the visible blocks tile by tile, pool them into selection-block
   importances (a reshape to [selection block, block within it] and a sum, plus a second load one selection
   block to the left for the blocks that reach into the next one), set the forced blocks and candidates as
   `nsa.route` does, and run n rounds of (max, first index at the max, retire); then they attend their share
   of the selected blocks;
3. `_combine_kernel` merges the splits of all three branches (running LSE) and applies the gates, one
   program per (row, KV head), writing o in the layout the output projection reads: one launch instead of
   XLA's three fusions (the combine weights, the weighted sums, the gates).

Every selected program of a (query, KV head) routes identically (same inputs, same arithmetic); the first writes
`sel`. The routing arithmetic differs from the reference's only in summation order, so near-ties of importance
may in principle route differently; the tests check identical routing on fresh random inputs. Reference:
`ssv_jax.nsa`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import (NEG, cache_arg, cache_refs, check_cache, check_cfg, init_state, is_pow2, layer_arg,
                      next_pow2, pallas, reduce_all, rows_of, scores, update)
from .compressed import compressed_launch, compressed_splits

TILE = 256  # compressed blocks per routing tile
_BIG = 2 ** 30


class DecodeQuery(NamedTuple):
    """One decode query per batch row, already in the layout the decode layer's kernels read (as written by
    `commit_blocks` from the fused q/k/v/gate product): `nsa_attention_kernel` takes it in place of (q, gates)."""
    rows: jax.Array  # [B, Hkv, 1, Mp, D] roped queries of each KV head's G query heads; rows G.. are zero
    gates: jax.Array  # [B, Hkv, 3, G] f32: the (compressed, selected, window) gates of those heads

    @property
    def shape(self) -> tuple:  # the q it stands for: [B, 1, Hq, D]
        B, H, _, _, D = self.rows.shape
        return (B, 1, H * self.gates.shape[-1], D)

    @property
    def dtype(self):
        return self.rows.dtype

    def as_arrays(self):
        """(q [B, 1, Hq, D], gates [B, 1, Hq, 3]) for the kernels that take plain arrays."""
        B, _, Hq, D = self.shape
        G = self.gates.shape[-1]
        return (self.rows[:, :, 0, :G].reshape(B, 1, Hq, D),
                jnp.swapaxes(self.gates, -1, -2).reshape(B, 1, Hq, 3))


@dataclasses.dataclass(frozen=True)
class _Spec:
    g: int  # query heads per KV head (rows in use)
    gp: int  # those rows padded to a power of two (routing)
    mp: int  # rows, padded to a power of two >= 16 (attention)
    d: int
    n: int
    ls: int
    window: int
    cmp_len: int
    cmp_stride: int
    ts: int  # compressed blocks per routing tile
    nt: int  # routing tiles
    ntp: int  # routing tiles, padded to a power of two
    nsel: int  # selection blocks of the cache
    slots: int  # compressed-split slots (a power of two >= the compressed launch's splits)
    nwin: int  # window blocks a query can touch
    nsplit: int  # programs per (query, KV head): window programs first, then selected ones
    nsplit_w: int  # programs attending window blocks
    kv_stacked: bool

    @property
    def sbt(self) -> int:  # selection blocks per routing tile
        return self.ts * self.cmp_stride // self.ls


def _route(sp: _Spec, s_ref, ma_ref, la_ref, t, nvis, nsa_splits):
    """The selection [n] int32 of one query for one KV head (see the module docstring)."""
    r = sp.ls // sp.cmp_stride  # compressed blocks starting in each selection block
    rows = pl.ds(0, sp.gp)  # the G real rows (padded to a power of two)
    # LSE of the compressed branch from its split states (slots past the launch's splits are unwritten)
    live_slot = jax.lax.broadcasted_iota(jnp.int32, (sp.slots, sp.gp), 0) < nsa_splits
    ma = jnp.where(live_slot, ma_ref[:, rows], NEG)
    la = jnp.where(live_slot, la_ref[:, rows], 0.0)
    mt = jnp.max(ma, axis=0)
    lt = jnp.sum(jnp.exp(ma - mt[None, :]) * la, axis=0)
    lse = (mt + jnp.log(jnp.where(lt > 0, lt, 1.0)))[:, None]
    row = jax.lax.broadcasted_iota(jnp.int32, (sp.gp, sp.ts), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (sp.gp, sp.ts), 1)
    # a block starting at offset k*d of a selection block reaches into the next one when k*d + l - 1 >= l'
    k = jax.lax.broadcasted_iota(jnp.int32, (sp.gp, sp.sbt, r), 2)
    spills = k * sp.cmp_stride + sp.cmp_len - 1 >= sp.ls
    tile = jax.lax.broadcasted_iota(jnp.int32, (sp.ntp, sp.sbt), 0)

    def probs(c0):  # [Gp, sbt, r] probabilities of blocks c0 .. c0 + ts - 1 (the logits sit r columns right)
        ok = (row < sp.g) & (c0 + col >= 0) & (c0 + col < nvis)  # real rows, visible blocks
        p = jnp.where(ok, jnp.exp(s_ref[rows, pl.ds(c0 + r, sp.ts)] - lse), 0.0)
        return p.reshape(sp.gp, sp.sbt, r)

    def pool(i, imp):
        c0 = pl.multiple_of(i * sp.ts, sp.ts)
        # selection block j gets its own blocks, and the previous selection block's blocks that spill into it
        part = jnp.sum(probs(c0), axis=2) + jnp.sum(jnp.where(spills, probs(c0 - r), 0.0), axis=2)
        return jnp.where(tile == i, jnp.sum(part, axis=0)[None, :], imp)

    # tiles up to the one holding the selection block after the last visible block's (it may take a spill)
    n_tiles = jnp.minimum(((nvis - 1) // r + 1) // sp.sbt + 1, sp.nt)
    imp = jax.lax.fori_loop(0, n_tiles, pool, jnp.zeros((sp.ntp, sp.sbt), jnp.float32))

    # top-n as nsa.route: forced blocks (+inf) first, then candidates j <= t // l' by (importance desc, index asc)
    sid = (tile * sp.sbt + jax.lax.broadcasted_iota(jnp.int32, (sp.ntp, sp.sbt), 1)).reshape(-1)
    cur = t // sp.ls
    forced = (sid == 0) | (sid == cur) | (sid == cur - 1)
    score = jnp.where(forced, jnp.inf, jnp.where(sid <= cur, imp.reshape(-1), -jnp.inf))
    live = sid < sp.nsel
    slot = jax.lax.broadcasted_iota(jnp.int32, (sp.n,), 0)
    sel = jnp.full((sp.n,), -1, jnp.int32)
    for i in range(sp.n):
        cand = jnp.where(live, score, -jnp.inf)
        best = jnp.max(cand)
        first = jnp.min(jnp.where(live & (cand == best), sid, _BIG))
        sel = jnp.where(slot == i, jnp.where(best > -jnp.inf, first, -1), sel)
        live = live & (sid != first)
    return sel


def _kernel(rows_ref, meta_ref, s_ref, ma_ref, la_ref, k_ref, v_ref, *rest, sp: _Spec):
    layer_ref = rest[0] if sp.kv_stacked else None
    sel_ref, acc_ref, m_ref, l_ref = rest[-4:]
    k_ref, v_ref = cache_refs(layer_ref, (k_ref, sp.kv_stacked), (v_ref, sp.kv_stacked))
    split = pl.program_id(2)
    t, kvlen, nvis, nsa_splits = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    # programs [0, nsplit_w) attend window blocks, which need no routing; the others route, then attend their
    # share of the selected blocks
    slc = split >= sp.nsplit_w
    sel = jax.lax.cond(slc, lambda: _route(sp, s_ref, ma_ref, la_ref, t, nvis, nsa_splits),
                       lambda: jnp.full((sp.n,), -1, jnp.int32))

    @pl.when(split == sp.nsplit_w)
    def _():
        sel_ref[...] = sel

    q = rows_ref[...]
    scale = sp.d ** -0.5
    ar = jax.lax.broadcasted_iota(jnp.int32, (1, sp.ls), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (sp.n,), 0)

    def share(count, parts, index):  # this program's items [lo, hi) of `count` split over `parts` programs
        per = -(-count // parts)
        lo = jnp.minimum(index * per, count)
        return lo, jnp.minimum(count, lo + per)

    def attend(st, blk, extra_ok):
        start = pl.multiple_of(blk * sp.ls, sp.ls)
        pos = start + ar
        valid = extra_ok(pos) & (pos <= t) & (pos < kvlen)
        return update(st, scores(q, k_ref.rows(start, sp.ls), scale), valid, v_ref.rows(start, sp.ls))[0]

    def slc_body(e, st):  # selected entry e (-1: empty)
        blk = reduce_all(jnp.where(slot == e, sel, 0), jnp.sum)
        return attend(st, jnp.maximum(blk, 0), lambda pos: jnp.broadcast_to(blk >= 0, pos.shape))

    cur = t // sp.ls
    w0 = jnp.maximum(t - sp.window + 1, 0) // sp.ls

    def win_body(e, st):  # window block w0 + e (past the current block: masked)
        blk = w0 + e
        return attend(st, jnp.minimum(blk, cur), lambda pos: (blk <= cur) & (pos > t - sp.window))

    lo, hi = share(sp.n, sp.nsplit - sp.nsplit_w, split - sp.nsplit_w)
    st_s = jax.lax.fori_loop(jnp.where(slc, lo, 0), jnp.where(slc, hi, 0), slc_body, init_state(sp.mp, sp.d))
    lo, hi = share(sp.nwin, sp.nsplit_w, split)
    st_w = jax.lax.fori_loop(jnp.where(slc, 0, lo), jnp.where(slc, 0, hi), win_body, init_state(sp.mp, sp.d))
    for b, (acc, m, l) in enumerate((st_s, st_w)):
        acc_ref[b] = acc
        m_ref[b] = m
        l_ref[b] = l


def _combine_kernel(ca_ref, cm_ref, cl_ref, a_ref, m_ref, l_ref, g_ref, o_ref, *, na: int, ns: int):
    """o = g_c * o_cmp + g_s * o_slc + g_w * o_win for one (row, KV head): each branch the LSE merge of its split
    states (acc unnormalised, m running max, l running sum) over the G real rows. The split loops are unrolled so
    that every load is independent of the merge (a loop-carried merge serialises ~30 load latencies)."""
    g, dc = o_ref.shape
    rows, cols = pl.ds(0, g), pl.ds(pl.program_id(1) * dc, dc)

    def merge(states):
        mt = functools.reduce(jnp.maximum, [m for _, m, _ in states])
        ws = [jnp.exp(m - mt) for _, m, _ in states]
        lt = sum(w * l for w, (_, _, l) in zip(ws, states))
        acc = sum(w[:, None] * a for w, (a, _, _) in zip(ws, states))
        return acc / jnp.where(lt > 0, lt, 1.0)[:, None]

    o_cmp = merge([(ca_ref[s, rows, cols], cm_ref[s, rows], cl_ref[s, rows]) for s in range(na)])
    o_slc, o_win = (merge([(a_ref[s, b, rows, cols], m_ref[s, b, rows], l_ref[s, b, rows]) for s in range(ns)])
                    for b in range(2))
    gates = [g_ref[c, :][:, None] for c in range(3)]
    o_ref[...] = (gates[0] * o_cmp + gates[1] * o_slc + gates[2] * o_win).astype(o_ref.dtype)


def supports(cfg: ModelConfig, q_shape, extra, sel) -> bool:
    """Whether `decode_refresh_layer` serves this call: one query per batch row, no in-flight keys, routing to
    do, selection blocks that are a power-of-two number of compressed strides, and compressed blocks no longer
    than a selection block (so a block meets at most the next selection block), and a power-of-two number of query
    heads per KV head (the combine kernel's rows)."""
    r = cfg.slc_block // cfg.cmp_stride
    return (q_shape[1] == 1 and extra is None and sel is None and cfg.slc_block % cfg.cmp_stride == 0
            and r & (r - 1) == 0 and cfg.cmp_len <= cfg.slc_block and is_pow2(q_shape[2] // cfg.n_kv_heads))


def decode_refresh_layer(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, *,
                         per_program: tuple[int, int] = (3, 2), cmp_nsplit: int | None = None,
                         combine_columns: int = 32, interpret: bool = False, num_warps: int = 2,
                         num_stages: int = 2):
    """Refresh-layer NSA attention for one query per batch row (decode), as `nsa.nsa_attention(sel=None)` with
    no extras: returns (o [B, 1, Hq, D] in q's dtype, sel [B, 1, Hkv, n]). k, v, kc, vc may be `nsa.LayerKV`
    views. `per_program` = (window blocks, selected blocks) each program of the second launch attends: window
    programs start at once, selected ones after routing. `cmp_nsplit` splits the compressed blocks;
    `combine_columns` is the head-dim slice each combine program merges (smaller: more, shorter programs).
    q may be a `DecodeQuery` (the decode prologue's layout; `gates` is then ignored)."""
    B, Q, Hq, D = q.shape
    H = k.shape[2]
    G = Hq // H
    if not supports(cfg, q.shape, None, None):
        raise ValueError(f"decode_refresh_layer serves one query per row (got Q={Q}; accepted: 1), with "
                         f"slc_block/cmp_stride a power of two (got {cfg.slc_block}/{cfg.cmp_stride}), "
                         f"cmp_len <= slc_block (got {cfg.cmp_len}) and Hq/Hkv a power of two (got {Hq}/{H})")
    check_cfg(cfg, D)
    check_cache(k, v, kc, cfg)
    mp = next_pow2(G)
    nc = kc.shape[1]
    r = cfg.slc_block // cfg.cmp_stride
    ts = max(TILE, r)
    nt = -(-nc // ts)
    if isinstance(q, DecodeQuery):  # laid out by the prologue (commit_blocks)
        rows, gates = q.rows, q.gates
    else:
        rows = rows_of(q, H, 1, mp)  # [B, H, 1, Mp, D]
        gates = jnp.swapaxes(gates.astype(jnp.float32).reshape(B, H, G, 3), -1, -2)  # [B, H, 3, G]
    na, _ = compressed_splits(B * H, nc, cmp_nsplit)
    slots = next_pow2(na, minimum=1)
    acc_a, m_a, l_a, logits = compressed_launch(rows, q_pos, kc, vc, kv_len, cfg, ct=1, g=G, nsplit=cmp_nsplit,
                                                interpret=interpret, emit="logits",
                                                logits_width=nt * ts + r, logits_offset=r, split_slots=slots)
    nwin = -(-(cfg.window - 1) // cfg.slc_block) + 1
    if not is_pow2(combine_columns):
        raise ValueError(f"combine_columns={combine_columns} is invalid; accepted: a power of two")
    if not (len(per_program) == 2 and all(isinstance(x, int) and x >= 1 for x in per_program)):
        raise ValueError(f"per_program={per_program!r} is invalid; accepted: (window blocks, selected blocks) per "
                         "program, two ints >= 1")
    per_w, per_s = per_program
    nsplit_w, nsplit_s = -(-nwin // per_w), -(-cfg.n_slc // per_s)
    sp = _Spec(g=G, gp=next_pow2(G, minimum=1), mp=mp, d=D, n=cfg.n_slc, ls=cfg.slc_block, window=cfg.window,
               cmp_len=cfg.cmp_len, cmp_stride=cfg.cmp_stride, ts=ts, nt=nt, ntp=next_pow2(nt, minimum=1),
               nsel=k.shape[1] // cfg.slc_block, slots=slots, nwin=nwin, nsplit=nsplit_w + nsplit_s,
               nsplit_w=nsplit_w, kv_stacked=isinstance(k, nsa.LayerKV))

    t = q_pos[:, 0].astype(jnp.int32)
    kl = kv_len.astype(jnp.int32)
    nvis = nsa.num_complete_blocks(jnp.minimum(t + 1, kl), cfg)
    meta = jnp.stack([t, kl, nvis, jnp.full_like(t, na)], -1)[:, None, :]  # [B, 1, 4]
    (k_arr, k_spec), (v_arr, v_spec) = cache_arg(k, H), cache_arg(v, H)
    bh = lambda i: (i // H, i % H)  # noqa: E731
    per_q = lambda *shape: pl.BlockSpec((None, None, None) + shape,  # noqa: E731
                                        lambda i, j, s: (*bh(i), j) + (0,) * len(shape))
    per_split = lambda *shape: pl.BlockSpec((None, None, None, None) + shape,  # noqa: E731
                                            lambda i, j, s: (*bh(i), j, s) + (0,) * len(shape))
    args = [rows, meta, logits, m_a, l_a, k_arr, v_arr]
    specs = [per_q(mp, D), pl.BlockSpec((None, None, 4), lambda i, j, s: (i // H, j, 0)), per_q(mp, nt * ts + r),
             per_q(slots, mp), per_q(slots, mp), k_spec, v_spec]
    layer = layer_arg(k, v)
    if layer is not None:
        args.append(layer)
        specs.append(pl.BlockSpec((1,), lambda i, j, s: (0,)))
    f32 = lambda *shape: jax.ShapeDtypeStruct((B, H, Q, sp.nsplit) + shape, jnp.float32)  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((B, Q, H, sp.n), jnp.int32), f32(2, mp, D), f32(2, mp), f32(2, mp)]
    out_specs = [pl.BlockSpec((None, None, None, sp.n), lambda i, j, s: (i // H, j, i % H, 0)),
                 per_split(2, mp, D), per_split(2, mp), per_split(2, mp)]
    sel, acc, m, l = pallas(functools.partial(_kernel, sp=sp), grid=(B * H, Q, sp.nsplit), in_specs=specs,
                            out_specs=out_specs, out_shape=out_shape, args=args, num_warps=num_warps,
                            num_stages=num_stages, interpret=interpret, name="decode_refresh")
    o_spec = lambda *shape: pl.BlockSpec((None, None, None) + shape,  # noqa: E731
                                         lambda i, e: (*bh(i), 0) + (0,) * len(shape))
    dc = min(D, combine_columns)  # D is a power of two (check_cfg), so dc divides it
    (o,) = pallas(functools.partial(_combine_kernel, na=na, ns=sp.nsplit), grid=(B * H, D // dc),
                  in_specs=[o_spec(slots, mp, D), o_spec(slots, mp), o_spec(slots, mp), o_spec(sp.nsplit, 2, mp, D),
                            o_spec(sp.nsplit, 2, mp), o_spec(sp.nsplit, 2, mp),
                            pl.BlockSpec((None, None, 3, G), lambda i, e: (i // H, i % H, 0, 0))],
                  out_specs=[pl.BlockSpec((None, None, G, dc), lambda i, e: (i // H, 0, i % H, e))],
                  out_shape=[jax.ShapeDtypeStruct((B, Q, Hq, D), q.dtype)],
                  args=[acc_a, m_a, l_a, acc, m, l, gates], num_warps=4, num_stages=1,
                  interpret=interpret, name="decode_combine")
    return o, sel
