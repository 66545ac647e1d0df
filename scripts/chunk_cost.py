"""What one jitted chunk of SSV rounds costs: per round, and per call (GPU; runs on CPU at small sizes).

    python scripts/chunk_cost.py --checkpoint checkpoints/ssv-small --dtype bfloat16 --context 15712 \
        --out $OUT/chunk_cost.json
    python scripts/chunk_cost.py --random-preset tiny --context 256 --tree 2 2 4 --schedule 2 \
        --backend reference --rounds 1 2 --out /tmp/chunk_cost.json

`ssv_generate` runs its rounds in chunks (`_ssv_chunk`, one jitted while_loop each). Between chunks the host reads
the results and runs the planner. From one held-out prompt's prefilled state, this times one chunk of each of
`--rounds` rounds of the fixed policy (`timing.chunk_ms_per_round`: the median of `--reps` calls after a compile
call, each on a fresh copy of the donated state). It then fits ms = per_call + rounds * per_round by least
squares. `null_ms` times a jitted function of the same arguments that returns at once: what handing the weights
and the state to a call costs. `bench_e2e.py`'s `chunks` rows give the same split from whole generations.

`chained` rows dispatch `--chain` chunks back to back, each on the previous one's state, with one sync at the end:
if the per-call cost is host work that the GPU's rounds can hide, a chained chunk costs about its rounds alone.
`dispatch_ms` is how long a call takes to return to Python (no sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import model as M
from ssv_jax import timing
from ssv_jax.generate_cli import add_dtype_arg, bench_policy, load_model, prompts
from ssv_jax.speculative import _ssv_chunk, rounds_tokens


def chained_ms(run, st0, n: int, reps: int) -> tuple[float, float]:
    """(median ms per chunk, median ms for a call to return) of `n` chunks `run` dispatched back to back from a
    fresh copy of `st0`, each on the previous one's (donated) state, synchronised once at the end."""
    per_chunk, dispatch = [], []
    for _ in range(reps):
        s = jax.tree.map(jnp.copy, st0)
        jax.block_until_ready(s)
        ran = []
        t = time.perf_counter()
        for _ in range(n):
            td = time.perf_counter()
            s, _, r = run(s)
            dispatch.append((time.perf_counter() - td) * 1e3)
            ran.append(r)
        jax.block_until_ready(s)
        per_chunk.append((time.perf_counter() - t) * 1e3 / n)
        if len(set(int(r) for r in ran)) != 1:
            raise SystemExit(f"chained chunks ran {[int(r) for r in ran]} rounds: the state finished early; "
                             "accepted: a live state")
        del s
    return statistics.median(per_chunk), statistics.median(dispatch)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--context", type=int, default=15712)
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--schedule", type=int, default=4, help="the fixed policy's refresh period P")
    ap.add_argument("--backend", default="kernel", choices=["kernel", "reference"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chain", type=int, default=4,
                    help="chunks dispatched back to back per chained row (rows with rounds * chain <= max(--rounds))")
    ap.add_argument("--out", default="chunk_cost.json")
    a = ap.parse_args(argv)
    if len(set(a.rounds)) < 2 or min(a.rounds) < 1:
        raise SystemExit(f"--rounds {a.rounds} is invalid; accepted: at least two distinct integers >= 1")
    if a.reps < 1:
        raise SystemExit(f"--reps={a.reps} is invalid; accepted: an integer >= 1")
    if a.chain < 2:
        raise SystemExit(f"--chain={a.chain} is invalid; accepted: an integer >= 2")
    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    d = a.tree[1]
    policy = bench_policy(a.tree, a.schedule, a.backend)
    name, p = prompts(tok, m.cfg.vocab_size, a.context, 1)[0]
    st0, eos = timing.prefilled_state(m, p, policy, rounds_tokens(max(a.rounds), d))
    split = M.split_layers(m.params)  # the rounds' weight layout, as in ssv_generate
    key = jax.random.key(0)

    def chunk(rounds):
        return lambda s: _ssv_chunk(split, m.draft_params, s, key, eos, cfg=m.cfg, dcfg=m.draft_cfg, policy=policy,
                                    temperature=0.0, rounds=rounds, max_new=1 << 30)

    rows = []
    for r in sorted(set(a.rounds)):
        run = chunk(r)
        ran = int(jax.block_until_ready(run(jax.tree.map(jnp.copy, st0)))[2])  # compiles
        if ran != r:
            raise SystemExit(f"a chunk of {r} rounds ran {ran}: the state finished early; accepted: a live state")
        ms = timing.chunk_ms_per_round(run, st0, a.reps, warmup=False) * r
        rows.append(dict(rounds=r, ms=ms))
        print(f"{r:3d} rounds: {ms:8.3f} ms a call", flush=True)
    n = np.array([row["rounds"] for row in rows], float)
    (per_call, per_round), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), [row["ms"] for row in rows],
                                                rcond=None)
    null = jax.jit(lambda params, dparams, st, key, eos: st.n_out + 1)
    null_ms = timing.host_time(null, split, m.draft_params, st0, key, eos, reps=a.reps)
    n_args = len(jax.tree.leaves((split, m.draft_params, st0, key, eos)))
    print(f"fit: {per_call:.3f} ms a call + {per_round:.3f} ms a round; a null call with the same {n_args} "
          f"arguments: {null_ms:.3f} ms")
    chained = []
    for r in sorted(r for r in set(a.rounds) if r * a.chain <= max(a.rounds)):
        per_chunk, dispatch = chained_ms(chunk(r), st0, a.chain, a.reps)
        chained.append(dict(rounds=r, chain=a.chain, ms_per_chunk=per_chunk, dispatch_ms=dispatch))
        print(f"{r:3d} rounds, {a.chain} chained: {per_chunk:8.3f} ms a chunk (a call returns in {dispatch:.3f} ms)",
              flush=True)
    res = dict(benchmark="chunk_cost", model=desc, device=jax.devices()[0].device_kind, jax=jax.__version__,
               context=a.context, prompt=name, policy=policy.describe(), reps=a.reps, rows=rows,
               fit=dict(per_call_ms=float(per_call), per_round_ms=float(per_round)), null_ms=null_ms,
               argument_buffers=n_args, chained=chained,
               method="host wall clock of one synchronised _ssv_chunk call per row (median of reps, fresh state "
                      "copy each), least-squares fit ms = per_call + rounds * per_round; null = a jitted function "
                      "of the same arguments returning at once; chained = `chain` calls back to back, each on the "
                      "previous call's state, one sync at the end (median of reps per chunk)")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
