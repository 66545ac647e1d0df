"""Timing helpers for the benchmark scripts: host wall clock of jitted calls, and the time split of one SSV round.

The split of a round (issue #8) is a model built from differences of timed jitted functions, not a trace:

* `round_split`: draft-only, draft+verify (`ssv_round(phase=...)`) and whole rounds (`_ssv_chunk`, per round);
  verify = (draft+verify) - draft, accept_commit = round - (draft+verify) (the method of `scripts/bench_verify.py`).
* `attention_split`: one layer's attention call at the round's shapes, as a refresh layer (`sel=None`: routing +
  branches) and as a reuse layer (inherited selection: branches only).
* `ssv_round_split`: both, with routing = n_R x (t_refresh - t_reuse), attention = L x t_reuse and
  rest of target = verify - routing - attention.
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.policy import SSVPolicy, attention_for
from ssv_jax.speculative import RoundState, SSVModel, _ssv_chunk, first_state, new_caches, ssv_round

SPLIT_PARTS = ("draft_ms", "routing_ms", "attention_ms", "rest_of_target_ms", "accept_commit_ms")
SPLIT_METHOD = (
    "a model from differences, not a trace. draft: median host wall clock of `reps` synchronised jitted "
    "ssv_round(phase='draft') calls after a warm-up; verify = jitted ssv_round(phase='verify') (draft + verify "
    "forward) - draft; round: a jitted while_loop of `rounds` rounds (_ssv_chunk) per round, median over `reps` "
    "runs after a compile run; accept_commit = round - (draft + verify) (includes the loop's bookkeeping, and "
    "absorbs the dispatch that the separately called stages pay and the chunk amortises). The verify forward is "
    "then split with one layer's attention call at this state's shapes (layer 0's cache, the drafted tree's "
    "positions and masks, random queries/gates/tree keys over rotated sets, `iters` calls inside one jitted "
    "fori_loop): t_R = refresh layer (routing + branches), t_U = reuse layer (inherited selection: branches "
    "only); routing = n_refresh x (t_R - t_U), attention = n_layers x t_U, rest_of_target = verify - routing - "
    "attention (projections, MLP, norms, lm_head, per-path compressed blocks, and whatever the isolated layer "
    "calls miss of the in-model cost). Parts sum to round_ms by construction; differences are kept unclamped, "
    "so a part within timing noise of 0 can come out negative (listed in the row's `negative`).")


def host_time(fn, *args, reps=10):
    """Median host wall clock of a synchronised jitted call, after one warm-up call (ms)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


OP_CATEGORIES = ("collective", "matmul", "nsa_kernel", "other")
_NSA_KERNELS = ("compressed_attention", "grouped_verify", "naive_verify", "window_verify", "reuse_layer", "top_n",
                "decode_refresh", "decode_combine", "commit_blocks")


def op_category(name: str) -> str:
    """Coarse class of a traced GPU op name: NCCL collectives, GEMM/GEMV fusions, our Pallas kernels, the rest."""
    n = name.lower()
    if any(s in n for s in ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather",
                            "reduce-scatter", "collective")):
        return "collective"
    if any(s in n for s in ("gemm", "gemv", "cublas", "cutlass", "sm90_xmma", "dot")):
        return "matmul"
    if any(s in n for s in _NSA_KERNELS):
        return "nsa_kernel"
    return "other"


class TracerTaken(RuntimeError):
    """A JAX profiler trace on a GPU backend held no GPU events: another CUPTI subscriber (torch's profiler, once it
    has traced) holds the device, and CUPTI takes one subscriber a process."""


