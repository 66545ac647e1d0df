"""Tensor parallelism over KV heads: with 2 (host) devices, sharded outputs equal single-device outputs and greedy
tokens are identical, for AR and for SSV on the reference and the kernel (shard_map) paths."""

import json
import os
import subprocess
import sys

import pytest

from ssv_jax import sharding

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def two_device_run():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(HERE, "helpers", "sharded_equivalence.py")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_two_devices_are_used_and_weights_and_cache_are_split_over_kv_heads(two_device_run):
    assert two_device_run["devices"] == 2
    assert "tp" in two_device_run["wq_sharded"] and "tp" in two_device_run["cache_sharded"]


def test_sharded_forward_equals_single_device(two_device_run):
    assert two_device_run["forward_rel"] <= 1e-5


def test_decode_layout_fuses_projections_per_shard_and_computes_the_same_model(two_device_run):
    """On a mesh the fused q/k/v/gate matrix is [in, n, out / n], split over "tp" on its shard axis."""
    assert two_device_run["fused_sharded"].replace(" ", "") == "P(None,'tp',None)"
    assert two_device_run["fused_forward_rel"] <= 1e-5


def test_sharded_greedy_tokens_are_identical(two_device_run):
    assert two_device_run["ar_equal"]
    assert two_device_run["ssv_reference_equals_ar"]
    assert two_device_run["ssv_kernel_equals_ar"]


def test_mesh_must_divide_the_sharded_dimensions(two_device_run):
    assert "vocab_size=255" in two_device_run["odd_vocab_error"]
    assert "mesh of 2 devices" in two_device_run["odd_vocab_error"]


def test_a_mesh_larger_than_the_machine_is_rejected():
    import jax

    with pytest.raises(ValueError, match="n_devices"):
        sharding.make_mesh(len(jax.devices()) + 1)
