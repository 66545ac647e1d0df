"""The benchmark and profiling scripts' contracts, at the tiny preset on CPU: what they write, not how fast."""

import argparse
import collections
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ssv_jax.planner import load_profile, save_profile
from ssv_jax.policy import SSVPolicy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _script(name):
    return importlib.import_module(name)


def test_profile_policies_averages_every_context_of_a_bucket(tmp_path, capsys):
    """Two contexts in the same bucket ("8K"): each policy's row covers both (one prompt each, the median of two
    timed runs), ranked best first; the summary says how clearly the first leads the runner-up."""
    out = tmp_path / "prof.json"
    _script("profile_policies").main(["--random-preset", "tiny", "--contexts", "160", "200", "--prompts", "1",
                                      "--new-tokens", "6", "--trees", "2,2,4", "--schedules", "1", "2",
                                      "--reps", "2", "--out", str(out)])
    prof = load_profile(str(out))
    assert prof["reps"] == 2
    assert list(prof["buckets"]) == ["8K"]
    rows = prof["buckets"]["8K"]
    assert len(rows) == 2 and all(r["runs"] == 2 for r in rows)
    for r in rows:  # the row's figures are the means of its per-prompt figures
        assert len(r["per_prompt_tokens_per_s"]) == len(r["per_prompt_tau"]) == 2
        assert r["tokens_per_s"] == pytest.approx(np.mean(r["per_prompt_tokens_per_s"]))
        assert r["tau"] == pytest.approx(np.mean(r["per_prompt_tau"]))
    assert {r["policy"]["schedule"] for r in rows} == {1, 2}
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"]
    assert [p["context"] for p in prof["prompts"]] == [160, 200]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    assert f"runner-up {SSVPolicy.from_dict(rows[1]['policy']).describe()} at {ratio:.3f}" in capsys.readouterr().out