def traced_gpu_ops(fn, trace_dir: str) -> dict:
    """Run `fn()` under the JAX profiler and read the perfetto trace back: {gpu process name: {op name: [total
    us, count]}} over the complete ("X") events of each GPU process (one per device); {} on a machine without a
    GPU. Raises `TracerTaken` for a trace without GPU events on a GPU backend rather than returning {}."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    ev = json.load(gzip.open(files[-1]))
    evs = ev["traceEvents"] if isinstance(ev, dict) else ev
    gpu = {e["pid"]: str(e["args"]["name"]) for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    out: dict = {}
    for e in evs:
        if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu:
            row = out.setdefault(gpu[e["pid"]], {}).setdefault(e["name"], [0.0, 0])
            row[0] += e["dur"]
            row[1] += 1
    if not out and jax.default_backend() == "gpu":
        raise TracerTaken("the JAX profiler trace holds no GPU events on a GPU backend: another profiler in this "
                          "process (torch's) holds CUPTI; trace with JAX first")
    return out


def op_summary(ops: dict, per: float = 1.0) -> dict:
    """Per GPU process: busy us and op count by `op_category`, divided by `per` (e.g. steps or calls)."""
    res = {}
    for proc, rows in ops.items():
        cat = {c: [0.0, 0] for c in OP_CATEGORIES}
        for name, (us, n) in rows.items():
            cat[op_category(name)][0] += us
            cat[op_category(name)][1] += n
        res[proc] = {c: dict(us=round(us / per, 1), ops=round(n / per, 1)) for c, (us, n) in cat.items()}
        res[proc]["total_us"] = round(sum(us for us, _ in cat.values()) / per, 1)
    return res


def prefilled_state(model: SSVModel, prompt_ids, policy: SSVPolicy, max_new_tokens: int, *,
                    prefill_chunk: int = 512, eos_id: int | None = None):
    """The first round's state of `ssv_generate(model, prompt_ids, policy=policy, ...)` (greedy, seed 0): the
    library's caches and chunked prefill under the policy's schedule. Returns (state, eos)."""
    policy.check_for(model.cfg)
    prompt, tcache, dcache = new_caches(model, prompt_ids, max_new_tokens, policy.depth, prefill_chunk)
    eos = jnp.int32(-2 if eos_id is None else eos_id)
    st = first_state(model, prompt, tcache, dcache, eos, max_new_tokens, policy.depth, key=jax.random.key(0),
                     prefill_chunk=prefill_chunk, schedule=policy.schedule)
    return st, eos


@functools.lru_cache(maxsize=None)
def _stage(cfg, dcfg, policy: SSVPolicy, phase: str):
    """A jitted `ssv_round` stage (greedy): (params, draft_params, state, eos) -> the draft tree ("draft") or the
    verify logits ("verify"). Cached so that `round_split` and `attention_split` share one compile."""
    return jax.jit(lambda p, dp, s, eos: ssv_round(SSVModel(cfg, p, dcfg, dp), policy, 0.0, s, jax.random.key(0),
                                                   eos, 1 << 30, phase=phase))


def chunk_ms_per_round(run, state: RoundState, reps: int, warmup: bool = True) -> float:
    """Median ms per round of `run(state) -> (state, history, rounds)`, a chunk of rounds that donates its state:
    each call gets a fresh copy (only one alive at a time, `state` stays intact). With `warmup` a first, untimed
    call compiles."""
    ts = []
    for rep in range(reps + int(warmup)):
        s = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(s)
        t = time.perf_counter()
        s, hist, r = run(s)
        jax.block_until_ready(s)
        if int(r) == 0:
            raise ValueError("the state is already done (every row finished); accepted: a state with a live row")
        if rep or not warmup:
            ts.append((time.perf_counter() - t) * 1e3 / int(r))
        del s, hist
    return statistics.median(ts)


def round_split(model: SSVModel, policy: SSVPolicy, state: RoundState, eos, *, rounds: int = 8, reps: int = 5):
    """Draft / verify / accept+commit of one greedy round from `state` (ms), by differences.

    draft = median host time of the draft stage; verify = (draft + verify stage) - draft; round = a jitted chunk of
    `rounds` rounds from a copy of `state` (the chunk donates its state; `state` stays intact), per round, median of
    `reps` after a compile run; accept_commit = round - (draft + verify). Pass the decode weight layout
    (`model.split_layers`) to time what `ssv_generate` runs. Returns dict(draft_ms, verify_ms, accept_commit_ms,
    round_ms)."""
    cfg, dcfg = model.cfg, model.draft_cfg
    room = state.tcache.capacity - int(np.max(np.asarray(state.tcache.length)))
    if rounds * (policy.depth + 1) > room:
        raise ValueError(f"rounds={rounds} of depth-{policy.depth} trees may commit {rounds * (policy.depth + 1)} "
                         f"tokens but the cache has room for {room}; accepted: fewer rounds or a larger cache")
    args = (model.params, model.draft_params, state, eos)
    t_draft = host_time(_stage(cfg, dcfg, policy, "draft"), *args, reps=reps)
    t_dv = host_time(_stage(cfg, dcfg, policy, "verify"), *args, reps=reps)
    t_round = chunk_ms_per_round(
        lambda s: _ssv_chunk(model.params, model.draft_params, s, jax.random.key(0), eos, cfg=cfg, dcfg=dcfg,
                             policy=policy, temperature=0.0, rounds=rounds, max_new=1 << 30), state, reps)
    return dict(draft_ms=t_draft, verify_ms=t_dv - t_draft, accept_commit_ms=t_round - t_dv, round_ms=t_round)


class LayerInputs(NamedTuple):
    """One layer's verify-time attention inputs at a round state (see `layer_inputs`)."""
    pos: jax.Array  # [B, N] node positions
    extra: nsa.Extra  # in-tree keys of set 0 (ancestor masks, per-path compressed-block ids)
    layer: tuple  # layer 0's committed (k, v, kc, vc)
    T: jax.Array  # committed lengths [B]
    qs: jax.Array  # [sets, B, N, Hq, D] random queries
    gs: jax.Array  # [sets, B, N, Hq, 3] random gates
    kv: list  # four [sets, B, N, Hkv, D] random in-tree k, v, compressed k, compressed v

    def rotated(self, j):
        """(q, gates, extra) of input set j (may be traced)."""
        ex = self.extra._replace(k=self.kv[0][j], v=self.kv[1][j], ck=self.kv[2][j], cv=self.kv[3][j])
        return self.qs[j], self.gs[j], ex


