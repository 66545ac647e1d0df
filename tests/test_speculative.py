"""`ssv_generate`: greedy SSV in class "exact" is token-for-token greedy AR NSA decoding, on the reference and
kernel paths, for chains and trees, both flattening orders and several group sizes; long accepted paths; batches
whose rows accept different lengths or stop early; a planner's switch of schedule; seeded sampling; mode B; input
validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import baselines, nsa
from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax import speculative as spec
from ssv_jax import tree as tr
from ssv_jax.config import get_config
from ssv_jax.generate import ar_generate
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import SSVModel, ssv_generate

CFG = get_config("tiny", max_seq_len=1024)  # l=16, d=8, l'=32, n=4, w=64: 300 tokens cross every boundary
PARAMS = M.init_params(CFG, jax.random.key(0))
DCFG = dr.DraftConfig.for_target(CFG)
MODEL = SSVModel(CFG, PARAMS, DCFG, dr.init_draft_params(DCFG, jax.random.key(1)))
PROMPT = np.asarray(jax.random.randint(jax.random.key(2), (1, 150), 0, CFG.vocab_size))
NEW = 300
CHAIN = dict(top_k=1, depth=4, budget=5)
TREE = dict(top_k=4, depth=4, budget=16)


@pytest.fixture(scope="module")
def ar_tokens():
    return ar_generate((CFG, PARAMS), PROMPT, NEW, prefill_chunk=64, chunk_steps=100).tokens


def _ssv(policy, **kw):
    return ssv_generate(MODEL, PROMPT, max_new_tokens=NEW, policy=policy, prefill_chunk=64, chunk_rounds=64, **kw)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_greedy_ssv_equals_greedy_ar_on_the_reference_path(ar_tokens, shape, order):
    res = _ssv(SSVPolicy(**shape, order=order))
    np.testing.assert_array_equal(res.tokens, ar_tokens)
    assert sum(res.stats["accepted_per_round"]) == NEW - 1  # every token after the first came from a round


@pytest.mark.parametrize("shape,order,C", [(CHAIN, "bfs", 1), (TREE, "bfs", 2), (TREE, "dfs", 4)])
def test_greedy_ssv_equals_greedy_ar_on_the_kernel_path(ar_tokens, shape, order, C):
    res = _ssv(SSVPolicy(**shape, order=order, group_size=C, backend="kernel"))
    np.testing.assert_array_equal(res.tokens, ar_tokens)


def _oracle_builder(sequence: np.ndarray, prompt_len: int):
    """A drafter that knows the target's greedy continuation: the first chain of the tree carries the true next
    tokens, the other nodes random ones. Exercises long accepted paths (many commits of depth+1 tokens).
    `sequence` [n] serves every row, [B, n] one per row."""
    seq = jnp.atleast_2d(jnp.asarray(sequence, jnp.int32))
    parents = jnp.asarray([-1, 0, 1, 2, 3, 0, 0, 0, 1, 1, 2, 2, 3, 5, 6, 8], jnp.int32)
    chain = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)

    def build(params, dcfg, embed, root_hidden, root_token, root_pos, cache, spec_, select=None, attention=None):
        B = root_token.shape[0]
        k = jax.random.fold_in(jax.random.key(7), root_pos[0])
        toks = jax.random.randint(k, (B, 16), 0, CFG.vocab_size)
        rel = root_pos[:, None] - prompt_len + 1 + jnp.arange(4)[None]  # index into the generated sequence
        rows = jnp.broadcast_to(seq, (B, seq.shape[1]))
        true_next = jnp.take_along_axis(rows, jnp.clip(rel, 0, seq.shape[1] - 1), axis=1)
        toks = toks.at[:, chain[1:]].set(true_next).at[:, 0].set(root_token)
        return tr.tree_from_parents(toks, jnp.broadcast_to(parents, (B, 16)), root_pos)

    return build


@pytest.fixture
def fresh_round_cache():
    """The round loop is jit-cached per policy: drop compiled rounds so a patched drafter is traced, and again
    afterwards so no other test reuses a round compiled with the patch."""
    spec._ssv_chunk.clear_cache()
    yield
    spec._ssv_chunk.clear_cache()


def test_long_accepted_paths_with_an_oracle_draft(ar_tokens, monkeypatch, fresh_round_cache):
    monkeypatch.setattr(spec.tr, "build_tree", _oracle_builder(ar_tokens[0], PROMPT.shape[1]))
    res = _ssv(SSVPolicy(**TREE, order="dfs"))
    np.testing.assert_array_equal(res.tokens, ar_tokens)
    assert res.stats["tau"] > 4.5  # depth 4 + bonus = 5 tokens per round except at the end
    assert res.stats["rounds"] <= NEW // 5 + 2


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_a_batch_whose_rows_accept_different_lengths_decodes_each_rows_greedy_ar_tokens(backend, monkeypatch,
                                                                                         fresh_round_cache):
    """Batch is a leading axis everywhere (DESIGN.md, "Generation"): each row commits its own accepted length
    into its own cache slot, so a batch of two prompts emits each prompt's greedy AR tokens. The drafter knows row
    0's continuation (5 tokens a round) and row 1's with every third token wrong (shorter, varying lengths)."""
    new = 60
    prompts = np.concatenate([PROMPT, np.asarray(jax.random.randint(jax.random.key(9), (1, 150), 0,
                                                                     CFG.vocab_size))])
    ar_rows = np.concatenate([ar_generate((CFG, PARAMS), p[None], new, prefill_chunk=64).tokens for p in prompts])
    known = ar_rows.copy()
    known[1, 2::3] = (known[1, 2::3] + 1) % CFG.vocab_size
    monkeypatch.setattr(spec.tr, "build_tree", _oracle_builder(known, PROMPT.shape[1]))
    res = ssv_generate(MODEL, prompts, max_new_tokens=new, policy=SSVPolicy(**TREE, order="dfs", backend=backend),
                       prefill_chunk=64, chunk_rounds=8)
    np.testing.assert_array_equal(res.tokens, ar_rows)
    per_round = np.asarray(res.stats["accepted_per_round"])  # the batch mean: a fraction where rows differ
    assert np.any(per_round != np.round(per_round))


def test_sampling_is_seeded_and_deterministic():
    pol = SSVPolicy(**TREE)
    run = lambda seed: ssv_generate(MODEL, PROMPT[:, :100], max_new_tokens=40, policy=pol, temperature=1.0,
                                    seed=seed, prefill_chunk=64).tokens
    a, b, c = run(5), run(5), run(6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_eos_stops_the_row():
    greedy = ar_generate((CFG, PARAMS), PROMPT, 30, prefill_chunk=64).tokens[0]
    eos = int(greedy[7])
    first = int(np.argmax(greedy == eos))
    res = ssv_generate(MODEL, PROMPT, max_new_tokens=30, policy=SSVPolicy(**TREE), eos_id=eos, prefill_chunk=64)
    np.testing.assert_array_equal(res.tokens[0, : first + 1], greedy[: first + 1])
    assert np.all(res.tokens[0, first:] == eos)


def test_in_a_batch_a_finished_row_pads_with_eos_while_the_other_decodes_on():
    """A row that emits EOS stops (its rounds accept nothing and re-commit only the root) and is padded with EOS;
    the other row decodes its greedy AR tokens to the end."""
    prompts = np.concatenate([PROMPT, np.asarray(jax.random.randint(jax.random.key(9), (1, 150), 0,
                                                                     CFG.vocab_size))])
    greedy = np.concatenate([ar_generate((CFG, PARAMS), p[None], 30, prefill_chunk=64).tokens for p in prompts])
    eos = next(int(t) for t in greedy[0, 3:] if t not in greedy[1])  # ends row 0 only
    first = int(np.argmax(greedy[0] == eos))
    res = ssv_generate(MODEL, prompts, max_new_tokens=30, policy=SSVPolicy(**TREE), eos_id=eos, prefill_chunk=64)
    np.testing.assert_array_equal(res.tokens[0, : first + 1], greedy[0, : first + 1])
    assert first < 29 and np.all(res.tokens[0, first:] == eos)
    np.testing.assert_array_equal(res.tokens[1], greedy[1])


def test_mode_b_equals_mode_a_when_a_group_shares_its_indices():
    """Queries at the same position with the same routing inputs select the same blocks: sharing the first
    query's selection then changes nothing."""
    r = np.random.default_rng(0)
    S, Q = 256, 8
    k = jnp.asarray(r.standard_normal((1, S, 2, 16)), jnp.float32)
    v = jnp.asarray(r.standard_normal((1, S, 2, 16)), jnp.float32)
    q0 = r.standard_normal((1, 1, 4, 16))
    q = jnp.asarray(np.repeat(q0, Q, 1) + 1e-3 * r.standard_normal((1, Q, 4, 16)), jnp.float32)
    pos = jnp.full((1, Q), 240, jnp.int32)
    g = jnp.asarray(r.uniform(size=(1, Q, 4, 3)), jnp.float32)
    kc, vc = nsa.compress_all(k, CFG), nsa.compress_all(v, CFG)
    a, sel_a = nsa.nsa_attention(q, pos, g, k, v, kc, vc, jnp.asarray([S]), CFG)
    assert np.all(np.asarray(sel_a) == np.asarray(sel_a)[:, :1])  # the premise: shared indices
    b, sel_b = baselines.shared_index_reference(q, pos, g, k, v, kc, vc, jnp.asarray([S]), CFG, group_size=4)
    np.testing.assert_array_equal(np.asarray(sel_b), np.asarray(sel_a))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_mode_b_generation_runs_in_class_approx():
    res = ssv_generate(MODEL, PROMPT[:, :100], max_new_tokens=20, prefill_chunk=64,
                       policy=SSVPolicy(**TREE, mode="B", precision="approx"))
    assert res.tokens.shape == (1, 20)


