"""The decode step's four projections at the 8B shapes (GPU; issue #2): XLA's GEMV fusions against
`pallas_kernels.gemv.fused_gemv` over its block sizes, warps and stages.

    python scripts/tune_gemv.py --out $OUT/gemv_h200.json

For one decode row of `llama31-8b-nsa` (bf16, random weights; `--preset small --rows 32` times the bundled
model's 32-node verify instead; q/k/v/gate is then 792 columns wide, which the kernel does not take):

* qkvg: rms_norm(x) @ w_qkvg                       [4096] x [4096, 6240]
* wo:   x + o @ wo                                 [4096] x [4096, 4096]
* gu:   silu(h @ w_gate) * (h @ w_up), h = rms_norm(x)   [4096] x [4096, 2 x 14336]
* down: x + a @ w_down                             [14336] x [14336, 4096]

Each is timed over `--layers` distinct weight matrices in one jitted call (as in a decode step, no weight stays
in L2 between uses), host-timed over `--reps` back-to-back calls, median of 3; it reports µs per projection and
the weight bandwidth. Every fused configuration is first checked against XLA's result on the same inputs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gemv import fused_gemv
from ssv_jax import model as M
from ssv_jax.config import get_config

EPS = 1e-5


def ops(cfg):
    """name -> (K, N of w, fused_gemv kwargs, XLA reference fn(x, w, nw, r))."""
    H, F = cfg.hidden, cfg.ffn
    n_qkvg = sum(M._qkvg_widths(cfg))

    def gu_ref(x, w, nw, r):
        g, u = jnp.split(M._mm(M.rms_norm(x, nw, EPS), w), 2, -1)
        return jax.nn.silu(g) * u

    return {
        "qkvg": (H, n_qkvg, dict(norm=True), lambda x, w, nw, r: M._mm(M.rms_norm(x, nw, EPS), w)),
        "wo": (H, H, dict(residual=True), lambda x, w, nw, r: r + M._mm(x, w)),
        "gu": (H, 2 * F, dict(norm=True, swiglu=True), gu_ref),
        "down": (F, H, dict(residual=True), lambda x, w, nw, r: r + M._mm(x, w)),
    }


def time_calls(fn, args, reps: int) -> float:
    """Seconds per call of the jitted fn, back-to-back calls, median of 3."""
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            y = fn(*args)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama31-8b-nsa")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of x: 1 for a decode step, 32 for a 32-node verify (`gemv.TILE_ROWS`)")
    ap.add_argument("--ops", nargs="+", default=["qkvg", "wo", "gu", "down"])
    ap.add_argument("--layers", type=int, default=16, help="distinct weights per timed call")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--dot", type=int, nargs="+", default=[1, 0], help="1: tensor-core dot, 0: CUDA-core reduce")
    ap.add_argument("--layout", nargs="+", default=["kn", "nk"], choices=["kn", "nk"],
                    help="weight storage: kn = [K, N] (the model's), nk = [N, K] (fused_gemv(transposed=True))")
    ap.add_argument("--xla-only", action="store_true", help="time XLA's fusions only (e.g. under other XLA_FLAGS)")
    ap.add_argument("--out", default="gemv.json")
    args = ap.parse_args()
    cfg = get_config(args.preset)
    dt = jnp.bfloat16
    res = {"benchmark": "decode_gemv", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": "python scripts/tune_gemv.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                   vars(args).items() if k != "out"),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "preset": args.preset, "rows": args.rows,
           "layers_per_call": args.layers,
           "ops": {}}
    key = jax.random.PRNGKey(0)
    for name in args.ops:
        K, N, kw, ref = ops(cfg)[name]
        n_out = N // 2 if kw.get("swiglu") else N
        ks = jax.random.split(jax.random.fold_in(key, hash(name) % 1000), args.layers + 3)
        ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(dt) for k in ks[:args.layers]]
        stored = {"kn": ws, "nk": [jnp.asarray(w.T) for w in ws] if "nk" in args.layout else None}
        x = jax.random.normal(ks[-3], (1, args.rows, K), jnp.float32).astype(dt)
        nw = (1 + 0.1 * jax.random.normal(ks[-2], (K,))).astype(dt)
        r = jax.random.normal(ks[-1], (1, args.rows, n_out), jnp.float32).astype(dt)
        gbytes = K * N * 2 / 1e9

        def many(f):
            return jax.jit(lambda x, ws, nw, r: [f(x, w, nw, r) for w in ws])

        t_xla = time_calls(many(ref), (x, ws, nw, r), args.reps) / args.layers
        y_ref = jax.jit(ref)(x, ws[0], nw, r).astype(jnp.float32)
        row = {"K": K, "N": N, "weight_GB": gbytes, "xla_us": t_xla * 1e6, "xla_TBps": gbytes / t_xla / 1e3,
               "configs": []}
        print(f"{name}: XLA {t_xla * 1e6:.1f} us ({gbytes / t_xla / 1e3:.2f} TB/s)", flush=True)
        grid = [] if args.xla_only else itertools.product(args.layout, args.dot, args.block_n, args.block_k,
                                                          args.warps, args.stages)
        for lay, d, bn, bk, nwp, ns in grid:
            if not d and ns > 2:
                continue
            opts = dict(dot=bool(d), block_n=bn, block_k=bk, num_warps=nwp, num_stages=ns, transposed=lay == "nk")

            def fused(x, w, nw, r, opts=opts):
                return fused_gemv(x, w, norm=nw if kw.get("norm") else None, eps=EPS,
                                  residual=r if kw.get("residual") else None, swiglu=kw.get("swiglu", False), **opts)

            try:
                y = jax.jit(fused)(x, stored[lay][0], nw, r).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(y - y_ref)) / (jnp.max(jnp.abs(y_ref)) + 1e-6))
                t = time_calls(many(fused), (x, stored[lay], nw, r), args.reps) / args.layers
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                row["configs"].append({**opts, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(name, opts, "error", type(e).__name__, flush=True)
                continue
            row["configs"].append({**opts, "us": t * 1e6, "TBps": gbytes / t / 1e3, "max_rel_err": err})
            print(f"{name} {opts}: {t * 1e6:.1f} us ({gbytes / t / 1e3:.2f} TB/s) err {err:.1e}", flush=True)
        ok = [c for c in row["configs"] if "us" in c and c["max_rel_err"] < 2e-2]
        if ok:
            row["best"] = min(ok, key=lambda c: c["us"])
            print(f"{name}: best {row['best']}", flush=True)
        res["ops"][name] = row
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
