"""Mode B's cost against mode A (DESIGN.md: mode B has no AR twin, so its cost is reported as the change in
acceptance length and as next-token agreement against mode A). Writes a JSON.

    python scripts/mode_b_agreement.py --checkpoint checkpoints/ssv-small --context 4096 \
        --out docs/results/mode_b_agreement_cpu.json
    python scripts/mode_b_agreement.py --random-preset tiny --context 256 --rounds 4 --out /tmp/mode_b.json

Per held-out prompt and policy, two measurements:
- **Paired, on identical trees** (`analysis.mode_b_agreement`): along mode A's greedy text, each round's tree is
  verified in both modes; the next-token (argmax) agreement over all tree nodes and over the nodes whose argmax
  mode A emits, and the tokens each mode's acceptance takes from the same tree.
- **Free-running**: greedy SSV in mode B against greedy mode A (greedy AR under the same schedule) for the same
  number of tokens: the share of positions where the two texts agree and the first position where they part.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from ssv_jax.analysis import mode_b_agreement
from ssv_jax.generate_cli import add_dtype_arg, load_model, prompts
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import ssv_generate
from ssv_jax.tree import TreeSpec


def free_run(m, prompt, policy: SSVPolicy, reference: np.ndarray) -> dict:
    """Greedy SSV under `policy` for as many tokens as `reference` [1, n] (mode A's text): agreement by position
    and the first position where the texts part (n when they never do)."""
    got = ssv_generate(m, prompt, max_new_tokens=reference.shape[1], policy=policy, prefill_chunk=512).tokens
    same = got[0] == reference[0]
    return dict(tokens=int(same.size), position_agreement=float(same.mean()),
                first_divergence=int(np.argmin(same)) if not same.all() else int(same.size))


def summary(rows: list[dict]) -> dict:
    """Means over every scored round of every prompt (the rounds weigh equally)."""
    cat = {k: np.concatenate([np.ravel(r["paired"][k]) for r in rows]) for k in rows[0]["paired"]}
    return dict(rounds=int(cat["accepted_a"].size), node_agreement=float(cat["node_agreement"].mean()),
                emitted_agreement=float(cat["emitted_agreement"].mean()),
                tau_a=float(cat["accepted_a"].mean()), tau_b=float(cat["accepted_b"].mean()),
                rounds_b_accepts_fewer=int(np.sum(cat["accepted_b"] < cat["accepted_a"])),
                rounds_b_accepts_more=int(np.sum(cat["accepted_b"] > cat["accepted_a"])),
                max_logit_gap_median=float(np.median(cat["max_logit_gap"])),
                free_run_position_agreement=float(np.mean([r["free_run"]["position_agreement"] for r in rows])),
                free_run_first_divergence=[r["free_run"]["first_divergence"] for r in rows])


def main(argv=None) -> dict:
    """Run the measurement; writes `--out` and returns the same dict."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts (random ones without a tokenizer)")
    ap.add_argument("--rounds", type=int, default=16, help="paired rounds scored per prompt and policy")
    ap.add_argument("--trees", default="4,6,32;4,4,16", help="top_k,depth,budget triples separated by ;")
    ap.add_argument("--orders", nargs="+", default=["dfs", "bfs"], choices=["dfs", "bfs"])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4])
    ap.add_argument("--schedules", type=int, nargs="+", default=[1],
                    help="refresh periods P (each shared by both modes)")
    ap.add_argument("--backend", default="reference", choices=["reference", "kernel"])
    ap.add_argument("--out", default="docs/results/mode_b_agreement_cpu.json")
    a = ap.parse_args(argv)
    for flag, v, lo in (("--rounds", a.rounds, 1), ("--prompts", a.prompts, 1), ("--schedules", min(a.schedules), 1)):
        if v < lo:
            ap.error(f"{flag} {v} is invalid; accepted: an integer >= {lo}")
    try:
        trees = TreeSpec.parse_list(a.trees)
    except ValueError as e:
        ap.error(f"--trees: {e}")
    try:
        policies = [SSVPolicy(top_k=t.top_k, depth=t.depth, budget=t.budget, order=o, mode="B", group_size=C,
                              schedule=P, precision="approx", backend=a.backend)
                    for t in trees for o in a.orders for C in a.group_sizes for P in a.schedules]
    except ValueError as e:
        ap.error(str(e))

    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    for p in policies:
        try:
            p.check_for(m.cfg)
        except ValueError as e:
            ap.error(str(e))
    found = prompts(tok, m.cfg.vocab_size, a.context, a.prompts)
    t0 = time.perf_counter()
    results = []
    bar = tqdm(total=len(policies) * len(found), desc="mode B vs A", unit="run")
    for pol in policies:
        rows = []
        for name, ids in found:
            r = mode_b_agreement(m, ids[None], pol, a.rounds)
            reference = r.pop("tokens")
            rows.append(dict(prompt=name, paired={k: np.ravel(v).tolist() for k, v in r.items()},
                             free_run=free_run(m, ids[None], pol, reference)))
            bar.update()
        results.append(dict(policy=pol.to_dict(), describe=pol.describe(), summary=summary(rows), per_prompt=rows))
    bar.close()
    res = dict(benchmark="mode_b_agreement", model=desc, device=jax.devices()[0].device_kind,
               host=platform.machine(), jax=jax.__version__, dtype=str(jax.tree.leaves(m.params)[0].dtype),
               context=a.context, rounds=a.rounds, prompts=[name for name, _ in found], results=results,
               seconds=time.perf_counter() - t0,
               what="paired: each round's tree verified in mode A and mode B along mode A's greedy text "
                    "(analysis.mode_b_agreement); free_run: greedy SSV in mode B against mode A's text")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in results:
        s = r["summary"]
        print(f"{r['describe']}: next-token agreement {s['node_agreement']:.3f} (tree) / "
              f"{s['emitted_agreement']:.3f} (emitted); tau A {s['tau_a']:.2f} B {s['tau_b']:.2f}; free run "
              f"{s['free_run_position_agreement']:.3f}, parts at {s['free_run_first_divergence']}")
    return res


if __name__ == "__main__":
    main()
