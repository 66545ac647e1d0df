"""The paper's two observations, measured on a model:

1. **Query overlap.** Adjacent draft-tree queries, flattened in an order, select mostly the same KV blocks. γ is
   |S_i ∩ S_{i+1}| / n.
2. **Layout stability.** The blocks that layer j selects overlap those that layer j+k selects for the same query.
   This is what lets reuse layers inherit routing.

Selections come from the model's own routing (`forward_train(..., with_selection=True)` and
`forward_tree(..., with_selection=True)`).

Mode B (every query of a group routes with the group's first query's blocks) has no AR twin, so its cost is
measured against mode A on the same trees (`mode_b_agreement`, DESIGN.md "Verification exactness"). A refresh/reuse
schedule does have one, but it is another model variant than refresh-every-layer: `schedule_agreement` measures
how far each schedule's next-token predictions are from the exact model's on the same text.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import model as M
from ssv_jax import acceptance as acc
from ssv_jax import nsa
from ssv_jax import schedule as sched
from ssv_jax import speculative as sp
from ssv_jax.config import ModelConfig, is_int
from ssv_jax.generate import _check_options
from ssv_jax.policy import SSVPolicy
from pallas_kernels.overlap import overlap_gamma


def set_overlap(a: jax.Array, b: jax.Array) -> jax.Array:
    """|A ∩ B| / |A| for block sets [..., n] (-1 = empty slot), elementwise over leading axes (NaN where A is
    empty)."""
    hit = (a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)
    inter = jnp.sum(jnp.any(hit, -1), -1)
    size = jnp.sum(a >= 0, -1)
    return jnp.where(size > 0, inter / jnp.maximum(size, 1), jnp.nan)


def layer_stability(sels: jax.Array, max_offset: int, min_pos: int = 0) -> np.ndarray:
    """Mean overlap between layer j's and layer j+k's selection for the same query and KV head.

    sels [L, B, S, Hkv, n] (one sequence's routing per layer). Queries before `min_pos` are skipped (there, the
    forced blocks are all there is). Returns [L, max_offset] with NaN where j + k >= L; entry [j, k-1] is the
    mean overlap of layer j with layer j+k."""
    L = sels.shape[0]
    out = np.full((L, max_offset), np.nan)
    s = sels[:, :, min_pos:]
    for k in range(1, max_offset + 1):
        if k >= L:
            break
        ov = set_overlap(s[:-k], s[k:])  # [L-k, B, S', Hkv]
        out[: L - k, k - 1] = np.nanmean(np.asarray(ov).reshape(L - k, -1), axis=1)
    return out


def query_overlap(sel: jax.Array) -> np.ndarray:
    """Mean γ between adjacent flattened queries, per layer: sel [L, B, Q, Hkv, n] -> [L]."""
    g = jax.vmap(overlap_gamma)(sel)  # [L, B, Q-1, Hkv]
    return np.asarray(jnp.mean(g, axis=(1, 2, 3)))


def sequence_selections(params, cfg: ModelConfig, tokens, schedule=None) -> jax.Array:
    """Every layer's routing for a whole sequence [B, S]: [L, B, S, Hkv, n]."""
    S = tokens.shape[1]
    qc = 512 if S % 512 == 0 else S
    return M.forward_train(params, cfg, jnp.asarray(tokens), schedule=schedule, remat=False, q_chunk=qc,
                           with_selection=True)[2]


def tree_selections(params, cfg: ModelConfig, tree: M.TreeInputs, cache, schedule=None) -> jax.Array:
    """Every layer's routing for the nodes of a verified tree: [L, B, N, Hkv, n]."""
    return M.forward_tree(params, cfg, tree, cache, schedule=schedule, with_selection=True)[4]


@partial(jax.jit, static_argnames=("cfg", "dcfg", "policy", "phase", "max_new"))
def _round_phase(params, dparams, st: sp.RoundState, *, cfg, dcfg, policy: SSVPolicy, phase: str, max_new: int):
    """`ssv_round` up to `phase` ("draft": the tree, "verify": the target logits, "all": the next state), greedy."""
    m = sp.SSVModel(cfg, params, dcfg, dparams)
    return sp.ssv_round(m, policy, 0.0, st, jax.random.key(0), jnp.int32(-2), max_new, phase=phase)


@partial(jax.jit, static_argnames=("depth",))
def _compare(tree, logits_a, logits_b, *, depth: int):
    """Per row: node agreement, emitted-token agreement, tokens each mode accepts, max |logit difference|."""
    best_a = jnp.argmax(logits_a, -1)
    best_b = jnp.argmax(logits_b, -1)
    same = best_a == best_b  # [B, N]
    path, n_a, _ = acc.greedy_accept(tree, logits_a, depth)
    _, n_b, _ = acc.greedy_accept(tree, logits_b, depth)
    on_path = jnp.arange(path.shape[1])[None, :] <= n_a[:, None]  # mode A emits the argmax at these nodes
    same_on_path = jnp.take_along_axis(same, jnp.maximum(path, 0), axis=1) & on_path
    gap = jnp.max(jnp.abs(logits_a.astype(jnp.float32) - logits_b.astype(jnp.float32)), axis=(1, 2))
    return dict(node_agreement=jnp.mean(same, 1), emitted_agreement=jnp.sum(same_on_path, 1) / (n_a + 1),
                accepted_a=n_a + 1, accepted_b=n_b + 1, max_logit_gap=gap)


