"""The verify-layer prologue kernel (`pallas_kernels.qkv_prologue`) computes what `model._qkv` does for a tree's
rows: RMSNorm, the fused q/k/v/gate product, RoPE on q and k, the gates' sigmoid. Interpret mode, fresh random
inputs and positions, NaN-poisoned outputs; it lowers for CUDA in one launch, and the model routes a tree's rows
there on the bundled shapes only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import poison_outputs, qkv_prologue
from pallas_kernels.qkv_prologue import MAX_ROWS, MIN_ROWS, serves
from ssv_jax import model as M
from ssv_jax.config import get_config
from test_kernels_lowering import TRITON, lower_for_cuda, sds

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |diff| relative to max |ref|


def _layer(cfg, rows: int, dtype, rng):
    """x [2, rows/2, H], a layer's {attn_norm, w_qkvg} and its Ctx at fresh random positions."""
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    K, N = cfg.hidden, sum(M._qkvg_widths(cfg))
    x = jax.random.normal(ks[0], (2, rows // 2, K), jnp.float32).astype(dtype)
    lp = {"attn_norm": (1 + 0.1 * jax.random.normal(ks[1], (K,))).astype(dtype),
          "w_qkvg": (jax.random.normal(ks[2], (K, N), jnp.float32) * K ** -0.5).astype(dtype)}
    pos = jnp.asarray(rng.integers(0, 1 << 16, (2, rows // 2)), jnp.int32)
    return x, lp, M.Ctx(cfg, pos, None, M.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 4, 32)])
def test_qkv_prologue_equals_the_models_xla_prologue(heads, dtype):
    """q, k (roped), v and the gates equal `model._qkv` for a fresh random power-of-two row count, with a
    contraction of several block_k steps; with 4 query heads of 32 features the 12 gate columns fill part of
    the last unit, with 8 heads of 64 the 24 gates part of one."""
    rng = np.random.default_rng()
    hq, hkv, d = heads
    cfg = get_config("small").replace(n_heads=hq, n_kv_heads=hkv, head_dim=d)
    rows = int(rng.choice([r for r in (16, 32, 64) if MIN_ROWS <= r <= MAX_ROWS]))
    x, lp, ctx = _layer(cfg, rows, dtype, rng)
    cos, sin = M.rope_cos_sin(ctx.pos, ctx.inv_freq)
    with poison_outputs():
        got = qkv_prologue(x, lp["attn_norm"], lp["w_qkvg"], cos, sin, n_heads=hq, n_kv_heads=hkv,
                           eps=cfg.norm_eps, block_k=128, interpret=True)
    ref = M._qkv(lp, ctx, x)
    for name, a, b in zip("qkvg", got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{name}: unwritten (NaN-poisoned) or non-finite outputs"
        assert np.max(np.abs(a - b)) <= TOL[dtype] * np.max(np.abs(b)), name


@pytest.mark.parametrize("x_shape,w_shape,needle", [
    ((1, 24, 512), (512, 792), "a power of two"),
    ((1, 128, 512), (512, 792), "16 to 64 rows"),
    ((1, 32, 512), (512, 800), "w \\[K, \\(Hq \\+ 2 Hkv\\) \\* D \\+ 3 Hq\\]"),
])
def test_qkv_prologue_rejects_bad_shapes_naming_them(x_shape, w_shape, needle):
    cs = jnp.zeros(x_shape[:-1] + (32,))
    with pytest.raises(ValueError, match=needle) as e:
        qkv_prologue(jnp.zeros(x_shape), jnp.zeros(x_shape[-1:]), jnp.zeros(w_shape), cs, cs, n_heads=8,
                     n_kv_heads=2, interpret=True)
    assert str(x_shape) in str(e.value) and str(w_shape) in str(e.value)


def test_the_model_routes_a_trees_rows_here_only_on_small_weights():
    """The bundled model's 32-node tree takes the kernel; the 8B shape's fused matrix (25.6M elements) stays on
    XLA's GEMM, as `fused_gemv`'s tile of rows does; a 24-node tree is not a power of two and stays on XLA."""
    small, big = get_config("small"), get_config("llama31-8b-nsa")
    for cfg, rows, ok in ((small, 32, True), (small, 24, False), (big, 32, False)):
        w = (cfg.hidden, sum(M._qkvg_widths(cfg)))
        assert serves((1, rows, cfg.hidden), w, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) is ok, (cfg.name, rows)


def test_qkv_prologue_lowers_for_cuda_in_one_launch():
    """At the bundled model's shapes (32 rows, [512, 792]): one Triton call, and no XLA dot, reduction, RoPE
    concatenation or logistic around it."""
    f = lambda x, nw, w, c, s: qkv_prologue(x, nw, w, c, s, n_heads=8, n_kv_heads=2)  # noqa: E731
    cs = sds((1, 32, 32), jnp.float32)
    text = lower_for_cuda(f, sds((1, 32, 512)), sds((512,)), sds((512, 792)), cs, cs)
    assert text.count(TRITON) == 1 and "qkv_prologue" in text
    for op in ("stablehlo.dot", "stablehlo.reduce", "stablehlo.concatenate", "stablehlo.logistic"):
        assert op not in text, op
