"""Which source lines the GPU ops of an SSV round come from (GPU capture, then an attribution that runs anywhere).

    python scripts/round_ops.py capture --checkpoint checkpoints/ssv-small --context 8192 --raw-dir $OUT/ops
    python scripts/round_ops.py attribute --raw-dir $OUT/ops --out docs/results/round_ops_8k_h200.json

`capture` (GPU) compiles `_ssv_chunk` of a fixed policy (`--tree`, default 4,6,32; dfs; `--schedule` P, default 4;
strict; kernel) from one held-out prompt's prefilled state, writes the optimized HLO text, runs it once untimed and
once timed, and traces a third call with `jax.profiler`; it writes `hlo.txt` and `trace_ops.json` ({op name: [total
µs, count]} of the first GPU, the rounds run, host ms per round). `attribute` joins each traced op with the HLO
instruction of that name (the trace writes `fusion_12` for `fusion.12`) and its stack frames, and sums ops and µs per
round by the innermost `depth` frames in this repository (function:line), the launch-count map that
`profile_round.py`'s top-op list lacks. The HLO is large (MBs); the JSON keeps the attribution only.

    python scripts/round_ops.py stages docs/results/round_ops_15k_h200.json

`stages` sums an attribution's rows by stage of the round (`STAGES`: drafting, verify attention, verify
projections and norms, per-path blocks, accept and commit, top-n kernels, loop and copies): where the round's
device time goes. `attribute` writes that summary too (`by_stage`).

    python scripts/round_ops.py ceiling --e2e docs/results/e2e_h200.json --context 15712 \
        --ops docs/results/verify_prologue_h200.json --run round_ops/runs/xla \
        --levels docs/results/tree_width_h200.json --profile docs/results/round_vs_ar_16k_h200.json --target 3.5

`ceiling` asks what a speed-up `--target` over AR would take, from measured figures only (`ceiling()`): the e2e
run's AR ms a token, the fixed policy's ms a round and tau; the attribution's drafting device time; and the
wall cost of one more drafted level, from a profile with two depths of the fixed policy's top-k and budget;
optionally (`--profile`) the AR step's and the drafting's GPU busy time traced on one lease by `profile_round.py`.
Without `--ops`, drafting's device time is that profile's draft stage, traced alone rather than inside the round.
With `--e2e-run RUN` the e2e figures come from `runs[RUN]` of a file that gathers several runs (e.g.
`--e2e docs/results/e2e_s42_h200.json --e2e-run 15712`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import time


def _tables(lines):
    """The HLO text's FileNames / FunctionNames / FileLocations / StackFrames tables (ids as written)."""
    files, funcs, locs, frames = {}, {}, {}, {}
    section = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section is None:
            continue
        if not re.match(r"^\d+ ", line):  # a table is a run of numbered lines
            section = None
            continue
        key, rest = line.split(" ", 1)
        key = int(key)
        if section == "FileNames":
            files[key] = rest.strip('"')
        elif section == "FunctionNames":
            funcs[key] = rest.strip('"')
        else:
            d = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
            if section == "FileLocations":
                locs[key] = (d["file_name_id"], d["function_name_id"], d["line"])
            else:  # parent_frame_id is 1-based (0, or absent, at the outermost frame)
                frames[key] = (d["file_location_id"], d.get("parent_frame_id", 0) - 1)
    return files, funcs, locs, frames


def _chain(frame, files, funcs, locs, frames, keep):
    """Innermost-first `module.function:line` of the frames whose file path contains one of `keep`."""
    out, seen = [], set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        loc, parent = frames[frame]
        f, fn, line = locs[loc]
        if any(k in files[f] for k in keep):
            out.append(f"{os.path.basename(files[f]).removesuffix('.py')}.{funcs[fn].split('.')[-1]}:{line}")
        frame = parent
    return out


# Stages of a round, in the order a source chain (`attribute`'s "inner < outer" frames, or a kernel's name) is
# tested against them: the first stage with a matching frame wins, so the head's own projections inside
# `draft_extend` count as committing, and `_common` helpers as the kernel that calls them.
STAGES = (
    ("accept and commit", ("draft.draft_extend", "model.commit_tree", "acceptance.", "cache.", "model.cmp_layer")),
    ("drafting", ("tree.", "draft.", "draft_attention")),
    ("per-path blocks", ("model.path_blocks", "model._path_block_plan")),
    ("verify attention", ("reuse_layer", "refresh_layer", "grouped_verify", "compressed", "groups.", "nsa.",
                          "_common.")),
    ("verify projections and norms", ("fused_gemv", "qkv_prologue", "model.")),  # qkv_prologue: 9deb952 only
)
INNER_STAGES = (  # tested on the innermost frame only, after STAGES
    ("accept and commit", ("speculative.ssv_round",)),  # the round's own acceptance bookkeeping
    # our top-n kernel serves the drafting's selection and the refresh layers' routing under one name; XLA's TopK
    # kernel (the drafting's selection without it) has no source frame
    ("top-n kernels (drafting and routing)", ("top_n", "void stream_executor::cuda::Run<")),
    ("loop and copies", ("speculative.", "Memcpy", "memcpy", "loop_")),
)


