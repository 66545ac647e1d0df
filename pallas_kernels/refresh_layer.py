"""Refresh-layer verify attention (issue #3 item 3): compressed attention with probabilities (launch 1), the
reference routing (`nsa.block_importance` + `nsa.route`, with `topn.route_top_n` as its top-n primitive: the
Pallas top-n kernel in place of XLA's TopK, the reference's rank fusion for small problems), then the grouped
selected + window kernel (launch 2, split with an LSE combine) and the gates. Two attention launches, plus the
top-n launch past small sizes; the rest is small XLA glue.
"""

from __future__ import annotations

import functools

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import check_group_size, gate
from .compressed import compressed_attention
from .grouped_verify import effective_selection, fused_call
from .naive_verify import naive_verify
from .topn import route_top_n


def route_from_kernel(q, q_pos, kc, vc, kv_len, k_len: int, cfg: ModelConfig, extra=None, *, interpret=False,
                      select=None):
    """Launch 1 plus routing: returns (o_cmp fp32, sel [B, Q, Hkv, n]) with `sel` computed by the reference's
    `block_importance` and `route` from the kernel's probabilities. `select` is routing's top-n primitive
    (default: `topn.route_top_n`, the Pallas top-n kernel past small sizes; `nsa.top_n` is the reference's)."""
    o_cmp, p, px = compressed_attention(q, q_pos, kc, vc, kv_len, cfg, extra, interpret=interpret)
    imp = nsa.block_importance(p, px, None if extra is None else extra.cidx, cfg, k_len // cfg.slc_block)
    return o_cmp, nsa.route(imp, q_pos, cfg, select or functools.partial(route_top_n, interpret=interpret))


def selected_and_window(q, q_pos, k, v, kv_len, sel, cfg: ModelConfig, extra=None, *, mode: str = "A",
                        group_size: int = 4, nsplit: int | None = None, interpret: bool = False,
                        walk: str | None = None):
    """(o_slc, o_win) fp32 for the routed `sel`: the naive per-query kernel plus a C=1 window launch in mode
    "naive", else one grouped launch for both branches (mode "B" shares each group's first query's blocks;
    `walk`: see `grouped_verify.fused_call`)."""
    if mode == "naive":
        o_slc = naive_verify(q, q_pos, k, v, kv_len, sel, cfg, extra, interpret=interpret)
        (o_win,) = fused_call(q, q_pos, k, v, kv_len, sel, cfg, extra, group_size=1, slc=False, win=True,
                              interpret=interpret, name="window_verify")
        return o_slc, o_win
    return fused_call(q, q_pos, k, v, kv_len, sel, cfg, extra, group_size=group_size, shared=mode == "B",
                      slc=True, win=True, nsplit=nsplit, interpret=interpret, walk=walk)


def refresh_layer(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
                  mode: str = "A", group_size: int = 4, nsplit: int | None = None, interpret: bool = False,
                  walk: str | None = None):
    """Complete refresh-layer NSA attention: same arguments and result (o, sel) as `nsa.nsa_attention` with
    `sel=None`. Mode "B" attends (and returns) the group-shared selection; mode "naive" uses the per-query
    kernel for the selected branch."""
    if mode != "naive":
        check_group_size(group_size, q.shape[1], q.shape[2] // k.shape[2])
    o_cmp, sel = route_from_kernel(q, q_pos, kc, vc, kv_len, k.shape[1], cfg, extra, interpret=interpret)
    o_slc, o_win = selected_and_window(q, q_pos, k, v, kv_len, sel, cfg, extra, mode=mode, group_size=group_size,
                                       nsplit=nsplit, interpret=interpret, walk=walk)
    return gate(gates, o_cmp, o_slc, o_win, q.dtype), effective_selection(sel, mode, group_size)
