"""Attention of the EAGLE-3 draft head's decode-time steps: one launch and an XLA combine per step.

A drafting step runs a handful of entries (the K frontier nodes of a tree level, or the accepted path that
`draft_extend` commits). Each attends to the committed head-cache slots within its window and, for tree nodes, to
one set of in-flight entries (its ancestors and itself). The jnp reference (`ssv_jax.draft.draft_attention`)
slices the window out of the cache and runs each key set through separate score / softmax / value fusions, about
a dozen launches a step. Here the grid is (batch x KV head, splits): a program holds the G query heads of one KV
head for all entries as rows, walks its share of the visible slot range, which it reads in place from the
cache (the range comes from `length` and the entries' positions, so nothing is sliced), and split 0 also takes
the in-flight keys. The splits' online-softmax states are LSE-combined in XLA. Same contract as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import (combine, dividing_chunk, init_state, next_pow2, pad_axis, pallas, query_rows, rows_of, scores,
                      split_count, unrows, update)

MAX_ROWS = 128  # entries x G query rows one program holds
BLOCK = 128  # cache slots per step of a program's walk (the largest power of two <= this dividing S)
POS_COLS = 16  # columns of the row-position block (the smallest Triton tile)
_BIG = 2 ** 30


def _kernel(len_ref, t_ref, q_ref, k_ref, v_ref, *rest, bk: int, nsplit: int, window: int | None, scale: float,
            has_ext: bool):
    ek_ref, ev_ref, em_ref = rest[:3] if has_ext else (None,) * 3
    acc_ref, m_ref, l_ref = rest[3:] if has_ext else rest
    split = pl.program_id(1)
    q = q_ref[...]  # [Mp, D]
    t = jnp.max(t_ref[...], axis=1)  # [Mp] each row's position (-1 on padding rows: sees nothing)
    length = len_ref[0]
    # the visible slot range of this batch row, in blocks: [first window start, min(length, last position + 1))
    hi = jnp.minimum(length, jnp.max(t) + 1)
    lo = 0 if window is None else jnp.maximum(jnp.min(jnp.where(t >= 0, t, _BIG)) - window + 1, 0)
    blo = lo // bk
    bhi = jnp.maximum((hi + bk - 1) // bk, blo)
    st = init_state(*q.shape)
    if has_ext:  # the in-flight keys: split 0 only
        valid = (em_ref[...] != 0) & (split == 0)
        st, _ = update(st, scores(q, ek_ref[...], scale), valid, ev_ref[...])
    per = (bhi - blo + nsplit - 1) // nsplit
    first = blo + split * per
    last = jnp.minimum(first + per, bhi)
    arc = jnp.arange(bk, dtype=jnp.int32)[None, :]
    t = t[:, None]

    def body(i, st):
        c0 = pl.multiple_of(i * bk, bk)
        slot = c0 + arc
        valid = (slot < length) & (slot <= t)
        if window is not None:
            valid = valid & (slot > t - window)
        st, _ = update(st, scores(q, k_ref[pl.ds(c0, bk), :], scale), valid, v_ref[pl.ds(c0, bk), :])
        return st

    acc, m, l = jax.lax.fori_loop(first, last, body, st)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _check(q, k, v, length, positions, window, extra):
    B, M, Hq, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B={B}, S, Hkv, D={D}] with "
                         f"Hkv dividing Hq={Hq}")
    if tuple(length.shape) != (B,) or tuple(positions.shape) != (B, M):
        raise ValueError(f"length {tuple(length.shape)} / positions {tuple(positions.shape)} must be [{B}] / "
                         f"[{B}, {M}]")
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"window={window!r} is invalid; accepted: None or an integer >= 1")
    if M * (Hq // k.shape[2]) > MAX_ROWS:
        raise ValueError(f"{M} entries x {Hq // k.shape[2]} query heads per KV head = {M * Hq // k.shape[2]} rows; "
                         f"accepted: at most {MAX_ROWS} (longer runs take the jnp reference)")
    if len(extra) > 1:
        raise ValueError(f"{len(extra)} extra key sets; accepted: at most one")
    if extra:
        ek, ev, em = extra[0]
        E = ek.shape[1]
        if ek.shape != ev.shape or ek.shape[0] != B or ek.shape[2:] != k.shape[2:] or tuple(em.shape) != (B, M, E):
            raise ValueError(f"extra keys {tuple(ek.shape)} / values {tuple(ev.shape)} / mask {tuple(em.shape)} "
                             f"must be [B, E, Hkv, D] / same / [B, M, E] with B={B}, M={M}, {tuple(k.shape[2:])}")


def draft_attention(q, k, v, length, positions, window=None, extra=(), *, nsplit: int | None = None,
                    interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """`ssv_jax.draft.draft_attention` in one Pallas launch (plus an XLA combine of the splits).

    Args:
      q: [B, M, Hq, D] the entries' (RoPE'd) queries; k, v: [B, S, Hkv, D] the head cache (S a multiple of 16).
      length: [B] committed slots; positions: [B, M] the entries' head positions. An entry sees the slots
        `s < length`, `s <= position` and, with `window`, `s > position - window`.
      extra: at most one in-flight key set (k [B, E, Hkv, D], v, mask [B, M, E] bool). E a power of two >= 16
        takes no padding copy.
      nsplit: programs per (batch, KV head) over the visible range (default: enough to fill the GPU).
    Returns [B, M, Hq * D] in q's dtype; an entry that sees no key gets zeros.
    """
    extra = tuple(extra)
    _check(q, k, v, length, positions, window, extra)
    B, M, Hq, D = q.shape
    S, H = k.shape[1], k.shape[2]
    G = Hq // H
    mp = next_pow2(M * G)
    bk = dividing_chunk(S, "draft cache length S", cap=BLOCK)
    span = S if window is None else min(S, window + M - 1)  # the most slots a row's entries can see
    if nsplit is None:
        nsplit = split_count(B * H, -(-span // bk))
    # Row data in one int32 array per call: each row's position, repeated over POS_COLS columns, after the
    # in-flight mask's columns; the kernel reads the two column ranges as two blocks of it.
    pos_rows = jnp.broadcast_to(query_rows(positions.astype(jnp.int32), M, G, mp, fill=-1)[:, 0, :, None],
                                (B, mp, POS_COLS))
    cache = lambda n: pl.BlockSpec((None, n, None, D), lambda i, s: (i // H, 0, i % H, 0))  # noqa: E731
    rows = lambda cols, at: pl.BlockSpec((None, mp, cols), lambda i, s: (i // H, 0, at))  # noqa: E731
    if extra:
        ek, ev, em = extra[0]
        ep = next_pow2(ek.shape[1])
        info = jnp.concatenate([query_rows(pad_axis(em.astype(jnp.int32), 2, ep), M, G, mp)[:, 0], pos_rows], -1)
    else:
        info = pos_rows
    args = [length.astype(jnp.int32), info, rows_of(q, H, M, mp)[:, :, 0], k, v]
    specs = [pl.BlockSpec((1,), lambda i, s: (i // H,)), rows(POS_COLS, ep // POS_COLS if extra else 0),
             pl.BlockSpec((None, None, mp, D), lambda i, s: (i // H, i % H, 0, 0)), cache(S), cache(S)]
    if extra:
        args += [pad_axis(ek, 1, ep), pad_axis(ev, 1, ep), info]
        specs += [cache(ep), cache(ep), rows(ep, 0)]
    st = lambda *shape: pl.BlockSpec((None, None, None) + shape,  # noqa: E731
                                     lambda i, s: (i // H, i % H, s) + (0,) * len(shape))
    f32 = lambda *shape: jax.ShapeDtypeStruct((B, H, nsplit) + shape, jnp.float32)  # noqa: E731
    kern = functools.partial(_kernel, bk=bk, nsplit=nsplit, window=window, scale=D ** -0.5, has_ext=bool(extra))
    acc, m, l = pallas(kern, grid=(B * H, nsplit), in_specs=specs, out_specs=[st(mp, D), st(mp), st(mp)],
                       out_shape=[f32(mp, D), f32(mp), f32(mp)], args=args, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret, name="draft_attention")
    o = combine(acc, m, l, axis=2)[0]  # [B, H, Mp, D]
    return unrows(o[:, :, None], M, G).reshape(B, M, Hq * D).astype(q.dtype)
