"""Where an AR step and an SSV round of the bundled model spend their GPU time (GPU; issue #8).

    python scripts/profile_round.py --checkpoint checkpoints/ssv-small --context 8192 --out $OUT/round_profile.json

`bench_e2e.py`'s round split is a model built from differences of separately timed calls (each pays its own
dispatch). This script reads the device's own timeline instead: from one held-out prompt's prefilled state it
traces, under the JAX profiler,
- `--steps` AR decode steps in one `_ar_chunk` (what `ar_generate` runs),
- `--rounds` SSV rounds of the fixed policy in one `_ssv_chunk` (what `ssv_generate` runs),
- `--rounds` calls of the round's draft stage alone, and as many of draft + verify (`timing.round_split`'s
  stages), so that draft and verify device time separate without dispatch,
each compiled first, then timed once untraced (host wall clock) and traced once; it writes per step / round /
call: host ms, traced GPU busy µs and op count (by `timing.op_category`), and the top ops. Host ms minus GPU busy
time is what launch gaps, the loop and (for the single stage calls) dispatch cost.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import timing
from ssv_jax.generate import _ar_chunk, default_decode_attention, prepare_prompt
from ssv_jax.generate_cli import add_dtype_arg, bench_policy, load_model, prompts
from ssv_jax.speculative import _ssv_chunk

TOP = 25


def _summary(ops: dict, per: int) -> dict:
    """Busy time by category and the top ops of the first GPU, per step/round/call."""
    if not ops:  # no GPU in the trace (CPU)
        return dict(by_category={}, top_ops=[])
    first = min(ops)
    top = sorted(ops[first].items(), key=lambda kv: -kv[1][0])[:TOP]
    return dict(by_category=timing.op_summary({first: ops[first]}, per)[first],
                top_ops=[dict(name=n[:100], us=round(us / per, 2), count=round(c / per, 2)) for n, (us, c) in top])


def _timed_trace(fn, trace_dir: str):
    """(host seconds of one untraced call of fn(), the ops of a second, traced call); fn is already compiled."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    host = time.perf_counter() - t
    return host, timing.traced_gpu_ops(fn, trace_dir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="AR decode steps traced")
    ap.add_argument("--rounds", type=int, default=8, help="SSV rounds traced (and draft / draft+verify calls)")
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--schedule", type=int, default=4, help="the fixed policy's refresh period P")
    ap.add_argument("--backend", default="kernel", choices=["kernel", "reference"],
                    help="the rounds' attention path (AR always takes ar_generate's default)")
    ap.add_argument("--trace-dir", default=None, help="where the traces go (default: a temporary folder)")
    ap.add_argument("--out", default="round_profile.json")
    a = ap.parse_args(argv)
    for name in ("context", "steps", "rounds", "schedule"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name}={getattr(a, name)} is invalid; accepted: an integer >= 1")
    trace_root = a.trace_dir or tempfile.mkdtemp(prefix="ssv_round_profile_")
    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    cfg = m.cfg
    d = a.tree[1]
    policy = bench_policy(a.tree, a.schedule, a.backend)
    policy.check_for(cfg)
    name, p = prompts(tok, cfg.vocab_size, a.context, 1)[0]
    new_tokens = max(a.steps + 1, a.rounds * (d + 1)) * 2 + 16
    res = dict(benchmark="round_profile", model=desc, device=jax.devices()[0].device_kind, jax=jax.__version__,
               context=a.context, prompt=name, policy=policy.describe(),
               command="python scripts/profile_round.py " + " ".join(
                   f"--{key.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for key, v in vars(a).items() if key not in ("out", "trace_dir") and v is not None),
               method="one compiled call of each, traced with jax.profiler; GPU busy = sum of the first GPU's op "
                      "durations; per step / round / call")
    split = M.split_layers(m.params)

    # AR: the library's chunked prefill, then decode steps in one while_loop
    prompt = prepare_prompt(cfg, p, new_tokens, extra_room=512)
    dtype = jax.tree.leaves(m.params)[0].dtype
    cache0 = kvc.init_cache(cfg, 1, prompt.shape[1] + new_tokens + 512, dtype)
    logits, _, cache0 = M.prefill(m.params, cfg, prompt, cache0, chunk=512)
    tok0 = jnp.argmax(logits, -1).astype(jnp.int32)
    attn = default_decode_attention()

    def ar(steps):
        cache = jax.tree.map(jnp.copy, cache0)  # the chunk donates its cache
        return _ar_chunk(split, cfg, cache, tok0, jax.random.key(0), jnp.zeros((1,), bool), jnp.int32(-2),
                         steps=steps, temperature=0.0, schedule=None, attn=attn)

    jax.block_until_ready(ar(a.steps))
    host, ops = _timed_trace(lambda: ar(a.steps), os.path.join(trace_root, "ar"))
    res["ar"] = dict(steps=a.steps, host_ms_per_step=host * 1e3 / a.steps, **_summary(ops, a.steps))
    print(f"AR: {res['ar']['host_ms_per_step']:.3f} ms/step, GPU busy "
          f"{res['ar']['by_category'].get('total_us', 0):.1f} us/step", flush=True)

    # SSV: the fixed policy's rounds in one while_loop, from the prefilled state
    st0, eos = timing.prefilled_state(m, p, policy, new_tokens)

    def rounds():
        s = jax.tree.map(jnp.copy, st0)
        return _ssv_chunk(split, m.draft_params, s, jax.random.key(0), eos, cfg=cfg, dcfg=m.draft_cfg,
                          policy=policy, temperature=0.0, rounds=a.rounds, max_new=1 << 30)

    out = rounds()
    n = int(out[2])
    emitted = int(np.asarray(out[1]).sum())
    host, ops = _timed_trace(rounds, os.path.join(trace_root, "ssv"))
    res["ssv"] = dict(rounds=n, tau=emitted / max(n, 1), host_ms_per_round=host * 1e3 / n, **_summary(ops, n))
    print(f"SSV: {res['ssv']['host_ms_per_round']:.3f} ms/round (tau {res['ssv']['tau']:.2f}), GPU busy "
          f"{res['ssv']['by_category'].get('total_us', 0):.1f} us/round", flush=True)

    # the round's stages alone: draft, and draft + verify
    args = (split, m.draft_params, st0, eos)
    for stage in ("draft", "verify"):
        fn = timing._stage(cfg, m.draft_cfg, policy, stage)
        jax.block_until_ready(fn(*args))
        host, ops = _timed_trace(lambda fn=fn: [fn(*args) for _ in range(a.rounds)],
                                 os.path.join(trace_root, stage))
        key = "draft" if stage == "draft" else "draft_verify"
        res[key] = dict(calls=a.rounds, host_ms_per_call=host * 1e3 / a.rounds, **_summary(ops, a.rounds))
        print(f"{key}: GPU busy {res[key]['by_category'].get('total_us', 0):.1f} us/call", flush=True)
    busy = {key: res[key]["by_category"].get("total_us", 0.0) for key in ("ar", "ssv", "draft", "draft_verify")}
    res["reading"] = dict(
        gpu_busy_us=busy, verify_gpu_us=busy["draft_verify"] - busy["draft"],
        accept_commit_gpu_us=busy["ssv"] - busy["draft_verify"],
        round_over_ar_step_host=res["ssv"]["host_ms_per_round"] / res["ar"]["host_ms_per_step"],
        implied_speedup=res["ssv"]["tau"] * res["ar"]["host_ms_per_step"] / res["ssv"]["host_ms_per_round"])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["reading"]), flush=True)


if __name__ == "__main__":
    main()
