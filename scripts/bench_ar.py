"""AR NSA baseline at the 8B benchmark shape (GPU): chunked prefill of a long prompt, then decode ms/token at
several context lengths, plus peak memory. Writes a JSON (default docs/results/ar_8b_h200.json).

    python scripts/bench_ar.py --contexts 8192 32768 65536 --decode-steps 64 --out $OUT/ar_8b_h200.json

Random bf16 weights (never zeros). Decode time: `--decode-steps` greedy steps inside ONE jitted while_loop, timed
after a warm-up call of the same shape, divided by the step count (DESIGN.md's "N calls inside one jit").
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax.config import get_config
from ssv_jax.generate import _ar_chunk
from ssv_jax.policy import attention_for


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama31-8b-nsa")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--schedule", default=None, help="refresh period P (int) or an R/U string; default: all R")
    ap.add_argument("--random-cache", action="store_true",
                    help="skip prefill: fill the cache with random K/V at each context (decode cost only)")
    ap.add_argument("--split-weights", action="store_true",
                    help="decode with per-layer weight buffers (model.split_layers) instead of stacked slices")
    ap.add_argument("--backend", default="reference", choices=["reference", "kernel"],
                    help="decode attention: the jnp reference or the Pallas kernels (mode A, one query per group)")
    ap.add_argument("--out", default="docs/results/ar_8b_h200.json")
    a = ap.parse_args(argv)
    attn = attention_for(a.backend, "A", 1, jax.default_backend() == "cpu")
    sched = None if a.schedule is None else (int(a.schedule) if a.schedule.isdigit() else a.schedule)

    cfg = get_config(a.preset)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    t = time.perf_counter()
    params = jax.jit(lambda k: M.init_params(cfg, k, jnp.bfloat16))(jax.random.key(0))
    jax.block_until_ready(params)
    print(f"init {cfg.param_count() / 1e9:.2f}B params: {time.perf_counter() - t:.1f}s", flush=True)

    max_ctx = max(a.contexts)
    cap = max_ctx + a.prefill_chunk + 3 * a.decode_steps * len(a.contexts) + 64
    cache = kvc.init_cache(cfg, 1, cap, jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (1, max_ctx)).astype(np.int32)
    eos = jnp.int32(-2)
    rows, prefill_s, done_len = [], 0.0, 0
    tok = None
    for ctx in sorted(a.contexts):
        piece = prompt[:, done_len:ctx]
        t = time.perf_counter()
        if a.random_cache:
            cache = kvc.random_cache(cfg, 1, cache.capacity, ctx, jax.random.key(ctx))
            tok = jnp.array([7], jnp.int32)
        else:
            logits, _, cache = M.prefill(params, cfg, piece, cache, chunk=a.prefill_chunk, schedule=sched,
                                         progress=True)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        jax.block_until_ready(tok)
        dt = time.perf_counter() - t
        prefill_s += dt
        done_len = ctx
        print(f"prefill to {ctx}: {dt:.1f}s", flush=True)
        key = jax.random.key(1)
        done = jnp.zeros((1,), bool)
        dec_params = M.split_layers(params) if a.split_weights else params
        # warm-up (compiles), then the timed call of the same shape
        cache, tok, done, _, n = _ar_chunk(dec_params, cfg, cache, tok, key, done, eos, steps=a.decode_steps,
                                           temperature=0.0, schedule=sched, attn=attn)
        jax.block_until_ready(tok)
        t = time.perf_counter()
        cache, tok, done, _, n = _ar_chunk(dec_params, cfg, cache, tok, key, done, eos, steps=a.decode_steps,
                                           temperature=0.0, schedule=sched, attn=attn)
        jax.block_until_ready(tok)
        ms = (time.perf_counter() - t) * 1e3 / int(n)
        length = int(cache.length[0])
        rows.append(dict(context=ctx, cache_length_at_end=length, decode_ms_per_token=ms, steps=int(n)))
        print(f"decode at {ctx}: {ms:.3f} ms/token", flush=True)
        # the decoded tokens stay in the cache; the next prefill continues after them
    stats = dev.memory_stats() or {}
    weight_bytes = cfg.param_count() * 2
    res = dict(
        benchmark="ar_nsa_decode", preset=a.preset, device=dev.device_kind, jax=jax.__version__,
        host=platform.node(), dtype="bfloat16", batch=1, schedule=a.schedule, decode_attention=a.backend,
        weights_layout="per-layer buffers, fused q/k/v/gate and gate/up (model.split_layers)" if a.split_weights else "stacked [L, ...]",
        prefill=None if a.random_cache else dict(tokens=max_ctx, chunk=a.prefill_chunk, seconds_total=prefill_s),
        cache="random K/V at each context (no prefill)" if a.random_cache else "chunked prefill of random tokens",
        decode=rows, peak_memory_gb=stats.get("peak_bytes_in_use", 0) / 1e9,
        weights_gb=weight_bytes / 1e9, weight_read_floor_ms=weight_bytes / 4.3e12 * 1e3,
        timing="decode_steps greedy steps inside one jitted lax.while_loop after a same-shape warm-up; "
               "host wall clock around the call / steps",
    )
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
