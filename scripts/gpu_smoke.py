"""Smoke check of a bundle on the current device: greedy SSV emits greedy AR NSA's tokens.

    python scripts/gpu_smoke.py --out docs/results/gpu_smoke_h200.json      # on the GPU

For each dtype, the bundle is loaded (`load_bundle` checks its weights against its config), and one held-out
prompt (`generate_cli.prompts`) is generated greedily with the fixed e2e tree (`--tree`, refresh on every layer;
the Pallas kernels on a GPU, the jnp reference elsewhere) and with `policy="auto"`, then with `ar_generate`.
Exactness is specified in fp32; in bf16 the verify pass and the decode step round differently, so their tokens
may part. Wall times include compilation: a check, not a speed measurement (that is `bench_e2e.py`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import jax
import numpy as np

from ssv_jax.generate import ar_generate
from ssv_jax.generate_cli import load_model, prompts
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import ssv_generate


def main(argv=None) -> dict:
    """Run the check; writes `--out` (JSON) when given and returns the same dict."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="bundle directory (default: the bundled ssv-small)")
    ap.add_argument("--random-preset", default=None, help="no checkpoint: a random preset (tests)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    backend = "kernel" if jax.default_backend() == "gpu" else "reference"
    fixed = SSVPolicy(top_k=a.tree[0], depth=a.tree[1], budget=a.tree[2], order="dfs", backend=backend)
    rows = []
    for dtype in a.dtypes:
        a.dtype, a.seed = dtype, 0
        m, tok, _ = load_model(a)
        (source, ids), = prompts(tok, m.cfg.vocab_size, a.context, 1)
        want = ar_generate((m.cfg, m.params), ids, a.new_tokens).tokens
        for policy in (fixed, "auto"):
            t = time.perf_counter()
            res = ssv_generate(m, ids, max_new_tokens=a.new_tokens, policy=policy)
            rows.append(dict(dtype=dtype, policy=res.stats["policy"], prompt=source, tau=res.stats["tau"],
                             greedy_identical=bool(np.array_equal(res.tokens, want)),
                             wall_s_incl_compile=time.perf_counter() - t))
            print(rows[-1], flush=True)
    code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(device=str(jax.devices()[0]), jax=jax.__version__, code=code, context=a.context,
               new_tokens=a.new_tokens, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