def stage_of(source: str) -> str:
    """The stage (`STAGES`, `INNER_STAGES`, else "other") of an attribution row's source."""
    frames = source.split(" < ")
    for name, prefixes in STAGES:
        if any(f.startswith(prefixes) for f in frames):
            return name
    for name, prefixes in INNER_STAGES:
        if frames[0].startswith(prefixes):
            return name
    return "other"


def by_stage(rows) -> list:
    """Ops and µs per round of each stage from `attribute`'s by_source rows, most µs first."""
    acc = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        a = acc[stage_of(r["source"])]
        a[0] += r["ops"]
        a[1] += r["us"]
    ranked = sorted(acc.items(), key=lambda kv: -kv[1][1])
    return [dict(stage=k, ops=round(c, 2), us=round(u, 2)) for k, (c, u) in ranked]


def attribute(hlo_text: str, trace: dict, depth: int = 2, keep=("ssv_jax/", "pallas_kernels/")) -> dict:
    """Ops and µs per round by source chain (innermost `depth` frames); ops whose HLO instruction carries no frame
    in `keep` (library kernels such as XLA's TopK, memcpys) are listed under their own name."""
    lines = hlo_text.splitlines()
    tables = _tables(lines)
    where = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*metadata=\{([^}]*)\}", line)
        if m:
            sf = re.search(r"stack_frame_id=(\d+)", m.group(2))
            op = re.search(r'op_name="([^"]*)"', m.group(2))
            where[m.group(1)] = (_chain(int(sf.group(1)), *tables, keep) if sf else [],
                                 op.group(1).split("/")[-1] if op else "")
    rounds = trace["rounds"]
    by = collections.defaultdict(lambda: [0.0, 0.0, set()])
    for name, (us, count) in trace["ops"].items():
        chain, prim = where.get(re.sub(r"_(\d+)$", r".\1", name), where.get(name, ([], "")))
        key = " < ".join(chain[:depth]) or name[:60]
        row = by[key]
        row[0] += count / rounds
        row[1] += us / rounds
        if prim:
            row[2].add(prim)
    rows = [dict(source=k, ops=round(c, 2), us=round(u, 2), primitives=sorted(p))
            for k, (c, u, p) in sorted(by.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))]
    return dict(rounds=rounds, host_ms_per_round=trace.get("host_ms_per_round"),
                ops_per_round=round(sum(r["ops"] for r in rows), 2), gpu_busy_us_per_round=round(
                    sum(r["us"] for r in rows), 2), by_stage=by_stage(rows), by_source=rows)


def capture(a) -> None:
    """The `capture` subcommand (GPU): compile, time and trace the fixed policy's round (see the module
    docstring)."""
    import jax
    import jax.numpy as jnp

    from ssv_jax import model as M
    from ssv_jax import timing
    from ssv_jax.generate_cli import bench_policy, load_model, prompts
    from ssv_jax.speculative import _ssv_chunk, rounds_tokens

    os.makedirs(a.raw_dir, exist_ok=True)
    m, tok, _ = load_model(argparse.Namespace(random_preset=None, checkpoint=a.checkpoint, seed=0, dtype=a.dtype))
    policy = bench_policy(a.tree, a.schedule)
    name, p = prompts(tok, m.cfg.vocab_size, a.context, 1)[0]
    st0, eos = timing.prefilled_state(m, p, policy, rounds_tokens(a.rounds, policy.depth))
    split = M.split_layers(m.params)
    kw = dict(cfg=m.cfg, dcfg=m.draft_cfg, policy=policy, temperature=0.0, rounds=a.rounds, max_new=1 << 30)
    key = jax.random.key(0)
    with open(os.path.join(a.raw_dir, "hlo.txt"), "w") as f:
        f.write(_ssv_chunk.lower(split, m.draft_params, st0, key, eos, **kw).compile().as_text())

    def run():
        return _ssv_chunk(split, m.draft_params, jax.tree.map(jnp.copy, st0), key, eos, **kw)

    n = int(jax.block_until_ready(run())[2])
    t = time.perf_counter()
    jax.block_until_ready(run())
    host = time.perf_counter() - t
    ops = timing.traced_gpu_ops(run, os.path.join(a.raw_dir, "trace"))
    trace = dict(prompt=name, context=a.context, policy=policy.describe(), rounds=n,
                 host_ms_per_round=host * 1e3 / n, ops=ops[min(ops)] if ops else {})
    with open(os.path.join(a.raw_dir, "trace_ops.json"), "w") as f:
        json.dump(trace, f)
    print(f"{n} rounds, {host * 1e3 / n:.3f} ms/round host, "
          f"{sum(c for _, c in trace['ops'].values()) / max(n, 1):.1f} GPU ops/round")


