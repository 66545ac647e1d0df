"""Refresh- and reuse-layer variants at the 8B layer shape, 64K context (GPU; issues #3 and #5): which launch
structure, merged-walk form, group size C and split count serve a 16- and a 64-node tree best.

    python scripts/tune_layers.py --out $OUT/layer_variants_h200.json

Inputs are `bench_kernels.Point`s (random bf16 cache, R rotated query sets at T + depth). Each reuse variant runs
on two selections: the one the refresh layer routes for these random queries (what `bench_verify.py`'s schedule
rows use: little overlap between queries) and a synthetic one with adjacent overlap gamma = 0.75 (closer to real
trees, whose measured gamma is 0.6-0.65). Timing is `bench_kernels.time_loop` (100 calls in one jitted fori_loop,
minus the empty loop, median of 5). Variants:

* refresh: the skipping walk ("skip") and the branch-free walk ("mask", mode A's default); its parts: the compressed kernel with and
  without probabilities, compressed + routing, selected + window;
* reuse: one launch (default split, or a forced split count), or two launches (compressed kernel without
  probabilities, then selected + window), each with walk "skip" or "mask", for C in {2, 4, 8}.

`--routing` instead times compressed attention + routing (`route_from_kernel`) with routing's top-n on the
reference's rank fusion and on the Pallas top-n kernel, over contexts x query counts (to place
`topn.RANK_MAX_PAIRS`, below which `topn.route_top_n` keeps the rank fusion):

    python scripts/tune_layers.py --routing --contexts 16384 32768 65536 --queries 1 4 16 --out $OUT/routing.json

`--decode` instead times a decode step's refresh layer (one query): the generic path (`refresh_layer`: compressed
kernel, XLA routing glue, selected + window kernel) against `decode_refresh_layer` (routing inside the second
kernel) at several split counts, after checking on the same inputs that both route identically and agree on the
output:

    python scripts/tune_layers.py --decode --contexts 8192 32768 65536 --out $OUT/decode_layer.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from bench_kernels import Point, time_loop
from pallas_kernels import topn
from pallas_kernels import compressed_attention, refresh_layer, reuse_layer, route_from_kernel, selected_and_window
from pallas_kernels.decode_layer import decode_refresh_layer
from ssv_jax import nsa
from ssv_jax.config import get_config


def refresh_variants(cfg):
    """name -> fn(q, sel, q_pos, gates, k, v, kc, vc, kv_len) for the refresh layer and its parts (sel unused)."""
    return {
        "refresh_C4_skip": lambda q, s, t, g, k, v, kc, vc, kl: refresh_layer(q, t, g, k, v, kc, vc, kl, cfg,
                                                                              walk="skip")[0],
        "refresh_C4_mask": lambda q, s, t, g, k, v, kc, vc, kl: refresh_layer(q, t, g, k, v, kc, vc, kl, cfg,
                                                                              walk="mask")[0],
        "part_cmp_probs": lambda q, s, t, g, k, v, kc, vc, kl: compressed_attention(q, t, kc, vc, kl, cfg)[:2],
        "part_cmp_only": lambda q, s, t, g, k, v, kc, vc, kl: compressed_attention(q, t, kc, vc, kl, cfg,
                                                                                   probs=False)[0],
        "part_cmp_route": lambda q, s, t, g, k, v, kc, vc, kl: route_from_kernel(q, t, kc, vc, kl, k.shape[1], cfg),
    }


def reuse_variants(cfg):
    """name -> fn(...) for the reuse layer (and the selected + window launch) with the inherited sel."""
    out = {}
    for C in (4, 8, 2):
        for walk in ("skip", "mask"):
            out[f"slcwin_C{C}_{walk}"] = lambda q, s, t, g, k, v, kc, vc, kl, C=C, w=walk: selected_and_window(
                q, t, k, v, kl, s, cfg, group_size=C, walk=w)
            for launches in (1, 2):
                out[f"reuse_L{launches}_C{C}_{walk}"] = (
                    lambda q, s, t, g, k, v, kc, vc, kl, C=C, w=walk, n=launches: reuse_layer(
                        q, t, g, k, v, kc, vc, kl, s, cfg, group_size=C, walk=w, launches=n)[0])
    for sp in (8, 16):
        out[f"reuse_L1_C4_skip_nsplit{sp}"] = lambda q, s, t, g, k, v, kc, vc, kl, sp=sp: reuse_layer(
            q, t, g, k, v, kc, vc, kl, s, cfg, group_size=4, nsplit=sp)[0]
    return out


def routing_sweep(cfg, contexts, queries, n: int) -> list:
    """Compressed attention + routing with the rank fusion vs the top-n kernel (rows: context, Q, pairs, µs)."""
    rows = []
    for T in contexts:
        for Q in queries:
            p = Point(cfg, T, Q, 0.75)
            pairs = Q * cfg.n_kv_heads * (p.S // cfg.slc_block) ** 2
            row = dict(context=T, Q=Q, rows=Q * cfg.n_kv_heads, width=p.S // cfg.slc_block, pairs=pairs)
            for name, select in (("rank", nsa.top_n), ("kernel", topn.top_n)):
                if name == "rank" and pairs > nsa.RANK_TOPK_MAX_PAIRS:
                    continue  # nsa.top_n would take XLA's TopK there

                def fn(q, s, t, g, k, v, kc, vc, kl, select=select):
                    return route_from_kernel(q, t, kc, vc, kl, k.shape[1], cfg, select=select)[1]

                row[f"{name}_us"] = round(time_loop(fn, (p.k, p.v, p.kc, p.vc, p.kv_len),
                                                    (p.q, p.sel, p.q_pos, p.gates), n=n)[0], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def decode_sweep(cfg, contexts, n: int, variants=(((3, 2), None, 2), ((3, 2), None, 4), ((5, 1), None, 2),
                                                   ((9, 4), None, 2), ((2, 1), None, 2))) -> list:
    """A decode step's refresh layer, generic path vs `decode_refresh_layer` (rows: context, variant, µs), with
    the two paths' selections compared and their outputs' relative RMS difference on the timed inputs."""
    rows = []
    for T in contexts:
        p = Point(cfg, T, 1, 0.75)
        static = (p.k, p.v, p.kc, p.vc, p.kv_len)
        rot = (p.q, p.sel, p.q_pos, p.gates)
        generic = jax.jit(lambda q, t, g: refresh_layer(q, t, g, *static[:4], p.kv_len, cfg, group_size=1))
        o_ref, s_ref = generic(p.q[0], p.q_pos[0], p.gates[0])
        row = dict(context=T, capacity=p.S, variant="generic",
                   us=round(time_loop(lambda q, s, t, g, k, v, kc, vc, kl: refresh_layer(
                       q, t, g, k, v, kc, vc, kl, cfg, group_size=1)[0], static, rot, n=n)[0], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
        for ns, cs, nw in variants:
            def fn(q, s, t, g, k, v, kc, vc, kl, ns=ns, cs=cs, nw=nw):
                return decode_refresh_layer(q, t, g, k, v, kc, vc, kl, cfg, per_program=ns, cmp_nsplit=cs,
                                            num_warps=nw)

            o, sel = jax.jit(lambda *a: fn(a[0], None, *a[1:]))(p.q[0], p.q_pos[0], p.gates[0], *static)
            diff = jnp.sqrt(jnp.mean((o.astype(jnp.float32) - o_ref.astype(jnp.float32)) ** 2)
                            / jnp.mean(o_ref.astype(jnp.float32) ** 2))
            row = dict(context=T, capacity=p.S, variant=f"decode_per_program{ns[0]}x{ns[1]}_cmp{cs}_warps{nw}",
                       same_selection=bool((sel == s_ref).all()), rel_rms_vs_generic=float(diff),
                       us=round(time_loop(fn, static, rot, n=n)[0], 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--queries", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--synthetic-queries", type=int, nargs="*", default=[64],
                    help="tree sizes whose reuse variants also run on the gamma=0.75 selection")
    ap.add_argument("--n", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new variants after this long")
    ap.add_argument("--out", default="docs/results/layer_variants_h200.json")
    ap.add_argument("--routing", action="store_true", help="only the rank-vs-kernel routing sweep (see above)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--decode", action="store_true", help="only the decode refresh-layer sweep (see above)")
    a = ap.parse_args(argv)
    cfg = get_config("llama31-8b-nsa")
    if a.decode:
        res = dict(benchmark="decode_refresh_layer", preset="llama31-8b-nsa", device=jax.devices()[0].device_kind,
                   jax=jax.__version__, dtype="bfloat16",
                   rows=decode_sweep(cfg, a.contexts, a.n),
                   timing="bench_kernels.time_loop: net µs per call, median of 5; cache capacity context + 1024")
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        return
    if a.routing:
        res = dict(benchmark="routing_top_n", preset="llama31-8b-nsa", device=jax.devices()[0].device_kind,
                   jax=jax.__version__, dtype="bfloat16", rows=routing_sweep(cfg, a.contexts, a.queries, a.n),
                   timing="bench_kernels.time_loop of route_from_kernel (compressed kernel + importance + route)")
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        return
    end = time.time() + a.budget_s
    rows = []

    def save():
        res = dict(benchmark="layer_variants", preset="llama31-8b-nsa", device=jax.devices()[0].device_kind,
                   jax=jax.__version__, context=a.context, dtype="bfloat16", batch=1, rows=rows,
                   timing="bench_kernels.time_loop: net µs per call (loop of n calls over rotated inputs minus "
                          "the empty loop), median of 5")
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)

    for Q in a.queries:
        p = Point(cfg, a.context, Q, 0.75)
        static = (p.k, p.v, p.kc, p.vc, p.kv_len)
        routed = jnp.stack([route_from_kernel(p.q[r], p.q_pos[r], p.kc, p.vc, p.kv_len, p.S, cfg)[1]
                            for r in range(p.q.shape[0])])
        jobs = [(name, fn, "none", p.sel) for name, fn in refresh_variants(cfg).items()]
        sels = [("routed", routed)] + ([("gamma0.75", p.sel)] if Q in a.synthetic_queries else [])
        jobs += [(name, fn, src, sel) for src, sel in sels for name, fn in reuse_variants(cfg).items()]
        for name, fn, src, sel in jobs:
            if time.time() > end:
                break
            row = dict(Q=Q, variant=name, sel=src)
            try:
                row["us"] = round(time_loop(fn, static, (p.q, sel, p.q_pos, p.gates), n=a.n)[0], 2)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    save()
    best = {}
    for r in rows:
        if "us" in r and r["variant"].startswith("reuse"):
            k = (r["Q"], r["sel"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    for (Q, src), r in sorted(best.items()):
        print(f"best reuse Q={Q} sel={src}: {r['variant']} {r['us']} us")


if __name__ == "__main__":
    main()
