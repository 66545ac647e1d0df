"""Decode step under refresh/reuse schedules at the 8B shape (GPU; issue #5): ms/token and first-call (compile)
seconds for each refresh period P, on both weight layouts:

* "per-layer" (the decode layout, `model.split_layers`): the schedule's layers unrolled at trace time;
* "stacked segments": the schedule compiled to static `lax.scan` segments over stacked weights, unroll=True.

The plain unrolled loop is P=1 on the per-layer layout; every row reports its ratio to it.

    python scripts/bench_schedule_decode.py --periods 1 2 4 8 32 --out $OUT/schedule_decode_8b_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import schedule as sched
from ssv_jax.config import get_config
from ssv_jax.generate import _ar_chunk
from ssv_jax.policy import attention_for


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama31-8b-nsa")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--stacked-periods", type=int, nargs="*", default=[1, 4],
                    help="periods also timed on stacked weights (scan segments); compile time grows with each")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--backend", default="kernel", choices=["reference", "kernel"])
    ap.add_argument("--out", default="docs/results/schedule_decode_8b_h200.json")
    a = ap.parse_args(argv)
    cfg = get_config(a.preset)
    attn = attention_for(a.backend, "A", 1, jax.default_backend() == "cpu")
    stacked = jax.jit(lambda k: M.init_params(cfg, k, jnp.bfloat16))(jax.random.key(0))
    layouts = {"per-layer": M.split_layers(stacked), "stacked segments": stacked}
    cap = kvc.cache_capacity(cfg, a.context + 4 * a.steps + 64)
    cache = kvc.random_cache(cfg, 1, cap, a.context, jax.random.key(1))
    rows = []
    for layout, params in layouts.items():
        for P in (a.periods if layout == "per-layer" else a.stacked_periods):
            flags = sched.parse(P, cfg.n_layers)
            run = lambda c: _ar_chunk(params, cfg, c, jnp.array([7], jnp.int32), jax.random.key(2),
                                      jnp.zeros((1,), bool), jnp.int32(-2), steps=a.steps, temperature=0.0,
                                      schedule=P, attn=attn)
            c = jax.tree.map(jnp.copy, cache)
            t = time.perf_counter()
            c, *_ = run(c)
            jax.block_until_ready(c)
            first_s = time.perf_counter() - t
            c = jax.tree.map(jnp.copy, cache)
            jax.block_until_ready(c)
            t = time.perf_counter()
            c, _, _, _, n = run(c)
            jax.block_until_ready(c)
            ms = (time.perf_counter() - t) * 1e3 / int(n)
            row = dict(layout=layout, P=P, schedule=sched.to_string(flags), segments=len(sched.segments(flags)),
                       decode_ms_per_token=ms, first_call_s=first_s)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = next(r for r in rows if r["layout"] == "per-layer" and r["P"] == 1)
    for r in rows:
        r["vs_plain_unrolled"] = r["decode_ms_per_token"] / base["decode_ms_per_token"]
    out = dict(benchmark="schedule_decode_step", preset=a.preset, device=jax.devices()[0].device_kind,
               jax=jax.__version__, context=a.context, decode_attention=a.backend, rows=rows,
               timing=f"{a.steps} greedy steps in one jitted while_loop (random bf16 weights and cache), after a "
                      "first call of the same shape (first_call_s: trace + compile + one run)")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
