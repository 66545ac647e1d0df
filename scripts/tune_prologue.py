"""The verify layers' attention prologue at the bundled model's shapes (GPU; issue #8): XLA's RMSNorm, q/k/v/gate
GEMM, split and RoPE fusions (`model._qkv`) against `pallas_kernels.qkv_prologue` over its launch configs.

    python scripts/tune_prologue.py --out $OUT/prologue_h200.json

A tree's rows (`--rows`, 32 for the 32-node tree) of `--preset` (bf16, random weights) through `--layers`
distinct weight matrices in one jitted call, host-timed over `--reps` back-to-back calls, median of 3 (as
`tune_gemv.py`); µs per layer. Each configuration is first checked against XLA's result on the same inputs.
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from tune_gemv import time_calls

from pallas_kernels.qkv_prologue import qkv_prologue
from ssv_jax import model as M
from ssv_jax.config import get_config


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16, help="distinct weights per timed call")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--col-split", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default="prologue.json")
    a = ap.parse_args()
    cfg = get_config(a.preset)
    dt = jnp.bfloat16
    K, N = cfg.hidden, sum(M._qkvg_widths(cfg))
    ks = jax.random.split(jax.random.key(0), a.layers + 2)
    lps = [{"attn_norm": (1 + 0.1 * jax.random.normal(k, (K,))).astype(dt),
            "w_qkvg": (jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(dt)} for k in ks[:a.layers]]
    x = jax.random.normal(ks[-2], (1, a.rows, K), jnp.float32).astype(dt)
    pos = jax.random.randint(ks[-1], (1, a.rows), 0, cfg.max_seq_len)
    ctx = M.Ctx(cfg, pos, None, M.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    cos, sin = M.rope_cos_sin(pos, ctx.inv_freq)

    def many(f):
        return jax.jit(lambda x, lps: [f(x, lp) for lp in lps])

    xla = lambda x, lp: M._qkv(lp, ctx, x)  # noqa: E731
    t_xla = time_calls(many(xla), (x, lps), a.reps) / a.layers
    ref = [np.asarray(o, np.float32) for o in jax.jit(xla)(x, lps[0])]
    res = {"benchmark": "verify_prologue", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "preset": a.preset, "rows": a.rows, "K": K, "N": N, "layers_per_call": a.layers,
           "command": "python scripts/tune_prologue.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(a).items() if k != "out"),
           "xla_us": t_xla * 1e6, "configs": []}
    print(f"XLA {t_xla * 1e6:.2f} us per layer", flush=True)
    for bk, cs, nw, ns in itertools.product(a.block_k, a.col_split, a.warps, a.stages):
        opts = dict(block_k=bk, col_split=cs, num_warps=nw, num_stages=ns)
        f = lambda x, lp, o=opts: qkv_prologue(x, lp["attn_norm"], lp["w_qkvg"], cos, sin,  # noqa: E731
                                               n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                               eps=cfg.norm_eps, **o)
        got = [np.asarray(o, np.float32) for o in jax.jit(f)(x, lps[0])]
        err = max(float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(got, ref))
        t = time_calls(many(f), (x, lps), a.reps) / a.layers
        res["configs"].append(dict(opts, us=t * 1e6, rel_err=err))
        print(f"{opts}: {t * 1e6:.2f} us (rel err {err:.1e})", flush=True)
    best = min(res["configs"], key=lambda c: c["us"])
    res["best"] = best
    print(f"best {best} against XLA {t_xla * 1e6:.2f} us", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
