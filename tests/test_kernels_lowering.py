"""Every kernel lowers for CUDA on this CPU-only machine (abstract H100, DESIGN.md "CPU compile check"), at the
llama31-8b-nsa layer shapes, with the launch counts the design promises: the refresh layer is two attention launches
plus, past small sizes, routing's top-n launch (in place of XLA's TopK, docs/DESIGN_NOTES.md), the reuse layer and
every verify kernel one."""

import jax
import jax.numpy as jnp
import pytest

from ssv_jax import nsa
from ssv_jax.config import get_config
from pallas_kernels import topn
from pallas_kernels import (commit_blocks, compressed_attention, grouped_verify, naive_verify, nsa_attention_kernel,
                            refresh_layer, reuse_layer)

CFG = get_config("llama31-8b-nsa")
T, S, Q, C = 8192, 8192 + 1024, 16, 4
H, HQ, D = CFG.n_kv_heads, CFG.n_heads, CFG.head_dim
TRITON = "__gpu$xla.gpu.triton"


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


ARGS = dict(q=sds((1, Q, HQ, D)), q_pos=sds((1, Q), jnp.int32), gates=sds((1, Q, HQ, 3)), k=sds((1, S, H, D)),
            v=sds((1, S, H, D)), kc=sds((1, S // 16, H, D)), vc=sds((1, S // 16, H, D)),
            kv_len=sds((1,), jnp.int32))
SEL = sds((1, Q, H, CFG.n_slc), jnp.int32)
EXTRA = nsa.Extra(k=sds((1, Q, H, D)), v=sds((1, Q, H, D)), pos=sds((1, Q), jnp.int32), mask=sds((1, Q, Q), bool),
                  ck=sds((1, 2, H, D)), cv=sds((1, 2, H, D)), cidx=sds((1, 2), jnp.int32),
                  cmask=sds((1, Q, 2), bool))


def lower_for_cuda(fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


CASES = {  # name -> (fn(arrays, sel, extra), Pallas launches)
    "naive": (lambda a, s, x: naive_verify(a["q"], a["q_pos"], a["k"], a["v"], a["kv_len"], s, CFG, x), 1),
    "grouped_A": (lambda a, s, x: grouped_verify(a["q"], a["q_pos"], a["k"], a["v"], a["kv_len"], s, CFG, x,
                                                 mode="A", group_size=C), 1),
    "grouped_B": (lambda a, s, x: grouped_verify(a["q"], a["q_pos"], a["k"], a["v"], a["kv_len"], s, CFG, x,
                                                 mode="B", group_size=8), 1),
    "compressed": (lambda a, s, x: compressed_attention(a["q"], a["q_pos"], a["kc"], a["vc"], a["kv_len"], CFG,
                                                        x), 1),
    "refresh_layer": (lambda a, s, x: refresh_layer(**a, cfg=CFG, extra=x, group_size=C), 3),
    "reuse_layer": (lambda a, s, x: reuse_layer(**a, sel=s, cfg=CFG, extra=x, group_size=C), 1),
    "reuse_layer_two_launches_masked_walk": (lambda a, s, x: reuse_layer(**a, sel=s, cfg=CFG, extra=x, group_size=C,
                                                                         launches=2, walk="mask"), 2),
    "dispatch_refresh": (lambda a, s, x: nsa_attention_kernel(**a, cfg=CFG, extra=x, group_size=C), 3),
    "dispatch_reuse_B": (lambda a, s, x: nsa_attention_kernel(**a, cfg=CFG, extra=x, sel=s, mode="B",
                                                              group_size=C), 1),
}


@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_lowers_for_cuda_with_the_promised_launch_count(name, with_extra):
    fn, launches = CASES[name]
    text = lower_for_cuda(fn, ARGS, SEL, EXTRA if with_extra else None)
    assert text.count(TRITON) == launches


@pytest.mark.parametrize("with_sel,launches", [(False, 3), (True, 1)])
def test_stacked_cache_views_lower_for_cuda_without_slicing_the_stack(with_sel, launches):
    """With `nsa.LayerKV` operands the kernels take the whole [L, ...] stack and the layer index as inputs."""
    L = 4
    views = {n: nsa.LayerKV(sds((L,) + ARGS[n].shape), sds((), jnp.int32)) for n in ("k", "v", "kc", "vc")}

    def fn(a, s, x):
        return nsa_attention_kernel(**{**a, **x}, cfg=CFG, sel=s if with_sel else None, group_size=C)

    text = lower_for_cuda(fn, {n: ARGS[n] for n in ("q", "q_pos", "gates", "kv_len")}, SEL, views)
    assert text.count(TRITON) == launches
    assert "dynamic_slice" not in text  # no per-layer copy of the cache


@pytest.mark.parametrize("q,s,launches", [(64, 65536 + 4096, 3), (1, 8192 + 256, 2)])
def test_routing_takes_the_top_n_kernel_or_the_rank_fusion_never_xla_top_k(q, s, launches):
    """At a 64-node verify over a 64K cache (512 rows of 1088 blocks) routing's top-n is the Pallas kernel (two
    attention launches plus the top-n launch); at a decode step over 8K it is the rank fusion (two launches).
    Neither lowers XLA's TopK."""
    args = dict(ARGS, q=sds((1, q, HQ, D)), q_pos=sds((1, q), jnp.int32), gates=sds((1, q, HQ, 3)),
                k=sds((1, s, H, D)), v=sds((1, s, H, D)), kc=sds((1, s // 16, H, D)), vc=sds((1, s // 16, H, D)))
    text = lower_for_cuda(lambda a: refresh_layer(**a, cfg=CFG, group_size=min(C, q)), args)
    assert text.count(TRITON) == launches
    assert "top_k" not in text.lower()


@pytest.mark.parametrize("s", [8192 + 256, 65536 + 4096])
def test_a_decode_step_refresh_layer_is_three_launches_routing_inside_the_second(s):
    """One query: the compressed kernel, `decode_refresh` (routing, selected and window), then `decode_combine`
    (split merge and gates); no XLA TopK, and no exponential left to XLA."""
    args = dict(ARGS, q=sds((1, 1, HQ, D)), q_pos=sds((1, 1), jnp.int32), gates=sds((1, 1, HQ, 3)),
                k=sds((1, s, H, D)), v=sds((1, s, H, D)), kc=sds((1, s // 16, H, D)), vc=sds((1, s // 16, H, D)))
    text = lower_for_cuda(lambda a: nsa_attention_kernel(**a, cfg=CFG, group_size=1), args)
    assert text.count(TRITON) == 3 and "decode_refresh" in text and "decode_combine" in text
    assert "top_k" not in text.lower() and "stablehlo.exponential" not in text


@pytest.mark.parametrize("prologue", [False, True])
def test_block_commit_lowers_to_one_launch_aliasing_both_compressed_stacks(prologue):
    """The decode step's block commit: one Triton call for K and V, writing the [L, ...] stacks in place; as the
    decode prologue (given the new token's fused q/k/v/gate product) it also writes the roped K/V rows into the
    stacks and the query and gates in the same launch (no XLA scatter, update, RoPE or sigmoid)."""
    L, s = 4, 8192 + 256
    st = lambda n: sds((L, 1, n, H, D))  # noqa: E731
    w, pe = sds((H, CFG.cmp_len, D, D)), sds((H, CFG.cmp_len, D))
    n_qkvg = HQ * D + 2 * H * D + 3 * HQ

    def fn(k, v, kc, vc, pos, li, w, pe, y, cos, sin):
        return commit_blocks(nsa.LayerKV(k, li), nsa.LayerKV(v, li), kc, vc, pos, CFG, w, pe, w, pe,
                             **(dict(qkvg=y, rope=(cos, sin)) if prologue else {}))

    text = lower_for_cuda(fn, st(s), st(s), st(s // 16), st(s // 16), sds((1,), jnp.int32), sds((), jnp.int32),
                          w, pe, sds((1, 1, n_qkvg)), sds((1, D // 2), jnp.float32), sds((1, D // 2), jnp.float32))
    assert text.count(TRITON) == 1 and "commit_blocks" in text
    assert "scatter" not in text and "dynamic_slice" not in text and "dynamic_update_slice" not in text
    assert "stablehlo.logistic" not in text and "stablehlo.cosine" not in text


def test_top_n_kernel_lowers_for_cuda_in_one_launch_per_stage():
    assert lower_for_cuda(lambda s: topn.top_n(s, 16), sds((512, 1088), jnp.float32)).count(TRITON) == 1
    assert lower_for_cuda(lambda s: topn.top_n(s, 8), sds((8, 128256), jnp.float32)).count(TRITON) == 2


def test_an_8b_decode_step_is_eight_launches_per_layer_and_one_xla_dot():
    """`model.forward` for one token on the Pallas path, in the decode weight layout (2 layers of the 8B shape):
    per layer the compressed kernel, `decode_refresh`, `decode_combine`, `commit_blocks` (the prologue: RoPE, the
    new K/V rows, the block they complete, the query rows and gates) and `fused_gemv` for the four projections
    (q/k/v/gate and gate/up with their RMSNorm, gate/up with its SwiGLU, wo and w_down with the residual add);
    XLA keeps the LM head and computes the RoPE angles once per step: no scatter or dynamic update of the caches,
    no per-layer RoPE, query padding, norm or sigmoid."""
    from ssv_jax import cache as kvc
    from ssv_jax import model as M
    from ssv_jax.policy import attention_for

    cfg = CFG.replace(n_layers=2, feature_layers=(0, 1, 1))
    params = jax.eval_shape(lambda: M.split_layers(M.init_params(cfg, jax.random.key(0), jnp.bfloat16)))
    cache = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, 8192 + 512, dtype=jnp.bfloat16))
    attn = attention_for("kernel", "A", 1, False)
    text = lower_for_cuda(lambda p, c: M.forward(p, cfg, jnp.zeros((1, 1), jnp.int32), c, attn=attn), params, cache)
    assert text.count(TRITON) == 8 * cfg.n_layers
    for name, per_layer in (("fused_gemv", 4), ("decode_refresh", 1), ("decode_combine", 1), ("commit_blocks", 1),
                            ("compressed_attention", 1)):
        assert text.count(f'name = "{name}"') == per_layer * cfg.n_layers, name
    assert text.count("stablehlo.dot_general") == 1  # the LM head
    assert "stablehlo.scatter" not in text and "dynamic_update_slice" not in text
    assert text.count("stablehlo.cosine") == 1  # the step's RoPE angles
    lines = text.splitlines()
    assert "stablehlo.logistic" not in text  # the gates' sigmoid and the SwiGLU's silu
    assert text.count("stablehlo.rsqrt") == 1  # the final norm's: each layer's two are in their GEMV kernels
    assert not [x for x in lines if "stablehlo.pad" in x and "bf16" in x]  # the query rows' padding


def test_a_drafting_step_lowers_for_cuda_in_one_launch_reading_the_cache_in_place():
    """The draft head's attention at the bundled head's shapes (4 nodes, 4 query / 2 KV heads, a 4096 window
    over a 16K cache, 32 in-flight slots): one Triton launch, and no slice of the cache."""
    from pallas_kernels.draft_attention import draft_attention

    q, kv = sds((1, 4, 4, 64)), sds((1, 16896, 2, 64))
    ext = (sds((1, 32, 2, 64)), sds((1, 32, 2, 64)), sds((1, 4, 32), bool))
    text = lower_for_cuda(lambda q, k, v, n, p, x: draft_attention(q, k, v, n, p, 4096, [x]), q, kv, kv,
                          sds((1,), jnp.int32), sds((1, 4), jnp.int32), ext)
    assert text.count(TRITON) == 1
    assert "dynamic_slice" not in text


@pytest.mark.parametrize("kernel_select", [False, True])
def test_drafting_a_tree_is_one_attention_launch_per_level(kernel_select):
    """`build_tree` with the kernel as the head's attention, at the bundled head's shapes (tree 4, 6, 32): the five
    drafting steps after the root are five Triton launches, and the head cache is never sliced. With the GPU
    rounds' selection (`speculative.draft_select`: `top_n_log_softmax` over the 2048 draft ids), the root and each
    step select in one more launch each, with no XLA TopK left."""
    from pallas_kernels.draft_attention import draft_attention
    from ssv_jax import draft as dr
    from ssv_jax.tree import TreeSpec, build_tree

    dcfg = dr.DraftConfig(hidden=512, n_heads=4, n_kv_heads=2, head_dim=64, ffn=256, draft_vocab=2048,
                          target_vocab=8192, feature_layers=(2, 4, 5), max_seq_len=16896, window=4096)
    params = jax.tree.map(lambda x: sds(x.shape, x.dtype), jax.eval_shape(
        lambda: dr.init_draft_params(dcfg, jax.random.key(0), jnp.bfloat16)))
    kv = sds((1, 16896, 2, 64))
    cache = dr.DraftCache(kv, kv, sds((1,), jnp.int32))

    def draft(params, embed, hidden, token, pos, cache):
        return build_tree(params, dcfg, embed, hidden, token, pos, cache, TreeSpec(top_k=4, depth=6, budget=32),
                          attention=draft_attention, select=topn.top_n_log_softmax if kernel_select else None)

    text = lower_for_cuda(draft, params, sds((8192, 512)), sds((1, 512)), sds((1,), jnp.int32),
                          sds((1,), jnp.int32), cache)
    assert text.count(TRITON) == (5 + 6 if kernel_select else 5)
    assert ("top_k" in text.lower()) != kernel_select
    assert "dynamic_slice" not in text.replace("dynamic_update_slice", "")
