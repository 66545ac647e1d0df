"""Reuse-layer kernel (issue #3 item 4): ONE launch computes the compressed branch (committed plus per-path
compressed blocks), the selected branch with the inherited indices (grouped, mode A or B) and the window branch,
keeps three online-softmax states and writes only the gated output. Reference: `nsa.nsa_attention(..., sel=sel)`.

`nsplit > 1` splits the same launch over the key work of each branch across programs, then combines the splits'
LSE and applies the gates in XLA (more programs, one more pass over small partials). The default (`nsplit=None`)
splits only when the grid is too small to fill the SMs, as for decode (Q=1: B*Hkv programs) and small trees.

`launches=2`, the default from 64 queries up, serves large trees better: the compressed branch runs as the refresh
layer's compressed kernel without probabilities (query tiles of up to 64 rows, so each KV head's compressed cache is
read by Q*G/64 programs instead of Q/C), then one grouped selected + window launch, then the gates in XLA.
"""

from __future__ import annotations

from ssv_jax import nsa
from ssv_jax.config import ModelConfig

from ._common import check_group_size, gate, split_count
from .compressed import compressed_attention
from .grouped_verify import effective_selection, fused_call

TWO_LAUNCH_MIN_QUERIES = 64  # H200, 64K: 2 launches 113 vs 121 µs at Q=64, 54 vs 48 µs at Q=16 (walk "mask")


def reuse_layer(q, q_pos, gates, k, v, kc, vc, kv_len, sel, cfg: ModelConfig, extra: nsa.Extra | None = None, *,
                mode: str = "A", group_size: int = 4, nsplit: int | None = None, interpret: bool = False,
                num_warps: int = 4, num_stages: int = 3, cmp_chunk: int = 64, walk: str | None = None,
                launches: int | None = None):
    """Gated NSA attention of a reuse layer with inherited `sel` [B, Q, Hkv, n]. Returns (o in q's dtype, the
    effective selection: `sel` in mode "A", the group-shared one in mode "B"). `launches`: 1 (all three branches
    in one kernel) or 2 (compressed kernel, then selected + window); the default takes 2 from Q >= 64 queries,
    where it measured faster (docs/results/layer_variants_h200.json). `walk`: see `fused_call`."""
    c = check_group_size(group_size, q.shape[1], q.shape[2] // k.shape[2])
    sel_eff = effective_selection(sel, mode, group_size)
    if launches is None:
        launches = 2 if q.shape[1] >= TWO_LAUNCH_MIN_QUERIES else 1
    if launches not in (1, 2):
        raise ValueError(f"launches={launches!r} is invalid; accepted: 1 or 2")
    if launches == 2:
        o_cmp = compressed_attention(q, q_pos, kc, vc, kv_len, cfg, extra, interpret=interpret, probs=False)[0]
        o_slc, o_win = fused_call(q, q_pos, k, v, kv_len, sel, cfg, extra, group_size=group_size,
                                  shared=mode == "B", slc=True, win=True, nsplit=nsplit, interpret=interpret,
                                  num_warps=num_warps, num_stages=num_stages, walk=walk)
        return gate(gates, o_cmp, o_slc, o_win, q.dtype), sel_eff
    if nsplit is None:
        nsplit = split_count(q.shape[0] * k.shape[2] * (q.shape[1] // c), c * cfg.n_slc)
    kw = dict(group_size=group_size, shared=mode == "B", slc=True, win=True, kc=kc, vc=vc, gates=gates,
              nsplit=nsplit, interpret=interpret, num_warps=num_warps, num_stages=num_stages, name="reuse_layer",
              cmp_chunk=cmp_chunk, walk=walk)
    o = fused_call(q, q_pos, k, v, kv_len, sel, cfg, extra, **kw)
    if nsplit > 1:
        o = gate(gates, *o, q.dtype)
    return o, sel_eff
