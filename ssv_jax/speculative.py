"""Sparse Speculative Verification: `ssv_generate`.

One round: the EAGLE-3 head drafts a tree (static shape), the NSA target verifies every node in one pass
(`model.forward_tree`: tree mask, per-path compressed blocks), acceptance picks the path (greedy, or stochastic
and lossless), the accepted K/V are committed into the target cache with their completed compressed blocks, and
the accepted nodes' features are fed back to the head. Rounds run inside a jitted `lax.while_loop` over
fixed-size buffers, a chunk of rounds per call; between chunks the host updates progress and lets the planner
switch policy. Each distinct `SSVPolicy` is one compiled variant, cached by jit.
"""

from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import acceptance as acc
from ssv_jax import cache as kvc
from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax import sharding
from ssv_jax import tree as tr
from ssv_jax.config import ModelConfig
from ssv_jax.generate import GenerateResult, _check_chunk, _check_options, prepare_prompt, sample
from ssv_jax.policy import SSVPolicy, attention_for


class SSVModel(NamedTuple):
    """A target and its EAGLE-3 head."""

    cfg: ModelConfig
    params: dict
    draft_cfg: dr.DraftConfig
    draft_params: dict


def unpack_ssv(model) -> SSVModel:
    """Accept an `SSVModel`, a checkpoint Bundle with a draft head, or a (cfg, params, dcfg, dparams) tuple."""
    if isinstance(model, SSVModel):
        m = model
    elif all(hasattr(model, a) for a in ("cfg", "params", "draft_cfg", "draft_params")):
        m = SSVModel(model.cfg, model.params, model.draft_cfg, model.draft_params)
    elif isinstance(model, tuple) and len(model) == 4:
        m = SSVModel(*model)
        if not isinstance(m.cfg, ModelConfig) or not isinstance(m.draft_cfg, (dr.DraftConfig, type(None))):
            raise ValueError(f"model tuple of ({type(m.cfg).__name__}, params, {type(m.draft_cfg).__name__}, "
                             "draft_params) is invalid; accepted: (ModelConfig, params, DraftConfig, draft_params)")
    else:
        raise ValueError(f"model of type {type(model).__name__} is not accepted; accepted: SSVModel, a checkpoint "
                         "Bundle with a draft head, or (cfg, params, draft_cfg, draft_params)")
    if m.draft_cfg is None or m.draft_params is None:
        raise ValueError("the model has no EAGLE-3 draft head; accepted: a bundle/model with draft_cfg and "
                         "draft_params (use ar_generate for plain decoding)")
    dr.check_compatible(m.draft_cfg, m.cfg)
    return m


class RoundState(NamedTuple):
    """What one SSV round carries to the next inside the jitted loop: both caches, the root the next tree grows
    from, and the emitted tokens so far."""

    tcache: kvc.KVCache
    dcache: dr.DraftCache
    root_token: jax.Array  # [B] the last sampled token, at position tcache.length
    root_hidden: jax.Array  # [B, H] the head's output at the entry that consumed root_token
    out: jax.Array  # [B, O] emitted tokens
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def draft_select(mesh=None):
    """The draft tree's top-k of the log-softmax over the draft vocabulary (`tree.build_tree`'s `select`).

    On one GPU, `pallas_kernels.topn.top_n_log_softmax`: one launch for a row of at most `topn.MAX_TILE` ids (the
    log-softmax formed in the kernel, in place of XLA's fusions and TopK), else XLA's log-softmax and the
    two-stage kernel. Against XLA's log-softmax and TopK on the H200 (µs per call,
    docs/results/draft_select_ab_h200.json) it took 13 against 17 over the bundled head's 2048 ids (4 rows) and
    26 against 71 over EAGLE-3's 32000 (8 rows); the two-stage top-n took 30 against XLA's TopK's 139 over 128K
    ids (topn_h200.json). On the CPU and on a mesh (the draft runs replicated there, outside shard_map) the
    reference `tree.log_softmax_top_k` (None). Both give the same indices."""
    if _on_cpu() or mesh is not None:
        return None
    from pallas_kernels.topn import top_n_log_softmax
    return top_n_log_softmax


def draft_attention_for(mesh=None):
    """The draft head's attention in the rounds: the Pallas kernel (`pallas_kernels.draft_attention`, one launch
    and a combine per drafting step where the jnp reference takes about a dozen) on one GPU; the reference (None)
    on the CPU and on a mesh (the draft runs replicated there, outside shard_map)."""
    if _on_cpu() or mesh is not None:
        return None
    from pallas_kernels.draft_attention import draft_attention
    return draft_attention


