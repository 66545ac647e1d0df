"""End-to-end tokens/s of every method in one harness, on held-out prompts (GPU; runs on CPU at small sizes).

    python scripts/bench_e2e.py --checkpoint checkpoints/ssv-small --contexts 4096 8192 16384 \
        --out docs/results/e2e_h200.json
    python scripts/bench_e2e.py --random-preset tiny --contexts 256 --new-tokens 16 --out /tmp/e2e.json

Methods: AR NSA; naive SD+NSA (per-query kernel, no grouping, no reuse); SSV with a fixed policy (the best
fixed one given, kernel path; `--tree`, and `--schedule`, which the baselines do not take; or, with `--fixed
profile`, the one the planner's profile ranks best over all its buckets, `planner.best_fixed_policy`, whose tree
the baselines then take); SSV with the planner (policy "auto", choosing within the fixed policy's precision class,
or within "strict" with `--fixed profile`, the class that choice is made in); dense EAGLE-3 SD (the same weights
with dense attention). Each method runs once per prompt to compile, then `--reps` times timed (the median run counts);
tokens/s excludes prefill. `planner_gain` in the JSON holds the planner's tokens/s over the fixed policy's per
prompt with its median, mean and range, and the same over the prompts its profile was not measured on
(`disjoint`; a planner row says `profiled` when its prompt shares a file with the profile's prompts of a
context bucket the generation can use).

Round time split (issue #8; off with `--no-split`): after each context's methods, one SSV round of the fixed
policy from the prefilled state of each of the first `--split-prompts` prompts (default 1) is split into draft,
routing, attention (the NSA branches), the rest of the target (projections, MLP, norms, lm_head) and
accept+commit. The split is a model from differences of timed jitted stages and of one layer's refresh vs reuse
attention call (`ssv_jax.timing.SPLIT_METHOD`); the JSON's `split` holds one row per context and prompt, with the
tau of that prompt's "ssv" run, and `split_median` each part's median over a context's rows.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import numpy as np
from tqdm.auto import tqdm

from ssv_jax import model as M
from ssv_jax import speculative, timing
from ssv_jax.generate import ar_generate
from ssv_jax.generate_cli import add_dtype_arg, load_model, prompt_files, prompts
from ssv_jax.planner import (DEFAULT_PROFILE, Planner, ProfileError, best_fixed_policy, bucket_of, check_model,
                             load_profile)
from ssv_jax.policy import SSVPolicy
from ssv_jax.schedule import parse
from ssv_jax.speculative import ssv_generate


def schedule_arg(s: str):
    """--schedule: a refresh period P (an integer) or an R/U string."""
    return int(s) if s.isdigit() else s


def profiled_files(path: str) -> dict:
    """Context bucket -> the held-out files the planner profile at `path` measured that bucket on (key None: a
    prompt recorded without its context); empty when the profile cannot be read."""
    try:
        prof = load_profile(path)
    except ProfileError:
        return {}
    out = {}
    for p in prof.get("prompts", []):
        b, name = (bucket_of(p["context"]), p["file"]) if isinstance(p, dict) else (None, str(p))
        out.setdefault(b, set()).update(prompt_files(name))
    return out


def was_profiled(seen: dict, name: str, context: int, new_tokens: int) -> bool:
    """Whether prompt `name` shares a file with the profile's prompts of a bucket its generation can use: the
    prompt's bucket, or the one its context grows into."""
    buckets = {None, bucket_of(context), bucket_of(context + new_tokens)}
    return bool(set(prompt_files(name)) & set().union(*(seen.get(b, set()) for b in buckets)))


def _spread(g: dict) -> dict:
    v = list(g.values())
    return dict(per_prompt=g, median=float(np.median(v)), mean=float(np.mean(v)), min=min(v), max=max(v))


