"""The decode-step projection kernel (`pallas_kernels.gemv.fused_gemv`) computes what the model's XLA path does:
`model.rms_norm` then `model._mm` (q/k/v/gate), the SwiGLU of the fused gate/up matrix, and the residual add
after wo and w_down. Interpret mode, fresh random inputs, NaN-poisoned outputs; it lowers for CUDA in one launch
at the 8B shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_gemv, poison_outputs
from pallas_kernels.gemv import PROJECTIONS
from ssv_jax import model as M
from ssv_jax.config import get_config
from test_kernels_lowering import TRITON, lower_for_cuda, sds

EPS = 1e-5
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |diff| relative to max |ref|


def _inputs(rows: int, K: int, N: int, dtype, seed: int):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (rows, 1, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (K, N), jnp.float32) * K ** -0.5).astype(dtype)
    nw = (1 + 0.1 * jax.random.normal(ks[2], (K,))).astype(dtype)
    r = jax.random.normal(ks[3], (rows, 1, N), jnp.float32).astype(dtype)
    return x, w, nw, r


def _close(got, ref, dtype):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(got).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    assert got.shape == ref.shape
    assert np.max(np.abs(got - ref)) <= TOL[dtype] * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dot", [True, False])
def test_fused_gemv_equals_the_model_projections(dtype, dot):
    """Norm prologue, SwiGLU and residual epilogue each equal the model's XLA composition, for a fresh random
    number of rows (1..16) and block sizes that leave several column tiles and contraction steps."""
    rng = np.random.default_rng()
    rows, K, N = int(rng.integers(1, 17)), 128, 96
    x, w, nw, r = _inputs(rows, K, 2 * N, dtype, int(rng.integers(1 << 30)))
    run = lambda *a, **kw: fused_gemv(*a, dot=dot, block_n=16, block_k=32, interpret=True, **kw)  # noqa: E731
    with poison_outputs():
        normed = run(x, w[:, :N], norm=nw, eps=EPS)
        swiglu = run(x, w, norm=nw, eps=EPS, swiglu=True)
        resid = run(x, w[:, :N], residual=r[..., :N])
    h = M.rms_norm(x, nw, EPS)
    _close(normed, M._mm(h, w[:, :N]), dtype)
    _close(swiglu, jax.nn.silu(M._mm(h, w[:, :N])) * M._mm(h, w[:, N:]), dtype)
    _close(resid, r[..., :N] + M._mm(x, w[:, :N]), dtype)
    assert normed.dtype == swiglu.dtype == resid.dtype == dtype


@pytest.mark.parametrize("shapes,needle", [
    (((17, 64), (64, 32)), "at most 16 rows"),
    (((1, 64), (48, 32)), "at most 16 rows"),
    (((1, 64), (64, 40)), "multiples of 16"),
])
def test_fused_gemv_rejects_bad_shapes_naming_them(shapes, needle):
    xs, ws = shapes
    with pytest.raises(ValueError, match=needle) as e:
        fused_gemv(jnp.zeros(xs), jnp.zeros(ws), interpret=True)
    assert str(xs) in str(e.value) and str(ws) in str(e.value)


def test_fused_gemv_rejects_a_residual_of_the_wrong_shape():
    with pytest.raises(ValueError, match="residual"):
        fused_gemv(jnp.zeros((1, 64)), jnp.zeros((64, 32)), residual=jnp.zeros((1, 16)), interpret=True)


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_the_decode_projections_lower_for_cuda_in_one_launch(name):
    """wo and w_down of llama31-8b-nsa, with their tuned launch configs: one Triton call, no XLA dot or add."""
    cfg = get_config("llama31-8b-nsa")
    K = cfg.n_heads * cfg.head_dim if name == "wo" else cfg.ffn
    text = lower_for_cuda(lambda x, w, r: fused_gemv(x, w, residual=r, **PROJECTIONS[name]),
                          sds((1, 1, K)), sds((K, cfg.hidden)), sds((1, 1, cfg.hidden)))
    assert text.count(TRITON) == 1 and "fused_gemv" in text
    assert "stablehlo.dot" not in text and "stablehlo.add" not in text