def ssv_round(m: SSVModel, policy: SSVPolicy, temperature: float, st: RoundState, key, eos, max_new: int,
              phase: str = "all", mesh=None):
    """One draft -> verify -> accept -> commit round (traced; call inside jit). `phase` is "all" in generation;
    the benchmarks use "draft" / "verify" to time the stages. Returns (new state, emitted count [B])."""
    cfg, dcfg = m.cfg, m.draft_cfg
    spec = policy.tree
    embed = m.params["embed"]
    T = st.tcache.length
    draft_attn = draft_attention_for(mesh)
    tree = tr.build_tree(m.draft_params, dcfg, embed, st.root_hidden, st.root_token, T, st.dcache, spec,
                         select=draft_select(mesh), attention=draft_attn)
    if policy.order != "bfs":
        tree = tr.permute_tree(tree, *tr.flatten_order(tree, policy.order))
    if phase == "draft":
        return tree
    attn = attention_for(policy.backend, policy.mode, policy.group_size, _on_cpu())
    if mesh is not None:
        attn = sharding.attention_on(attn, mesh)
    logits, feats, nk, nv = M.forward_tree(m.params, cfg, M.TreeInputs(tree.tokens, tree.depth, tree.mask),
                                           st.tcache, schedule=policy.schedule, attn=attn)
    if phase == "verify":
        return logits
    if temperature == 0.0:
        path, n_acc, bonus = acc.greedy_accept(tree, logits, spec.depth)
    else:
        path, n_acc, bonus = acc.stochastic_accept(tree, logits, temperature, key, spec.depth)
    n_acc = jnp.where(st.done, 0, n_acc)  # finished rows only re-commit their root
    tcache = M.commit_tree(m.params, cfg, st.tcache, nk, nv, path, n_acc + 1)
    node_idx, new_tokens, positions, valid = acc.accepted_inputs(tree, path, n_acc, bonus)
    f = jnp.take_along_axis(feats, node_idx[..., None], axis=1)
    hidden, _, dcache = dr.draft_extend(m.draft_params, dcfg, embed, f, new_tokens, positions, valid, st.dcache,
                                        attention=draft_attn)
    bidx = jnp.arange(T.shape[0])
    # emit the accepted drafts and the bonus, stopping after EOS and at max_new
    A = new_tokens.shape[1]
    j = jnp.arange(A)[None, :]
    is_eos = (new_tokens == eos) & (j <= n_acc[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1), A)
    count = jnp.minimum(jnp.minimum(n_acc + 1, first_eos + 1), max_new - st.n_out)
    count = jnp.where(st.done, 0, count)
    slot = jnp.where(j < count[:, None], st.n_out[:, None] + j, st.out.shape[1])
    out = st.out.at[bidx[:, None], slot].set(new_tokens, mode="drop")
    n_out = st.n_out + count
    done = st.done | (first_eos < A) & (first_eos <= n_acc) | (n_out >= max_new)
    new = RoundState(tcache, dcache, bonus.astype(jnp.int32), hidden[bidx, n_acc], out, n_out, done)
    return new, count


@partial(jax.jit, static_argnames=("cfg", "dcfg", "policy", "temperature", "rounds", "max_new", "mesh"),
         donate_argnames=("st",))
def _ssv_chunk(params, dparams, st: RoundState, key, eos, start=0, *, cfg, dcfg, policy: SSVPolicy,
               temperature: float, rounds: int, max_new: int, mesh=None):
    """Up to `rounds` rounds in one while_loop; returns (state, emitted per round [rounds, B], rounds run). Round r
    samples with fold_in(fold_in(key, start), r) (`start`: the rounds run before, folded in here rather than by a
    separate host-dispatched op)."""
    B = st.root_token.shape[0]
    m = SSVModel(cfg, params, dcfg, dparams)
    key = jax.random.fold_in(key, start)

    def cond(c):
        r, st, _ = c
        return (r < rounds) & ~jnp.all(st.done)

    def body(c):
        r, st, hist = c
        st, count = ssv_round(m, policy, temperature, st, jax.random.fold_in(key, r), eos, max_new, mesh=mesh)
        return r + 1, st, hist.at[r].set(count)

    r, st, hist = jax.lax.while_loop(cond, body, (0, st, jnp.zeros((rounds, B), jnp.int32)))
    return st, hist, r


_draft_extend = jax.jit(dr.draft_extend, static_argnums=(1,))


