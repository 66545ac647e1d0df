"""Verification-round and refresh/reuse-schedule costs at the 8B benchmark shape (GPU).

    python scripts/bench_verify.py --out-verify $OUT/verify_8b_h200.json --out-schedule $OUT/schedule_8b_h200.json

Random bf16 target and EAGLE-3 head weights (never zeros), and random committed caches of T tokens (the cost of a
round does not depend on the cache's values, only on T, so no 64K prefill is needed). Measures:
- verify: one SSV round at each T on the reference (jnp) and kernel (Pallas) paths, split into draft / verify /
  accept+commit (draft-only, draft+verify and whole-round jitted functions; the stages are their differences);
- schedule: for each refresh period P, the whole verify forward (projections and MLP included) and the NSA
  attention time of one round summed over layers (per-layer refresh and reuse attention timed N times inside one
  jit over rotated inputs, then n_R * t_R + n_U * t_U).

Verify rows: one per (tree in `--trees`, refresh period in `--verify-schedules`, context, backend); P=1 runs in the
precision class "exact", P>1 in "strict". `--draft-vocab 32000` gives the head the draft vocabulary of the published
EAGLE-3 heads for LLaMA-3.1-8B (SpecForge's llama3-8B-eagle3.json: 32,000 of the 128,256 ids); the default is the
target's whole vocabulary. `--draft-window 4096` has the head attend its last 4096 slots, as the bundled head
does. `--no-split` times only the whole rounds (one compile per row instead of three).

Tensor parallelism (issue #9): `--mesh-sizes 1 2 --contexts 65536 131072 --backends kernel --skip-schedule` times
the rounds on one device and on a 2-device "tp" mesh (target params and caches split over KV heads, the draft
replicated; set NCCL_NVLS_ENABLE=0); each row records its `devices`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from ssv_jax import cache as kvc
from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax import schedule as sched
from ssv_jax import sharding
from ssv_jax.config import get_config
from ssv_jax.policy import SSVPolicy, attention_for
from ssv_jax.speculative import RoundState, SSVModel, _ssv_chunk, ssv_round
from ssv_jax.timing import chunk_ms_per_round, host_time, op_summary, traced_gpu_ops
from ssv_jax.tree import TreeSpec


def round_state(tc, dc, hidden: int):
    """A RoundState over random caches: a fixed root token and random target features."""
    return RoundState(tc, dc, jnp.array([17], jnp.int32),
                      jax.random.normal(jax.random.key(4), (1, hidden), jnp.bfloat16),
                      jnp.full((1, 4096), -1, jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), bool))


def random_draft_cache(dcfg, T, cap, key):
    """A bf16 head cache of capacity `cap` filled with random K/V and holding `T` entries (batch 1)."""
    k1, k2 = jax.random.split(key)
    shp = (1, cap, dcfg.n_kv_heads, dcfg.head_dim)
    return dr.DraftCache(jax.random.normal(k1, shp, jnp.bfloat16), jax.random.normal(k2, shp, jnp.bfloat16),
                         jnp.full((1,), T, jnp.int32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama31-8b-nsa")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--schedule-context", type=int, default=65536)
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--backends", nargs="+", default=["reference", "kernel"])
    ap.add_argument("--skip-schedule", action="store_true")
    ap.add_argument("--skip-verify", action="store_true", help="only the schedule rows")
    ap.add_argument("--mesh-sizes", type=int, nargs="+", default=[1],
                    help="tensor-parallel degrees for the verify rounds (1: one device; n: a 'tp' mesh of n devices)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--trees", default="8,6,64", help="verify rows' trees: top_k,depth,budget triples separated by ;")
    ap.add_argument("--verify-schedules", type=int, nargs="+", default=[1],
                    help="verify rows' refresh periods (1: every layer refreshes, class exact; P>1: class strict)")
    ap.add_argument("--order", default="bfs", choices=["bfs", "dfs"], help="verify rows' tree flattening order")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the head's draft vocabulary (default: the target's; 32000 is EAGLE-3's LLaMA-3.1-8B head)")
    ap.add_argument("--draft-window", type=int, default=None,
                    help="the head attends the last W committed slots (default: all; the bundled head uses 4096)")
    ap.add_argument("--no-split", action="store_true", help="verify rows: only whole rounds, no draft/verify split")
    ap.add_argument("--compile-threads", type=int, default=12, help="verify forwards compiled at once")
    ap.add_argument("--trace-dir", default=None,
                    help="also trace 3 draft and 3 draft+verify calls per verify row and record each GPU's busy "
                         "time by op class (collectives, matmuls, NSA kernels, other) in the row")
    ap.add_argument("--out-verify", default="docs/results/verify_8b_h200.json")
    ap.add_argument("--out-schedule", default="docs/results/schedule_8b_h200.json")
    a = ap.parse_args(argv)
    try:
        trees = [dict(top_k=t.top_k, depth=t.depth, budget=t.budget) for t in TreeSpec.parse_list(a.trees)]
    except ValueError as e:
        ap.error(f"--trees: {e}")
    if min(a.verify_schedules) < 1:
        ap.error(f"--verify-schedules {a.verify_schedules} is invalid; accepted: integers >= 1")

    cfg = get_config(a.preset)
    try:
        dcfg = dr.DraftConfig.for_target(cfg, draft_vocab=a.draft_vocab, window=a.draft_window)
    except ValueError as e:
        ap.error(f"--draft-vocab / --draft-window: {e}")
    dev = jax.devices()[0]
    interpret = jax.default_backend() == "cpu"
    init = jax.jit(lambda k: M.init_params(cfg, k, jnp.bfloat16))
    dparams = jax.jit(lambda k: dr.init_draft_params(dcfg, k, jnp.bfloat16))(jax.random.key(1))
    meshes = {n: None if n == 1 else sharding.make_mesh(n) for n in a.mesh_sizes}

    def layout(n_dev):
        """The decode weight layout ssv_generate runs rounds in: per-layer buffers, projections fused (per shard
        on a mesh, split over KV heads). Built per mesh size (from the same key) so that only one copy of
        the 8B weights is resident at a time: at 128K, two layouts plus the caches do not fit one H200."""
        mesh = meshes[n_dev]
        stacked = init(jax.random.key(0))
        return sharding.split_layers(stacked if mesh is None else sharding.shard_params(stacked, cfg, mesh), mesh)

    tree64 = dict(top_k=8, depth=6, budget=64)
    tree16 = dict(top_k=4, depth=4, budget=16)
    meta = dict(preset=a.preset, device=dev.device_kind, jax=jax.__version__, dtype="bfloat16", batch=1)

    # -- one verification round --------------------------------------------------------------------------------
    rows = []
    cap = kvc.cache_capacity(cfg, max(a.contexts) + 4096)  # one shape for every T: one compile per backend
    prm, prm_dev = None, None
    @functools.cache
    def stage_fns(pol, mesh):
        """The draft-only and draft+verify programs of one policy: one compile each, shared by the contexts
        (one cache shape). Parameters travel as arguments: a closure would embed 16 GB of weights as constants."""
        eos = jnp.int32(-2)
        f_draft = jax.jit(lambda p, dp, s: ssv_round(SSVModel(cfg, p, dcfg, dp), pol, 0.0, s, jax.random.key(0),
                                                     eos, 4000, phase="draft", mesh=mesh).tokens)
        f_verify = jax.jit(lambda p, dp, s: ssv_round(SSVModel(cfg, p, dcfg, dp), pol, 0.0, s,
                                                      jax.random.key(0), eos, 4000, phase="verify", mesh=mesh))
        return f_draft, f_verify

    points = [] if a.skip_verify else [(n, tree, P, T, b) for n in a.mesh_sizes for tree in trees
                                       for P in a.verify_schedules for T in a.contexts for b in a.backends]
    for n_dev, tree, P, T, backend in tqdm(points, desc="verify rounds", unit="row"):
        mesh = meshes[n_dev]
        if prm_dev != n_dev:
            prm = None  # free the previous layout first
            prm, prm_dev = layout(n_dev), n_dev
        st = None  # the previous context's caches go before these are made
        tc = kvc.random_cache(cfg, 1, cap, T, jax.random.key(2))
        dc = random_draft_cache(dcfg, T, cap, jax.random.key(3))
        pol = SSVPolicy(**tree, order=a.order, backend=backend, group_size=4, schedule=P,
                        precision="exact" if P == 1 else "strict")
        st = round_state(tc, dc, cfg.hidden)
        dprm = dparams
        if mesh is not None:  # tensor parallel: target params and cache over KV heads, the draft replicated
            st = sharding.replicate(st._replace(tcache=None), mesh)._replace(tcache=sharding.shard_cache(tc, mesh))
            dprm = sharding.replicate(dparams, mesh)
        del tc, dc
        eos = jnp.int32(-2)
        f_draft, f_verify = stage_fns(pol, mesh)
        # whole rounds: a chunk of `rounds` rounds in one while_loop, per round (one state copy alive at a time:
        # 128K caches are large)
        t_round = chunk_ms_per_round(
            lambda s: _ssv_chunk(prm, dprm, s, jax.random.key(0), eos, cfg=cfg, dcfg=dcfg, policy=pol,
                                 temperature=0.0, rounds=a.rounds, max_new=4000, mesh=mesh), st, reps=3)
        row = dict(context=T, backend=backend, devices=n_dev, tree=tree, schedule=P, order=a.order,
                   draft_vocab=dcfg.draft_vocab, draft_window=dcfg.window, round_ms=t_round)
        if not a.no_split:
            t_draft = host_time(f_draft, prm, dprm, st)
            t_dv = host_time(f_verify, prm, dprm, st)
            row.update(draft_ms=t_draft, verify_ms=t_dv - t_draft, accept_commit_ms=t_round - t_dv)
        if a.trace_dir:
            tag = f"{pol.top_k}-{pol.depth}-{pol.budget}_P{P}_V{dcfg.draft_vocab}"
            traced = {}
            for part, fn in (("draft", f_draft), ("draft_verify", f_verify)):
                traced[part] = traced_gpu_ops(lambda fn=fn: [fn(prm, dprm, st) for _ in range(3)],
                                              os.path.join(a.trace_dir, f"{n_dev}dev_{T}_{backend}_{tag}_{part}"))
                row[f"traced_{part}_us_per_call"] = op_summary(traced[part], 3)
            with open(os.path.join(a.trace_dir, f"hlo_verify_{n_dev}dev_{T}_{backend}_{tag}.txt"), "w") as f:
                f.write(f_verify.lower(prm, dprm, st).compile().as_text())
            gpu0 = traced["draft_verify"][min(traced["draft_verify"])]
            top = sorted(gpu0.items(), key=lambda kv: -kv[1][0])[:40]
            row["traced_draft_verify_top_ops_gpu0"] = {n[:100]: [round(us / 3, 1), round(c / 3, 1)]
                                                       for n, (us, c) in top}
        rows.append(row)
        print(json.dumps(row), flush=True)
        verify = dict(benchmark="ssv_verify_round", **meta, rows=rows,  # written after every row: a cut-off run
                      command="python scripts/bench_verify.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                      timing="round: a jitted while_loop of `rounds` rounds, per round, median of 3; draft and "
                             "draft+verify (unless --no-split): median host wall clock of 10 synchronised jitted "
                             "calls after warm-up; verify = (draft+verify) - draft, accept_commit = round - "
                             "(draft+verify)",
                      weights="random bf16 target and draft head; random committed caches")
        with open(a.out_verify, "w") as f:
            json.dump(verify, f, indent=2)
    if a.skip_schedule:
        return
    st = prm = dprm = None
    params = layout(1)

    # -- refresh/reuse schedules ---------------------------------------------------------------------------------
    T = a.schedule_context
    cap = kvc.cache_capacity(cfg, T + 4096)
    tc = kvc.random_cache(cfg, 1, cap, T, jax.random.key(5))
    srows = []
    attn = attention_for("kernel", "A", 4, interpret)
    trees = {}
    for spec in (tree16, tree64):
        N = spec["budget"]
        kq = jax.random.split(jax.random.key(6), 3)
        trees[N] = M.TreeInputs(jax.random.randint(kq[2], (1, N), 0, cfg.vocab_size),
                                jnp.minimum(jnp.arange(N), spec["depth"])[None].astype(jnp.int32),
                                jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool))[None], (1, N, N)))
    # whole verify forwards (projections and MLP included): one 32-layer program per (tree, P), compiled in
    # parallel threads (XLA compiles outside the GIL), then timed one after another
    fwds = {(N, P): jax.jit(lambda p, tr, c, P=P: M.forward_tree(p, cfg, tr, c, schedule=P, attn=attn)[0])
            for N in trees for P in a.periods}
    # whole SSV rounds (draft + verify + accept/commit) under each schedule: a chunk of `rounds` rounds
    dc = random_draft_cache(dcfg, T, cap, jax.random.key(3))
    st = round_state(tc, dc, cfg.hidden)
    eos = jnp.int32(-2)
    pols = {(s["budget"], P): SSVPolicy(**s, backend="kernel", group_size=4, schedule=P,
                                        precision="exact" if P == 1 else "strict")
            for s in (tree16, tree64) for P in a.periods}

    def compile_one(key):
        t0 = time.perf_counter()
        if key[0] == "fwd":
            exe = fwds[key[1:]].lower(params, trees[key[1]], tc).compile()
        else:
            exe = _ssv_chunk.lower(params, dparams, st, jax.random.key(0), eos, cfg=cfg, dcfg=dcfg,
                                   policy=pols[key[1:]], temperature=0.0, rounds=a.rounds, max_new=4000,
                                   mesh=None).compile()
        return key, exe, time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(a.compile_threads) as pool:
        compiled = {k: (exe, s) for k, exe, s in pool.map(compile_one, [(kind,) + k for kind in ("fwd", "round")
                                                                          for k in fwds])}
    print(f"compiled {len(compiled)} verify forwards and round chunks in {time.perf_counter() - t0:.1f} s "
          f"({a.compile_threads} threads)", flush=True)
    for spec in (tree16, tree64):
        N = spec["budget"]
        # per-layer attention: refresh (routing + branches) vs reuse (inherited indices), rotated inputs
        R = 4
        kq = jax.random.split(jax.random.key(6), 3)
        qs = jax.random.normal(kq[0], (R, 1, N, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
        gs = jax.nn.sigmoid(jax.random.normal(kq[1], (R, 1, N, cfg.n_heads, 3)))
        pos = jnp.full((1, N), T, jnp.int32) + jnp.minimum(jnp.arange(N), spec["depth"])[None]
        Kl, Vl, KCl, VCl = tc.k[0], tc.v[0], tc.kc[0], tc.vc[0]
        _, sel0 = attn(qs[0], pos, gs[0], Kl, Vl, KCl, VCl, tc.length, cfg)
        iters = 32

        def loop(refresh):
            def run(sel, qs, gs, Kl, Vl, KCl, VCl):
                def body(i, acc):
                    q, g = qs[i % R], gs[i % R]
                    o, _ = attn(q, pos, g, Kl, Vl, KCl, VCl, tc.length, cfg, sel=None if refresh else sel)
                    return acc + o[0, 0, 0, 0].astype(jnp.float32)
                return jax.lax.fori_loop(0, iters, body, 0.0)
            return jax.jit(run)

        args = (sel0, qs, gs, Kl, Vl, KCl, VCl)
        t_ref = host_time(loop(True), *args) / iters
        t_reu = host_time(loop(False), *args) / iters
        for P in a.periods:
            flags = sched.parse(P, cfg.n_layers)
            nR = sum(flags)
            exe, compile_s = compiled[("fwd", N, P)]
            t_fwd = host_time(exe, params, trees[N], tc, reps=5)
            chunk = compiled[("round", N, P)][0]
            t_round = chunk_ms_per_round(lambda s: chunk(params, dparams, s, jax.random.key(0), eos), st, reps=3,
                                         warmup=False)
            row = dict(tree=spec, P=P, schedule=sched.to_string(flags), n_refresh=nR, n_reuse=cfg.n_layers - nR,
                       attn_refresh_layer_us=t_ref * 1e3, attn_reuse_layer_us=t_reu * 1e3,
                       verify_attention_ms=(nR * t_ref + (cfg.n_layers - nR) * t_reu),
                       verify_forward_ms=t_fwd, round_ms=t_round, compile_s_parallel=compile_s)
            srows.append(row)
            print(json.dumps(row), flush=True)
    for spec in (tree16, tree64):
        base = next(r for r in srows if r["tree"] == spec and r["P"] == 1)
        for r in srows:
            if r["tree"] == spec:
                r["attention_speedup_vs_P1"] = base["verify_attention_ms"] / r["verify_attention_ms"]
                r["forward_speedup_vs_P1"] = base["verify_forward_ms"] / r["verify_forward_ms"]
                r["round_speedup_vs_P1"] = base["round_ms"] / r["round_ms"]
    out = dict(benchmark="refresh_reuse_schedule", **meta, context=T,
               backend="kernel (Pallas, mode A, C=4); library defaults for the walk and the reuse launches",
               rows=srows,
               timing="attention: per-layer kernel calls, 32 inside one jitted fori_loop over 4 rotated input "
                      "sets, median of 10 host-timed loops / 32, then summed over the schedule's layers; forward: "
                      "median host wall clock of 5 synchronised forward_tree calls (unrolled segments); round: a "
                      "jitted chunk of `rounds` whole SSV rounds (draft + verify + accept/commit, random draft head, "
                      "greedy), per round, median of 3; both compiled ahead in parallel threads "
                      "(compile_s_parallel: one compile's wall time while the others ran)")
    with open(a.out_schedule, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
