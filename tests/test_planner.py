"""The host planner: profile files, bucket choice, switching on synthetic acceptance traces, fallbacks."""

import json

import numpy as np
import pytest

from ssv_jax.config import get_config
from ssv_jax.planner import (Planner, ProfileError, best_fixed_policy, bucket_lead, bucket_of, chain_alpha,
                            chain_tau, load_profile, merge_profiles, predict_tokens_per_s, save_profile)
from ssv_jax.policy import SSVPolicy

CFG = get_config("tiny")
P_BIG = SSVPolicy(top_k=4, depth=6, budget=32)
P_MID = SSVPolicy(top_k=4, depth=4, budget=16)
P_APPROX = SSVPolicy(top_k=4, depth=4, budget=16, mode="B", precision="approx")
P_STRICT = SSVPolicy(top_k=2, depth=4, budget=8, schedule=2, precision="strict")


def _rows(*entries):
    return [dict(policy=p.to_dict(), tokens_per_s=tps, tau=tau, verify_ms=1.0) for p, tps, tau in entries]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "prof.json"
    save_profile(str(path), {"8K": _rows((P_MID, 100.0, 3.0), (P_BIG, 120.0, 4.0), (P_APPROX, 150.0, 3.2)),
                             "32K": _rows((P_STRICT, 90.0, 2.0), (P_MID, 80.0, 3.0))},
                 hardware="test", model=CFG.name, prompts=["a", "b"])
    return str(path)


def _exact_planner_at_4k(profile):
    """A planner over the fixture's exact policies (eps 0.5, window 8) and its initial policy for a 4K prompt."""
    pl = Planner.from_profile(load_profile(profile), "exact", eps=0.5, window=8)
    return pl, pl.initial(4000)


def test_profile_round_trips_ranked_by_tokens_per_s(profile):
    prof = load_profile(profile)
    assert prof["version"] == 1 and prof["hardware"] == "test" and prof["prompts"] == ["a", "b"]
    assert [SSVPolicy.from_dict(r["policy"]) for r in prof["buckets"]["8K"]] == [P_APPROX, P_BIG, P_MID]
    with pytest.raises(ValueError, match=r"unknown SSVPolicy fields \['bogus'\]; accepted: \[.*'top_k'"):
        SSVPolicy.from_dict(dict(prof["buckets"]["8K"][0]["policy"], bogus=1))


def test_buckets():
    assert [bucket_of(n) for n in (100, 8192, 8193, 20000, 65536, 70000)] == ["8K", "8K", "16K", "32K", "64K",
                                                                              ">64K"]


def test_initial_policy_is_the_buckets_best_within_the_class(profile):
    prof = load_profile(profile)
    assert Planner.from_profile(prof, "exact").initial(4000) == P_BIG
    assert Planner.from_profile(prof, "approx").initial(4000) == P_APPROX
    assert Planner.from_profile(prof, "strict").initial(20000) == P_STRICT
    assert Planner.from_profile(prof, "exact").initial(20000) == P_MID


def test_no_switch_while_acceptance_matches_the_prediction(profile):
    pl, pol = _exact_planner_at_4k(profile)
    for _ in range(10):
        pol = pl.observe(pol, np.full((4, 1), 4.2), context=4000)
    assert pol == P_BIG and pl.switches == []


def test_a_large_drop_switches_to_the_policy_predicted_fastest(profile):
    """tau 1.2 observed vs 4.0 predicted: the shallow 16-node tree loses less and is predicted faster."""
    pl, pol = _exact_planner_at_4k(profile)
    pol = pl.observe(pol, np.full((8, 1), 1.2), context=4000)
    assert pol == P_MID
    (sw,) = pl.switches
    assert sw["reason"] == "drift" and sw["tau_observed"] == pytest.approx(1.2) and sw["tau_predicted"] == 4.0
    assert sw["tokens_per_s_predicted"] >= pl.min_gain * sw["tokens_per_s_staying"]


