"""Acceptance of the bundled model's head with and without a drafting attention window (issue #8).

    python scripts/draft_window.py --contexts 8192 15712 --windows none 4096 \
        --out docs/results/draft_window_cpu.json

The head was trained on sequences of 4096 tokens, so at longer contexts it attends over distances it never saw.
`DraftConfig.window` limits its attention to the committed slots within `window` positions. For each context and
held-out prompt (`generate_cli.prompts`, the e2e benchmark's prompts) this runs greedy `ssv_generate` with the
fixed e2e policy once per window. Greedy SSV emits the target's own greedy tokens whatever the head does, so the
runs of one prompt decode the same text and only tau (tokens per round) differs: a paired comparison. Runs on
the CPU in fp32 on the jnp reference path by default (`--backend kernel` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from ssv_jax.generate_cli import add_dtype_arg, load_model, prompts
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import ssv_generate


def window_arg(s: str):
    """'none' or a positive integer."""
    if s == "none":
        return None
    if not s.isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"window {s!r} is invalid; accepted: 'none' or an integer >= 1")
    return int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--contexts", type=int, nargs="+", default=[15712])
    ap.add_argument("--windows", type=window_arg, nargs="+", default=[None, 4096])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--backend", default="reference", choices=["reference", "kernel"])
    ap.add_argument("--out", default="draft_window.json")
    a = ap.parse_args(argv)
    m, tok, desc = load_model(argparse.Namespace(random_preset=None, checkpoint=a.checkpoint, seed=0, dtype=a.dtype))
    if m.draft_cfg is None:
        raise SystemExit(f"{desc} has no draft head; accepted: a bundle with an EAGLE-3 head")
    k, d, b = a.tree
    policy = SSVPolicy(top_k=k, depth=d, budget=b, order="dfs", group_size=4, backend=a.backend, schedule=4,
                       precision="strict")
    policy.check_for(m.cfg)
    rows = []
    res = dict(benchmark="draft_window", model=desc, device=jax.devices()[0].device_kind, jax=jax.__version__,
               bundle_window=m.draft_cfg.window, policy=policy.describe(), new_tokens=a.new_tokens, rows=rows,
               command="python scripts/draft_window.py " + " ".join(argv if argv is not None else __import__(
                   "sys").argv[1:]))
    for ctx in a.contexts:
        for name, p in prompts(tok, m.cfg.vocab_size, ctx, a.prompts):
            tokens = None
            for w in a.windows:
                mw = m._replace(draft_cfg=m.draft_cfg.replace(window=w))
                t = time.perf_counter()
                r = ssv_generate(mw, p, max_new_tokens=a.new_tokens, policy=policy)
                same = tokens is None or np.array_equal(tokens, r.tokens)
                tokens = r.tokens if tokens is None else tokens
                rows.append(dict(context=ctx, prompt=name, window=w, tau=r.stats["tau"], rounds=r.stats["rounds"],
                                 same_tokens_as_first_window=bool(same), wall_s=round(time.perf_counter() - t, 1)))
                print(json.dumps(rows[-1]), flush=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    res["summary"] = {f"{ctx}/{w}": float(np.mean([r["tau"] for r in rows if r["context"] == ctx and r["window"] == w]))
                      for ctx in a.contexts for w in a.windows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"]), flush=True)


if __name__ == "__main__":
    main()