def ssv_prefill(m: SSVModel, prompt: np.ndarray, tcache, dcache, temperature: float, key, *, chunk: int,
                schedule=None, attn=None, progress: bool = False):
    """Chunked prefill of target and head. Samples the first token x_P from the target and returns the round
    state's pieces: (tcache, dcache, first token [B], root hidden [B, H])."""
    B, P = prompt.shape
    holder = {}

    def on_chunk(lg, ft, start, n):
        nxt = np.zeros((B, chunk), np.int32)
        real = prompt[:, start + 1: start + n + 1]
        nxt[:, : real.shape[1]] = real
        if start + n == P:  # the last prompt position pairs with the first sampled token
            holder["first"] = sample(lg[:, n - 1], temperature, key)
            nxt = jnp.asarray(nxt).at[:, n - 1].set(holder["first"])
        pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        valid = jnp.broadcast_to(jnp.arange(chunk) < n, (B, chunk))
        hidden, _, holder["dcache"] = _draft_extend(m.draft_params, m.draft_cfg, m.params["embed"], ft,
                                                    jnp.asarray(nxt), pos, valid, holder["dcache"])
        holder["hidden"] = hidden[:, n - 1]

    holder["dcache"] = dcache
    kw = {} if attn is None else dict(attn=attn)
    _, _, tcache = M.prefill(m.params, m.cfg, prompt, tcache, chunk=chunk, schedule=schedule, progress=progress,
                             on_chunk=on_chunk, **kw)
    return tcache, holder["dcache"], holder["first"], holder["hidden"]


def rounds_tokens(rounds: int, depth: int) -> int:
    """The most tokens `rounds` rounds of depth-`depth` trees can emit after prefill's first: each round at most its
    accepted drafts and the bonus, depth + 1. As `max_new_tokens`, caches that such a chunk never outgrows."""
    return rounds * (depth + 1) + 1


def new_caches(m: SSVModel, prompt_ids, max_new_tokens: int, max_depth: int, prefill_chunk: int = 512,
               cache_dtype=None):
    """The validated prompt [B, P] and empty target and head caches with room for it, a prefill chunk's padding,
    `max_new_tokens` and two trees of depth `max_depth`: (prompt, tcache, dcache)."""
    prompt = prepare_prompt(m.cfg, prompt_ids, max_new_tokens, extra_room=prefill_chunk + 2 * (max_depth + 2))
    B, P = prompt.shape
    dtype = cache_dtype or jax.tree.leaves(m.params)[0].dtype
    room = P + prefill_chunk + max_new_tokens + 2 * (max_depth + 2)
    tcache = kvc.init_cache(m.cfg, B, room, dtype)
    return prompt, tcache, dr.init_draft_cache(m.draft_cfg, B, dtype, max_len=tcache.capacity)


def first_state(m: SSVModel, prompt: np.ndarray, tcache, dcache, eos, max_new_tokens: int, max_depth: int, *,
                temperature: float = 0.0, key=None, prefill_chunk: int = 512, schedule=None,
                progress: bool = False) -> RoundState:
    """Prefill `prompt` into the caches (`ssv_prefill`) and return the first round's state: the sampled first
    token as root and as the first emitted token."""
    key = jax.random.key(0) if key is None else key
    tcache, dcache, first, hidden = ssv_prefill(m, prompt, tcache, dcache, temperature, key, chunk=prefill_chunk,
                                                schedule=schedule, progress=progress)
    B = prompt.shape[0]
    out = jnp.full((B, max_new_tokens + max_depth + 2), -1, jnp.int32).at[:, 0].set(first)
    return RoundState(tcache, dcache, first.astype(jnp.int32), hidden, out, jnp.ones((B,), jnp.int32),
                      (first == eos) | (max_new_tokens <= 1))