def test_a_drift_that_leaves_the_current_policy_fastest_does_not_switch(profile):
    """tau 2.0 vs 4.0 is a drift, but the 32-node tree is still predicted about as fast as the 16-node one (within
    min_gain): switching would only cost a recompile."""
    pl, pol = _exact_planner_at_4k(profile)
    for _ in range(3):
        pol = pl.observe(pol, np.full((8, 1), 2.0), context=4000)
    assert pol == P_BIG and pl.switches == []


def test_a_rise_switches_to_a_deeper_tree_when_it_pays(tmp_path):
    path = tmp_path / "prof.json"
    save_profile(str(path), {"8K": _rows((P_MID, 130.0, 2.0), (P_BIG, 100.0, 2.5))}, hardware="test",
                 model=CFG.name, prompts=[])
    pl = Planner.from_profile(load_profile(str(path)), "exact", eps=0.5, window=8)
    pol = pl.initial(4000)
    assert pol == P_MID
    assert pl.observe(pol, np.full((8, 1), 4.0), context=4000) == P_BIG


def test_without_profiled_tokens_per_s_drift_moves_to_the_next_ranked_policy():
    pl = Planner({"8K": [(P_BIG, 4.0, None), (P_MID, 3.0, None)]}, eps=0.5, window=8)
    pol = pl.initial(4000)
    pol = pl.observe(pol, np.full((8, 1), 2.0), context=4000)
    assert pol == P_MID and len(pl.switches) == 1
    # the last-ranked policy has nowhere to go: it stays, with no new switch recorded
    pol = pl.observe(pol, np.full((8, 1), 1.0), context=4000)
    assert pol == P_MID and len(pl.switches) == 1


def test_chain_alpha_inverts_chain_tau_and_clips_to_the_chains_reach():
    rng = np.random.default_rng()
    for depth, u in zip(rng.integers(1, 9, size=50), rng.random(50)):
        depth = int(depth)
        tau = 1.0 + u * depth  # inside [1, depth + 1]
        a = chain_alpha(tau, depth)
        assert 0.0 <= a <= 1.0 and chain_tau(a, depth) == pytest.approx(tau, abs=1e-9)
        assert chain_alpha(tau, depth) == a  # the cached value is the computed one
    assert chain_alpha(0.5, 4) == pytest.approx(0.0, abs=1e-12)  # below one token a round: rate 0
    assert chain_alpha(9.0, 4) == pytest.approx(1.0, abs=1e-12)  # beyond the chain's reach: rate 1


def test_predicted_tokens_per_s_is_the_profile_when_acceptance_is_as_profiled():
    """On fresh random rows: observing exactly the current policy's profiled tau predicts every row's profiled
    tokens/s; observing less never predicts more for any row."""
    rng = np.random.default_rng()
    pols = [SSVPolicy(top_k=4, depth=int(d), budget=int(d) + 1) for d in rng.choice(np.arange(1, 8), 5, replace=False)]
    rows = [(p, float(rng.uniform(1.05, p.depth + 0.95)), float(rng.uniform(10, 500))) for p in pols]
    cur = rows[int(rng.integers(len(rows)))]
    np.testing.assert_allclose(predict_tokens_per_s(rows, cur[0], cur[1]), [v for _, _, v in rows], rtol=1e-6)
    lower = predict_tokens_per_s(rows, cur[0], 1.0 + (cur[1] - 1.0) * rng.uniform(0, 1))
    assert all(lo <= v * (1 + 1e-9) for lo, (_, _, v) in zip(lower, rows))


def test_too_few_rounds_never_switch(profile):
    pl, pol = _exact_planner_at_4k(profile)
    assert pl.observe(pol, np.full((2, 1), 1.0), context=4000) == P_BIG


def test_growing_into_another_bucket_restarts_from_its_best(profile):
    pl = Planner.from_profile(load_profile(profile), "strict")
    pol = pl.initial(8000)
    pol = pl.observe(pol, np.full((4, 1), 4.0), context=9000)  # 16K has no ranking: the nearest, 8K
    pol = pl.observe(pol, np.full((4, 1), 4.0), context=20000)
    assert pol == P_STRICT and pl.switches[-1]["reason"] == "bucket"