def attributions(obj, label=""):
    """(label, attribution) of every attribution nested in a JSON object (one with `by_source` rows)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("by_source"), list):
            yield label, obj
            return
        for k, v in obj.items():
            yield from attributions(v, f"{label}/{k}" if label else k)


def stages(paths) -> dict:
    """Print and return {file: {run: by_stage rows}} for the attributions in the given JSON files."""
    out = {}
    for path in paths:
        with open(path) as f:
            runs = list(attributions(json.load(f)))
        if not runs:
            raise SystemExit(f"{path} holds no attribution (an object with by_source rows); accepted: a file that "
                             f"`round_ops.py attribute --out` wrote, or one that nests such runs")
        out[path] = {}
        for label, r in runs:
            rows = by_stage(r["by_source"])
            out[path][label] = rows
            print(f"{path} {label}: {r['ops_per_round']} ops, {r['gpu_busy_us_per_round']} us a round")
            for row in rows:
                print(f"  {row['us']:7.1f} us {row['ops']:6.1f} ops  {row['stage']}")
    return out


def ceiling(ar_ms: float, round_ms: float, tau: float, depth: int, draft_us: float, level_ms: float,
            target: float = 3.5, max_depth: int = 16, device: tuple[float, float] | None = None) -> dict:
    """Speed-ups over AR under two bounds that favour SSV, from measured figures.

    - `verify_as_cheap_as_ar`: the round costs one AR step plus its drafting's device time, nothing else
      (verification, acceptance and commit for free beyond what an AR step costs; drafting without launch gaps);
      `draft_needed_ms` is the drafting time that would reach `target` at the measured tau under that bound.
    - `perfect_head`: every drafted token accepted (tau = depth + 1) at the measured round cost, each extra level
      adding `level_ms`; `perfect_head_depth_needed` is the first depth that reaches `target` (None up to
      `max_depth`).
    - `device_only` (with `device` = (AR step, drafting) GPU busy µs traced on one lease): the first bound in
      device time alone, launch gaps left out on both sides.
    `round_needed_ms` is the round that would reach `target` at the measured tau."""
    for name, v in dict(ar_ms=ar_ms, round_ms=round_ms, tau=tau, draft_us=draft_us, target=target).items():
        if not v > 0:
            raise ValueError(f"{name}={v!r} is invalid; accepted: a number > 0")
    if level_ms < 0 or depth < 1:
        raise ValueError(f"level_ms={level_ms!r} / depth={depth!r} are invalid; accepted: level_ms >= 0, depth >= 1")
    rounds = {d: round_ms + level_ms * (d - depth) for d in range(depth, max_depth + 1)}
    perfect = [dict(depth=d, round_ms=r, speedup=(d + 1) * ar_ms / r) for d, r in rounds.items()]
    out = dict(ar_ms=ar_ms, round_ms=round_ms, tau=tau, depth=depth, draft_us=draft_us, level_ms=level_ms,
               target=target, measured=tau * ar_ms / round_ms, round_needed_ms=tau * ar_ms / target,
               verify_as_cheap_as_ar=tau * ar_ms / (ar_ms + draft_us / 1e3),
               draft_needed_ms=ar_ms * (tau / target - 1), perfect_head=perfect,
               perfect_head_depth_needed=next((p["depth"] for p in perfect if p["speedup"] >= target), None))
    if device is not None:
        ar_us, d_us = device
        if not (ar_us > 0 and d_us > 0):
            raise ValueError(f"device={device!r} is invalid; accepted: (AR step, drafting) GPU busy µs, both > 0")
        out["device_only"] = dict(ar_us=ar_us, draft_us=d_us, speedup=tau * ar_us / (ar_us + d_us))
    return out


def _e2e_figures(path: str, context: int, run: str | None = None) -> dict:
    """AR ms a token, and the fixed policy (its description) with its ms a round, tau and depth, over the prompts of
    an e2e JSON's rows at `context` (decode time over rounds, summed over prompts): its top-level rows, or with
    `run` those of `runs[run]` (a file that gathers several bench_e2e.py runs)."""
    with open(path) as f:
        data = json.load(f)
    if run is not None:
        runs = data.get("runs", {})
        if run not in runs:
            raise SystemExit(f"--e2e-run={run!r} is not a run of {path}; accepted: {sorted(runs)}")
        data = runs[run]
    rows = [r for r in data.get("rows", []) if r.get("context") == context]
    ar, ssv = ([r for r in rows if r["method"] == m] for m in ("ar", "ssv"))
    if not ar or not ssv:
        raise SystemExit(f"{path} has no 'ar' and 'ssv' rows at context {context}; accepted: a bench_e2e.py output "
                         f"that ran both there")
    depths = {int(re.search(r"depth=(\d+)", r["policy"]).group(1)) for r in ssv}
    if len(depths) != 1:
        raise SystemExit(f"{path}: the ssv rows at {context} ran depths {sorted(depths)}; accepted: one fixed policy")
    per = lambda rs: 1e3 * sum(r["decode_s"] for r in rs) / sum(r["rounds"] for r in rs)  # noqa: E731
    return dict(ar_ms=per(ar), round_ms=per(ssv), depth=depths.pop(), policy=data["fixed_policy"],
                tau=sum(r["tau"] * r["rounds"] for r in ssv) / sum(r["rounds"] for r in ssv))


def _level_ms(path: str, policy: str) -> float:
    """Wall ms of one more drafted level: the round-cost slope between the two shallowest depths that a profile
    JSON ran with `policy`'s top-k and budget (and its other settings)."""
    from ssv_jax.policy import SSVPolicy

    any_depth = functools.partial(re.sub, r"depth=\d+", "depth=?")  # a policy description, depth left open
    key = any_depth(policy)
    with open(path) as f:
        rows = [r for rs in json.load(f)["buckets"].values() for r in rs]
    pts = sorted({(r["policy"]["depth"], r["round_ms"]) for r in rows
                  if any_depth(SSVPolicy.from_dict(r["policy"]).describe()) == key})
    if len({d for d, _ in pts}) < 2:
        raise SystemExit(f"{path} has fewer than two depths of {key}; accepted: a profile_policies.py output "
                         f"with two trees that differ in depth alone")
    (d0, r0), (d1, r1) = pts[0], next(p for p in pts if p[0] != pts[0][0])
    return (r1 - r0) / (d1 - d0)