def ssv_generate(model, prompt_ids, *, max_new_tokens: int, policy="auto", temperature: float = 0.0,
                 seed: int = 0, eos_id: int | None = None, chunk_rounds: int = 32, prefill_chunk: int = 512,
                 planner=None, cache_dtype=None, progress: bool = False, mesh=None,
                 split_weights: bool = True) -> GenerateResult:
    """Generate with Sparse Speculative Verification.

    Args:
      model: an `SSVModel`, a checkpoint Bundle with a draft head, or (cfg, params, draft_cfg, draft_params).
      prompt_ids: [P] or [B, P] token ids.
      policy: an `SSVPolicy`, or "auto" (the planner picks from its profile, see `ssv_jax.planner`).
      temperature: 0 for greedy, else lossless stochastic acceptance at that temperature.
      eos_id: stop a row after it emits this id.
      planner: an `ssv_jax.planner.Planner` (default: one built for "auto").
      mesh: a `jax.sharding.Mesh` with axis "tp" (`ssv_jax.sharding.make_mesh`): tensor parallelism over KV
        heads; default one device.
      split_weights: run the rounds on the decode weight layout (`model.split_layers`: per-layer buffers, fused
        projections), which holds a second copy of the target's weights; False slices the stacked weights
        inside the loop instead (about 3x slower per round at 8B shapes, docs/RESULTS.md).
      chunk_rounds: the most rounds per jitted call. Between calls the host reads the results in one transfer,
        updates progress and lets the planner switch policy. Beyond its rounds a call costs ~0.7 ms (calls
        back to back) to ~2 ms (synchronised) on the H200, which the rounds cannot hide
        (docs/results/chunk_cost_h200.json); 32 rounds are ~30 ms of the bundled model's.
    Returns `GenerateResult(tokens [B, n], stats)`; stats: rounds, accepted_per_round (tokens emitted per round:
    accepted drafts + bonus), tau (their mean), policy_trace, prefill_s, decode_s, tokens_per_s.
    """
    from ssv_jax.planner import Planner

    m = unpack_ssv(model)
    cfg = m.cfg
    _check_options(cfg, temperature=temperature, seed=seed, eos_id=eos_id, prefill_chunk=prefill_chunk,
                   cache_dtype=cache_dtype, mesh=mesh, progress=progress, split_weights=split_weights)
    _check_chunk("chunk_rounds", chunk_rounds)
    if planner is not None and not isinstance(planner, Planner):
        raise ValueError(f"planner of type {type(planner).__name__} is invalid; accepted: None or an "
                         "ssv_jax.planner.Planner")
    if planner is None:
        planner = Planner.for_policy(policy, cfg, precision=getattr(policy, "precision", "exact"))
    for cand in planner.candidates():  # every check before any device work
        cand.check_for(cfg)
    pol = planner.initial(prompt_len=np.asarray(prompt_ids).shape[-1])
    max_depth = max(p.depth for p in planner.candidates())
    prompt, tcache, dcache = new_caches(m, prompt_ids, max_new_tokens, max_depth, prefill_chunk, cache_dtype)
    B = prompt.shape[0]
    if mesh is not None:
        params, tcache = sharding.place(m.params, cfg, tcache, mesh)
        m = SSVModel(cfg, params, m.draft_cfg, sharding.replicate(m.draft_params, mesh))
        dcache = sharding.replicate(dcache, mesh)
    key_first, key = jax.random.split(jax.random.key(seed))
    eos = jnp.int32(-2 if eos_id is None else eos_id)
    t0 = time.perf_counter()
    # the prompt runs under the initial policy's schedule: greedy SSV == greedy AR under the same schedule
    st = first_state(m, prompt, tcache, dcache, eos, max_new_tokens, max_depth, temperature=float(temperature),
                     key=key_first, prefill_chunk=prefill_chunk, schedule=pol.schedule, progress=progress)
    if split_weights:
        m = m._replace(params=sharding.split_layers(m.params, mesh))  # projections fused per shard on a mesh
    jax.block_until_ready((st.root_hidden, m.params))
    t1 = time.perf_counter()
    per_round, trace, r_total = [], [], 0
    observe_s, switch_s = [], []  # the planner's own host time, per chunk without / with a switch
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens, desc="ssv", unit="tok", initial=1)
    done = np.asarray(st.done)
    while not done.all():
        tc = time.perf_counter()
        st, hist, r = _ssv_chunk(m.params, m.draft_params, st, key, eos, r_total, cfg=cfg, dcfg=m.draft_cfg,
                                 policy=pol, temperature=float(temperature), rounds=chunk_rounds,
                                 max_new=max_new_tokens, mesh=mesh)
        # everything the host reads between chunks, in one transfer (each separate read costs a device sync)
        hist, r, done, length = jax.device_get((hist, r, st.done, st.tcache.length))
        r = int(r)
        h = hist[:r]
        per_round.extend(h.mean(1).tolist())
        trace.append(dict(round=r_total, policy=pol.describe(), rounds=r, tau=float(h.mean()) if r else None,
                          seconds=time.perf_counter() - tc))
        r_total += r
        if bar is not None:
            bar.update(int(h.sum(0).max()) if r else 0)
        if done.all():  # the planner picks the next chunk's policy, and there is none
            break
        tp = time.perf_counter()
        n_sw = len(planner.switches)
        pol = planner.observe(pol, h, context=int(length.max()))
        (switch_s if len(planner.switches) > n_sw else observe_s).append(time.perf_counter() - tp)
    if bar is not None:
        bar.close()
    t2 = time.perf_counter()
    n_out = np.asarray(st.n_out)
    tokens = np.array(st.out)[:, : int(n_out.max())]
    if eos_id is not None:
        for b in range(B):
            tokens[b, n_out[b]:] = eos_id
    tau = float(np.mean(per_round)) if per_round else 0.0
    stats = dict(method="ssv", rounds=r_total, accepted_per_round=per_round, tau=tau, policy_trace=trace,
                 switches=planner.switches, prefill_s=t1 - t0,
                 planner_us_per_chunk=1e6 * float(np.mean(observe_s)) if observe_s else 0.0,
                 planner_us_per_switch=1e6 * float(np.mean(switch_s)) if switch_s else None, decode_s=t2 - t1,
                 tokens_per_s=(tokens.shape[1] - 1) / max(t2 - t1, 1e-9), policy=trace[0]["policy"] if trace else
                 pol.describe())
    return GenerateResult(tokens, stats)
