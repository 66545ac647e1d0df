"""The benchmark and profiling scripts' contracts, at the tiny preset on CPU: what they write, not how fast."""

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ssv_jax.planner import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _script(name):
    return importlib.import_module(name)


def test_profile_policies_averages_every_context_of_a_bucket(tmp_path):
    """Two contexts in the same bucket ("8K"): each policy's row covers both (one prompt each), ranked best first."""
    out = tmp_path / "prof.json"
    _script("profile_policies").main(["--random-preset", "tiny", "--contexts", "160", "200", "--prompts", "1",
                                      "--new-tokens", "6", "--trees", "2,2,4", "--schedules", "1", "2",
                                      "--out", str(out)])
    prof = load_profile(str(out))
    assert list(prof["buckets"]) == ["8K"]
    rows = prof["buckets"]["8K"]
    assert len(rows) == 2 and all(r["runs"] == 2 for r in rows)
    assert {r["policy"]["schedule"] for r in rows} == {1, 2}
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"]
    assert [p["context"] for p in prof["prompts"]] == [160, 200]


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


def test_e2e_bench_clamps_contexts_to_what_the_model_handles(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    _script("bench_e2e").main(["--random-preset", "tiny", "--contexts", "100000", "--prompts", "1",
                               "--new-tokens", "4", "--tree", "2", "2", "4", "--backend", "reference",
                               "--methods", "ar", "ssv", "--out", str(out)])
    res = json.loads(out.read_text())
    longest = 2048 - 4 - 512 - 64  # tiny max_seq_len minus the new tokens and the working room
    assert {r["context"] for r in res["rows"]} == {longest}
    assert set(res["summary"]) == {f"{longest}/ar", f"{longest}/ssv"}
    assert res["summary"][f"{longest}/ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert "handles at most" in capsys.readouterr().out


def test_implied_8b_speed_combines_round_cost_ar_step_and_tau(tmp_path):
    """tokens/s = tau / round; speedup = that x AR step; a context without an AR step has no speedup; the TP file's
    one-device rows fill contexts the verify file lacks, and its 2-device rows are ignored."""
    rng = np.random.default_rng()
    tree = dict(top_k=8, depth=6, budget=64)
    r32, r128, r128x2, ar32, tau = rng.uniform(10, 30), rng.uniform(10, 30), rng.uniform(5, 9), \
        rng.uniform(4, 8), rng.uniform(2, 5)
    files = {
        "verify_8b_h200.json": dict(rows=[dict(context=32768, backend="kernel", tree=tree, round_ms=r32),
                                          dict(context=32768, backend="reference", tree=tree, round_ms=99.0)]),
        "tp_h200x2.json": dict(rows=[dict(context=131072, backend="kernel", devices=1, tree=tree, round_ms=r128),
                                     dict(context=131072, backend="kernel", devices=2, tree=tree,
                                          round_ms=r128x2)]),
        "ar_8b_h200.json": dict(decode=[dict(context=32768, decode_ms_per_token=ar32)]),
        "policy_profile.json": dict(buckets={"8K": [
            dict(policy=dict(tree, schedule=1), tau=tau),
            dict(policy=dict(tree, schedule=4), tau=tau + 1.0),
            dict(policy=dict(top_k=4, depth=6, budget=32, schedule=1), tau=tau + 2.0)]}),
    }
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    out = tmp_path / "implied.json"
    _script("implied_8b").main(["--results", str(tmp_path), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["tau"] == pytest.approx(tau) and "IMPLIED" in res["label"]
    a, b = res["rows"]
    assert (a["context"], b["context"]) == (32768, 131072)
    assert a["implied_ssv_tokens_per_s"] == pytest.approx(tau / r32 * 1e3)
    assert a["implied_speedup"] == pytest.approx(tau / r32 * ar32)
    assert b["round_ms"] == pytest.approx(r128) and b["round_source"] == "tp_h200x2.json"
    assert b["implied_speedup"] is None and b["ar_tokens_per_s"] is None
