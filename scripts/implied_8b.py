"""Tokens/s implied for `llama31-8b-nsa` by its measured round costs and the bundled model's measured τ.

    python scripts/implied_8b.py --out docs/results/e2e_8b_implied.json

No 8B NSA model is trained here, so its end-to-end speed cannot be measured: this combines three measurements
(issue #8 asks for it, labelled as such). For each configuration (tree, refresh period P, draft vocabulary, draft
window) that `bench_verify.py` timed, and each context T:
- the H200 cost of one SSV round on random 8B weights (`verify_8b_h200.json`, and the one-GPU rows of
  `tp_h200x2.json` for contexts the first lacks);
- the H200 AR decode step at T (`ar_8b_h200.json`; null where it was not measured);
- τ of the same tree and P on the bundled small model, from the planner profile (`policy_profile.json`, its
  largest context bucket; the mean over its held-out text prompts, leaving out random-token fill-ins): a trained
  8B model would accept differently, so the result is an estimate.
  A configuration the profile has no τ for is listed under `no_tau`.

implied SSV tokens/s = τ / round time; implied speedup = that / (1 / AR step time).
"""

from __future__ import annotations

import argparse
import json
import os

from ssv_jax.generate_cli import RANDOM_PROMPT
from ssv_jax.planner import bucket_of

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")
TREE_KEYS = ("top_k", "depth", "budget")
TARGET_VOCAB = 128256  # llama31-8b-nsa: rows written before `draft_vocab` was recorded used the whole vocabulary


def _load(results, name):
    path = os.path.join(results, name)
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run the benchmark that writes it first (see docs/RESULTS.md)")
    with open(path) as f:
        return json.load(f)


def _config(r) -> tuple:
    """(top_k, depth, budget, P, draft vocabulary, draft window or None) of a round row (rows written before
    `draft_window` was recorded had none)."""
    return tuple(r["tree"][k] for k in TREE_KEYS) + (r.get("schedule", 1), r.get("draft_vocab", TARGET_VOCAB),
                                                     r.get("draft_window"))


def _text_tau(profile: dict, bucket: str, row: dict) -> tuple[float, list]:
    """(τ, prompts) of a profile row over its held-out text prompts. `profile_policies.py` fills a context's
    missing prompts with random tokens; where the row records per-prompt τ (in the order of the bucket's
    `prompts`), those are left out. Older rows have only the mean, over all their prompts."""
    names = [p["file"] for p in profile.get("prompts", []) if bucket_of(p["context"]) == bucket]
    per = row.get("per_prompt_tau")
    if per is None or len(per) != len(names):
        return row["tau"], names
    text = [(n, t) for n, t in zip(names, per) if n != RANDOM_PROMPT]
    return (sum(t for _, t in text) / len(text), [n for n, _ in text]) if text else (row["tau"], names)


def _tau(profile: dict, top_k: int, depth: int, budget: int, P: int):
    """(τ, bucket, prompts) of that tree and P in the profile's largest bucket that has it, or None."""
    found = [(int(b.rstrip("K")), b, r) for b, rows in profile["buckets"].items() for r in rows
             if tuple(r["policy"][k] for k in TREE_KEYS) == (top_k, depth, budget)
             and (r["policy"].get("schedule") or 1) == P]
    if not found:
        return None
    _, bucket, row = max(found, key=lambda f: f[0])
    tau, prompts = _text_tau(profile, bucket, row)
    return tau, bucket, prompts


def implied(results=RESULTS):
    """The implied-speed rows from the committed JSON files in `results`."""
    rounds = {}  # config -> context -> (round ms, source, code); verify_8b first, one-GPU TP rows fill the gaps
    sources = ["verify_8b_h200.json"] + [n for n in ("tp_h200x2.json",) if os.path.exists(os.path.join(results, n))]
    for name in sources:  # the TP file is optional
        for r in _load(results, name)["rows"]:
            if r["backend"] == "kernel" and r.get("devices", 1) == 1:
                rounds.setdefault(_config(r), {}).setdefault(r["context"], (r["round_ms"], name, r.get("code")))
    ar = {d["context"]: d["decode_ms_per_token"] for d in _load(results, "ar_8b_h200.json")["decode"]}
    prof = _load(results, "policy_profile.json")
    rows, no_tau = [], []
    for cfg in sorted(rounds, key=lambda c: c[:-1] + (c[-1] or 0,)):  # no window sorts first
        k, d, n, P, vocab, window = cfg
        found = _tau(prof, k, d, n, P)
        if found is None:
            no_tau.append(dict(tree=dict(top_k=k, depth=d, budget=n), schedule=P, draft_vocab=vocab,
                               draft_window=window))
            continue
        tau, bucket, tau_prompts = found
        for T in sorted(rounds[cfg]):
            round_ms, src, code = rounds[cfg][T]
            ssv = tau / round_ms * 1e3
            ar_ms = ar.get(T)
            rows.append(dict(tree=dict(top_k=k, depth=d, budget=n), schedule=P, draft_vocab=vocab,
                             draft_window=window, context=T,
                             tau=tau, tau_source=f"policy_profile.json, bucket {bucket}, P={P}",
                             tau_prompts=tau_prompts, round_ms=round_ms,
                             round_source=src, round_code=code, ar_ms_per_token=ar_ms, implied_ssv_tokens_per_s=ssv,
                             ar_tokens_per_s=None if ar_ms is None else 1e3 / ar_ms,
                             implied_speedup=None if ar_ms is None else ssv * ar_ms / 1e3))
    if not rows:
        raise SystemExit("no measured round has a tau in policy_profile.json (same tree and P); accepted: profile "
                         f"one of {[dict(zip(TREE_KEYS + ('schedule',), c[:4])) for c in sorted(rounds)]}")
    with_ar = [r for r in rows if r["implied_speedup"] is not None]
    best = {T: max((r for r in with_ar if r["context"] == T), key=lambda r: r["implied_speedup"])
            for T in sorted({r["context"] for r in with_ar})}
    return dict(benchmark="e2e_8b_implied", label="IMPLIED, not measured end to end: 8B round costs on random "
                "weights x tau of the bundled small model", rows=rows, best_per_context=best, no_tau=no_tau)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS, help="folder of the benchmark JSON files")
    ap.add_argument("--out", default=os.path.join(RESULTS, "e2e_8b_implied.json"))
    a = ap.parse_args(argv)
    res = implied(a.results)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(res["label"])
    for r in res["rows"]:
        t = r["tree"]
        sp = "AR not measured" if r["implied_speedup"] is None else f"x{r['implied_speedup']:.2f} vs AR"
        print(f"tree {t['top_k']},{t['depth']},{t['budget']} P={r['schedule']} Vd={r['draft_vocab']:6d} "
              f"window {r['draft_window'] or 'none':>5} "
              f"{r['context']:7d}  tau {r['tau']:.2f}  round {r['round_ms']:6.2f} ms  "
              f"{r['implied_ssv_tokens_per_s']:6.1f} tok/s  {sp}")
    for c in res["no_tau"]:
        print(f"no tau in the profile for {c}")


if __name__ == "__main__":
    main()
