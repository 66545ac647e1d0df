"""Top-n primitives at the shapes the library runs: XLA's TopK (`jax.lax.top_k`), the pairwise-rank top-n
(`nsa.top_n`, where its pair count allows) and the Pallas `top_n` kernel; and the draft tree's selection, the
top k of a log-softmax over the draft vocabulary: XLA's log-softmax and TopK (`tree.log_softmax_top_k`) against
the Pallas `top_n_log_softmax` (one launch up to `topn.MAX_TILE` ids).

    python scripts/bench_topn.py --out docs/results/topn_h200.json [--draft-only]

Each figure is the median host wall clock of a jitted loop of `--iters` calls (each call's input depends on the
loop index, so XLA cannot hoist it), per call.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallas_kernels.topn import top_n as pallas_top_n
from pallas_kernels.topn import top_n_log_softmax
from ssv_jax import nsa
from ssv_jax.tree import log_softmax_top_k
from ssv_jax.timing import host_time

SHAPES = (  # (name, rows, width, n)
    ("routing, decode, 8K cache", 8, 132, 16),
    ("routing, decode, 64K cache", 8, 1088, 16),
    ("routing, 64-node verify, 64K cache", 512, 1088, 16),
    ("routing, 64-node verify, 128K cache", 512, 2112, 16),
    ("routing, 64-node verify, 128K cache, one of 2 TP shards", 256, 2112, 16),
    ("draft tree, bundled model, 4 frontier rows over its 8192 ids", 4, 8192, 4),
    ("draft tree, root row over the vocabulary", 1, 128256, 8),
    ("draft tree, frontier rows over the vocabulary", 8, 128256, 8),
)
DRAFT_SHAPES = (  # the selection over draft log-probs: (name, rows, width, n)
    ("draft selection, bundled head, root row over its 2048 draft ids", 1, 2048, 4),
    ("draft selection, bundled head, 4 frontier rows over its 2048 draft ids", 4, 2048, 4),
    ("draft selection, 8 frontier rows over EAGLE-3's 32000 draft ids", 8, 32000, 8),
)


def run(iters: int = 50, shapes=SHAPES, draft_shapes=DRAFT_SHAPES, log=print) -> list:
    """One row per shape: us per call of each method and whether it equals the reference (`jax.lax.top_k`; for
    the draft selection `tree.log_softmax_top_k`)."""
    interpret = jax.default_backend() == "cpu"
    methods = {"xla_top_k": jax.lax.top_k, "rank_top_n": nsa.top_n,
               "pallas_top_n": lambda s, n: pallas_top_n(s, n, interpret=interpret)}
    draft_methods = {"xla_log_softmax_top_k": log_softmax_top_k,
                     "pallas_top_n_log_softmax": lambda s, n: top_n_log_softmax(s, n, interpret=interpret)}
    groups = [(shapes, methods, jax.lax.top_k), (draft_shapes, draft_methods, log_softmax_top_k)]
    rows = []
    for name, r, m, n, meths, reference in [s + (meths, ref) for shp, meths, ref in groups for s in shp]:
        score = jax.random.normal(jax.random.key(r * m), (r, m), jnp.float32)
        row = dict(shape=name, rows=r, width=m, n=n)
        ref = reference(score, n)[1]
        for meth, fn in meths.items():
            if meth == "rank_top_n" and r * m * m > nsa.RANK_TOPK_MAX_PAIRS:
                continue  # nsa.top_n would fall back to lax.top_k here

            def loop(s, fn=fn):
                def body(i, acc):
                    v, idx = fn(s + i.astype(jnp.float32) * 0.0, n)
                    return acc + idx[..., 0].sum() + v[..., -1].sum().astype(jnp.int32)
                return jax.lax.fori_loop(0, iters, body, jnp.int32(0))

            same = bool(jnp.all(fn(score, n)[1] == ref))
            row[meth] = dict(us_per_call=round(host_time(jax.jit(loop), score, reps=5) * 1e3 / iters, 2),
                             equals_reference=same)
        rows.append(row)
        log(json.dumps(row))
    return rows


TIMING = "median host wall clock of 5 runs of a jitted fori_loop of `iters` calls, per call"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="docs/results/topn_h200.json")
    ap.add_argument("--draft-only", action="store_true", help="only the draft selection rows (DRAFT_SHAPES)")
    a = ap.parse_args(argv)
    rows = run(a.iters, shapes=() if a.draft_only else SHAPES)
    res = dict(benchmark="top_n", device=jax.devices()[0].device_kind, jax=jax.__version__, iters=a.iters,
               rows=rows, timing=TIMING)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