@pytest.mark.parametrize("kw,needle", [
    (dict(depth=0), "depth"),
    (dict(order="random"), "order"),
    (dict(mode="B"), "approx"),
    (dict(schedule=2), "strict"),
    (dict(precision="loose"), "precision"),
    (dict(budget=500), "budget"),
    (dict(schedule=2.0, precision="strict"), r"schedule=2.0 is invalid; accepted: None"),
    (dict(schedule=True), r"schedule=True is invalid"),
    (dict(schedule="RXRU", precision="strict"), r"schedule entry 'X' is invalid; accepted: 'R', 'U'"),
    (dict(group_size=True), r"group_size=True is invalid; accepted: an integer >= 1"),
])
def test_bad_policy_raises_clear_value_error(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SSVPolicy(**{**TREE, **kw})


def test_a_policy_stores_its_schedule_in_one_form_and_round_trips_it():
    """Equal schedules make equal (hashable) policies whatever form they came in; `describe` and `to_dict` show
    the schedule itself (a tuple of bools once printed as all refresh)."""
    strict = dict(TREE, precision="strict")
    p = SSVPolicy(**strict, schedule="RURU")
    assert SSVPolicy(**strict, schedule=(True, False, True, False)) == p
    assert SSVPolicy(**strict, schedule=["R", "U", "R", "U"]) == p and hash(p) == hash(SSVPolicy(**p.to_dict()))
    assert "schedule=RURU" in p.describe() and p.to_dict()["schedule"] == "RURU"
    assert SSVPolicy.from_dict(p.to_dict()) == p
    assert SSVPolicy(**strict, schedule=np.int64(2)).schedule == 2 and "schedule=P=2" in SSVPolicy(
        **strict, schedule=np.int64(2)).describe()
    assert SSVPolicy(**{**TREE, "top_k": np.int64(TREE["top_k"])}) == SSVPolicy(**TREE)


def test_group_size_must_divide_the_tree_rows():
    with pytest.raises(ValueError, match="group_size"):
        ssv_generate(MODEL, PROMPT, max_new_tokens=8, policy=SSVPolicy(**CHAIN, group_size=2, backend="kernel"),
                     prefill_chunk=64)


@pytest.mark.parametrize("kw,needle", [
    (dict(planner="x"), r"planner of type str is invalid; accepted: None or an ssv_jax.planner.Planner"),
    (dict(prefill_chunk=-8), r"prefill_chunk=-8 is invalid; accepted: an integer >= 1"),
    (dict(temperature=float("nan")), r"temperature=nan is invalid; accepted: a finite float >= 0"),
    (dict(seed=None), r"seed=None is invalid; accepted: an integer"),
    (dict(progress="yes"), r"progress='yes' is invalid; accepted: True or False"),
])
def test_bad_generation_options_are_named_before_any_device_work(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ssv_generate(MODEL, PROMPT, max_new_tokens=8, policy=SSVPolicy(**TREE), **kw)


def test_a_model_tuple_must_hold_configs_not_dicts():
    bad = (MODEL.cfg, MODEL.params, MODEL.draft_cfg.to_dict(), MODEL.draft_params)
    with pytest.raises(ValueError, match=r"\(ModelConfig, params, dict, draft_params\) is invalid; accepted"):
        ssv_generate(bad, PROMPT, max_new_tokens=8, policy=SSVPolicy(**TREE))


@pytest.mark.parametrize("chunk_rounds", [0, 2.5])
def test_chunk_rounds_must_be_a_positive_integer(chunk_rounds):
    with pytest.raises(ValueError, match=f"chunk_rounds={chunk_rounds}.*integer >= 1"):
        ssv_generate(MODEL, PROMPT, max_new_tokens=8, policy=SSVPolicy(**TREE), chunk_rounds=chunk_rounds)


def test_budget_above_the_cache_room_is_rejected():
    with pytest.raises(ValueError, match="exceeds the cache"):
        ssv_generate(MODEL, PROMPT, max_new_tokens=900, policy=SSVPolicy(**TREE), prefill_chunk=64)


def test_draft_target_mismatch_is_rejected():
    bad = DCFG.replace(hidden=CFG.hidden * 2)
    with pytest.raises(ValueError, match="hidden"):
        ssv_generate((CFG, PARAMS, bad, MODEL.draft_params), PROMPT, max_new_tokens=8, policy=SSVPolicy(**TREE))
    with pytest.raises(ValueError, match="draft head"):
        ssv_generate((CFG, PARAMS, None, None), PROMPT, max_new_tokens=8, policy=SSVPolicy(**TREE))


def test_the_gpu_rounds_select_draft_tokens_with_the_kernel(monkeypatch):
    """`draft_select`: the Pallas `top_n_log_softmax` on one GPU, whatever the draft vocabulary (measured faster
    than XLA's log-softmax and TopK from the bundled head's 2048 ids to 128K); the reference (None) on a mesh
    and on the CPU."""
    from pallas_kernels.topn import top_n_log_softmax

    assert spec.draft_select() is None  # this machine is a CPU
    monkeypatch.setattr(spec, "_on_cpu", lambda: False)
    assert spec.draft_select() is top_n_log_softmax
    assert spec.draft_select(mesh=object()) is None


def _ar_switching_schedules(switch_at: int, first, then, n_new: int) -> np.ndarray:
    """Greedy AR NSA whose steps consume tokens 0 .. switch_at-2 under schedule `first` (the prompt too) and every
    later token under `then`: the text that a generation switching schedules at token `switch_at` specifies."""
    from ssv_jax import cache as kvc

    cache = kvc.init_cache(CFG, 1, PROMPT.shape[1] + n_new + 64)
    logits, _, cache = M.prefill(PARAMS, CFG, PROMPT, cache, chunk=64, schedule=first)
    step = {s: jax.jit(lambda c, t, s=s: M.forward(PARAMS, CFG, t[:, None], c, schedule=s)) for s in (first, then)}
    toks = [jnp.argmax(logits, -1).astype(jnp.int32)]
    for j in range(n_new - 1):
        logits, _, cache = step[first if j < switch_at - 1 else then](cache, toks[-1])
        toks.append(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))
    return np.stack([np.asarray(t) for t in toks], 1)


def test_a_planner_switch_of_schedule_continues_as_ar_switching_at_the_same_token():
    """Within class strict a planner may switch to another refresh/reuse schedule between chunks. The committed
    K/V keep the schedule they were computed under, so greedy SSV is greedy AR that switches schedules at the
    token where the next chunk starts (DESIGN_NOTES, "Schedules and the prompt")."""
    from ssv_jax.planner import Planner

    every, reuse = SSVPolicy(**TREE, precision="strict"), SSVPolicy(**TREE, schedule=2, precision="strict")

    class SwitchOnce(Planner):
        def observe(self, policy, emitted, context):
            return reuse

    planner = SwitchOnce({b: [(every, None, None), (reuse, None, None)] for b in Planner.fixed(every).ranking})
    new = 40
    res = ssv_generate(MODEL, PROMPT, max_new_tokens=new, policy="auto", planner=planner, chunk_rounds=4,
                       prefill_chunk=64)
    trace = res.stats["policy_trace"]
    assert [t["policy"] for t in trace[:2]] == [every.describe(), reuse.describe()]
    switch_at = 1 + int(round(sum(res.stats["accepted_per_round"][: trace[0]["rounds"]])))
    expected = _ar_switching_schedules(switch_at, None, 2, new)
    np.testing.assert_array_equal(res.tokens, expected)
    # and the switch matters here: AR under either schedule alone emits other text
    assert not np.array_equal(expected, ar_generate((CFG, PARAMS), PROMPT, new, prefill_chunk=64).tokens)
    assert not np.array_equal(expected, ar_generate((CFG, PARAMS), PROMPT, new, schedule=2, prefill_chunk=64).tokens)