def test_fixed_policy_never_switches():
    pl = Planner.for_policy(P_MID, CFG)
    pol = pl.initial(100)
    for _ in range(5):
        pol = pl.observe(pol, np.full((8, 1), 1.0), context=100)
    assert pol == P_MID and pl.switches == []


@pytest.mark.parametrize("content,needle", [("{not json", "not valid JSON"), (json.dumps({"version": 7}), "version"),
                                            (json.dumps({"version": 1}), "buckets"),
                                            (json.dumps({"version": 1, "buckets": {"8K": [{"policy": {}}]}}),
                                             "lacks")])
def test_corrupt_profiles_raise_clear_errors(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ProfileError, match=needle):
        load_profile(str(p))


def _profile_with(tmp_path, row_or_buckets):
    """A profile file whose "8K" bucket holds one given entry (or whose buckets are the given dict)."""
    buckets = row_or_buckets if "policy" not in row_or_buckets else {"8K": [row_or_buckets]}
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"version": 1, "model": CFG.name, "buckets": buckets}))
    return str(p)


GOOD_ROW = dict(policy=P_MID.to_dict(), tokens_per_s=100.0, tau=3.0)


@pytest.mark.parametrize("buckets,needle", [
    ({"8K": 5}, r"bucket '8K' holds a int; accepted: a list of entries"),
    ({"8K": [5]}, r"bucket '8K', entry 0 is a int; accepted: a dict"),
    ({"bogus": [GOOD_ROW]}, r"bucket 'bogus' is invalid; accepted: \['8K', '16K', '32K', '64K', '>64K'\]"),
    ({"8K": [dict(GOOD_ROW, tau=None)]}, r"tau=None is invalid; accepted: a finite number >= 1"),
    ({"8K": [dict(GOOD_ROW, tau="x")]}, r"tau='x' is invalid; accepted: a finite number >= 1"),
    ({"8K": [dict(GOOD_ROW, tau=-2.0)]}, r"tau=-2.0 is invalid; accepted: a finite number >= 1"),
    ({"8K": [dict(GOOD_ROW, tau=float("nan"))]}, r"tau=nan is invalid; accepted: a finite number >= 1"),
    ({"8K": [dict(GOOD_ROW, tokens_per_s=0)]}, r"tokens_per_s=0 is invalid; accepted: a finite number > 0"),
    ({"8K": [dict(GOOD_ROW, tokens_per_s=True)]}, r"tokens_per_s=True is invalid; accepted: a finite number > 0"),
    ({"8K": [dict(GOOD_ROW, policy=dict(top_k=0))]}, r"entry 0: policy is invalid \(TreeSpec.top_k=0 is invalid; "
                                                     r"accepted"),
    ({"8K": [dict(GOOD_ROW, policy="fast")]}, r"entry 0: policy is invalid .*accepted: a dict"),
])
def test_profile_rows_with_bad_types_or_values_raise_profile_error(tmp_path, buckets, needle):
    with pytest.raises(ProfileError, match=needle):
        load_profile(_profile_with(tmp_path, buckets))


def test_profile_path_and_profile_dict_must_be_valid():
    with pytest.raises(ProfileError, match=r"path=None is invalid; accepted: a file path"):
        load_profile(None)
    with pytest.raises(ProfileError, match=r"has version None; accepted: 1"):
        Planner.from_profile({})
    with pytest.raises(ProfileError, match=r"has no 'buckets'"):
        Planner.from_profile({"version": 1})


def test_the_committed_profile_loads():
    from ssv_jax.planner import DEFAULT_PROFILE

    prof = load_profile(DEFAULT_PROFILE)
    assert Planner.from_profile(prof, "approx", platform="cpu").candidates()