def ceiling_cli(a) -> dict:
    """The `ceiling` subcommand: what a target speed-up over AR would take, from the benchmark files; prints and
    returns the bounds."""
    fig = _e2e_figures(a.e2e, a.context, a.e2e_run)
    policy = fig["policy"]
    device = None
    if a.profile:
        with open(a.profile) as f:
            busy = json.load(f).get("reading", {}).get("gpu_busy_us", {})
        if not {"ar", "draft"} <= set(busy):
            raise SystemExit(f"{a.profile} has no reading.gpu_busy_us with 'ar' and 'draft'; accepted: a "
                             f"profile_round.py output")
        device = (busy["ar"], busy["draft"])
    if a.ops is None:  # drafting's device time from the profile's draft stage traced alone
        if device is None or a.run is not None:
            raise SystemExit("--ops is missing; accepted: --ops FILE --run LABEL (drafting from a round's "
                             "attribution) or --profile FILE alone (drafting from profile_round's draft stage)")
        draft = device[1]
    else:
        with open(a.ops) as f:
            runs = dict(attributions(json.load(f)))
        if a.run not in runs:
            raise SystemExit(f"--run={a.run!r} is not an attribution in {a.ops}; accepted: {sorted(runs)}")
        draft = next(r["us"] for r in by_stage(runs[a.run]["by_source"]) if r["stage"] == "drafting")
    res = ceiling(fig["ar_ms"], fig["round_ms"], fig["tau"], fig["depth"], draft, _level_ms(a.levels, policy),
                  a.target, device=device)
    res["sources"] = dict(e2e=a.e2e, e2e_run=a.e2e_run, context=a.context, ops=a.ops, run=a.run, levels=a.levels,
                          policy=policy, profile=a.profile,
                          drafting="the round's attribution" if a.ops else "the profile's draft stage alone")
    print(f"AR {res['ar_ms']:.4f} ms/token; SSV {res['round_ms']:.4f} ms/round at tau {res['tau']:.2f} "
          f"(depth {res['depth']}): {res['measured']:.2f}x")
    print(f"{a.target}x at tau {res['tau']:.2f} needs a round of {res['round_needed_ms']:.4f} ms")
    print(f"round = one AR step + drafting's {draft:.1f} us of device time: {res['verify_as_cheap_as_ar']:.2f}x; "
          f"{a.target}x would need drafting <= {1e3 * res['draft_needed_ms']:.1f} us")
    print(f"every drafted token accepted, {1e3 * res['level_ms']:.1f} us a level: "
          + ", ".join(f"depth {p['depth']} {p['speedup']:.2f}x" for p in res["perfect_head"][:7])
          + f"; {a.target}x from depth {res['perfect_head_depth_needed']}")
    if device:
        print(f"device time only: AR step {device[0]:.1f} us + drafting {device[1]:.1f} us: "
              f"{res['device_only']['speedup']:.2f}x")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="compile, time and trace the round (GPU)")
    c.add_argument("--checkpoint", default="checkpoints/ssv-small")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--context", type=int, default=8192)
    c.add_argument("--rounds", type=int, default=8)
    c.add_argument("--raw-dir", required=True)
    c.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"),
                   help="the fixed policy's tree (dfs, C=4, kernel backend)")
    c.add_argument("--schedule", type=int, default=4, help="the fixed policy's refresh period P")
    t = sub.add_parser("attribute", help="ops per round by source line, from a capture's files")
    t.add_argument("--raw-dir", required=True, nargs="+", help="one or more capture folders")
    t.add_argument("--depth", type=int, default=2, help="frames of the source chain to group by")
    t.add_argument("--out", default=None)
    g = sub.add_parser("stages", help="ops and µs per round by stage, from attribution JSONs")
    g.add_argument("json", nargs="+", help="files `attribute --out` wrote (or that nest such runs)")
    e = sub.add_parser("ceiling", help="what a target speed-up over AR would take, from measured figures")
    e.add_argument("--e2e", required=True, help="a bench_e2e.py JSON with 'ar' and 'ssv' rows at --context")
    e.add_argument("--context", type=int, required=True)
    e.add_argument("--e2e-run", default=None, help="read the rows of this key under the --e2e file's 'runs' "
                   "(files that gather several runs) instead of its top-level rows")
    e.add_argument("--ops", default=None, help="a JSON holding round attributions (`attribute --out`); without it "
                   "drafting's device time is --profile's draft stage")
    e.add_argument("--run", default=None, help="the attribution's label in --ops, as `stages` prints it")
    e.add_argument("--levels", required=True, help="a profile_policies.py JSON with two depths of the fixed tree")
    e.add_argument("--profile", default=None, help="a profile_round.py JSON: the device-time-only bound from its "
                   "traced AR step and drafting")
    e.add_argument("--target", type=float, default=3.5)
    e.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "stages":
        return stages(a.json)
    if a.cmd == "ceiling":
        res = ceiling_cli(a)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return res
    if a.cmd == "capture":
        if min(a.context, a.rounds, a.schedule, *a.tree) < 1:
            raise SystemExit(f"--context={a.context} / --rounds={a.rounds} / --tree={a.tree} / "
                             f"--schedule={a.schedule} are invalid; accepted: integers >= 1")
        return capture(a)
    if a.depth < 1:
        raise SystemExit(f"--depth={a.depth} is invalid; accepted: an integer >= 1")
    res = {}
    for d in a.raw_dir:
        for f in ("hlo.txt", "trace_ops.json"):
            if not os.path.exists(os.path.join(d, f)):
                raise SystemExit(f"{os.path.join(d, f)} is missing; run `round_ops.py capture --raw-dir {d}` first")
        with open(os.path.join(d, "hlo.txt")) as fh, open(os.path.join(d, "trace_ops.json")) as ft:
            res[os.path.basename(os.path.normpath(d))] = attribute(fh.read(), json.load(ft), a.depth)
    for label, r in res.items():
        print(f"{label}: {r['ops_per_round']} GPU ops / round, {r['gpu_busy_us_per_round']} us busy")
        for row in r["by_source"][:12]:
            print(f"  {row['ops']:6.1f} ops {row['us']:7.1f} us  {row['source']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
