"""Is mode B's slow point in the kernel table (64K, Q=16, gamma=0.75, C<=4) the selection or the context?

    python scripts/probe_mode_b.py --out $OUT/probe_mode_b.json

`bench_kernels.py` builds every (T, Q, gamma) point from seed 0, so its 64K point has one fixed set of R selections.
This probe times grouped B (C = 4 and 8) and grouped A (C = 4) at Q = 16, gamma = 0.75 over several contexts and
several seeds, with the kernel table's timing loop, in an interleaved order (seed 0 at 64K is timed first and again
last). A slow seed at 64K that stays slow elsewhere, or a slow 64K that every seed shares, says which it is.

It also times mode B with two split counts: "C*n" sizes the splits from C * n work items (the default before
session 50, when at C = 4 and 8 each split got one block, since mode B walks only the first query's n blocks) and
"n" from the n blocks mode B walks (the default since). `nsplit` is the split count used; `split_rule` the rule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pallas_kernels import grouped_verify  # noqa: E402
from pallas_kernels._common import split_count  # noqa: E402
from scripts.bench_kernels import Point, gpu_busy, time_loop  # noqa: E402
from ssv_jax.config import get_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[65536, 32768, 131072])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--n", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new points after this long")
    ap.add_argument("--traced", action=argparse.BooleanOptionalAction, default=True,
                    help="also record each row's traced GPU busy µs per call (us_gpu_busy)")
    args = ap.parse_args()
    for name, vals in (("--contexts", args.contexts), ("--seeds", args.seeds)):
        if not vals:
            ap.error(f"{name} needs at least one value")
    cfg = get_config("llama31-8b-nsa")
    plan = [(T, s) for s in args.seeds for T in args.contexts] + [(args.contexts[0], args.seeds[0])]
    res = {"machine": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "scripts/probe_mode_b.py"] + sys.argv[1:]), "Q": 16, "gamma": 0.75,
           "timing": "bench_kernels.time_loop: N calls in one jit over R rotated inputs, minus the empty loop "
                     "timed beside it in each repeat (since session 51; us_loop, us_empty_loop); us_gpu_busy: "
                     "bench_kernels.gpu_busy, the traced GPU busy time of the same loop minus the empty loop's (which "
                     "slices every rotated input since session 52; before, only q); us_gpu_busy_kernel: the same "
                     "trace's time in the Pallas kernels alone",
           "plan": "seeds outer, contexts inner, then the first (context, seed) again", "rows": [], "skipped": []}
    t0 = time.time()
    for T, seed in plan:
        if time.time() - t0 > args.budget_s:
            res["skipped"].append(dict(T=T, seed=seed))
            continue
        p = Point(cfg, T, 16, 0.75, seed=seed)
        static, rot = (p.k, p.v, p.kc, p.vc, p.kv_len), (p.q, p.sel, p.q_pos, p.gates)
        H, n = cfg.n_kv_heads, cfg.n_slc
        for mode, C, rule in (("B", 4, "C*n"), ("B", 4, "n"), ("B", 8, "C*n"), ("B", 8, "n"), ("A", 4, "C*n")):
            ns = split_count(H * (16 // C), (C if rule == "C*n" else 1) * n)

            def fn(q, s, t, g, k, v, kc, vc, kl, mode=mode, C=C, ns=ns):
                return grouped_verify(q, t, k, v, kl, s, cfg, mode=mode, group_size=C, nsplit=ns)
            us, loop, empty = time_loop(fn, static, rot, n=args.n)
            res["rows"].append(dict(T=T, seed=seed, kernel=f"grouped_{mode}", C=C, nsplit=ns, split_rule=rule,
                                    us=round(us, 2), us_loop=round(loop, 2), us_empty_loop=round(empty, 2)))
            busy = gpu_busy(fn, static, rot, n=args.n) if args.traced else None
            if busy is not None:
                res["rows"][-1].update(us_gpu_busy=busy["gpu_busy_us"],
                                       us_gpu_busy_kernel=busy["gpu_busy_nsa_kernel_us"])
            print(f"T={T:6d} seed={seed} grouped_{mode} C={C} nsplit={ns:2d} ({rule}): {us:7.2f} us" + (
                "" if busy is None else f", GPU busy {busy['gpu_busy_us']:6.2f} us "
                                        f"({busy['gpu_busy_nsa_kernel_us']:6.2f} in the Pallas kernels)"), flush=True)
        del p
    res["wall_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} in {res['wall_s']} s")


if __name__ == "__main__":
    main()
