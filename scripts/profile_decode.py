"""Where does a decode step's time go? Profiles `ar` decode steps at the 8B layer shape with a few layers and
prints the GPU ops by total time (from a perfetto trace), plus step times with stacked vs per-layer weights and
with the attention swapped out.

    python scripts/profile_decode.py --layers 4 --context 8192 --outdir $OUT
    python scripts/profile_decode.py --layers 32 --context 8192 --capacity 8448 --variants kernel_fused \
        --trace kernel_fused --outdir $OUT --json $OUT/decode_profile.json   # decode_profile_8k_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import jax
import jax.numpy as jnp

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import get_config
from ssv_jax.generate import _ar_chunk
from ssv_jax.policy import attention_for
from ssv_jax.timing import op_summary, traced_gpu_ops


def no_attention(q, q_pos, gates, k, v, kc, vc, kv_len, cfg, extra=None, sel=None):
    """Baseline: the query itself (no cache reads)."""
    B, Q = q.shape[:2]
    return q, jnp.zeros((B, Q, cfg.n_kv_heads, cfg.n_slc), jnp.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=65536 + 2048,
                    help="cache capacity in tokens (bench_schedule_decode sizes it to the context: "
                         "context + 4 * steps + 64)")
    ap.add_argument("--outdir", default="/tmp/prof")
    ap.add_argument("--trace", default="nsa_fused", help="which variant to trace, list the GPU ops of and dump the HLO of")
    ap.add_argument("--variants", nargs="+", default=None, help="run only these variants (default: all)")
    ap.add_argument("--json", default=None, help="also write the step times and the traced GPU busy time here")
    ap.add_argument("--projections", nargs="*", default=None,
                    help="the decode projections routed through pallas_kernels.gemv.fused_gemv on the kernel path "
                         "(default: its PROJECTIONS; given with no names: XLA for all)")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    from pallas_kernels import gemv
    if a.projections is not None:
        keep = {k: v for k, v in gemv.PROJECTIONS.items() if k in a.projections}
        gemv.PROJECTIONS.clear()
        gemv.PROJECTIONS.update(keep)
    cfg = get_config("llama31-8b-nsa").replace(n_layers=a.layers, feature_layers=(0, a.layers // 2, a.layers - 1))
    params = jax.jit(lambda k: M.init_params(cfg, k, jnp.bfloat16))(jax.random.key(0))
    cap = kvc.cache_capacity(cfg, a.capacity)
    mk = lambda: kvc.random_cache(cfg, 1, cap, a.context, jax.random.key(1))  # noqa: E731
    tok = jnp.array([5], jnp.int32)
    res = {}
    split, fused = M.split_layers(params, fuse=False), M.split_layers(params)
    variants = (("nsa_stacked", params, nsa.nsa_attention), ("nsa_split", split, nsa.nsa_attention),
                ("nsa_fused", fused, nsa.nsa_attention), ("no_attention_fused", fused, no_attention),
                ("kernel_fused", fused, attention_for("kernel", "A", 1, jax.default_backend() == "cpu")))
    for name, prm, attn in variants:
        if a.variants and name not in a.variants:
            continue
        cache = mk()
        run = lambda c, prm=prm, attn=attn: _ar_chunk(prm, cfg, c, tok, jax.random.key(0), jnp.zeros((1,), bool),
                                                      jnp.int32(-2), steps=a.steps, temperature=0.0, schedule=None,
                                                      attn=attn)
        cache, *_ = run(cache)
        jax.block_until_ready(cache)
        t = time.perf_counter()
        cache, *_ = run(cache)
        jax.block_until_ready(cache)
        res[name] = (time.perf_counter() - t) * 1e3 / a.steps
        print(f"{name}: {res[name]:.3f} ms/step for {a.layers} layers", flush=True)
        if name == a.trace:
            with open(os.path.join(a.outdir, f"hlo_{name}.txt"), "w") as f:
                f.write(_ar_chunk.lower(prm, cfg, mk(), tok, jax.random.key(0), jnp.zeros((1,), bool),
                                        jnp.int32(-2), steps=a.steps, temperature=0.0, schedule=None,
                                        attn=attn).compile().as_text())
            ops = traced_gpu_ops(lambda: run(cache)[0], os.path.join(a.outdir, "trace"))
            tot, cnt = defaultdict(float), defaultdict(int)
            for rows in ops.values():
                for n, (us, c) in rows.items():
                    tot[n] += us
                    cnt[n] += c
            rows = sorted(tot.items(), key=lambda x: -x[1])[:60]
            for n, t in rows:
                print(f"{t / a.steps:10.1f} us/step  x{cnt[n] / a.steps:6.1f}  {n[:150]}")
            # busy time: kernels on the GPU streams against the step's wall clock; the gap is launch latency
            res["traced_gpu_op_us_per_step"] = sum(tot.values()) / a.steps
            res["traced_gpu_ops_per_step"] = sum(cnt.values()) / a.steps
            res["by_category_per_step"] = op_summary(ops, a.steps)
            res["top_ops_us_per_step"] = {n[:120]: round(t / a.steps, 1) for n, t in rows[:25]}
            res["top_ops_count_per_step"] = {n[:120]: round(cnt[n] / a.steps, 2) for n, _ in rows}
    res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    res["fused_projections"] = sorted(gemv.PROJECTIONS)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