def test_profile_policies_show_summarizes_existing_profiles_and_runs_nothing(tmp_path, capsys):
    """--show prints each file's buckets: the first policy, then the runner-up's share of its tokens/s and whether
    a prompt favours the runner-up (a ranking the profiled prompts do not settle)."""
    a = SSVPolicy(top_k=4, depth=6, budget=32, schedule=8, precision="strict")
    b = SSVPolicy(top_k=4, depth=4, budget=16)

    def row(p, tps):
        return dict(policy=p.to_dict(), tokens_per_s=float(np.mean(tps)), tau=3.0, verify_ms=1.0,
                    per_prompt_tokens_per_s=tps)

    path = tmp_path / "prof.json"
    save_profile(str(path), {"8K": [row(a, [100.0, 200.0]), row(b, [90.0, 210.0])],
                             "16K": [row(a, [100.0, 200.0]), row(b, [80.0, 150.0])]},
                 hardware="test GPU", model="tiny", prompts=["x", "y"])
    _script("profile_policies").main(["--show", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path} (test GPU, prompts: 2)"
    assert out[1].startswith(f"8K: best {a.describe()}  150.0 tok/s")
    assert out[2].strip().startswith(f"runner-up {b.describe()} at 1.000 of it, 0.900-1.050 per prompt: some prompt")
    assert out[3].startswith(f"16K: best {a.describe()}")
    assert out[4].strip() == f"runner-up {b.describe()} at {230 / 300:.3f} of it, 0.750-0.800 per prompt"
    with pytest.raises(SystemExit, match="missing.json"):
        _script("profile_policies").main(["--show", str(tmp_path / "missing.json")])


def test_profile_policies_merge_writes_one_profile_from_per_context_files(tmp_path, capsys):
    """--merge FILE:BUCKET ... --out: the buckets taken, each from its file, in one profile that the planner loads;
    a bucket from two files is an error that names both."""
    p16, p8 = SSVPolicy(top_k=4, depth=6, budget=32), SSVPolicy(top_k=4, depth=4, budget=16)

    def profile(name, buckets):
        save_profile(str(tmp_path / name), {b: [dict(policy=p.to_dict(), tokens_per_s=100.0, tau=3.0)]
                                            for b, p in buckets.items()},
                     hardware="test GPU (x86_64)", model="tiny", prompts=[])
        return str(tmp_path / name)

    both, short = profile("both.json", {"16K": p16, "8K": p16}), profile("short.json", {"8K": p8})
    out = tmp_path / "merged.json"
    _script("profile_policies").main(["--merge", f"{both}:16K", short, "--out", str(out)])
    prof = load_profile(str(out))
    assert {b: SSVPolicy.from_dict(rows[0]["policy"]) for b, rows in prof["buckets"].items()} == {"16K": p16,
                                                                                                 "8K": p8}
    assert capsys.readouterr().out.splitlines()[0] == f"{out}: buckets ['16K', '8K'] from 2 profile(s)"
    with pytest.raises(SystemExit, match=r"bucket '8K' is in both .*both.json' and .*short.json'"):
        _script("profile_policies").main(["--merge", both, short, "--out", str(tmp_path / "bad.json")])
    assert not (tmp_path / "bad.json").exists()
    with pytest.raises(SystemExit, match=r"bucket '4K' is invalid; accepted: \['8K', '16K'"):
        _script("profile_policies").main(["--merge", f"{both}:16K,4K", "--out", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):
        _script("profile_policies").main(["--merge", both, "--show", both])


def test_profile_policies_rejects_zero_reps(tmp_path):
    with pytest.raises(SystemExit):
        _script("profile_policies").main(["--random-preset", "tiny", "--reps", "0", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit):
        _script("profile_policies").main(["--random-preset", "tiny", "--skip-prompts", "-1",
                                          "--out", str(tmp_path / "p.json")])


def test_profile_policies_profiles_held_out_text_only_unless_asked_to_fill_in(tmp_path):
    """With a tokenizer the profile's prompts are held-out text (files, then packed windows): random-token
    fill-ins are dropped, and a context no prompt reaches stops the run before any profiling (the message names the
    context and what is accepted)."""
    from ssv_jax.generate_cli import RANDOM_PROMPT, prompts
    from ssv_jax.tokenizer import Tokenizer

    pp = _script("profile_policies")
    tok = Tokenizer.load(ROOT / "checkpoints" / "ssv-small" / "tokenizer.json")
    many = len(prompts(tok, tok.vocab_size, 300, 10**6, fill=False))
    text = pp.text_prompts(tok, tok.vocab_size, 300, many + 2, 0)  # asks for two more prompts than there are
    assert len(text) == many and RANDOM_PROMPT not in [n for n, _ in text]
    assert [n for n, _ in prompts(tok, tok.vocab_size, 300, many + 2)][many:] == [RANDOM_PROMPT] * 2
    with pytest.raises(SystemExit, match=f"no held-out prompt of 300 tokens is left after skipping {many}"):
        pp.text_prompts(tok, tok.vocab_size, 300, 1, many)
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit, match="no held-out prompt of 15712 tokens is left after skipping 1000.*random-fill"):
        pp.main(["--checkpoint", str(ROOT / "checkpoints" / "ssv-small"), "--contexts", "15712",
                 "--skip-prompts", "1000", "--out", str(out)])
    assert not out.exists()


def test_held_out_prompts_are_whole_files_then_shorter_files_packed_as_in_training():
    """The files long enough alone come first, each its own first n ids; then each packed prompt is the named
    shorter files' ids, each followed by end-of-text, cut to n: a window starts at a file, its files are
    consecutive held-out files in path order, and no file appears twice. `pack=False` keeps whole files only."""
    from ssv_jax import data
    from ssv_jax.generate_cli import packed_name, prompt_files, prompts
    from ssv_jax.tokenizer import Tokenizer

    tok = Tokenizer.load(ROOT / "checkpoints" / "ssv-small" / "tokenizer.json")
    n = 1500
    got = prompts(tok, tok.vocab_size, n, 10**6, fill=False)
    docs = {rel: tok.encode(text) for rel, text in data.iter_documents("test")
            if not rel.split("/")[-1].startswith("_")}
    whole = [rel for rel, ids in docs.items() if len(ids) >= n + 16]
    assert [name for name, _ in got[:len(whole)]] == whole
    assert all(np.array_equal(ids, docs[name][:n]) and prompt_files(name) == [name] for name, ids in got[:len(whole)])
    packed = got[len(whole):]
    assert packed and all(name.startswith("packed: ") for name, _ in packed)
    short, used = [rel for rel in docs if rel not in whole], []
    for name, ids in packed:
        files = name[len("packed: "):].split(" + ")
        assert name == packed_name(files) and prompt_files(name) == files
        i = short.index(files[0])
        assert short[i:i + len(files)] == files  # consecutive files
        expect = [t for rel in files for t in list(docs[rel]) + [tok.eos_id]]
        assert len(expect) >= n and len(expect) - len(docs[files[-1]]) - 1 < n  # the last file completes it
        assert ids.dtype == np.int32 and np.array_equal(ids, expect[:n])
        used += files
    assert len(used) == len(set(used))
    assert [name for name, _ in prompts(tok, tok.vocab_size, n, 10**6, fill=False, pack=False)] == whole


def test_held_out_prompts_skip_the_first_files_the_benchmark_takes():
    """`prompts(..., skip=n)` continues the list where `prompts(..., count=n)` stops: the planner's profile
    (`profile_policies.py --skip-prompts 3`) and `bench_e2e.py --prompts 3` share no prompt."""
    from ssv_jax.generate_cli import prompts
    from ssv_jax.tokenizer import Tokenizer

    tok = Tokenizer.load(ROOT / "checkpoints" / "ssv-small" / "tokenizer.json")
    first = prompts(tok, tok.vocab_size, 300, 3)
    rest = prompts(tok, tok.vocab_size, 300, 2, skip=1)
    assert [name for name, _ in rest] == [name for name, _ in first[1:]]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(rest, first[1:]))
    with pytest.raises(ValueError, match="skip=-1"):
        prompts(tok, tok.vocab_size, 300, 1, skip=-1)


def test_schedule_decode_bench_reports_each_period_against_the_plain_loop(tmp_path):
    out = tmp_path / "sched.json"
    _script("bench_schedule_decode").main(["--preset", "tiny", "--context", "200", "--periods", "1", "2",
                                           "--stacked-periods", "1", "--steps", "2", "--backend", "reference",
                                           "--out", str(out)])
    res = json.loads(out.read_text())
    got = [(r["layout"], r["P"], r["schedule"]) for r in res["rows"]]
    assert got == [("per-layer", 1, "RRRR"), ("per-layer", 2, "RURU"), ("stacked segments", 1, "RRRR")]
    assert res["rows"][0]["vs_plain_unrolled"] == 1.0
    assert all(r["decode_ms_per_token"] > 0 and r["first_call_s"] > 0 for r in res["rows"])


def test_ar_bench_decodes_each_context_in_a_cache_sized_for_it(tmp_path):
    """One prefill of the longest context; each context decodes from its first tokens in a fitted cache (or, with
    --shared-cache, in the full one), and the JSON records the capacity and the steps of every row."""
    from ssv_jax import cache as kvc
    from ssv_jax.config import get_config

    cfg = get_config("tiny")
    for shared in (False, True):
        out = tmp_path / f"ar{shared}.json"
        _script("bench_ar").main(["--preset", "tiny", "--contexts", "64", "200", "--decode-steps", "3",
                                  "--prefill-chunk", "64", "--split-weights", "--out", str(out)]
                                 + (["--shared-cache"] if shared else []))
        res = json.loads(out.read_text())
        assert res["prefill"]["tokens"] == 200 and ("full-size" in res["cache"]) == shared
        caps = [r["cache_capacity"] for r in res["decode"]]
        full = kvc.cache_capacity(cfg, 200 + 64 + 4 * 3 + 64)
        assert caps == ([full, full] if shared else [kvc.cache_capacity(cfg, c + 4 * 3 + 64) for c in (64, 200)])
        assert [r["cache_length_at_end"] for r in res["decode"]] == [64 + 6, 200 + 6]  # warm-up + timed call
        assert all(r["decode_ms_per_token"] > 0 and r["steps"] == 3 for r in res["decode"])


def test_e2e_planner_gain_is_per_prompt_with_its_spread():
    """`bench_e2e.planner_gain`: per context, the planner's tokens/s over the fixed policy's on each prompt that
    both ran, with the median, mean and range; a prompt without both rows is left out."""
    rng = np.random.default_rng()
    fixed, planned = rng.uniform(100, 200, 3), rng.uniform(100, 200, 3)
    rows = [dict(context=8, prompt=f"p{i}", method=m, tokens_per_s=float(v))
            for i in range(3) for m, v in (("ssv", fixed[i]), ("ssv_planner", planned[i]), ("ar", 50.0))]
    rows.append(dict(context=8, prompt="planner only", method="ssv_planner", tokens_per_s=1.0))
    g = _script("bench_e2e").planner_gain(rows)
    assert list(g) == [8]
    ratio = planned / fixed
    assert g[8]["per_prompt"] == pytest.approx({f"p{i}": ratio[i] for i in range(3)})
    assert (g[8]["median"], g[8]["mean"]) == pytest.approx((np.median(ratio), np.mean(ratio)))
    assert (g[8]["min"], g[8]["max"]) == pytest.approx((ratio.min(), ratio.max()))
    assert _script("bench_e2e").planner_gain([r for r in rows if r["method"] != "ssv_planner"]) == {}
    assert "disjoint" not in g[8]  # no row says its prompt was profiled
    rows[1]["profiled"] = True  # p0's planner row: a prompt the planner's profile was measured on
    d = _script("bench_e2e").planner_gain(rows)[8]["disjoint"]
    assert d["per_prompt"] == pytest.approx({f"p{i}": ratio[i] for i in (1, 2)})
    assert (d["min"], d["max"]) == pytest.approx((ratio[1:].min(), ratio[1:].max()))


def test_e2e_marks_a_prompt_profiled_where_its_files_ranked_a_bucket_the_generation_can_use(tmp_path):
    """A planner row is `profiled` when its prompt shares a file with the profile's prompts of the prompt's context
    bucket or of the bucket its generation grows into; prompts of other buckets do not count."""

    be = _script("bench_e2e")
    path = tmp_path / "prof.json"
    used = [dict(context=8192, file="pdb.py"), dict(context=15712, file="packed: a.py + pickle.py")]
    save_profile(str(path), {"8K": [dict(policy=SSVPolicy().to_dict(), tokens_per_s=1.0, tau=2.0)]},
                 hardware="test", model="tiny", prompts=used)
    seen = be.profiled_files(str(path))
    assert seen == {"8K": {"pdb.py"}, "16K": {"a.py", "pickle.py"}}
    assert be.was_profiled(seen, "pdb.py", 8000, 96) and not be.was_profiled(seen, "pdb.py", 15712, 96)
    assert be.was_profiled(seen, "pickle.py", 8192, 96)  # 8192 + 96 tokens reach the 16K bucket
    assert not be.was_profiled(seen, "pickle.py", 4096, 96)
    assert be.was_profiled(seen, "packed: b.py + pickle.py", 15712, 96)
    assert be.was_profiled({None: {"x.py"}}, "x.py", 100, 1) and be.profiled_files(str(tmp_path / "none")) == {}


def test_e2e_bench_planner_reads_the_profile_it_is_given(tmp_path):
    """`--profile PATH`: the planner starts from that ranking's best policy in the fixed policy's class, and the
    JSON names the file; a planner row whose prompt the profile was measured on says so (`profiled`). Without
    the flag, the library's default profile is named. Each row records its chunks (policy, rounds, tau) and the
    planner's switch log, so that online switching can be read from the JSON."""
    from ssv_jax.generate_cli import RANDOM_PROMPT
    from ssv_jax.planner import DEFAULT_PROFILE

    best = SSVPolicy(top_k=2, depth=3, budget=6, order="dfs", schedule=2, precision="strict", backend="reference")
    other = best.replace(top_k=1, budget=3)
    prof = tmp_path / "prof.json"
    save_profile(str(prof), {"8K": [dict(policy=p.to_dict(), tokens_per_s=v, tau=2.0)
                                    for p, v in ((other, 10.0), (best, 20.0))]},
                 hardware="test", model="tiny", prompts=[dict(context=128, file=RANDOM_PROMPT)])
    args = ["--random-preset", "tiny", "--contexts", "128", "--prompts", "1", "--new-tokens", "4", "--tree", "2",
            "2", "4", "--backend", "reference", "--schedule", "2", "--methods", "ssv_planner", "--no-split",
            "--reps", "1"]
    out = tmp_path / "e2e.json"
    _script("bench_e2e").main(args + ["--profile", str(prof), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["planner_profile"] == str(prof)
    assert [(r["policy"], r["profiled"]) for r in res["rows"]] == [(best.describe(), True)]
    (row,) = res["rows"]
    assert row["chunks"] and {c["policy"] for c in row["chunks"]} == {best.describe()}
    assert sum(c["rounds"] for c in row["chunks"]) == row["rounds"] and row["switch_log"] == []
    assert all(1.0 <= c["tau"] <= best.depth + 1 for c in row["chunks"] if c["rounds"])
    _script("bench_e2e").main(args + ["--out", str(out)])
    assert json.loads(out.read_text())["planner_profile"] == DEFAULT_PROFILE


def test_e2e_bench_takes_the_best_fixed_policy_from_the_profile(tmp_path):
    """`--fixed profile`: the fixed policy is the profile's best over all its buckets (`best_fixed_policy`), not
    any bucket's first choice; the JSON records its per-bucket scores, and naming --tree or --schedule as well is
    refused."""

    steady = SSVPolicy(top_k=2, depth=2, budget=4, order="dfs", schedule=2, precision="strict", backend="reference")
    peaky = steady.replace(top_k=1, budget=2)
    prof = tmp_path / "prof.json"
    save_profile(str(prof), {b: [dict(policy=p.to_dict(), tokens_per_s=v, tau=2.0) for p, v in rows]
                             for b, rows in {"8K": ((peaky, 20.0), (steady, 19.0)),
                                             "16K": ((steady, 20.0), (peaky, 10.0))}.items()},
                 hardware="test", model="tiny", prompts=[])
    out = tmp_path / "e2e.json"
    args = ["--random-preset", "tiny", "--contexts", "128", "--prompts", "1", "--new-tokens", "4", "--backend",
            "reference", "--methods", "ssv", "--no-split", "--reps", "1", "--profile", str(prof), "--fixed",
            "profile", "--out", str(out)]
    _script("bench_e2e").main(args)
    res = json.loads(out.read_text())
    assert res["fixed_policy"] == steady.describe() and [r["policy"] for r in res["rows"]] == [steady.describe()]
    assert res["fixed_from_profile"] == pytest.approx({"8K": 0.95, "16K": 1.0})
    with pytest.raises(SystemExit, match=r"--fixed profile takes the fixed policy from the profile; --tree=\[2, 2, "
                                         r"4\] --schedule=None would be ignored"):
        _script("bench_e2e").main(args + ["--tree", "2", "2", "4"])
    other = json.loads(prof.read_text()) | {"model": "small"}
    prof.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"--fixed profile: the profile is for model 'small', not 'tiny'"):
        _script("bench_e2e").main(args)


def test_e2e_bench_splits_the_round_of_several_prompts_and_takes_their_median(tmp_path, capsys):
    """`--split-prompts N` splits the round from each of a context's first N prompts (one row each, in prompt
    order) and `split_median` holds each time's median over those rows; N outside [1, --prompts] is refused."""
    args = ["--random-preset", "tiny", "--contexts", "128", "--prompts", "2", "--new-tokens", "4", "--tree", "2",
            "2", "4", "--backend", "reference", "--methods", "ssv", "--reps", "1"]
    out = tmp_path / "e2e.json"
    for bad in ("0", "3"):
        with pytest.raises(SystemExit, match=f"--split-prompts={bad} is invalid; accepted: an integer in \\[1, "):
            _script("bench_e2e").main(args + ["--split-prompts", bad, "--out", str(out)])
    _script("bench_e2e").main(args + ["--split-prompts", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    names = [r["prompt"] for r in res["rows"]]
    assert len(names) == 2 and [r["prompt"] for r in res["split"]] == names
    assert [r["tau"] for r in res["split"]] == [r["tau"] for r in res["rows"]]
    (med,) = res["split_median"].values()
    assert med["prompts"] == 2
    for key in ("draft_ms", "routing_ms", "attention_ms", "rest_of_target_ms", "accept_commit_ms", "round_ms"):
        assert med[key] == pytest.approx(np.median([r[key] for r in res["split"]]))
    assert "split ms, median over 2 prompts" in capsys.readouterr().out


def test_e2e_bench_clamps_contexts_and_splits_the_fixed_policys_round(tmp_path, capsys):
    """Contexts beyond the model run at the longest it handles. The round split of the fixed policy (schedule
    P=2: RURU) has one row for the context: finite parts that sum to the round, the schedule's refresh count, and
    the tau of the same prompt's ssv run."""
    out = tmp_path / "e2e.json"
    _script("bench_e2e").main(["--random-preset", "tiny", "--contexts", "100000", "--prompts", "1",
                               "--new-tokens", "4", "--tree", "2", "2", "4", "--backend", "reference",
                               "--schedule", "2", "--methods", "ar", "ssv", "--chunk-rounds", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert (res["chunk_rounds"], res["chunk_steps"]) == (1, 128)
    longest = 2048 - 4 - 512 - 64  # tiny max_seq_len minus the new tokens and the working room
    assert {r["context"] for r in res["rows"]} == {longest}
    assert set(res["summary"]) == {f"{longest}/ar", f"{longest}/ssv"}
    assert res["summary"][f"{longest}/ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "handles at most" in printed and f"{longest} split ms:" in printed
    ssv = next(r for r in res["rows"] if r["method"] == "ssv")
    assert sum(c["rounds"] for c in ssv["chunks"]) == ssv["rounds"] and all(c["seconds"] > 0 for c in ssv["chunks"])
    assert [c["rounds"] for c in ssv["chunks"]] == [1] * ssv["rounds"]  # --chunk-rounds 1: a call per round
    (row,) = res["split"]
    assert (row["context"], row["prompt"], row["tau"]) == (longest, ssv["prompt"], ssv["tau"])
    assert (row["n_refresh"], row["n_layers"]) == (2, 4)
    parts = [row[k] for k in ("draft_ms", "routing_ms", "attention_ms", "rest_of_target_ms", "accept_commit_ms")]
    assert np.all(np.isfinite(parts))
    # draft and round are timed directly; verify is the difference of two timings, which a loaded CPU can make
    # negative (as accept+commit often is), so only its decomposition is asserted
    assert row["draft_ms"] > 0 and row["round_ms"] > 0
    assert row["draft_ms"] + row["verify_ms"] + row["accept_commit_ms"] == pytest.approx(row["round_ms"], rel=1e-6)
    assert row["attn_refresh_layer_us"] > 0 and row["attn_reuse_layer_us"] > 0
    assert row["attention_ms"] == pytest.approx(4 * row["attn_reuse_layer_us"] / 1e3)
    assert row["routing_ms"] == pytest.approx(2 * (row["attn_refresh_layer_us"] - row["attn_reuse_layer_us"]) / 1e3)
    assert sum(parts) == pytest.approx(row["round_ms"], rel=1e-6)
    assert row["negative"] == [k for k in ("draft_ms", "routing_ms", "attention_ms", "rest_of_target_ms",
                                           "accept_commit_ms") if row[k] < 0]
    assert "differences" in res["split_timing"]


def test_round_split_leaves_the_state_and_matches_generation(tmp_path):
    """The timed chunk donates its state: round_split must time copies and leave the caller's state usable; the
    prefilled state is ssv_generate's (same first token)."""
    import jax

    from ssv_jax import model as M
    from ssv_jax import timing
    from ssv_jax.generate_cli import load_model
    from ssv_jax.speculative import ssv_generate

    m, _, _ = load_model(argparse.Namespace(random_preset="tiny", checkpoint=None, seed=0))
    pol = SSVPolicy(top_k=2, depth=2, budget=4, order="dfs", backend="reference")
    p = np.random.default_rng(0).integers(0, m.cfg.vocab_size, 300).astype(np.int32)
    st, eos = timing.prefilled_state(m, p, pol, 8)
    assert int(st.root_token[0]) == int(ssv_generate(m, p, max_new_tokens=1, policy=pol).tokens[0, 0])
    r = timing.round_split(m._replace(params=M.split_layers(m.params)), pol, st, eos, rounds=2, reps=1)
    assert not any(x.is_deleted() for x in jax.tree.leaves(st))
    assert r["round_ms"] > 0 and r["draft_ms"] > 0
    assert r["accept_commit_ms"] == pytest.approx(r["round_ms"] - r["draft_ms"] - r["verify_ms"])
    with pytest.raises(ValueError, match="room"):
        timing.round_split(m, pol, st, eos, rounds=10_000)


def test_implied_8b_speed_combines_round_cost_ar_step_and_tau(tmp_path):
    """tokens/s = tau / round; speedup = that x AR step; a context without an AR step has no speedup; the TP file's
    one-device rows fill contexts the verify file lacks, and its 2-device rows are ignored. Each (tree, P, draft
    vocabulary, draft window) is its own row and takes the tau of the same tree and P from the profile's largest
    bucket, over its held-out text prompts where the row has per-prompt tau (a random-token fill-in is left out);
    a configuration the profile lacks is listed, not guessed."""
    rng = np.random.default_rng()
    tree, small = dict(top_k=8, depth=6, budget=64), dict(top_k=4, depth=6, budget=32)
    r32, r128, r128x2, ar32, tau = rng.uniform(10, 30), rng.uniform(10, 30), rng.uniform(5, 9), \
        rng.uniform(4, 8), rng.uniform(2, 5)
    r_small, r_window, tau_small = rng.uniform(5, 9), rng.uniform(5, 9), rng.uniform(2, 5)
    files = {
        "verify_8b_h200.json": dict(rows=[
            dict(context=32768, backend="kernel", tree=tree, round_ms=r32),
            dict(context=32768, backend="reference", tree=tree, round_ms=99.0),
            dict(context=32768, backend="kernel", tree=small, schedule=4, draft_vocab=32000, round_ms=r_small),
            dict(context=32768, backend="kernel", tree=small, schedule=4, draft_vocab=32000, draft_window=4096,
                 round_ms=r_window),
            dict(context=32768, backend="kernel", tree=small, schedule=2, draft_vocab=32000, round_ms=1.0)]),
        "tp_h200x2.json": dict(rows=[dict(context=131072, backend="kernel", devices=1, tree=tree, round_ms=r128),
                                     dict(context=131072, backend="kernel", devices=2, tree=tree,
                                          round_ms=r128x2)]),
        "ar_8b_h200.json": dict(decode=[dict(context=32768, decode_ms_per_token=ar32)]),
        "policy_profile.json": dict(prompts=[dict(context=8192, file="a.py"), dict(context=15712, file="b.py"),
                                             dict(context=15712, file="random tokens")], buckets={
            "8K": [dict(policy=dict(tree, schedule=1), tau=tau - 1.0),
                   dict(policy=dict(small, schedule=4), tau=tau_small + 1.0)],
            "16K": [dict(policy=dict(tree, schedule=1), tau=tau),
                    dict(policy=dict(tree, schedule=4), tau=tau + 1.0),
                    dict(policy=dict(small, schedule=4), tau=(tau_small + 1.0) / 2,
                         per_prompt_tau=[tau_small, 1.0]),  # b.py, then the random-token fill-in
                    dict(policy=dict(small, schedule=1), tau=tau_small + 2.0)]}),
    }
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    out = tmp_path / "implied.json"
    _script("implied_8b").main(["--results", str(tmp_path), "--out", str(out)])
    res = json.loads(out.read_text())
    assert "IMPLIED" in res["label"]
    by = {(r["tree"]["budget"], r["schedule"], r["draft_vocab"], r["draft_window"], r["context"]): r
          for r in res["rows"]}
    assert set(by) == {(64, 1, 128256, None, 32768), (64, 1, 128256, None, 131072), (32, 4, 32000, None, 32768),
                       (32, 4, 32000, 4096, 32768)}
    a, b, c = by[64, 1, 128256, None, 32768], by[64, 1, 128256, None, 131072], by[32, 4, 32000, None, 32768]
    w = by[32, 4, 32000, 4096, 32768]
    assert a["tau"] == pytest.approx(tau) and "16K" in a["tau_source"]
    assert a["tau_prompts"] == ["b.py", "random tokens"] and c["tau_prompts"] == ["b.py"]
    assert a["implied_ssv_tokens_per_s"] == pytest.approx(tau / r32 * 1e3)
    assert a["implied_speedup"] == pytest.approx(tau / r32 * ar32)
    assert b["round_ms"] == pytest.approx(r128) and b["round_source"] == "tp_h200x2.json"
    assert b["implied_speedup"] is None and b["ar_tokens_per_s"] is None
    assert c["tau"] == pytest.approx(tau_small) and c["implied_speedup"] == pytest.approx(tau_small / r_small * ar32)
    assert w["tau"] == pytest.approx(tau_small) and w["implied_speedup"] == pytest.approx(tau_small / r_window * ar32)
    assert res["no_tau"] == [dict(tree=small, schedule=2, draft_vocab=32000, draft_window=None)]
    best = max((a, c, w), key=lambda r: r["implied_speedup"])
    assert res["best_per_context"]["32768"] == best


def test_traced_op_classes_and_per_gpu_summary():
    """`timing.op_summary` (bench_verify --trace-dir, profile_decode) sums each GPU's traced busy time and op
    count by class, per call: NCCL collectives, GEMM fusions, our Pallas kernels, everything else."""
    from ssv_jax.timing import OP_CATEGORIES, op_category, op_summary

    names = {"ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective", "all-reduce-start.3": "collective",
             "gemm_fusion_dot_260": "matmul", "cutlass_80_tensorop_bf16_s16816gemm": "matmul",
             "compressed_attention": "nsa_kernel", "grouped_verify": "nsa_kernel", "top_n": "nsa_kernel",
             "decode_refresh": "nsa_kernel", "decode_combine": "nsa_kernel", "commit_blocks": "nsa_kernel",
             "fused_gemv": "matmul", "fused_gemv__1": "matmul",
             "loop_add_fusion_62": "other", "input_reduce_fusion_160": "other"}
    assert {n: op_category(n) for n in names} == names
    r = np.random.default_rng()
    ops = {f"/device:GPU:{g}": {n: [float(r.integers(1, 100)), int(r.integers(1, 9))] for n in names} for g in (0, 1)}
    per = 4
    summary = op_summary(ops, per)
    for gpu, rows in ops.items():
        got = summary[gpu]
        for c in OP_CATEGORIES:
            want_us = sum(us for n, (us, _) in rows.items() if names[n] == c) / per
            want_ops = sum(k for n, (_, k) in rows.items() if names[n] == c) / per
            assert got[c] == {"us": round(want_us, 1), "ops": round(want_ops, 1)}
        assert got["total_us"] == round(sum(us for us, _ in rows.values()) / per, 1)


def test_round_profile_reports_ar_steps_ssv_rounds_and_stages(tmp_path):
    """profile_round.py writes per-step / per-round host times, tau and each stage's traced summary (on CPU the
    trace has no GPU ops, so the op tables are empty: the host figures and the round count must still be real)."""
    out = tmp_path / "rp.json"
    _script("profile_round").main(["--random-preset", "tiny", "--context", "300", "--steps", "3", "--rounds", "2",
                                   "--tree", "2", "3", "8", "--schedule", "2", "--backend", "reference",
                                   "--trace-dir", str(tmp_path / "tr"), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["ar"]["steps"] == 3 and res["ar"]["host_ms_per_step"] > 0
    assert 1 <= res["ssv"]["rounds"] <= 2 and 1.0 <= res["ssv"]["tau"] <= 4.0  # depth 3: at most 3 + bonus
    assert res["draft"]["calls"] == 2 and res["draft_verify"]["host_ms_per_call"] > 0
    assert "P=2" in res["policy"] and res["context"] == 300
    r = res["reading"]
    assert r["implied_speedup"] == pytest.approx(res["ssv"]["tau"] * res["ar"]["host_ms_per_step"]
                                                 / res["ssv"]["host_ms_per_round"])
    with pytest.raises(SystemExit, match="--rounds=0"):
        _script("profile_round").main(["--random-preset", "tiny", "--rounds", "0"])


def test_draft_window_runs_decode_the_same_tokens_per_prompt(tmp_path):
    """draft_window.py: for each prompt, every window decodes the target's greedy tokens (only tau may differ), and
    the JSON has one row per (prompt, window) and a mean tau per (context, window)."""
    out = tmp_path / "dw.json"
    _script("draft_window").main(["--checkpoint", str(ROOT / "checkpoints" / "ssv-small"), "--contexts", "300",
                                  "--windows", "none", "64", "--prompts", "1", "--new-tokens", "8",
                                  "--tree", "2", "3", "8", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(r["context"], r["window"]) for r in res["rows"]] == [(300, None), (300, 64)]
    assert all(r["same_tokens_as_first_window"] and 1.0 <= r["tau"] <= 4.0 for r in res["rows"])
    assert res["bundle_window"] == 4096 and set(res["summary"]) == {"300/None", "300/64"}
    with pytest.raises(SystemExit):
        _script("draft_window").main(["--windows", "0"])


def test_bundle_layer_variants_match_the_reference_before_they_are_timed(tmp_path):
    """tune_bundle_layers.py checks each variant's output against `nsa.nsa_attention` at the bundled model's verify
    shapes (interpret mode on CPU) and records its host time; on CPU the trace has no GPU ops."""
    out = tmp_path / "bl.json"
    _script("tune_bundle_layers").main(["--checkpoint", str(ROOT / "checkpoints" / "ssv-small"), "--contexts", "256",
                                        "--iters", "1", "--sets", "1", "--only", "reuse_L1_C4_splitauto_w4",
                                        "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["variant"] == "reuse_L1_C4_splitauto_w4" and row["context"] == 256
    assert row["rel_rms_vs_reference"] < 1e-4 and "host_us" in row and row["ops"] == 0


def test_generate_cli_with_a_draft_window_still_decodes_the_ar_tokens(capsys):
    """ssv_generate.py --draft-window overrides the head's window; greedy SSV still emits greedy AR's tokens
    (--compare-ar says so), and a negative window is refused with the accepted range."""
    from ssv_jax.generate_cli import main

    assert main(["--random-preset", "tiny", "--prompt-tokens", "300", "--max-new-tokens", "12", "--draft-window", "64",
                 "--top-k", "2", "--depth", "3", "--budget", "8", "--compare-ar"]) == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--draft-window=-1 is invalid; accepted: 0"):
        main(["--random-preset", "tiny", "--draft-window", "-1"])


def test_generate_cli_compares_against_ar_under_the_policys_schedule(capsys):
    """Greedy SSV equals greedy AR under the same schedule, so --compare-ar decodes AR under the policy's (with
    reuse layers the text differs from the refresh-every-layer model's on this random model)."""
    from ssv_jax.generate_cli import main

    assert main(["--random-preset", "tiny", "--prompt-tokens", "200", "--max-new-tokens", "24", "--top-k", "4",
                 "--depth", "4", "--budget", "16", "--schedule", "2", "--compare-ar"]) == 0
    out = capsys.readouterr().out
    assert "AR NSA (schedule P=2)" in out and "greedy outputs identical: True" in out


def test_compare_ar_says_where_outputs_part_and_what_that_means():
    from ssv_jax.generate_cli import compare_outputs

    exact, approx = dict(approx=False, dtype="float32"), dict(approx=True, dtype="float32")
    assert compare_outputs([1, 2, 3], [1, 2, 3], 0.0, **exact) == "greedy outputs identical: True"
    assert "part at token 2; unexpected in float32" in compare_outputs([1, 2, 3], [1, 2, 4], 0.0, **exact)
    assert "part at token 2; possible in bfloat16" in compare_outputs([1, 2, 3], [1, 2, 4], 0.0, approx=False,
                                                                      dtype="bfloat16")
    assert "part at token 0; expected: mode B" in compare_outputs([1, 2, 3], [0, 2, 3], 0.0, **approx)
    assert "part at token 2;" in compare_outputs([1, 2, 3], [1, 2], 0.0, **exact)  # one stopped early
    assert compare_outputs([1, 2], [3, 4], 1.0, **exact).startswith("sampled outputs are not compared")


def test_generate_cli_names_a_bad_value_in_one_line_and_exits_2(capsys, tmp_path):
    """A bad flag value or a missing file ends ssv_generate.py with one `error:` line on stderr naming it
    and status 2, not a traceback."""
    from ssv_jax.generate_cli import main

    cases = [(["--random-preset", "tiny", "--max-new-tokens", "0"], "max_new_tokens=0 is invalid; accepted"),
             (["--random-preset", "tiny", "--top-k", "0"], "top_k=0 is invalid; accepted"),
             (["--checkpoint", str(tmp_path)], "is not a bundle: config.json is missing"),
             (["--prompt-file", str(tmp_path / "missing.py")], "No such file or directory")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2, argv
        last = err.strip().splitlines()[-1]  # earlier lines may be warnings
        assert "Traceback" not in err and ": error: " in last and message in last, (argv, err)


def test_chunk_cost_fits_a_per_call_and_a_per_round_cost(tmp_path):
    """One timed chunk per requested length, each running all of its rounds; with two lengths the least-squares
    line passes through both; the null call over the same arguments is timed too."""
    out = tmp_path / "chunk_cost.json"
    res = _script("chunk_cost").main(["--random-preset", "tiny", "--context", "200", "--rounds", "2", "1",
                                      "--tree", "2", "2", "4", "--schedule", "2", "--backend", "reference",
                                      "--reps", "1", "--chain", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert [r["rounds"] for r in res["rows"]] == [1, 2]
    assert [(c["rounds"], c["chain"]) for c in res["chained"]] == [(1, 2)]  # only rounds * chain <= max(rounds)
    assert res["chained"][0]["ms_per_chunk"] > 0 and res["chained"][0]["dispatch_ms"] > 0
    for r in res["rows"]:
        assert r["ms"] > 0
        assert res["fit"]["per_call_ms"] + r["rounds"] * res["fit"]["per_round_ms"] == pytest.approx(r["ms"])
    assert res["null_ms"] > 0 and res["argument_buffers"] > 10


def test_chunk_cost_needs_two_chunk_lengths():
    with pytest.raises(SystemExit, match="two distinct"):
        _script("chunk_cost").main(["--random-preset", "tiny", "--rounds", "4", "4"])
    with pytest.raises(SystemExit, match="--chain=1 is invalid"):
        _script("chunk_cost").main(["--random-preset", "tiny", "--rounds", "1", "2", "--chain", "1"])


def test_round_ops_attributes_traced_ops_to_their_source_lines():
    """Trace names map to HLO instructions (`fusion_3` is `fusion.3`), frames to `module.function:line` of this
    repository's files, counts and µs are per round, and ops with no such frame keep their own name."""
    hlo = "\n".join([
        "HloModule m", "FileNames", '1 "/x/ssv_jax/draft.py"', '2 "/usr/lib/jax/core.py"', "",
        "FunctionNames", '1 "_attend"', '2 "draft_tree_level"', '3 "bind"', "",
        "FileLocations", "1 {file_name_id=1 function_name_id=2 line=40}", "2 {file_name_id=1 function_name_id=1 line=7}",
        "3 {file_name_id=2 function_name_id=3 line=9}", "",
        "StackFrames", "1 {file_location_id=1}", "2 {file_location_id=2 parent_frame_id=2}",
        "3 {file_location_id=3 parent_frame_id=3}", "",
        '  %fusion.3 = f32[4] fusion(%p), kind=kLoop, metadata={op_name="jit(f)/exp" stack_frame_id=3}',
        '  %gemm.1 = f32[4] fusion(%p), kind=kCustom, metadata={op_name="jit(f)/dot_general" stack_frame_id=2}',
    ])
    trace = {"rounds": 2, "host_ms_per_round": 1.0,
             "ops": {"fusion_3": [10.0, 4], "gemm_1": [6.0, 2], "void topk_kernel<4>": [8.0, 2]}}
    res = _script("round_ops").attribute(hlo, trace, depth=2)
    rows = {r["source"]: r for r in res["by_source"]}
    assert rows["draft._attend:7 < draft.draft_tree_level:40"]["ops"] == 3.0  # fusion.3's jax frame is skipped
    assert rows["draft._attend:7 < draft.draft_tree_level:40"]["us"] == 8.0
    assert rows["void topk_kernel<4>"]["ops"] == 1.0
    assert res["ops_per_round"] == 4.0 and res["gpu_busy_us_per_round"] == 12.0
    assert res["by_stage"] == [dict(stage="drafting", ops=3.0, us=8.0), dict(stage="other", ops=1.0, us=4.0)]


def test_round_ops_ceiling_bounds_what_a_target_speedup_over_ar_would_take():
    """Both bounds favour SSV: charging the round only one AR step plus its drafting, or accepting every drafted
    token, never reads below the measured speed-up when the measured round costs at least that much; the round,
    drafting time and depth they name reach the target exactly or first."""
    ro = _script("round_ops")
    rng = np.random.default_rng()
    for _ in range(20):
        ar, draft_us, depth = rng.uniform(0.1, 1.0), rng.uniform(10, 500), int(rng.integers(1, 9))
        rnd = ar + draft_us / 1e3 + rng.uniform(0, 1.0)
        tau, level, target = rng.uniform(1, depth + 1), rng.uniform(0, 0.2), rng.uniform(1.5, 5)
        c = ro.ceiling(ar, rnd, tau, depth, draft_us, level, target)
        assert c["measured"] == pytest.approx(tau * ar / rnd)
        assert c["verify_as_cheap_as_ar"] >= c["measured"] and c["perfect_head"][0]["speedup"] >= c["measured"]
        assert c["round_needed_ms"] * target == pytest.approx(tau * ar)
        assert tau * ar / (ar + c["draft_needed_ms"]) == pytest.approx(target)
        d = c["perfect_head_depth_needed"]
        reach = [p["depth"] for p in c["perfect_head"] if p["speedup"] >= target]
        assert d == (reach[0] if reach else None)
    c = ro.ceiling(0.4, 1.0, 5.0, 6, 200.0, 0.05, 3.5)
    assert [p["depth"] for p in c["perfect_head"][:5]] == [6, 7, 8, 9, 10]
    assert c["perfect_head"][3]["speedup"] == pytest.approx(10 * 0.4 / 1.15) and c["perfect_head_depth_needed"] == 10
    with pytest.raises(ValueError, match="tau=0"):
        ro.ceiling(0.4, 1.0, 0, 6, 200.0, 0.05)
    assert "device_only" not in c
    dev = ro.ceiling(0.4, 1.0, 5.0, 6, 200.0, 0.05, 3.5, device=(300.0, 200.0))["device_only"]
    assert dev["speedup"] == pytest.approx(5.0 * 300.0 / 500.0)
    with pytest.raises(ValueError, match="device="):
        ro.ceiling(0.4, 1.0, 5.0, 6, 200.0, 0.05, device=(0.0, 200.0))


def test_round_ops_ceiling_reads_its_figures_from_the_benchmark_files(tmp_path, capsys):
    """AR ms a token and the round's ms and tau come from the e2e rows at the context (decode time over rounds,
    over all prompts), the drafting µs from the named attribution's drafting stage, and the cost of a level from
    the profile's two depths of the fixed tree (or, with --e2e-run, from one run of a file that gathers several);
    without --ops the drafting µs are --profile's draft stage; a missing run, neither source of drafting, or a
    profile with one depth is refused by name."""
    ro = _script("round_ops")
    fixed = SSVPolicy(top_k=4, depth=6, budget=32, order="dfs", schedule=4, precision="strict", backend="kernel")
    rows = [dict(context=99, method="ar", decode_s=0.04, rounds=100, tau=1.0, policy=None),
            dict(context=99, method="ar", decode_s=0.02, rounds=50, tau=1.0, policy=None),
            dict(context=99, method="ssv", decode_s=0.02, rounds=20, tau=5.0, policy=fixed.describe()),
            dict(context=99, method="ssv", decode_s=0.03, rounds=30, tau=4.0, policy=fixed.describe()),
            dict(context=7, method="ar", decode_s=9.0, rounds=1, tau=1.0, policy=None)]
    (tmp_path / "e2e.json").write_text(json.dumps(dict(fixed_policy=fixed.describe(), rows=rows)))
    src = [dict(source="draft._finish:348 < draft.draft_tree_level:437", ops=10.0, us=120.0),
           dict(source="tree.step:306 < tree.build_tree_with:228", ops=2.0, us=30.0),
           dict(source="fused_gemv", ops=8.0, us=500.0)]
    (tmp_path / "ops.json").write_text(json.dumps({"runs": {"x": dict(by_source=src)}}))
    prof = [dict(policy=fixed.replace(depth=d).to_dict(), tokens_per_s=1.0, tau=1.0, round_ms=r)
            for d, r in ((6, 1.0), (8, 1.5), (7, 1.06))]
    prof.append(dict(policy=fixed.replace(depth=5, top_k=8).to_dict(), tokens_per_s=1.0, tau=1.0, round_ms=0.1))
    (tmp_path / "prof.json").write_text(json.dumps(dict(buckets={"16K": prof})))
    args = ["ceiling", "--e2e", str(tmp_path / "e2e.json"), "--context", "99", "--ops", str(tmp_path / "ops.json"),
            "--levels", str(tmp_path / "prof.json"), "--out", str(tmp_path / "c.json")]
    res = ro.main(args + ["--run", "runs/x"])
    want = ro.ceiling(0.4, 1.0, 4.4, 6, 150.0, 0.06, 3.5)  # the two shallowest depths: 1.06 - 1.0
    scalars = [k for k, v in want.items() if isinstance(v, float)]
    assert {k: res[k] for k in scalars} == pytest.approx({k: want[k] for k in scalars})
    assert [p["speedup"] for p in res["perfect_head"]] == pytest.approx([p["speedup"] for p in want["perfect_head"]])
    assert json.loads((tmp_path / "c.json").read_text())["sources"]["run"] == "runs/x"
    assert "needs a round of" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="runs/x"):
        ro.main(args + ["--run", "runs/y"])
    (tmp_path / "prof_round.json").write_text(json.dumps(dict(reading=dict(gpu_busy_us=dict(ar=300.0, draft=100.0)))))
    dev = ro.main(args + ["--run", "runs/x", "--profile", str(tmp_path / "prof_round.json")])["device_only"]
    assert dev == dict(ar_us=300.0, draft_us=100.0, speedup=pytest.approx(4.4 * 300.0 / 400.0))
    no_ops = [a for a in args if a not in ("--ops", str(tmp_path / "ops.json"))]
    alone = ro.main(no_ops + ["--profile", str(tmp_path / "prof_round.json")])  # drafting: the profile's 100 µs
    assert alone["draft_us"] == 100.0 and alone["sources"]["drafting"] == "the profile's draft stage alone"
    assert alone["verify_as_cheap_as_ar"] == pytest.approx(4.4 * 0.4 / (0.4 + 0.1))
    with pytest.raises(SystemExit, match="--ops is missing"):
        ro.main(no_ops)
    (tmp_path / "runs.json").write_text(json.dumps(dict(runs={"99": dict(fixed_policy=fixed.describe(), rows=rows)})))
    nested = ["--e2e", str(tmp_path / "runs.json"), "--run", "runs/x"]
    assert ro.main(args + nested + ["--e2e-run", "99"])["measured"] == pytest.approx(want["measured"])
    with pytest.raises(SystemExit, match="accepted: \\['99'\\]"):
        ro.main(args + nested + ["--e2e-run", "98"])
    (tmp_path / "prof.json").write_text(json.dumps(dict(buckets={"16K": prof[:1]})))
    with pytest.raises(SystemExit, match="fewer than two depths"):
        ro.main(args + ["--run", "runs/x"])


def test_bench_topn_times_every_primitive_against_its_reference(tmp_path):
    """Each row times each primitive and records whether its indices equal the reference's (`jax.lax.top_k`, or
    the top k of the log-softmax for the draft selection); on CPU the kernels run interpreted, and all agree."""
    rows = _script("bench_topn").run(iters=2, shapes=[("routing", 3, 40, 4)],
                                     draft_shapes=[("draft", 2, 64, 4), ("wide draft", 1, 5000, 4)],
                                     log=lambda *_: None)
    assert [r["shape"] for r in rows] == ["routing", "draft", "wide draft"]
    assert set(rows[0]) >= {"xla_top_k", "rank_top_n", "pallas_top_n"}
    assert set(rows[1]) >= {"xla_log_softmax_top_k", "pallas_top_n_log_softmax"}
    for r in rows:
        timed = {k: v for k, v in r.items() if isinstance(v, dict)}
        assert timed and all(v["equals_reference"] and v["us_per_call"] > 0 for v in timed.values())


def test_xla_flag_sweep_runs_bench_e2e_once_per_flag_set_and_records_rejected_flags(tmp_path):
    """`sweep_xla_flags.py --e2e` runs `bench_e2e.py` with the arguments after `--` in one process per flag set:
    the default set's summary and rows land in the JSON, and a flag XLA rejects is recorded as that set's error."""
    out = tmp_path / "sweep.json"
    _script("sweep_xla_flags").main([
        "--e2e", "--sets", "default", "--extra", "bogus=--xla_no_such_flag_for_this_test=1", "--timeout", "300",
        "--out", str(out), "--", "--random-preset", "tiny", "--contexts", "256", "--prompts", "1",
        "--new-tokens", "4", "--methods", "ar", "--no-split", "--reps", "1"])
    res = json.loads(out.read_text())
    assert res["benchmark"] == "e2e_xla_flags_sweep" and res["bench_e2e_args"][:2] == ["--random-preset", "tiny"]
    default = res["runs"]["default"]
    assert default["flags"] == "" and set(default["summary"]) == {"256/ar"}
    assert default["summary"]["256/ar"]["tokens_per_s"] > 0 and len(default["rows"]) == 1
    bogus = res["runs"]["bogus"]
    assert "summary" not in bogus and "xla_no_such_flag_for_this_test" in bogus["error"]


def test_xla_flag_sweep_takes_bench_arguments_only_with_e2e(tmp_path):
    with pytest.raises(SystemExit, match="need --e2e"):
        _script("sweep_xla_flags").main(["--out", str(tmp_path / "x.json"), "--", "--contexts", "256"])


def test_round_ops_capture_refuses_a_bad_tree_or_period_by_name(tmp_path):
    """`capture --tree TOP_K DEPTH BUDGET --schedule P` picks the traced policy; a value below 1 is refused, naming
    it, before anything is loaded."""
    ro = _script("round_ops")
    with pytest.raises(SystemExit, match=r"--tree=\[4, 0, 24\].*accepted: integers >= 1"):
        ro.main(["capture", "--raw-dir", str(tmp_path), "--tree", "4", "0", "24", "--schedule", "8"])
    with pytest.raises(SystemExit, match="--schedule=0"):
        ro.main(["capture", "--raw-dir", str(tmp_path), "--tree", "4", "5", "24", "--schedule", "0"])
    assert not any(tmp_path.iterdir())


def test_round_ops_stages_sum_an_attribution_by_stage_of_the_round(tmp_path, capsys):
    """Each source chain lands in one stage: the head's projections inside `draft_extend` count as committing, a
    `_common` helper as the kernel that calls it, a kernel known only by name by that name, the round's own
    bookkeeping as accept and commit, unknown names as other. `stages` finds attributions nested in a JSON and
    its sums keep every op and µs."""
    ro = _script("round_ops")
    cases = {"draft._qkv:248 < draft.draft_extend:385": "accept and commit",
             "draft._finish:348 < draft.draft_tree_level:437": "drafting",
             "_common.combine:261 < draft_attention.draft_attention:139": "drafting",
             "_common.gate:278 < reuse_layer.reuse_layer:53": "verify attention",
             "model.path_blocks:529 < model.layer:540": "per-path blocks",
             "model._mm:76 < model._split_fused:173": "verify projections and norms",
             "fused_gemv__2": "verify projections and norms",
             "model.forward_tree:524 < speculative.ssv_round:117": "verify projections and norms",
             "speculative.ssv_round:136 < speculative.body:164": "accept and commit",
             "top_n__1": "top-n kernels (drafting and routing)",
             "MemcpyD2H": "loop and copies",
             "input_reduce_fusion_9": "other"}
    for source, stage in cases.items():
        assert ro.stage_of(source) == stage, source
    rng = np.random.default_rng()
    rows = [dict(source=s, ops=float(rng.integers(1, 9)), us=float(rng.uniform(1, 50))) for s in cases]
    run = dict(ops_per_round=sum(r["ops"] for r in rows), gpu_busy_us_per_round=sum(r["us"] for r in rows),
               by_source=rows)
    path = tmp_path / "ops.json"
    path.write_text(json.dumps({"runs": {"a": run}}))
    (got,) = ro.main(["stages", str(path)])[str(path)].values()
    assert len(got) == len(set(cases.values()))
    assert sum(r["ops"] for r in got) == pytest.approx(run["ops_per_round"], abs=0.05)  # rows keep 2 decimals
    assert sum(r["us"] for r in got) == pytest.approx(run["gpu_busy_us_per_round"], abs=0.05)
    assert [r["us"] for r in got] == sorted((r["us"] for r in got), reverse=True)
    assert "runs/a" in capsys.readouterr().out
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds no attribution"):
        ro.main(["stages", str(tmp_path / "none.json")])


def test_gpu_smoke_reports_greedy_ssv_equal_to_ar_for_the_fixed_tree_and_auto(tmp_path):
    """The smoke check runs the fixed tree and policy='auto' per dtype and records whether greedy SSV emitted
    greedy AR's tokens (fp32: it must)."""
    out = tmp_path / "smoke.json"
    res = _script("gpu_smoke").main(["--random-preset", "tiny", "--dtypes", "float32", "--context", "100",
                                     "--new-tokens", "8", "--tree", "2", "3", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert [r["dtype"] for r in res["rows"]] == ["float32", "float32"]
    assert "tree(k=2, depth=3, budget=6)" in res["rows"][0]["policy"]
    assert all(r["greedy_identical"] and r["tau"] >= 1 for r in res["rows"])


def test_mode_b_agreement_pairs_trees_and_free_runs_against_mode_a(tmp_path):
    """Per policy: paired next-token agreement and tau on identical trees, and a free run against mode A's text;
    in groups of one, mode B is mode A on both counts."""
    out = tmp_path / "mode_b.json"
    res = _script("mode_b_agreement").main(["--random-preset", "tiny", "--context", "200", "--prompts", "1",
                                            "--rounds", "2", "--trees", "2,3,6", "--orders", "dfs",
                                            "--group-sizes", "1", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    one, six = (r["summary"] for r in res["results"])
    assert [r["policy"]["group_size"] for r in res["results"]] == [1, 6]
    assert one["rounds"] == six["rounds"] == 2
    assert one["node_agreement"] == one["emitted_agreement"] == one["free_run_position_agreement"] == 1.0
    assert one["tau_a"] == one["tau_b"] and one["max_logit_gap_median"] < 1e-5
    assert six["max_logit_gap_median"] > 1e-3  # six queries route with the root's blocks
    run = res["results"][1]["per_prompt"][0]["free_run"]
    assert run["tokens"] == 1 + sum(res["results"][1]["per_prompt"][0]["paired"]["accepted_a"])
    assert 0 <= run["first_divergence"] <= run["tokens"]


def test_mode_b_agreement_names_a_bad_flag(capsys):
    with pytest.raises(SystemExit):
        _script("mode_b_agreement").main(["--random-preset", "tiny", "--rounds", "0"])
    assert "--rounds 0 is invalid" in capsys.readouterr().err


def test_schedule_quality_reports_each_period_against_the_first(tmp_path):
    out = tmp_path / "sq.json"
    res = _script("schedule_quality").main(["--random-preset", "tiny", "--seq-len", "200", "--windows", "2",
                                            "--periods", "1", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    ref, p2 = res["rows"]
    assert res["periods"] == [1, 2] and ref["schedule"] is None and p2["schedule"] == 2
    assert ref["agreement"] == ref["agreement_routed"] == 1.0
    assert ref["tokens_scored"] == p2["tokens_scored"] == 2 * 199 and ref["tokens_routed"] == 2 * (199 - 128)
    assert 0 <= p2["agreement_routed"] <= 1 and len(p2["per_window_agreement_routed"]) == 2
    assert ref["perplexity"] > 1 and p2["perplexity"] > 1
    assert ref["margin_changed_median"] is None and ref["changed_below_routed_q25"] is None
    assert 0 <= ref["margin_routed_q25"] <= ref["margin_routed_median"] == p2["margin_routed_median"]
    if p2["agreement_routed"] < 1:
        assert p2["margin_changed_median"] >= 0 and 0 <= p2["changed_below_routed_q25"] <= 1


def test_schedule_quality_names_a_bad_period(capsys):
    with pytest.raises(SystemExit):
        _script("schedule_quality").main(["--random-preset", "tiny", "--periods", "1", "8"])
    assert "--periods: refresh period P=8 is invalid" in capsys.readouterr().err


def test_kernel_timing_measures_the_empty_loop_beside_every_repeat_of_the_full_one(monkeypatch):
    """A clock that drifts between repeats must not leak into the net per-call time: each repeat times the full loop
    and then the empty loop, and the net figure is the median of the per-repeat differences."""
    bk = _script("bench_kernels")
    n, per_call_us, drift_us = 10, 3.0, iter([0.0, 0.0, 40.0, 40.0, 7.0, 7.0, 90.0, 90.0, 1.0, 1.0])
    clock, calls = [0.0], []

    def fake_loop(name, cost_us):
        def loop(static, rot):
            calls.append(name)
            if len(calls) > 2:  # after both warm-ups, every timed call advances the clock
                clock[0] += (next(drift_us) + cost_us * n) * 1e-6
            return np.zeros(1)
        return loop

    monkeypatch.setattr(bk.time, "perf_counter", lambda: clock[0])
    net, full, empty = bk._measure_pair(fake_loop("full", 5.0 + per_call_us), fake_loop("empty", 5.0), None, None,
                                        n, repeats=5)
    assert calls == ["full", "empty"] + ["full", "empty"] * 5
    assert net == pytest.approx(per_call_us)
    assert full - empty == pytest.approx(per_call_us)
    assert full > 5.0 + per_call_us and empty > 5.0  # the drift is in both figures, only the difference drops it


def test_traced_kernel_time_is_the_loops_gpu_busy_time_less_the_empty_loops(monkeypatch):
    """`gpu_busy` reads GPU busy time from a profiler trace of the timed loop, subtracts the empty loop's (traced
    once per input signature), and divides by the calls; it also reports the time in our Pallas kernels alone. With
    no GPU in the trace (CPU) it says so with None."""
    import jax.numpy as jnp
    bk = _script("bench_kernels")
    n, rot, static = 10, (jnp.ones((bk.R, 4, 4)),), (jnp.ones((4, 4)),)
    assert bk.gpu_busy(lambda q, w: q @ w, static, rot, n=n) is None  # this machine's trace has no GPU

    empty_ops = {"dynamic-slice": [20.0, 10], "loop-cond": [10.0, 10]}  # 3 µs an iteration
    traces = iter([{"/device:GPU:0 (H100)": empty_ops},
                   {"/device:GPU:0 (H100)": {**empty_ops, "grouped_verify_kernel": [42.0, 10], "fusion.7": [8.0, 10]}},
                   {"/device:GPU:0 (H100)": {**empty_ops, "naive_verify_kernel": [70.0, 10]}}])
    traced = []

    def fake_trace(fn, trace_dir):
        traced.append(fn())
        return next(traces)

    monkeypatch.setattr(bk.timing, "traced_gpu_ops", fake_trace)
    monkeypatch.setattr(bk, "_EMPTY_BUSY", {})
    grouped = bk.gpu_busy(lambda q, w: q @ w, static, rot, n=n)
    assert grouped == pytest.approx(dict(gpu_busy_us=5.0, gpu_busy_nsa_kernel_us=4.2))  # kernel 4.2 + combine 0.8
    assert bk.gpu_busy(lambda q, w: q + w, static, rot, n=n) == pytest.approx(
        dict(gpu_busy_us=7.0, gpu_busy_nsa_kernel_us=7.0))
    assert len(traced) == 3  # the empty loop was traced once for both kernels


def test_an_empty_trace_on_a_gpu_is_an_error_not_a_missing_figure(monkeypatch):
    """CUPTI takes one subscriber a process: once torch's profiler has traced fla, JAX's traces hold no GPU events.
    On a GPU backend `gpu_busy` says so (`TracerTaken`, from `timing.traced_gpu_ops`, which every traced script
    shares) instead of returning None as it does on CPU, where a trace has no GPU to hold."""
    import contextlib
    import gzip

    import jax.numpy as jnp
    bk = _script("bench_kernels")
    n, rot, static = 10, (jnp.ones((bk.R, 4, 4)),), (jnp.ones((4, 4)),)

    @contextlib.contextmanager
    def host_only_trace(trace_dir, **kw):  # what a trace looks like when torch holds CUPTI: the host, no GPU
        yield
        with gzip.open(Path(trace_dir) / "t.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
                                       {"ph": "X", "name": "host op", "pid": 1, "dur": 5.0}]}, f)

    monkeypatch.setattr(bk.timing.jax.profiler, "trace", host_only_trace)
    monkeypatch.setattr(bk, "_EMPTY_BUSY", {})
    monkeypatch.setattr(bk.jax, "default_backend", lambda: "gpu")
    with pytest.raises(bk.timing.TracerTaken, match="CUPTI"):
        bk.gpu_busy(lambda q, w: q @ w, static, rot, n=n)


def test_the_traced_table_runs_every_jax_trace_before_fla_s_torch_trace(monkeypatch, tmp_path):
    """Because torch's profiler keeps CUPTI once it has traced, `bench_kernels.py --traced` times and traces every
    table point before the fla comparison, and fla still runs (outside --budget-s) when the budget is spent.
    `--contexts` runs only those contexts' points, in the order given, and refuses a context off the grid by name."""
    bk = _script("bench_kernels")
    order = []
    monkeypatch.setattr(bk, "check_correctness", lambda cfg, T, Q, log: {})
    monkeypatch.setattr(bk, "bench_top_n", lambda log: [])
    monkeypatch.setattr(bk, "Point", collections.namedtuple("Point", "cfg T Q gamma"))
    monkeypatch.setattr(bk, "bench_point", lambda p, C, names, n, rows, log, traced: order.append(("table", traced)))
    monkeypatch.setattr(bk, "bench_fla", lambda T, n, log, traced: order.append(("fla", traced)) or {})
    monkeypatch.setattr(bk, "summarize", lambda res: {})
    for budget, points in (("1e9", 23), ("0", 0)):  # the whole plan (5 contexts x 3 Q, + C and gamma sweeps); none
        order.clear()
        monkeypatch.setattr("sys.argv", ["bench_kernels.py", "--traced", "--budget-s", budget,
                                         "--out", str(tmp_path / "k.json")])
        bk.main()
        assert order == [("table", True)] * points + [("fla", True)]
        assert len(json.loads((tmp_path / "k.json").read_text())["skipped"]) == 23 - points
    order.clear()  # --contexts: only those contexts' points, in the order given; 16K and 32K hold 3 each
    monkeypatch.setattr("sys.argv", ["bench_kernels.py", "--contexts", "32768", "16384", "--out",
                                     str(tmp_path / "k.json")])
    monkeypatch.setattr(bk, "bench_point", lambda p, C, names, n, rows, log, traced: order.append(p.T))
    bk.main()
    assert order == [32768] * 3 + [16384] * 3 + [("fla", False)]
    for bad in (["4096"], ["16384", "16384"]):
        monkeypatch.setattr("sys.argv", ["bench_kernels.py", "--contexts", *bad, "--out", str(tmp_path / "k.json")])
        with pytest.raises(SystemExit, match="--contexts=.*accepted: distinct values of"):
            bk.main()


def test_the_empty_timing_loop_slices_every_rotated_input():
    """What `time_loop` subtracts is the full loop's own overhead: the empty loop slices each rotated input at step
    i (i % R), as the full loop must to feed its call, not only the first."""
    import jax.numpy as jnp
    bk = _script("bench_kernels")
    rot = (jnp.arange(bk.R * 3.0).reshape(bk.R, 3), jnp.arange(bk.R * 2, dtype=jnp.int32).reshape(bk.R, 2))
    n = bk.R + 3
    out = bk._timing_loop(None, rot, n)((), rot)
    assert len(out) == 2
    for got, x in zip(out, rot):
        np.testing.assert_array_equal(got, x[(n - 1) % bk.R])


def test_torch_busy_time_sums_the_traced_device_ops_per_call(monkeypatch):
    """fla's busy time (`torch_gpu_busy_us`) counts the kernels, copies and sets of a torch profiler trace, not the
    host-side ops or launches, and divides by the calls run() issued."""
    import types
    bk = _script("bench_kernels")
    trace = [{"ph": "X", "cat": "kernel", "name": "parallel_nsa_fwd_kernel", "dur": 50.0},
             {"ph": "X", "cat": "kernel", "name": "parallel_nsa_fwd_kernel", "dur": 52.0},
             {"ph": "X", "cat": "gpu_memset", "name": "Memset", "dur": 2.0},
             {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 400.0},
             {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "dur": 30.0},
             {"ph": "i", "cat": "kernel", "name": "marker"}]
    ran = []

    class Profile:
        def __init__(self, activities):
            assert activities == ["CUDA"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            Path(path).write_text(json.dumps({"traceEvents": trace}))

    profiler = types.SimpleNamespace(profile=Profile, ProfilerActivity=types.SimpleNamespace(CUDA="CUDA"))
    torch = types.SimpleNamespace(profiler=profiler, cuda=types.SimpleNamespace(synchronize=lambda: ran.append("sync")))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    assert bk.torch_gpu_busy_us(lambda: ran.append("run"), n=2) == pytest.approx(52.0)
    assert ran == ["run", "sync"]


def test_kernel_targets_are_summarized_by_the_loop_and_again_by_traced_busy_time():
    """`bench_kernels.summarize` fills the issue's targets from the rows at 64K, gamma 0.75 (C=4, and the best C),
    by the loop figure; rows traced with --traced give a second table by GPU busy time, where fla is divided by its
    own busy time when that was traced."""
    bk = _script("bench_kernels")

    def row(kernel, C, us, busy, Q=16, T=65536):
        return dict(kernel=kernel, T=T, Q=Q, C=C, gamma=0.75, us=us, gpu_busy_us=busy)

    res = {"rows": [row("grouped_B", 4, 7.6, 12.9), row("grouped_B", 8, 6.9, 12.2), row("grouped_B", 2, 9.1, 15.7),
                    row("grouped_B", 4, 1.0, 1.0, T=8192), row("grouped_A", 4, 16.6, 25.5, Q=64),
                    dict(kernel="naive", T=65536, Q=16, C=4, gamma=0.75, error="boom")],
           "fla": {"ours_grouped_A_C1_us": 12.3, "ours_grouped_A_C4_us": 15.3, "fla_parallel_nsa_fwd_us": 25.9,
                   "ours_grouped_A_C1_gpu_busy_us": 16.9, "ours_grouped_A_C4_gpu_busy_us": 23.2,
                   "fla_gpu_busy_us": 20.3}}
    out = bk.summarize(res)
    assert out["grouped_B_Q16_us"]["C4"] == 7.6 and out["grouped_B_Q16_us"]["best"] == {"us": 6.9, "C": 8}
    assert out["grouped_A_Q64_us"]["C4"] == 16.6 and out["naive_Q16_us"]["value"] is None
    assert out["vs_fla_TQ16_64K"]["speedup_C4"] == round(25.9 / 15.3, 2)
    assert out["vs_fla_TQ16_64K"]["speedup_best"] == round(25.9 / 12.3, 2)
    busy = out["traced_gpu_busy"]
    assert busy["grouped_B_Q16_us"]["C4"] == 12.9 and busy["grouped_B_Q16_us"]["best"] == {"us": 12.2, "C": 8}
    assert busy["vs_fla_TQ16_64K"]["fla_figure"] == "fla_gpu_busy_us"
    assert busy["vs_fla_TQ16_64K"]["speedup_C4"] == round(20.3 / 23.2, 2)

    for r in res["rows"]:
        r.pop("gpu_busy_us", None)
    assert "traced_gpu_busy" not in bk.summarize(res)  # an untraced table has only the loop's