def layer_inputs(model: SSVModel, policy: SSVPolicy, state: RoundState, *, sets: int = 4,
                 seed: int = 0) -> LayerInputs:
    """Inputs of one layer's attention call at this state's verify shapes: layer 0's committed cache of `state`;
    the tree the head drafts from `state` (its node positions, ancestor mask and per-path compressed-block ids);
    random queries, gates and in-flight tree keys/values in `sets` rotated sets (their values do not change the
    cost; rotation keeps a timing loop from reusing one input)."""
    cfg = model.cfg
    tree = _stage(cfg, model.draft_cfg, policy, "draft")(model.params, model.draft_params, state, jnp.int32(-2))
    tc = state.tcache
    T = tc.length
    B, N = tree.tokens.shape
    dt = tc.k.dtype
    completes, cidx = M._path_block_plan(cfg, T, M.TreeInputs(tree.tokens, tree.depth, tree.mask))[:2]
    pos = T[:, None] + tree.depth
    ks = jax.random.split(jax.random.key(seed), 6)
    qs = jax.random.normal(ks[0], (sets, B, N, cfg.n_heads, cfg.head_dim), dt)
    gs = jax.nn.sigmoid(jax.random.normal(ks[1], (sets, B, N, cfg.n_heads, 3)))
    kv = [jax.random.normal(k, (sets, B, N, cfg.n_kv_heads, cfg.head_dim), dt) for k in ks[2:]]
    extra = nsa.Extra(kv[0][0], kv[1][0], pos, tree.mask, kv[2][0], kv[3][0], cidx, tree.mask & completes[:, None])
    return LayerInputs(pos, extra, (tc.k[0], tc.v[0], tc.kc[0], tc.vc[0]), T, qs, gs, kv)


def attention_split(model: SSVModel, policy: SSVPolicy, state: RoundState, *, iters: int = 16, sets: int = 4,
                    reps: int = 5, seed: int = 0):
    """One layer's attention call (the policy's `attention_for`) at this state's verify shapes, as a refresh layer
    and as a reuse layer: returns (t_refresh_us, t_reuse_us) per call.

    Inputs: `layer_inputs`. The refresh call routes (`sel=None`); the reuse call takes the selection a refresh
    call returned. Each is timed as `iters` calls inside one jitted fori_loop (median of `reps` host-timed loops,
    / iters), so dispatch is amortised."""
    cfg = model.cfg
    attn = attention_for(policy.backend, policy.mode, policy.group_size, jax.default_backend() == "cpu")
    li = layer_inputs(model, policy, state, sets=sets, seed=seed)
    _, sel0 = jax.jit(lambda q, g, ex, lay: attn(q, li.pos, g, *lay, li.T, cfg, extra=ex))(
        li.qs[0], li.gs[0], li.extra, li.layer)

    def loop(refresh):
        return attention_loop(lambda li, q, g, ex, sel: attn(q, li.pos, g, *li.layer, li.T, cfg, extra=ex,
                                                              sel=None if refresh else sel)[0], iters)

    return (host_time(loop(True), sel0, li, reps=reps) / iters * 1e3,
            host_time(loop(False), sel0, li, reps=reps) / iters * 1e3)


def attention_loop(fn, iters: int):
    """Jitted (sel, li: LayerInputs) -> the sum of `iters` calls of fn(li, q, gates, extra, sel) -> o, each on the
    next of li's rotated input sets, inside one fori_loop (li is an argument, so the cache is not a constant)."""
    def run(sel, li):
        def body(i, acc):
            q, g, ex = li.rotated(i % li.qs.shape[0])
            return acc + jnp.sum(fn(li, q, g, ex, sel).astype(jnp.float32))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    return jax.jit(run)


def ssv_round_split(model: SSVModel, policy: SSVPolicy, state: RoundState, eos, *, rounds: int = 8, reps: int = 5,
                    iters: int = 16):
    """The five-part split of one round (ms): draft, routing, attention (the NSA branches), rest of the target
    (projections, MLP, norms, lm_head, ...) and accept+commit, plus round_ms, verify_ms, the per-layer attention
    times (µs), n_refresh / n_layers of the policy's schedule, and `negative`: the parts that came out below 0
    (kept, not clamped). Method: `SPLIT_METHOD`."""
    r = round_split(model, policy, state, eos, rounds=rounds, reps=reps)
    t_ref, t_reu = attention_split(model, policy, state, iters=iters, reps=reps)
    flags = policy.flags(model.cfg)
    n_r, n_l = sum(flags), len(flags)
    routing, attention = n_r * (t_ref - t_reu) / 1e3, n_l * t_reu / 1e3
    out = dict(draft_ms=r["draft_ms"], routing_ms=routing, attention_ms=attention,
               rest_of_target_ms=r["verify_ms"] - routing - attention, accept_commit_ms=r["accept_commit_ms"],
               round_ms=r["round_ms"], verify_ms=r["verify_ms"], attn_refresh_layer_us=t_ref,
               attn_reuse_layer_us=t_reu, n_refresh=n_r, n_layers=n_l)
    out["negative"] = [k for k in SPLIT_PARTS if out[k] < 0]
    return out