def planner_gain(rows) -> dict:
    """Per context, the planner's tokens/s over the fixed policy's on each prompt both ran: {context: {per_prompt,
    median, mean, min, max}} (issue #8 asks for the gain's spread, not only its mean). Where some planner rows
    are marked `profiled` (their prompt shares a file with the planner's profile), `disjoint` holds the same
    figures over the other prompts alone, when there are any."""
    tps = {(r["context"], r["prompt"], r["method"]): r["tokens_per_s"] for r in rows}
    profiled = {(r["context"], r["prompt"]) for r in rows if r["method"] == "ssv_planner" and r.get("profiled")}
    out = {}
    for (ctx, name, meth), v in tps.items():
        if meth == "ssv_planner" and (ctx, name, "ssv") in tps:
            out.setdefault(ctx, {})[name] = v / tps[(ctx, name, "ssv")]
    res = {ctx: _spread(g) for ctx, g in out.items()}
    for ctx, g in out.items():
        disjoint = {name: v for name, v in g.items() if (ctx, name) not in profiled}
        if profiled and disjoint:
            res[ctx]["disjoint"] = _spread(disjoint)
    return res


def split_median(split) -> dict:
    """Per context: each time of the split rows (ms), the round included, as its median over the prompts split
    (the parts' medians need not sum to the round's)."""
    out = {}
    for ctx in dict.fromkeys(r["context"] for r in split):
        sel = [r for r in split if r["context"] == ctx]
        out[str(ctx)] = dict(prompts=len(sel), **{k: float(np.median([r[k] for r in sel]))
                                                  for k in timing.SPLIT_PARTS + ("round_ms",)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fixed", choices=["args", "profile"], default="args",
                    help="the fixed policy: from --tree and --schedule (default), or the best fixed policy of the "
                         "--profile (planner.best_fixed_policy: the one whose worst bucket loses least)")
    ap.add_argument("--tree", type=int, nargs=3, default=None, metavar=("TOP_K", "DEPTH", "BUDGET"),
                    help="the fixed policy's tree (default 4 5 16)")
    ap.add_argument("--backend", default="kernel", choices=["kernel", "reference"],
                    help="the SSV attention path (naive SD+NSA always uses the per-query kernel)")
    ap.add_argument("--schedule", type=schedule_arg, default=None,
                    help="the fixed policy's refresh/reuse schedule: a period P or an R/U string (default: refresh "
                         "every layer, precision 'exact'; otherwise 'strict')")
    ap.add_argument("--methods", nargs="+", default=["ar", "naive", "ssv", "ssv_planner", "dense_sd"])
    ap.add_argument("--no-split", action="store_true", help="skip the per-context round time split")
    ap.add_argument("--split-prompts", type=int, default=1,
                    help="split the round from the first N prompts of each context (default 1); the JSON's "
                         "`split_median` holds each part's median over them")
    ap.add_argument("--chunk-rounds", type=int, default=32, help="SSV rounds per jitted call (ssv_generate)")
    ap.add_argument("--chunk-steps", type=int, default=128, help="AR steps per jitted call (ar_generate)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per method and prompt (the median is kept)")
    ap.add_argument("--draft-select", choices=["auto", "reference"], default="auto",
                    help="the draft tree's top-k: the library's choice (speculative.draft_select), or the XLA "
                         "reference (tree.log_softmax_top_k) everywhere, to A/B the selection kernel")
    ap.add_argument("--profile", default=None,
                    help="the planner's ranking JSON (default: the library's, planner.DEFAULT_PROFILE)")
    ap.add_argument("--out", default="docs/results/e2e_h200.json")
    a = ap.parse_args(argv)
    if a.fixed == "profile" and (a.tree is not None or a.schedule is not None):
        raise SystemExit(f"--fixed profile takes the fixed policy from the profile; --tree={a.tree} --schedule="
                         f"{a.schedule} would be ignored; accepted: --fixed args with them, or neither")
    if a.reps < 1:
        raise SystemExit(f"--reps={a.reps} is invalid; accepted: an integer >= 1")
    if not 1 <= a.split_prompts <= a.prompts:
        raise SystemExit(f"--split-prompts={a.split_prompts} is invalid; accepted: an integer in [1, --prompts="
                         f"{a.prompts}]")

    if a.draft_select == "reference":  # before any round is traced: every SSV method drafts with XLA's TopK
        speculative.draft_select = lambda *args, **kw: None
    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0,
                                                 dtype=a.dtype))
    fixed_scores = None
    if a.fixed == "profile":
        try:
            prof = load_profile(a.profile or DEFAULT_PROFILE)
            check_model(prof, m.cfg)
            fixed, fixed_scores = best_fixed_policy(prof, "strict")
        except ProfileError as e:
            raise SystemExit(f"--fixed profile: {e}") from e
        planner_class = "strict"
    else:
        k, d, b = a.tree or (4, 5, 16)
        exact = a.schedule is None or all(parse(a.schedule, m.cfg.n_layers))
        fixed = SSVPolicy(top_k=k, depth=d, budget=b, order="dfs", group_size=4, backend=a.backend,
                          schedule=a.schedule, precision="exact" if exact else "strict")
        planner_class = fixed.precision
    fixed.check_for(m.cfg)
    base = fixed.replace(schedule=None, precision="exact")  # the baselines never reuse a selection
    ssv = lambda p, policy, **kw: ssv_generate(m, p, max_new_tokens=a.new_tokens, policy=policy,
                                               chunk_rounds=a.chunk_rounds, **kw)
    runs = {
        "ar": lambda p: ar_generate((m.cfg, m.params), p, a.new_tokens, chunk_steps=a.chunk_steps),
        "naive": lambda p: ssv(p, base.replace(backend="naive")),
        "ssv": lambda p: ssv(p, fixed),
        # the planner chooses within the fixed policy's precision class, so that both compete on the same terms
        "ssv_planner": lambda p: ssv(p, "auto", planner=Planner.for_policy("auto", m.cfg, precision=planner_class,
                                                                           profile_path=a.profile)),
        "dense_sd": lambda p: ssv(p, base.replace(backend="dense")),
    }
    unknown = sorted(set(a.methods) - set(runs))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; accepted: {sorted(runs)}")
    # the longest prompt that fits the model with the new tokens and the generators' working room (a prefill
    # chunk plus two tree depths); a longer requested context runs at this length and says so
    longest = m.cfg.max_seq_len - a.new_tokens - 512 - 64
    contexts = sorted({min(c, longest) for c in a.contexts})
    if contexts != sorted(set(a.contexts)):
        print(f"contexts {a.contexts} -> {contexts}: the model handles at most {longest} prompt tokens with "
              f"{a.new_tokens} new tokens")
    rows, split = [], []
    seen = profiled_files(a.profile or DEFAULT_PROFILE) if "ssv_planner" in a.methods else {}
    m_dec = None if a.no_split else m._replace(params=M.split_layers(m.params))  # the rounds' weight layout

    def split_row(ctx, name, p):
        """The round time split of the fixed policy from prompt p's prefilled state (ms)."""
        st, eos = timing.prefilled_state(m, p, fixed, a.new_tokens)
        tau = [r["tau"] for r in rows if r["context"] == ctx and r["prompt"] == name and r["method"] == "ssv"]
        row = dict(context=ctx, prompt=name, **timing.ssv_round_split(m_dec, fixed, st, eos),
                   tau=tau[0] if tau else None)
        parts = " + ".join(f"{key[:-3]} {row[key]:.3f}" for key in timing.SPLIT_PARTS)
        note = f"  (negative, kept: {', '.join(row['negative'])})" if row["negative"] else ""
        print(f"{ctx} split ms: {parts} = round {row['round_ms']:.3f}; n_refresh {row['n_refresh']}{note}")
        return row

    def write(done):
        """Summarise the contexts in `done` (the last one possibly part-way) and write the JSON."""
        summary = {}
        for ctx in done:
            ar = np.mean([r["tokens_per_s"] for r in rows if r["context"] == ctx and r["method"] == "ar"] or [np.nan])
            for meth in a.methods:
                sel = [r for r in rows if r["context"] == ctx and r["method"] == meth]
                v = np.mean([r["tokens_per_s"] for r in sel])
                summary[f"{ctx}/{meth}"] = dict(tokens_per_s=float(v), speedup_vs_ar=float(v / ar),
                                                tau=float(np.mean([r["tau"] for r in sel])))
        res = dict(benchmark="e2e", model=desc, device=jax.devices()[0].device_kind, host=platform.node(),
                   jax=jax.__version__, dtype=str(jax.tree.leaves(m.params)[0].dtype),
                   draft_window=m.draft_cfg.window if m.draft_cfg is not None else None,
                   new_tokens=a.new_tokens, fixed_policy=fixed.describe(), fixed_from_profile=fixed_scores,
                   contexts=done,
                   chunk_rounds=a.chunk_rounds, chunk_steps=a.chunk_steps, draft_select=a.draft_select,
                   planner_profile=a.profile or DEFAULT_PROFILE,
                   rows=rows, summary=summary, planner_gain=planner_gain(rows),
                   timing=f"host wall clock of the decode loop after a compile run, the median of {a.reps} runs; "
                          "prefill excluded")
        if not a.no_split:
            res.update(split=split, split_median=split_median(split), split_timing=timing.SPLIT_METHOD)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        return summary

    for i, ctx in enumerate(contexts):
        ps = prompts(tok, m.cfg.vocab_size, ctx, a.prompts)
        for name, p in ps:
            for meth in tqdm(a.methods, desc=f"{ctx} {name}", unit="method"):
                runs[meth](p)  # compile
                timed = sorted((runs[meth](p) for _ in range(a.reps)), key=lambda r: r.stats["tokens_per_s"])
                s = timed[len(timed) // 2].stats  # the median run
                rows.append(dict(context=ctx, prompt=name, method=meth, tokens_per_s=s["tokens_per_s"],
                                 tau=s.get("tau", 1.0), rounds=s.get("rounds", s.get("steps")),
                                 decode_s=s["decode_s"], prefill_s=s["prefill_s"], policy=s.get("policy"),
                                 switches=len(s.get("switches", [])), switch_log=s.get("switches", []),
                                 # SSV: each chunk's policy, rounds, tau and host seconds; the planner's host µs
                                 # per chunk
                                 chunks=[dict(policy=c["policy"], rounds=c["rounds"], tau=c["tau"],
                                              seconds=c["seconds"]) for c in s.get("policy_trace", [])],
                                 planner_us_per_chunk=s.get("planner_us_per_chunk"),
                                 # the planner's prompt shares a file with its profile's (not a held-out test)
                                 **(dict(profiled=was_profiled(seen, name, ctx, a.new_tokens))
                                    if meth == "ssv_planner" else {})))
            summary = write(contexts[: i + 1])  # after each prompt, so that a run cut off keeps its prompts
        if not a.no_split:
            split.extend(split_row(ctx, *named) for named in ps[: a.split_prompts])
        summary = write(contexts[: i + 1])
    for key, v in summary.items():
        print(f"{key:28s} {v['tokens_per_s']:9.1f} tok/s  x{v['speedup_vs_ar']:.2f} vs AR  tau {v['tau']:.2f}")
    for ctx, med in ({} if a.no_split or a.split_prompts == 1 else split_median(split)).items():
        parts = " + ".join(f"{key[:-3]} {med[key]:.3f}" for key in timing.SPLIT_PARTS)
        print(f"{ctx} split ms, median over {med['prompts']} prompts: {parts}; round {med['round_ms']:.3f}")
    for ctx, g in planner_gain(rows).items():
        for label, h in (("", g), (" (prompts the profile did not use)", g.get("disjoint"))):
            if h:
                print(f"{ctx} planner / fixed policy per prompt{label}: median {h['median']:.3f}, mean "
                      f"{h['mean']:.3f}, range {h['min']:.3f}-{h['max']:.3f} over {len(h['per_prompt'])} prompts")


if __name__ == "__main__":
    main()
