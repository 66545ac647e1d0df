"""What a refresh/reuse schedule costs in model quality: each refresh period P against refresh-every-layer, on the
same held-out text. Writes a JSON.

    python scripts/schedule_quality.py --checkpoint checkpoints/ssv-small --seq-len 4096 --windows 8 \
        --out docs/results/schedule_quality_cpu.json
    python scripts/schedule_quality.py --random-preset tiny --seq-len 300 --windows 2 --out /tmp/sq.json

Greedy SSV under a schedule emits greedy AR under that schedule (class `strict`), and a schedule with reuse layers
is another model than refresh-every-layer (class `exact`). This measures how far, teacher-forced on the same text
(`analysis.schedule_agreement`, a full-sequence forward per window): each period's held-out perplexity, and the
share of next-token argmaxes equal to refresh-every-layer's, over all positions and over those where routing
chooses (past the first n * l' tokens, where every query selects every block and all schedules agree).
Windows: `--windows` evenly spaced non-overlapping windows of the held-out test split (random tokens without a
tokenizer).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from ssv_jax import data as D
from ssv_jax import schedule as sched
from ssv_jax.analysis import schedule_agreement
from ssv_jax.generate_cli import add_dtype_arg, load_model


def summarize(per_window: list[list[dict]]) -> list[dict]:
    """Per schedule, over all windows: perplexity, agreement over all and over routed positions, and the first
    schedule's argmax margin (nats) where this schedule's argmax differs, against its quartiles over every routed
    position."""
    routed = np.concatenate([w[0]["margins_routed"] for w in per_window])
    q25, q50 = (float(x) for x in np.percentile(routed, [25, 50])) if routed.size else (None, None)
    rows = []
    for i, first in enumerate(per_window[0]):
        tot = {k: sum(w[i][k] for w in per_window) for k in ("nll_sum", "tokens_scored", "agree", "agree_routed",
                                                             "tokens_routed")}
        changed = np.concatenate([w[i]["margins_changed"] for w in per_window])
        rows.append(dict(schedule=first["schedule"], perplexity=math.exp(tot["nll_sum"] / tot["tokens_scored"]),
                         agreement=tot["agree"] / tot["tokens_scored"],
                         agreement_routed=tot["agree_routed"] / max(tot["tokens_routed"], 1),
                         per_window_agreement_routed=[w[i]["agree_routed"] / max(w[i]["tokens_routed"], 1)
                                                      for w in per_window],
                         margin_changed_median=float(np.median(changed)) if changed.size else None,
                         margin_routed_median=q50, margin_routed_q25=q25,
                         changed_below_routed_q25=float(np.mean(changed < q25)) if changed.size else None, **tot))
    return rows


def main(argv=None) -> dict:
    """Run the measurement; writes `--out` and returns the same dict."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=8, help="evenly spaced held-out windows (0 = all)")
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="refresh periods P; the first is the reference (1 = refresh every layer)")
    ap.add_argument("--out", default="docs/results/schedule_quality_cpu.json")
    a = ap.parse_args(argv)
    if a.windows < 0:
        ap.error(f"--windows {a.windows} is invalid; accepted: an integer >= 0 (0 = all)")
    if min(a.periods) < 1:
        ap.error(f"--periods {a.periods} is invalid; accepted: integers >= 1")

    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    cfg = m.cfg
    try:
        for p in a.periods:
            sched.parse(p, cfg.n_layers)
    except ValueError as e:
        ap.error(f"--periods: {e}")
    if not 2 <= a.seq_len <= cfg.max_seq_len:
        ap.error(f"--seq-len {a.seq_len} is invalid; accepted: an integer in [2, {cfg.max_seq_len}]")
    if tok is not None:
        test = D.tokenize_split(tok, "test")
        try:
            starts, n_all = D.evenly_spaced_windows(test, a.seq_len, a.windows)
        except ValueError as e:
            ap.error(str(e))
        windows = [test.tokens[s:s + a.seq_len].astype(np.int32) for s in starts]
        source = f"held-out test split, {len(starts)} of {n_all} windows"
    else:
        rng = np.random.default_rng(0)
        windows = [rng.integers(0, cfg.vocab_size, a.seq_len, dtype=np.int32) for _ in range(max(a.windows, 1))]
        source = "random tokens"
    schedules = [None if p == 1 else p for p in a.periods]
    t0 = time.perf_counter()
    per_window = [schedule_agreement(m.params, cfg, w[None], schedules)
                  for w in tqdm(windows, desc="schedules", unit="window")]
    rows = summarize(per_window)
    res = dict(benchmark="schedule_quality", model=desc, device=jax.devices()[0].device_kind,
               host=platform.machine(), jax=jax.__version__, dtype=str(jax.tree.leaves(m.params)[0].dtype),
               seq_len=a.seq_len, windows=len(windows), source=source, periods=a.periods,
               routed_from_position=cfg.n_slc * cfg.slc_block, rows=rows, seconds=time.perf_counter() - t0,
               what="teacher-forced next-token argmax agreement with the first period's model, and perplexity, "
                    "per refresh period (analysis.schedule_agreement)")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for p, r in zip(a.periods, rows):
        margin = "" if r["margin_changed_median"] is None else (
            f"; where it differs, P={a.periods[0]}'s margin is {r['margin_changed_median']:.3f} nats (median; "
            f"{r['margin_routed_median']:.3f} over all routed positions)")
        print(f"P={p}: perplexity {r['perplexity']:.2f}, next-token agreement with P={a.periods[0]} "
              f"{r['agreement']:.4f} (routed positions {r['agreement_routed']:.4f}){margin}")
    return res


if __name__ == "__main__":
    main()
