"""Offline profiler for the planner: run candidate SSV policies on representative prompts per context bucket and
write the versioned ranking JSON that `policy="auto"` reads (DESIGN.md, "Planner").

    python scripts/profile_policies.py --checkpoint checkpoints/ssv-small --contexts 8192 15712 --out my_profile.json
    python scripts/profile_policies.py --random-preset tiny --contexts 256 --new-tokens 24 --out /tmp/prof.json
    python scripts/profile_policies.py --show docs/results/policy_profile_s45_h200.json
    python scripts/profile_policies.py --merge docs/results/policy_profile_16k_s42_h200.json \
        docs/results/policy_profile_8k_s45_h200.json --out merged.json

Each policy runs once per prompt to compile, then `--reps` times timed; the median run counts (a single timed run
once ran hundreds of times slower on the H200, docs/results/policy_profile.json). tokens/s counts the emitted
tokens over the decode time (prefill excluded); round_ms is the decode time per round. The summary printed at the
end (or by `--show` for existing files) says, per bucket, how clearly the first policy leads the runner-up: when
some prompt favours the runner-up, the prompts profiled do not settle the bucket's choice.

`--merge` joins profiles of one card and model that cover different buckets (contexts profiled in separate
calls) into one file (`planner.merge_profiles`); `FILE:16K` takes only that file's 16K bucket (several:
`FILE:8K,16K`). It runs nothing.

With a tokenizer, the prompts are held-out text only: the files long enough alone, then windows of shorter files
packed as in training (`generate_cli.prompts`). Where fewer than `--prompts` exist, the context is profiled on
those alone (a random-token prompt accepts little with every tree and so favours the cheapest round;
docs/DESIGN_NOTES.md, "The planner's profile"). `--random-fill` tops them up with random tokens
instead. Without a tokenizer (`--random-preset`) every prompt is random tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import re

import jax
import numpy as np
from tqdm.auto import tqdm

from ssv_jax.generate_cli import add_dtype_arg, load_model, prompts
from ssv_jax.planner import (BUCKET_KEYS, DEFAULT_PROFILE, ProfileError, bucket_lead, bucket_of, load_profile,
                             merge_profiles, save_profile)
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import ssv_generate
from ssv_jax.tree import TreeSpec


def candidate_policies(trees, orders, modes, group_sizes, schedules, backend) -> list[SSVPolicy]:
    """The cross product of the given options, in the weakest precision class each allows."""
    out = []
    for (k, d, b), order, mode, C, P in itertools.product(trees, orders, modes, group_sizes, schedules):
        precision = "approx" if mode == "B" else ("exact" if P == 1 else "strict")
        try:
            p = SSVPolicy(top_k=k, depth=d, budget=b, order=order, mode=mode, group_size=C, schedule=P,
                          precision=precision, backend=backend)
        except ValueError as e:
            print(f"skipping an invalid combination: {e}")
            continue
        if backend == "kernel" and b % C:
            continue
        out.append(p)
    return out


def text_prompts(tok, vocab_size: int, context: int, count: int, skip: int) -> list:
    """Up to `count` held-out prompts of `context` tokens, files then packed windows (`prompts(..., fill=False)`:
    no random-token fill-ins). Raises SystemExit when there is none."""
    text = prompts(tok, vocab_size, context, count, skip=skip, fill=False)
    if not text:
        raise SystemExit(f"no held-out prompt of {context} tokens is left after skipping {skip}; accepted: a "
                         f"smaller --skip-prompts or context, or --random-fill to profile on random tokens")
    if len(text) < count:
        print(f"profiling {context} on {len(text)} held-out prompt(s) alone (--random-fill adds random tokens)")
    return text


def summary(prof: dict) -> list[str]:
    """A profile's ranking in a few lines: per bucket, the first policy and how clearly it leads the runner-up
    (`planner.bucket_lead`)."""
    lines = []
    for b, rows in prof["buckets"].items():
        best = rows[0]
        lines.append(f"{b}: best {SSVPolicy.from_dict(best['policy']).describe()}  {best['tokens_per_s']:.1f} tok/s  "
                     f"tau {best['tau']:.2f}")
        lead = bucket_lead(rows)
        if lead:
            per = lead["per_prompt"]
            lines.append(f"    runner-up {SSVPolicy.from_dict(lead['runner_up']).describe()} at {lead['ratio']:.3f} "
                         f"of it, {min(per):.3f}-{max(per):.3f} per prompt"
                         + ("" if lead["clear"] else ": some prompt favours the runner-up, so these prompts do not "
                                                     "settle which of the two is best"))
    return lines


def merge_sources(args: list) -> list:
    """`--merge` arguments -> `planner.merge_profiles` sources: "FILE" takes every bucket of FILE, "FILE:8K,16K"
    the buckets named. Raises `ProfileError` for an unreadable file or a bucket key that no profile can hold."""
    out = []
    for arg in args:
        path, sel = arg, None
        head, _, tail = arg.rpartition(":")
        if head and re.fullmatch(r">?\d+K(,>?\d+K)*", tail):  # a bucket selector
            sel = tail.split(",")
            bad = [k for k in sel if k not in BUCKET_KEYS]
            if bad:
                raise ProfileError(f"--merge {arg}: bucket {bad[0]!r} is invalid; accepted: {list(BUCKET_KEYS)}")
            path = head
        out.append((path, load_profile(path), sel))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--skip-prompts", type=int, default=0,
                    help="pass over the first N held-out prompts of each context (bench_e2e.py --prompts N takes "
                         "those), so the profile and the benchmark use different prompts")
    ap.add_argument("--random-fill", action="store_true",
                    help="top up with random-token prompts where too few held-out prompts exist")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per policy and prompt (the median counts)")
    ap.add_argument("--trees", default="1,4,5;4,4,16;4,6,32", help="top_k,depth,budget triples separated by ;")
    ap.add_argument("--orders", nargs="+", default=["dfs"])
    ap.add_argument("--modes", nargs="+", default=["A"])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4])
    ap.add_argument("--schedules", type=int, nargs="+", default=[1])
    ap.add_argument("--backend", default="reference", choices=["reference", "kernel"])
    ap.add_argument("--out", default=DEFAULT_PROFILE, help="where the ranking JSON goes (default: the one "
                    "policy=\"auto\" reads, planner.DEFAULT_PROFILE)")
    only = ap.add_mutually_exclusive_group()  # each reads files, writes or prints, and exits
    only.add_argument("--show", nargs="+", metavar="PROFILE",
                    help="print the summary of existing profile files (the first policy of each bucket and how "
                         "clearly it leads the runner-up) and exit; runs nothing")
    only.add_argument("--merge", nargs="+", metavar="FILE[:BUCKETS]",
                    help="write one profile (--out) from the buckets of profiles of one card and model, and exit; "
                         "FILE:16K takes only that bucket of FILE (FILE:8K,16K several); runs nothing")
    a = ap.parse_args(argv)
    if a.merge:
        try:
            prof = merge_profiles(merge_sources(a.merge))
        except ProfileError as e:
            raise SystemExit(str(e)) from e
        with open(a.out, "w") as f:
            json.dump(prof, f, indent=2)
        print(f"{a.out}: buckets {list(prof['buckets'])} from {len(a.merge)} profile(s)")
        print("\n".join(summary(prof)))
        return
    if a.show:
        for path in a.show:
            try:
                prof = load_profile(path)
            except ProfileError as e:
                raise SystemExit(str(e)) from e
            print(f"{path} ({prof['hardware']}, prompts: {len(prof['prompts'])})")
            print("\n".join(summary(prof)))
        return
    if a.reps < 1:
        ap.error(f"--reps {a.reps} is invalid; accepted: an integer >= 1")
    if a.skip_prompts < 0:
        ap.error(f"--skip-prompts {a.skip_prompts} is invalid; accepted: an integer >= 0")

    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    try:
        trees = [(t.top_k, t.depth, t.budget) for t in TreeSpec.parse_list(a.trees)]
    except ValueError as e:
        ap.error(f"--trees: {e}")
    cands = candidate_policies(trees, a.orders, a.modes, a.group_sizes, a.schedules, a.backend)
    per_bucket, used = {}, []  # per_bucket: bucket -> policy index -> measurements over its contexts
    hw = f"{jax.devices()[0].device_kind} ({platform.machine()}, jax {jax.__version__})"
    by_context = {}  # every context's prompts before any profiling, so a missing one fails at once
    for ctx in a.contexts:
        by_context[ctx] = (prompts(tok, m.cfg.vocab_size, ctx, a.prompts, skip=a.skip_prompts)
                           if tok is None or a.random_fill
                           else text_prompts(tok, m.cfg.vocab_size, ctx, a.prompts, a.skip_prompts))
    for ctx, found in by_context.items():
        used.extend(dict(context=ctx, file=name) for name, _ in found)
        ctx_prompts = [ids for _, ids in found]
        meas = per_bucket.setdefault(bucket_of(ctx), {})
        for i, pol in enumerate(tqdm(cands, desc=f"profile {ctx}", unit="policy")):
            tps, taus, round_ms = meas.setdefault(i, ([], [], []))
            for p in ctx_prompts:
                kw = dict(max_new_tokens=a.new_tokens, policy=pol, prefill_chunk=512)
                ssv_generate(m, p, **kw)  # compile
                runs = sorted((ssv_generate(m, p, **kw) for _ in range(a.reps)),
                              key=lambda r: r.stats["tokens_per_s"])
                r = runs[len(runs) // 2]  # the median run (greedy: every run emits the same tokens)
                tps.append(r.stats["tokens_per_s"])
                taus.append(r.stats["tau"])
                round_ms.append(1e3 * r.stats["decode_s"] / max(r.stats["rounds"], 1))
        # written after every context, so a run cut short keeps the contexts it finished
        buckets = {b: [dict(policy=cands[i].to_dict(), tokens_per_s=float(np.mean(t)), tau=float(np.mean(u)),
                            verify_ms=float(np.mean(r)), round_ms=float(np.mean(r)), runs=len(t),
                            per_prompt_tokens_per_s=[float(x) for x in t], per_prompt_tau=[float(x) for x in u])
                       for i, (t, u, r) in meas.items()] for b, meas in per_bucket.items()}
        prof = save_profile(a.out, buckets, hardware=hw, model=m.cfg.name, prompts=used,
                            extra=dict(model_source=desc, new_tokens=a.new_tokens, reps=a.reps,
                                       skip_prompts=a.skip_prompts, random_fill=a.random_fill,
                                       note="verify_ms is the whole round time (draft + verify + commit)"))
    print("\n".join(summary(prof)))


if __name__ == "__main__":
    main()