def test_auto_falls_back_to_the_default_when_a_profiled_policy_is_invalid(tmp_path):
    path = _profile_with(tmp_path, dict(GOOD_ROW, policy=dict(P_MID.to_dict(), precision="lossy")))
    with pytest.warns(UserWarning, match=r"SSVPolicy.precision='lossy' is invalid.*falling back"):
        pl = Planner.for_policy("auto", CFG, profile_path=path)
    assert pl.initial(100) == SSVPolicy()


@pytest.mark.parametrize("kw,needle", [
    (dict(window=0), r"Planner.window=0 is invalid; accepted: an integer >= 1"),
    (dict(window=2.5), r"Planner.window=2.5 is invalid; accepted: an integer >= 1"),
    (dict(window=True), r"Planner.window=True is invalid; accepted: an integer >= 1"),
    (dict(eps=-0.1), r"Planner.eps=-0.1 is invalid; accepted: a finite number >= 0"),
    (dict(eps=float("inf")), r"Planner.eps=inf is invalid; accepted: a finite number >= 0"),
    (dict(min_gain=0), r"Planner.min_gain=0 is invalid; accepted: a finite number > 0"),
    (dict(min_gain=float("nan")), r"Planner.min_gain=nan is invalid; accepted: a finite number > 0"),
])
def test_planner_settings_are_validated(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Planner({"8K": [(P_MID, 3.0, 100.0)]}, **kw)
    assert Planner({"8K": [(P_MID, 3.0, 100.0)]}, window=np.int64(8)).window == 8


def test_precision_is_checked_even_when_auto_falls_back(tmp_path):
    with pytest.raises(ValueError, match=r"precision='foo' is invalid; accepted: \('exact', 'strict', 'approx'\)"):
        Planner.for_policy("auto", CFG, precision="foo", profile_path=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match=r"precision='foo' is invalid; accepted"):
        Planner.for_policy(P_MID, CFG, precision="foo")


def test_missing_profile_warns_and_falls_back_to_the_default(tmp_path):
    with pytest.warns(UserWarning, match="falling back"):
        pl = Planner.for_policy("auto", CFG, profile_path=str(tmp_path / "none.json"))
    assert pl.initial(100) == SSVPolicy()


def test_profile_for_another_model_falls_back(profile):
    with pytest.warns(UserWarning, match="not 'small'"):
        pl = Planner.for_policy("auto", get_config("small"), profile_path=profile)
    assert pl.initial(100) == SSVPolicy()


def test_invalid_class_and_policy_are_rejected(profile):
    with pytest.raises(ValueError, match="precision"):
        Planner.from_profile(load_profile(profile), "lossy")
    with pytest.raises(ValueError, match="auto"):
        Planner.for_policy("fastest", CFG)


def _tiny_ssv_model():
    """A tiny SSVModel with a random (untrained) head, which accepts ~1 token a round, and a 100-token prompt."""
    import jax

    from ssv_jax import draft as dr
    from ssv_jax import model as M
    from ssv_jax.speculative import SSVModel

    cfg = get_config("tiny", max_seq_len=512)
    params = M.init_params(cfg, jax.random.key(0))
    dcfg = dr.DraftConfig.for_target(cfg)
    m = SSVModel(cfg, params, dcfg, dr.init_draft_params(dcfg, jax.random.key(1)))
    return m, np.asarray(jax.random.randint(jax.random.key(2), (1, 100), 0, cfg.vocab_size))


def test_ssv_generate_switches_policy_online_and_records_the_trace(profile):
    """A random draft accepts ~1 token per round; the profile predicts 4: the planner must switch after the first
    chunk, and the greedy output stays AR's (both policies are class exact)."""
    from ssv_jax.generate import ar_generate
    from ssv_jax.speculative import ssv_generate

    m, prompt = _tiny_ssv_model()
    planner = Planner.from_profile(load_profile(profile), "exact", eps=0.5, window=8)
    res = ssv_generate(m, prompt, max_new_tokens=24, policy="auto", planner=planner, chunk_rounds=4,
                       prefill_chunk=64)
    trace = res.stats["policy_trace"]
    assert trace[0]["policy"] == P_BIG.describe() and trace[1]["policy"] == P_MID.describe()
    assert res.stats["switches"][0]["reason"] == "drift"
    assert res.stats["planner_us_per_switch"] is not None and res.stats["planner_us_per_chunk"] >= 0
    np.testing.assert_array_equal(res.tokens, ar_generate((m.cfg, m.params), prompt, 24, prefill_chunk=64).tokens)


class _CountingPlanner(Planner):
    """A Planner that counts its observations."""

    def observe(self, *args, **kw):
        self.calls = getattr(self, "calls", 0) + 1
        return super().observe(*args, **kw)


@pytest.mark.parametrize("chunk_rounds", [4, 64])
def test_the_planner_observes_between_chunks_only(profile, chunk_rounds):
    """The planner chooses the next chunk's policy, so it observes once per chunk boundary and never after the
    last chunk: every recorded switch is run by a later chunk. A generation in one chunk records no switch, although
    its acceptance (~1 token a round) is far below the profile's 4."""
    from ssv_jax.speculative import ssv_generate

    m, prompt = _tiny_ssv_model()
    planner = _CountingPlanner.from_profile(load_profile(profile), "exact", eps=0.5, window=8)
    res = ssv_generate(m, prompt, max_new_tokens=24, policy="auto", planner=planner, chunk_rounds=chunk_rounds,
                       prefill_chunk=64)
    trace = res.stats["policy_trace"]
    assert getattr(planner, "calls", 0) == len(trace) - 1
    for s in res.stats["switches"]:
        assert s["to"] in [t["policy"] for t in trace[1:]]
    if len(trace) == 1:
        assert res.stats["switches"] == []


def test_kernel_policies_run_on_the_reference_path_off_the_gpu(tmp_path):
    """A GPU profile used on a CPU: kernel policies become reference policies (same math), and a policy that then
    repeats a better-ranked one is dropped; on the GPU the ranking is kept as profiled."""
    k_big, k_mid = (p.replace(backend="kernel") for p in (P_BIG, P_MID))
    path = tmp_path / "gpu.json"
    save_profile(str(path), {"8K": _rows((k_big, 200.0, 4.0), (P_BIG, 120.0, 4.0), (k_mid, 100.0, 3.0))},
                 hardware="NVIDIA H200", model=CFG.name, prompts=[])
    prof = load_profile(str(path))
    cpu = Planner.from_profile(prof, "exact", platform="cpu")
    assert [row[0] for row in cpu.ranking["8K"]] == [P_BIG, P_MID]
    gpu = Planner.from_profile(prof, "exact", platform="gpu")
    assert [row[0] for row in gpu.ranking["8K"]] == [k_big, P_BIG, k_mid]


def test_the_best_fixed_policy_is_the_one_whose_worst_bucket_loses_least(tmp_path):
    """Each bucket's best differs (P_BIG at 8K, P_STRICT at 32K); the best fixed policy is the one profiled in
    every bucket whose worst ratio to a bucket's best is highest (P_MID: 0.9 and 0.95, where P_BIG drops to 0.5
    at 32K). A policy missing from a bucket (P_STRICT at 8K) is not eligible; the class bounds the candidates."""
    path = tmp_path / "prof.json"
    save_profile(str(path), {"8K": _rows((P_BIG, 100.0, 4.0), (P_MID, 90.0, 3.0), (P_APPROX, 300.0, 3.0)),
                             "32K": _rows((P_STRICT, 100.0, 3.0), (P_MID, 95.0, 3.0), (P_BIG, 50.0, 4.0),
                                          (P_APPROX, 300.0, 3.0))},
                 hardware="test", model=CFG.name, prompts=[])
    prof = load_profile(str(path))
    pick, scores = best_fixed_policy(prof, "strict")
    assert pick == P_MID and scores == pytest.approx({"8K": 0.9, "32K": 0.95})
    assert best_fixed_policy(prof, "approx") == (P_APPROX, pytest.approx({"8K": 1.0, "32K": 1.0}))
    with pytest.raises(ValueError, match=r"precision='loose' is invalid; accepted: \('exact', 'strict', 'approx'\)"):
        best_fixed_policy(prof, "loose")


def test_the_best_fixed_policy_breaks_ties_by_the_mean_then_needs_a_shared_candidate(tmp_path):
    path = tmp_path / "prof.json"
    save_profile(str(path), {"8K": _rows((P_BIG, 100.0, 4.0), (P_MID, 80.0, 3.0)),
                             "32K": _rows((P_MID, 100.0, 3.0), (P_BIG, 80.0, 4.0), (P_STRICT, 90.0, 2.0)),
                             "64K": _rows((P_MID, 100.0, 3.0), (P_BIG, 90.0, 4.0))},
                 hardware="test", model=CFG.name, prompts=[])
    assert best_fixed_policy(load_profile(str(path)), "strict")[0] == P_MID  # both worst 0.8; P_MID's mean higher
    save_profile(str(path), {"8K": _rows((P_BIG, 100.0, 4.0)), "32K": _rows((P_MID, 100.0, 3.0))},
                 hardware="test", model=CFG.name, prompts=[])
    with pytest.raises(ProfileError, match=r"no policy in precision class 'strict' is profiled in every bucket"):
        best_fixed_policy(load_profile(str(path)), "strict")


def _measured(policy, per_prompt):
    """A profile row with per-prompt tokens/s, its tokens_per_s their mean (as profile_policies writes it)."""
    return dict(policy=policy.to_dict(), tokens_per_s=float(np.mean(per_prompt)), tau=3.0, verify_ms=1.0,
                per_prompt_tokens_per_s=list(per_prompt))


def test_bucket_lead_is_clear_only_when_the_first_policy_wins_on_every_prompt(tmp_path):
    rng = np.random.default_rng()
    base = rng.uniform(1000.0, 5000.0, size=3)
    margin = rng.uniform(0.80, 0.99, size=3)
    mixed = margin * np.where(np.arange(3) == rng.integers(3), 1.3, 1.0)  # one prompt favours the other policy
    path = tmp_path / "prof.json"
    save_profile(str(path), {"16K": [_measured(P_MID, base * margin), _measured(P_BIG, base)],
                             "8K": [_measured(P_MID, base), _measured(P_BIG, base * mixed)]},
                 hardware="test", model=CFG.name, prompts=["a", "b", "c"])
    prof = load_profile(str(path))
    clear = bucket_lead(prof["buckets"]["16K"])  # ranked on saving: P_BIG first, faster on every prompt
    assert clear["clear"] and clear["runner_up"] == P_MID.to_dict()
    assert clear["per_prompt"] == pytest.approx(list(margin))
    assert clear["ratio"] == pytest.approx(np.mean(base * margin) / np.mean(base))
    # whichever of the two ranks first, a prompt favours the runner-up: the ranking rests on the prompts profiled
    lead = bucket_lead(prof["buckets"]["8K"])
    assert not lead["clear"] and max(lead["per_prompt"]) > 1.0 > min(lead["per_prompt"])


def test_bucket_lead_needs_two_policies_with_matching_per_prompt_figures():
    assert bucket_lead([_measured(P_MID, [100.0, 120.0])]) is None
    assert bucket_lead(_rows((P_MID, 120.0, 3.0), (P_BIG, 100.0, 4.0))) is None  # no per-prompt figures
    assert bucket_lead([_measured(P_MID, [100.0, 120.0]), _measured(P_BIG, [90.0])]) is None


def _bucket_profile(tmp_path, name, buckets, hardware="NVIDIA H200 (x86_64, jax 0.11.2)", model=CFG.name, **extra):
    """A saved profile of random tokens/s and tau per bucket (`buckets`: key -> context of its one prompt)."""
    rng = np.random.default_rng()
    rows = {b: _rows((P_MID, rng.uniform(100, 200), rng.uniform(1, 5)), (P_BIG, rng.uniform(100, 200),
                                                                          rng.uniform(1, 5)))
            for b in buckets}
    path = tmp_path / name
    save_profile(str(path), rows, hardware=hardware, model=model,
                 prompts=[dict(context=c, file=f"{name}:{b}") for b, c in buckets.items()], extra=extra)
    return load_profile(str(path))


def test_merging_profiles_takes_each_bucket_from_the_source_that_names_it(tmp_path):
    long = _bucket_profile(tmp_path, "long.json", {"16K": 15000, "8K": 8000}, command="profile 15000 8000")
    short = _bucket_profile(tmp_path, "short.json", {"8K": 8100, "32K": 30000}, command="profile 8100 30000")
    merged = merge_profiles([("long", long, ["16K"]), ("short", short, None)])
    assert list(merged["buckets"]) == ["16K", "8K", "32K"]  # in the order taken: the first is best_fixed's tie-break
    assert merged["buckets"]["16K"] == long["buckets"]["16K"]
    assert merged["buckets"]["8K"] == short["buckets"]["8K"] and merged["buckets"]["32K"] == short["buckets"]["32K"]
    assert [p["file"] for p in merged["prompts"]] == ["long.json:16K", "short.json:8K", "short.json:32K"]
    assert [(m["source"], m["buckets"], m["command"]) for m in merged["merged_from"]] == [
        ("long", ["16K"], "profile 15000 8000"), ("short", ["8K", "32K"], "profile 8100 30000")]
    assert (merged["hardware"], merged["model"]) == (long["hardware"], CFG.name)
    Planner.from_profile(merged, "exact")  # a valid profile


def test_merging_refuses_a_bucket_twice_another_card_or_model_and_a_bucket_a_source_lacks(tmp_path):
    a = _bucket_profile(tmp_path, "a.json", {"8K": 8000})
    with pytest.raises(ProfileError, match=r"bucket '8K' is in both 'a' and 'b'"):
        merge_profiles([("a", a, None), ("b", _bucket_profile(tmp_path, "b.json", {"8K": 8000}), None)])
    h100 = _bucket_profile(tmp_path, "c.json", {"16K": 15000}, hardware="NVIDIA H100 80GB HBM3 (x86_64, jax 0.11.2)")
    with pytest.raises(ProfileError, match=r"'c' was measured on 'NVIDIA H100 80GB HBM3', 'a' on 'NVIDIA H200'"):
        merge_profiles([("a", a, None), ("c", h100, None)])
    other = _bucket_profile(tmp_path, "d.json", {"16K": 15000}, model="small")
    with pytest.raises(ProfileError, match=r"'d' is for model 'small', 'a' for 'tiny'"):
        merge_profiles([("a", a, None), ("d", other, None)])
    with pytest.raises(ProfileError, match=r"'a' has no bucket '16K'; accepted: one of \['8K'\]"):
        merge_profiles([("a", a, ["16K"])])
    with pytest.raises(ProfileError, match="nothing to merge"):
        merge_profiles([])
    with pytest.raises(ProfileError, match=r"policy profile 'e'.*has version None"):
        merge_profiles([("a", a, None), ("e", {"buckets": {}}, None)])


@pytest.mark.parametrize("merged, sources", [
    ("policy_profile_s45_h200.json", [("policy_profile_16k_s42_h200.json", None), ("policy_profile_8k_s45_h200.json",
                                                                                   None)]),
    ("policy_profile_s44_h100.json", [("policy_profile_h100.json", ["16K"]), ("policy_profile_8k_s44_h100.json",
                                                                            None)]),
])
def test_the_committed_merged_profiles_are_their_sources_merged(merged, sources):
    """The default profile and the H100 one were joined from per-context runs; merging their sources gives them
    back, bucket for bucket and in order (the commands are in docs/RESULTS.md)."""
    import os

    from ssv_jax.planner import DEFAULT_PROFILE

    results = os.path.dirname(DEFAULT_PROFILE)
    want = load_profile(os.path.join(results, merged))
    got = merge_profiles([(n, load_profile(os.path.join(results, n)), b) for n, b in sources])
    assert list(got["buckets"].items()) == list(want["buckets"].items())
    assert got["prompts"] == want["prompts"]
