"""Pallas-Triton kernels for sparse speculative verification (DESIGN.md, "Kernels"; issue #3).

`nsa_attention_kernel` is the kernel path of `ssv_jax.nsa.nsa_attention`: same signature and result (o, sel).
Without `sel` it runs the refresh layer (compressed attention with probabilities, reference routing, grouped
selected + window), or for one query per row the three-launch decode layer that routes inside its kernel; with
`sel` it runs the one-launch reuse kernel. `mode`: "A" exact merge, "B" shared index
(approximate: attends, and returns, the first query's blocks for each group of `group_size` queries), "naive"
per-query selected branch (the naive SD+NSA baseline). `draft_attention` is the kernel path of the draft head's
attention in the rounds (`ssv_jax.draft.draft_attention`, same contract).
"""

from __future__ import annotations

import jax
# pallas_call imports the fuser lazily at its first trace, and the fuser registers a config flag that is part of
# the jit cache key: every jit traced before that point would miss its cache once. Import it up front.
import jax.experimental.pallas.fuser  # noqa: F401

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import gate, poison_outputs
from .commit_blocks import commit_blocks
from .compressed import compressed_attention
from .decode_layer import DecodeQuery, decode_refresh_layer
from .decode_layer import supports as _decode_supports
from .draft_attention import draft_attention
from .gemv import fused_gemv
from .grouped_verify import effective_selection, grouped_verify
from .naive_verify import naive_verify
from .overlap import merged_sizes, overlap_gamma, synthetic_selection
from .refresh_layer import refresh_layer, route_from_kernel, selected_and_window
from .reuse_layer import reuse_layer

MODES = ("A", "B", "naive")


def nsa_attention_kernel(q, q_pos, gates, k, v, kc, vc, kv_len, cfg: ModelConfig, extra: nsa.Extra | None = None,
                         sel: jax.Array | None = None, *, mode: str = "A", group_size: int = 4,
                         interpret: bool = False):
    """Kernel path of `nsa.nsa_attention`: returns (o [B, Q, Hq, D] in q's dtype, sel [B, Q, Hkv, n]).

    Groups are `group_size` consecutive queries (a power of two dividing Q; ignored in mode "naive"). k, v, kc, vc
    may be `nsa.LayerKV` views of stacked caches (one shared layer index): the kernels then index the stack in
    place instead of receiving a per-layer copy."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; accepted: {MODES}")
    if isinstance(q, DecodeQuery):  # from the decode prologue (`commit_blocks`): the decode layer reads it as is
        if mode != "naive" and _decode_supports(cfg, q.shape, extra, sel):
            return decode_refresh_layer(q, q_pos, None, k, v, kc, vc, kv_len, cfg, interpret=interpret)
        q, gates = q.as_arrays()
    if mode == "naive":
        if sel is None:
            o_cmp, sel = route_from_kernel(q, q_pos, kc, vc, kv_len, k.shape[1], cfg, extra, interpret=interpret)
        else:
            o_cmp = compressed_attention(q, q_pos, kc, vc, kv_len, cfg, extra, interpret=interpret)[0]
        o_slc, o_win = selected_and_window(q, q_pos, k, v, kv_len, sel, cfg, extra, mode="naive",
                                           interpret=interpret)
        return gate(gates, o_cmp, o_slc, o_win, q.dtype), sel
    if _decode_supports(cfg, q.shape, extra, sel):  # one query: routing inside the attention kernel
        return decode_refresh_layer(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, interpret=interpret)
    if sel is None:
        return refresh_layer(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, extra, mode=mode, group_size=group_size,
                             interpret=interpret)
    return reuse_layer(q, q_pos, gates, k, v, kc, vc, kv_len, sel, cfg, extra, mode=mode, group_size=group_size,
                       interpret=interpret)


nsa_attention_kernel.reads_layer_views = True  # k, v, kc, vc may be nsa.LayerKV views: read in place from the stack
nsa_attention_kernel.reads_compressed_views = True
nsa_attention_kernel.commit_blocks = commit_blocks  # a decode step's prologue and block commit (model.forward)
nsa_attention_kernel.gemv = fused_gemv  # a decode step's four projections, with their norm, SwiGLU or residual add

__all__ = ["nsa_attention_kernel", "refresh_layer", "reuse_layer", "grouped_verify", "naive_verify",
           "compressed_attention", "commit_blocks", "fused_gemv", "decode_refresh_layer", "DecodeQuery",
           "draft_attention",
           "overlap_gamma", "merged_sizes", "synthetic_selection", "effective_selection", "poison_outputs", "MODES"]
