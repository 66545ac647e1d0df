"""AR NSA baseline at the 8B benchmark shape (GPU): chunked prefill of a long prompt, then decode ms/token at
several context lengths, plus peak memory. Writes a JSON (default docs/results/ar_8b_h200.json).

    python scripts/bench_ar.py --contexts 8192 32768 65536 --decode-steps 64 --split-weights --backend kernel \
        --out $OUT/ar_8b_h200.json

Random bf16 weights (never zeros). One chunked prefill of the longest context; each context then decodes from
that cache's first `context` tokens, in a cache sized for the context plus the decode steps (what `ar_generate`
allocates for such a prompt; `--shared-cache` keeps the full-size cache instead). Decode time: `--decode-steps`
greedy steps inside ONE jitted while_loop, timed after a warm-up call of the same shape, divided by the step
count (DESIGN.md's "N calls inside one jit").
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
                    help="skip prefill: fill the cache with random K/V (decode cost only)")
    ap.add_argument("--shared-cache", action="store_true",
                    help="decode every context in the full-size cache (sized for the longest) instead of a cache "
                         "sized for that context")
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
    cap = kvc.cache_capacity(cfg, max_ctx + a.prefill_chunk + 4 * a.decode_steps + 64)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (1, max_ctx)).astype(np.int32)
    eos = jnp.int32(-2)
    dec_params = M.split_layers(params) if a.split_weights else params
    t = time.perf_counter()
    if a.random_cache:
        full = kvc.random_cache(cfg, 1, cap, max_ctx, jax.random.key(1))
    else:
        _, _, full = M.prefill(params, cfg, prompt, kvc.init_cache(cfg, 1, cap, jnp.bfloat16),
                               chunk=a.prefill_chunk, schedule=sched, progress=True)
    jax.block_until_ready(full)
    prefill_s = time.perf_counter() - t
    print(f"prefill of {max_ctx} tokens: {prefill_s:.1f}s", flush=True)

    def at_context(ctx: int):
        """The prefilled cache cut to its first `ctx` tokens: in a cache sized for ctx plus the decode steps (what
        `ar_generate` allocates for a prompt of that length), or in the full-size cache (`--shared-cache`)."""
        length = jnp.full((1,), ctx, jnp.int32)
        if a.shared_cache:
            return full._replace(length=length)
        c = kvc.cache_capacity(cfg, ctx + 4 * a.decode_steps + 64)
        d = cfg.cmp_stride
        return kvc.KVCache(full.k[:, :, :c], full.v[:, :, :c], full.kc[:, :, :c // d], full.vc[:, :, :c // d],
                           length)

    def save():
        stats = dev.memory_stats() or {}
        weight_bytes = cfg.param_count() * 2
        res = dict(
            benchmark="ar_nsa_decode", preset=a.preset, device=dev.device_kind, jax=jax.__version__,
            host=platform.node(), dtype="bfloat16", batch=1, schedule=a.schedule, decode_attention=a.backend,
            weights_layout=("per-layer buffers, fused q/k/v/gate and gate/up (model.split_layers)" if a.split_weights
                            else "stacked [L, ...]"),
            prefill=None if a.random_cache else dict(tokens=max_ctx, chunk=a.prefill_chunk, seconds_total=prefill_s),
            cache=("random K/V" if a.random_cache else f"chunked prefill of {max_ctx} random tokens") + (
                ", decoded at each context in the full-size cache" if a.shared_cache else
                ", cut to each context in a cache sized for it plus the decode steps (what ar_generate allocates)"),
            decode=rows, peak_memory_gb=stats.get("peak_bytes_in_use", 0) / 1e9,
            weights_gb=weight_bytes / 1e9, weight_read_floor_ms=weight_bytes / 4.3e12 * 1e3,
            timing="decode_steps greedy steps inside one jitted lax.while_loop after a same-shape warm-up; "
                   "host wall clock around the call / steps",
        )
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        return res

    rows = []
    for ctx in sorted(a.contexts):
        cache = jax.tree.map(jnp.copy, at_context(ctx)) if a.shared_cache else at_context(ctx)
        tok = jnp.asarray(prompt[:, ctx - 1])
        key = jax.random.key(1)
        done = jnp.zeros((1,), bool)
        # warm-up (compiles), then the timed call of the same shape
        cache, tok, done, _, n = _ar_chunk(dec_params, cfg, cache, tok, key, done, eos, steps=a.decode_steps,
                                           temperature=0.0, schedule=sched, attn=attn)
        jax.block_until_ready(tok)
        t = time.perf_counter()
        cache, tok, done, _, n = _ar_chunk(dec_params, cfg, cache, tok, key, done, eos, steps=a.decode_steps,
                                           temperature=0.0, schedule=sched, attn=attn)
        jax.block_until_ready(tok)
        ms = (time.perf_counter() - t) * 1e3 / int(n)
        rows.append(dict(context=ctx, cache_capacity=cache.capacity, cache_length_at_end=int(cache.length[0]),
                         decode_ms_per_token=ms, steps=int(n)))
        print(f"decode at {ctx} (capacity {cache.capacity}): {ms:.3f} ms/token", flush=True)
        save()
        del cache
    print(json.dumps(save(), indent=2))


if __name__ == "__main__":
    main()
