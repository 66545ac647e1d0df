"""Tokens/s implied for `llama31-8b-nsa` by its measured round costs and the bundled model's measured τ.

    python scripts/implied_8b.py --out docs/results/e2e_8b_implied.json

No 8B NSA model is trained here, so its end-to-end speed cannot be measured: this combines three measurements
(issue #8 asks for it, labelled as such). Per context T:
- the H200 cost of one 64-node SSV round on random 8B weights (`verify_8b_h200.json`, and the one-GPU rows of
  `tp_h200x2.json` for contexts the first lacks);
- the H200 AR decode step at T (`ar_8b_h200.json`; null where it was not measured);
- τ of the same tree shape (top-k 8, depth 6, 64 nodes, P=1) on the bundled small model at 8K, from the planner
  profile (`policy_profile.json`): a trained 8B model would accept differently, so the result is an estimate.

implied SSV tokens/s = τ / round time; implied speedup = that / (1 / AR step time).
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")
TREE = dict(top_k=8, depth=6, budget=64)


def _load(results, name):
    path = os.path.join(results, name)
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run the benchmark that writes it first (see docs/RESULTS.md)")
    with open(path) as f:
        return json.load(f)


def implied(results=RESULTS):
    """The implied-speed rows from the committed JSON files in `results`."""
    rounds = {}  # context -> (round ms, source); verify_8b first, one-GPU TP rows fill the gaps
    sources = ["verify_8b_h200.json"] + [n for n in ("tp_h200x2.json",) if os.path.exists(os.path.join(results, n))]
    for name in sources:  # the TP file is optional
        for r in _load(results, name)["rows"]:
            if r["backend"] == "kernel" and r.get("devices", 1) == 1 and r["tree"] == TREE:
                rounds.setdefault(r["context"], (r["round_ms"], name))
    ar = {d["context"]: d["decode_ms_per_token"] for d in _load(results, "ar_8b_h200.json")["decode"]}
    prof = _load(results, "policy_profile.json")
    taus = [(b, r["tau"]) for b, rows in prof["buckets"].items() for r in rows
            if {k: r["policy"][k] for k in TREE} == TREE and r["policy"]["schedule"] == 1]
    if not taus:
        raise SystemExit(f"policy_profile.json has no P=1 row for the tree {TREE}; accepted: profile that tree")
    bucket, tau = max(taus, key=lambda bt: int(bt[0].rstrip("K")))
    rows = []
    for T in sorted(rounds):
        round_ms, src = rounds[T]
        ssv = tau / round_ms * 1e3
        ar_ms = ar.get(T)
        rows.append(dict(context=T, round_ms=round_ms, round_source=src, ar_ms_per_token=ar_ms,
                         implied_ssv_tokens_per_s=ssv, ar_tokens_per_s=None if ar_ms is None else 1e3 / ar_ms,
                         implied_speedup=None if ar_ms is None else ssv * ar_ms / 1e3))
    return dict(benchmark="e2e_8b_implied", label="IMPLIED, not measured end to end: 8B round costs on random "
                "weights x tau of the bundled small model", tree=TREE, tau=tau,
                tau_source=f"policy_profile.json, bucket {bucket}, P=1", rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS, help="folder of the benchmark JSON files")
    ap.add_argument("--out", default=os.path.join(RESULTS, "e2e_8b_implied.json"))
    a = ap.parse_args(argv)
    res = implied(a.results)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"{res['label']} (tau {res['tau']:.2f}, {res['tau_source']})")
    for r in res["rows"]:
        sp = "AR not measured" if r["implied_speedup"] is None else f"x{r['implied_speedup']:.2f} vs AR"
        print(f"{r['context']:7d}  round {r['round_ms']:6.2f} ms  {r['implied_ssv_tokens_per_s']:6.1f} tok/s  {sp}")


if __name__ == "__main__":
    main()
