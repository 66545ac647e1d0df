"""The collectives of the 2-device tensor-parallel verify program (`scripts/tp_collectives.py`, issue #9), at the
tiny preset on 2 forced host devices (a subprocess, as in tests/test_sharding.py): what the design implies.

Design (docs/DESIGN_NOTES.md, "Tensor parallelism"): attention runs per shard (its heads, no communication); the
output projection `wo` and the FFN's `w_down` are split by rows, so each needs one all-reduce per layer; the
embedding is split by vocabulary, so the tree's token lookup needs one all-reduce per call; the LM head is split by
vocabulary and its logits stay split (no collective in the verify stage)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_collectives(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tp_collectives.py"), "--preset", "tiny",
                        "--layers", "1", "2", "--contexts", "400", "900", "--collectives-only", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_all_reduces_per_layer_at_the_row_split_projections(tiny_collectives):
    vs = tiny_collectives["verify_stage"]["by_context"]["400"]
    assert vs["per_layer"] == {"all-reduce": {"count": 2.0, "bytes": vs["per_layer"]["all-reduce"]["bytes"]}}
    assert tiny_collectives["verify_stage"]["check_per_layer_count_by_layer_difference"] == {"all-reduce": 2.0}
    rows = [r for r in vs["detail"] if r["stage"] == "verify_per_layer"]
    assert any("lp[\"wo\"]" in r["site"] for r in rows)
    assert any("lp[\"w_down\"]" in r["site"] for r in rows)


def test_one_all_reduce_per_call_for_the_vocab_split_embedding_and_none_else(tiny_collectives):
    vs = tiny_collectives["verify_stage"]["by_context"]["400"]
    assert vs["once_per_call"] == {"all-reduce": {"count": 1.0, "bytes": vs["once_per_call"]["all-reduce"]["bytes"]}}
    (row,) = [r for r in vs["detail"] if r["stage"] == "verify_once"]
    assert "embed" in row["site"]
    assert set(vs["per_call"]) == {"all-reduce"}  # no all-gather of logits, cache or weights
    # the stack attribution agrees with bench_verify's stage split, (draft+verify) - draft
    assert vs["check_count_by_program_difference"] == {"all-reduce": vs["per_call"]["all-reduce"]["count"]}


def test_collectives_do_not_depend_on_the_cache_capacity(tiny_collectives):
    assert tiny_collectives["verify_stage"]["same_at_every_context"]