def mode_b_agreement(model, prompt_ids, policy: SSVPolicy, rounds: int, *, prefill_chunk: int = 512) -> dict:
    """Mode B's cost against mode A on identical trees, along mode A's greedy generation.

    Each round drafts one tree from mode A's state and verifies it twice, under `policy` (mode B) and under the
    same policy in mode A (same tree, order, C, schedule, backend). Then mode A's round advances the state, so
    every round is scored on the text greedy mode A emits, which is greedy AR under the policy's schedule.

    Args:
      model: an `SSVModel` or a bundle with a draft head (`speculative.unpack_ssv`).
      prompt_ids: [P] or [B, P] token ids.
      policy: an `SSVPolicy` in mode "B".
      rounds: rounds to score (>= 1).
    Returns a dict of numpy arrays [rounds, B]:
      - `node_agreement`: the share of tree nodes whose target argmax (next token) is the same in both modes;
      - `emitted_agreement`: the same over the nodes whose argmax mode A emits (its accepted path, bonus
        included): the next-token agreement that decides the text;
      - `accepted_a`, `accepted_b`: tokens each mode's greedy acceptance emits from the same tree (tau);
      - `max_logit_gap`: max |logit_A - logit_B| over nodes and vocabulary;
    and `tokens` [B, n]: the text mode A emitted (the root token and every round's tokens).
    """
    if not isinstance(policy, SSVPolicy) or policy.mode != "B":
        raise ValueError(f"policy={policy!r} is invalid; accepted: an SSVPolicy with mode='B'")
    if not (is_int(rounds) and rounds >= 1):
        raise ValueError(f"rounds={rounds!r} is invalid; accepted: an integer >= 1")
    m = sp.unpack_ssv(model)
    _check_options(m.cfg, temperature=0.0, seed=0, eos_id=None, prefill_chunk=prefill_chunk, cache_dtype=None,
                   mesh=None)
    policy_a = policy.replace(mode="A", precision="strict")
    for p in (policy, policy_a):
        p.check_for(m.cfg)
    rounds = int(rounds)
    max_new = sp.rounds_tokens(rounds, policy.depth)
    prompt, tcache, dcache = sp.new_caches(m, prompt_ids, max_new, policy.depth, prefill_chunk)
    st = sp.first_state(m, prompt, tcache, dcache, jnp.int32(-2), max_new, policy.depth,
                        prefill_chunk=prefill_chunk, schedule=policy.schedule)
    kw = dict(cfg=m.cfg, dcfg=m.draft_cfg, max_new=max_new)
    rows = []
    for _ in range(rounds):
        tree = _round_phase(m.params, m.draft_params, st, policy=policy_a, phase="draft", **kw)
        la = _round_phase(m.params, m.draft_params, st, policy=policy_a, phase="verify", **kw)
        lb = _round_phase(m.params, m.draft_params, st, policy=policy, phase="verify", **kw)
        rows.append(jax.device_get(_compare(tree, la, lb, depth=policy.depth)))
        st, _ = _round_phase(m.params, m.draft_params, st, policy=policy_a, phase="all", **kw)
    out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    out["tokens"] = np.asarray(st.out)[:, : int(np.max(np.asarray(st.n_out)))]
    return out


@partial(jax.jit, static_argnames=("cfg", "schedule"))
def _next_token(params, tokens, *, cfg: ModelConfig, schedule):
    """Teacher-forced argmax, NLL of each next token, and the log-prob margin of the argmax over the runner-up
    under `schedule`: three [B, S-1] arrays."""
    logits, _ = M.forward_train(params, cfg, tokens, schedule=schedule, remat=False, q_chunk=tokens.shape[1],
                                attn=nsa.nsa_attention_dense)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    top2 = jax.lax.top_k(lp, 2)[0]
    return jnp.argmax(lp, -1), nll, top2[..., 0] - top2[..., 1]


def schedule_agreement(params, cfg: ModelConfig, tokens, schedules) -> list[dict]:
    """Each refresh/reuse schedule against the first (normally None: refresh every layer), teacher-forced on the
    same text `tokens` [B, S] (full-sequence forward, `nsa.nsa_attention_dense`).

    Returns one dict per schedule: `schedule` (canonical form), `nll_sum` and `tokens_scored` (its loss on the next
    tokens), `agree` (positions whose argmax equals the first schedule's) and, counted from the first position
    where routing chooses (past the n * l' tokens that every query selects whole), `agree_routed` and
    `tokens_routed`. Where routing has nothing to choose, every schedule is the same model. `margins_changed`
    (numpy) holds the first schedule's log-prob margin (argmax over runner-up) at the routed positions where this
    schedule's argmax differs, and `margins_routed` (the first row only) that margin at every routed position:
    how close to a tie the changed predictions were."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens of shape {tokens.shape} is invalid; accepted: [B, S] with S >= 2")
    schedules = [sched.canonical(s) for s in schedules]
    for s in schedules:
        sched.parse(s, cfg.n_layers)  # a bad schedule fails before any forward
    routed = slice(cfg.n_slc * cfg.slc_block, None)  # queries at t >= n * l' choose n of more blocks
    out, first, margin = [], None, None
    for s in schedules:
        best, nll, m = _next_token(params, tokens, cfg=cfg, schedule=s)
        if first is None:
            first, margin = best, np.asarray(m)[:, routed]
        same = np.asarray(best == first)
        out.append(dict(schedule=s, nll_sum=float(jnp.sum(nll)), tokens_scored=int(nll.size),
                        agree=int(same.sum()), agree_routed=int(same[:, routed].sum()),
                        tokens_routed=int(same[:, routed].size), margins_changed=margin[~same[:, routed]]))
    out[0]["margins_routed"] = margin.ravel()
    return out
