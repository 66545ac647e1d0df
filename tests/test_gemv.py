"""The decode-step projection kernel (`pallas_kernels.gemv.fused_gemv`) computes what the model's XLA path does:
`model.rms_norm` then `model._mm` (q/k/v/gate), the SwiGLU of the fused gate/up matrix, and the residual add
after wo and w_down. Interpret mode, fresh random inputs, NaN-poisoned outputs; it lowers for CUDA in one launch
at the 8B shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_gemv, poison_outputs
from pallas_kernels.gemv import MAX_ROWS, PROJECTIONS, TILE_MAX_WEIGHT, TILE_ROWS, serves
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


def _check_projections(run, x, w, nw, r, dtype):
    """run(x, w, **fused steps) with the norm prologue, SwiGLU and the residual epilogue, each against the model's
    XLA composition; w holds [gate | up] (N columns each). Returns the three outputs."""
    N = w.shape[1] // 2
    with poison_outputs():
        normed = run(x, w[:, :N], norm=nw, eps=EPS)
        swiglu = run(x, w, norm=nw, eps=EPS, swiglu=True)
        resid = run(x, w[:, :N], residual=r[..., :N])
    h = M.rms_norm(x, nw, EPS)
    _close(normed, M._mm(h, w[:, :N]), dtype)
    _close(swiglu, jax.nn.silu(M._mm(h, w[:, :N])) * M._mm(h, w[:, N:]), dtype)
    _close(resid, r[..., :N] + M._mm(x, w[:, :N]), dtype)
    return normed, swiglu, resid


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_gemv_equals_the_model_projections(dtype, dot, transposed):
    """Norm prologue, SwiGLU and residual epilogue each equal the model's XLA composition, for a fresh random
    number of rows (1..16) and block sizes that leave several column tiles and contraction steps; with the
    weight stored [K, N] or transposed [N, K]."""
    rng = np.random.default_rng()
    rows, K, N = int(rng.integers(1, 17)), 128, 96
    x, w, nw, r = _inputs(rows, K, 2 * N, dtype, int(rng.integers(1 << 30)))
    lay = (lambda a: a.T) if transposed else (lambda a: a)  # noqa: E731
    run = lambda x, w, **kw: fused_gemv(x, lay(w), dot=dot, block_n=16, block_k=32,  # noqa: E731
                                        transposed=transposed, interpret=True, **kw)
    normed, swiglu, resid = _check_projections(run, x, w, nw, r, dtype)
    assert normed.dtype == swiglu.dtype == resid.dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", TILE_ROWS)
def test_fused_gemv_on_a_tile_of_rows_equals_the_model_projections(rows, dtype):
    """A tile of rows (a verified tree's nodes) loads at once: norm, SwiGLU and residual as above."""
    rng = np.random.default_rng()
    K, N = 256, 96
    x, w, nw, r = _inputs(rows, K, 2 * N, dtype, int(rng.integers(1 << 30)))
    x, r = x.reshape(2, rows // 2, K), r.reshape(2, rows // 2, -1)
    run = lambda x, w, **kw: fused_gemv(x, w, block_n=16, block_k=64, interpret=True, **kw)  # noqa: E731
    _check_projections(run, x, w, nw, r, dtype)


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


@pytest.mark.parametrize("rows", TILE_ROWS)
def test_the_model_routes_a_tile_of_rows_here_only_for_small_weights(rows):
    """A verified tree's rows take the kernel on the bundled model's projections and XLA's GEMM on the 8B shape's
    (measured: docs/results/gemv_h200.json); a decode step's rows take the kernel at both. The line is
    TILE_MAX_WEIGHT elements of weight."""
    for preset, tiled in (("small", True), ("llama31-8b-nsa", False)):
        cfg = get_config(preset)
        for name in ("wo", "w_gu", "w_down"):
            K, w_shape, steps = _decode_projection(cfg, name)
            sw = bool(steps.get("swiglu"))
            assert serves((1, rows, K), w_shape, swiglu=sw) is tiled, (preset, name)
            assert serves((1, MAX_ROWS, K), w_shape, swiglu=sw), (preset, name)
    K = 256
    assert serves((rows, K), (K, TILE_MAX_WEIGHT // K))
    assert not serves((rows, K), (K, TILE_MAX_WEIGHT // K + 16))
    assert not serves((rows + 1, K), (K, 64)), "rows outside TILE_ROWS are not supported at all"


def _decode_projection(cfg, name: str):
    """(x rows' K, w [K, N], the fused steps) of projection `name` as `model.forward` calls it in a decode step
    of the fused layout."""
    H, F = cfg.hidden, cfg.ffn
    return {"w_qkvg": (H, (H, sum(M._qkvg_widths(cfg))), dict(norm=sds((H,)))),
            "wo": (cfg.n_heads * cfg.head_dim, (cfg.n_heads * cfg.head_dim, H), dict(residual=sds((1, 1, H)))),
            "w_gu": (H, (H, 2 * F), dict(norm=sds((H,)), swiglu=True)),
            "w_down": (F, (F, H), dict(residual=sds((1, 1, H))))}[name]


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_the_decode_projections_lower_for_cuda_in_one_launch(name):
    """The fused layout's projections of llama31-8b-nsa, with their tuned launch configs and fused steps (norm,
    SwiGLU, residual): one Triton call, no XLA dot, add, reduction or logistic around it."""
    cfg = get_config("llama31-8b-nsa")
    K, w_shape, steps = _decode_projection(cfg, name)
    arrays = {k: v for k, v in steps.items() if not isinstance(v, bool)}
    flags = {k: v for k, v in steps.items() if isinstance(v, bool)}
    text = lower_for_cuda(lambda x, w, *a: fused_gemv(x, w, **dict(zip(arrays, a)), **flags, **PROJECTIONS[name]),
                          sds((1, 1, K)), sds(w_shape), *arrays.values())
    assert text.count(TRITON) == 1 and "fused_gemv" in text
    for op in ("stablehlo.dot", "stablehlo.add", "stablehlo.reduce", "stablehlo.logistic"):
        assert op not in text, op
