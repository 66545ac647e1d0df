"""The NSA target: a Llama decoder (GQA, RoPE with llama3 scaling, SwiGLU, RMSNorm) whose attention is NSA.

The model is a set of pure functions over a params pytree (a nested dict; layer weights stacked on a leading L
axis so that layers run under `lax.scan`). `NSATransformer` is the Flax NNX module that owns the parameters:
`graphdef, state = nnx.split(model)`; `params = state.to_pure_dict()`.

Three entry points share one layer body:
- `forward`: commit mode. Appends `tokens` at `cache.length` (a prefill chunk or one decode token), updates the
  compressed cache, returns logits, EAGLE-3 features and the new cache.
- `forward_tree`: verify mode. Runs draft-tree nodes as in-flight keys under the ancestor mask with per-path
  compressed blocks; the cache is read only. Returns logits, features and the nodes' K/V for `commit_tree`.
- `forward_train`: a whole sequence from an empty context, differentiable.

Parameter layout (matmul weights are [in, out]):
  embed [V, H], norm [H], lm_head [H, V] (absent when tied)
  layers: attn_norm [L, H], wq [L, H, Hq*D], wk/wv [L, H, Hkv*D], wo [L, Hq*D, H], wg [L, H, Hq*3] (column
          h*3+j, j = cmp, slc, win), mlp_norm [L, H], w_gate/w_up [L, H, F], w_down [L, F, H];
          for compression == "mlp": cmp_wk/cmp_wv [L, Hkv, l, D, D], cmp_pek/cmp_pev [L, Hkv, l, D]
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ssv_jax import cache as kvc
from ssv_jax import nsa, schedule as sched
from ssv_jax.config import ModelConfig

AttnFn = Callable[..., tuple[jax.Array, jax.Array]]


# -- building blocks -------------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """Inverse RoPE frequencies [D/2], with llama3 scaling when `scaling` is given."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    lo_wl = scaling.original_max_position / scaling.low_freq_factor
    hi_wl = scaling.original_max_position / scaling.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wl - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wl > lo_wl, inv / scaling.factor, inv)
    mid = (wl <= lo_wl) & (wl >= hi_wl)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def rope_cos_sin(pos: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, Q, D/2] (f32) of the RoPE angles at positions pos [B, Q]."""
    ang = pos[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq) -> jax.Array:
    """Rotate-half RoPE (the HF Llama layout). x [B, Q, H, D], pos [B, Q]."""
    cos, sin = (a[:, :, None, :] for a in rope_cos_sin(pos, inv_freq))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _mm(x, w):
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


# -- parameters ------------------------------------------------------------------------------------------------
def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree as shapes (see the module docstring)."""
    L, H, D, F = cfg.n_layers, cfg.hidden, cfg.head_dim, cfg.ffn
    Hq, Hkv, l = cfg.n_heads, cfg.n_kv_heads, cfg.cmp_len
    layers = dict(attn_norm=(L, H), wq=(L, H, Hq * D), wk=(L, H, Hkv * D), wv=(L, H, Hkv * D),
                  wo=(L, Hq * D, H), wg=(L, H, Hq * 3), mlp_norm=(L, H), w_gate=(L, H, F), w_up=(L, H, F),
                  w_down=(L, F, H))
    if cfg.compression == "mlp":
        layers.update(cmp_wk=(L, Hkv, l, D, D), cmp_wv=(L, Hkv, l, D, D), cmp_pek=(L, Hkv, l, D),
                      cmp_pev=(L, Hkv, l, D))
    out = dict(embed=(cfg.vocab_size, H), norm=(H,), layers=layers)
    if not cfg.tie_embeddings:
        out["lm_head"] = (H, cfg.vocab_size)
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters: N(0, 1/fan_in) matmuls, unit norms, N(0, 1) embeddings; mlp compression starts as
    mean pooling plus noise."""
    shapes = param_shapes(cfg)
    flat, tree = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shp), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            a = jnp.ones(shp, dtype)
        elif name == "embed":
            a = jax.random.normal(k, shp, dtype)
        elif name in ("cmp_wk", "cmp_wv"):
            eye = jnp.eye(shp[-1], dtype=dtype) / shp[2]
            a = (eye + 0.02 * jax.random.normal(k, shp, dtype) / math.sqrt(shp[-1])).astype(dtype)
        elif name in ("cmp_pek", "cmp_pev"):
            a = 0.02 * jax.random.normal(k, shp, dtype)
        else:
            a = jax.random.normal(k, shp, dtype) / math.sqrt(shp[-2])
        leaves.append(a)
    return jax.tree.unflatten(tree, leaves)


# What decides each parameter's shape (check_params names it on a mismatch).
_SHAPE_FIELDS = {
    "embed": "[vocab_size, hidden]", "norm": "[hidden]", "lm_head": "[hidden, vocab_size]",
    "attn_norm": "[n_layers, hidden]", "mlp_norm": "[n_layers, hidden]",
    "wq": "[n_layers, hidden, n_heads*head_dim]", "wk": "[n_layers, hidden, n_kv_heads*head_dim]",
    "wv": "[n_layers, hidden, n_kv_heads*head_dim]", "wo": "[n_layers, n_heads*head_dim, hidden]",
    "wg": "[n_layers, hidden, n_heads*3]", "w_gate": "[n_layers, hidden, ffn]", "w_up": "[n_layers, hidden, ffn]",
    "w_down": "[n_layers, ffn, hidden]",
    "cmp_wk": "[n_layers, n_kv_heads, cmp_len, head_dim, head_dim]",
    "cmp_wv": "[n_layers, n_kv_heads, cmp_len, head_dim, head_dim]",
    "cmp_pek": "[n_layers, n_kv_heads, cmp_len, head_dim]", "cmp_pev": "[n_layers, n_kv_heads, cmp_len, head_dim]",
}


def _presence_hint(cfg: ModelConfig, names) -> str:
    """The config field that decides whether the named parameters exist."""
    hints = []
    if "lm_head" in names:
        hints.append(f"tie_embeddings={cfg.tie_embeddings} (a tied model has no lm_head)")
    if any(n.startswith("cmp_") for n in names):
        hints.append(f"compression={cfg.compression!r} (only 'mlp' has cmp_wk/cmp_wv/cmp_pek/cmp_pev)")
    return f"; decided by {', '.join(hints)}" if hints else ""


def check_params(cfg: ModelConfig, params) -> None:
    """Raise `ValueError` unless `params` is a parameter pytree of `cfg`: the keys, shapes and floating dtypes of
    `init_params(cfg, ...)` (any floating dtype: weights may be stored in bf16 and computed in fp32).

    The message names the first mismatching parameter ("layers/wq", as in a bundle's tensor index), its shape,
    the expected shape and the config fields that decide it, or the missing / unexpected keys. Only the
    `init_params` layout (stacked layers) is accepted, which is what `checkpoint.load_bundle` returns; the
    decode layout of `split_layers` is rejected with a pointer to `stack_layers`."""
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    _check_tree(cfg, params, want, "")


def _check_tree(cfg: ModelConfig, got, want, path: str) -> None:
    where = f"params[{path!r}]" if path else "params"
    if isinstance(want, dict):
        if path == "layers" and isinstance(got, (list, tuple)):
            raise ValueError(f"{where} is a list of per-layer dicts (the decode layout of split_layers); accepted: "
                             f"the init_params layout with stacked layers (use stack_layers(params, cfg))")
        if not isinstance(got, dict):
            raise ValueError(f"{where} is a {type(got).__name__}; accepted: a dict with keys {sorted(want)}")
        missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want), key=str)
        if missing or unexpected:
            problem = " and ".join(([f"lacks keys {missing}"] if missing else [])
                                   + ([f"has unexpected keys {unexpected}"] if unexpected else []))
            raise ValueError(f"{where} {problem} for ModelConfig name={cfg.name!r}; accepted: exactly the keys "
                             f"{sorted(want)}{_presence_hint(cfg, missing + unexpected)}")
        for k in want:
            _check_tree(cfg, got[k], want[k], f"{path}/{k}" if path else k)
        return
    shape, dtype = getattr(got, "shape", None), getattr(got, "dtype", None)
    fields = _SHAPE_FIELDS.get(path.rsplit("/", 1)[-1], "")
    expected = f"shape {tuple(want.shape)}" + (f" = {fields}" if fields else "")
    if shape is None or dtype is None:
        raise ValueError(f"{where} is a {type(got).__name__}; accepted: a floating array of {expected}")
    if tuple(shape) != tuple(want.shape):
        raise ValueError(f"{where} has shape {tuple(shape)}; accepted: {expected} for ModelConfig "
                         f"name={cfg.name!r}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{where} has dtype {np.dtype(dtype).name}; accepted: a floating dtype (float32, bfloat16, "
                         f"float16)")


FUSED_PROJECTIONS = {"w_qkvg": ("wq", "wk", "wv", "wg"), "w_gu": ("w_gate", "w_up")}


def split_layers(params: dict, fuse: bool = True, shards: int = 1) -> dict:
    """The decode layout: `layers` as a list of per-layer dicts (one buffer per weight per layer), so that a
    weight-bound loop slices nothing out of a stacked array (a copy per weight per step inside a while_loop,
    docs/DESIGN_NOTES.md, "Decode weight layout"). With `fuse`, each layer's q/k/v/gate projections become one
    matrix `w_qkvg` and the MLP's gate/up one `w_gu` (FUSED_PROJECTIONS): fewer, wider GEMVs.

    `shards` > 1 lays a fused matrix out as [in, shards, out / shards], each shard's slice holding its own
    columns of every part (q, k, v, gates), so that splitting it over a tensor-parallel axis on dim 1 keeps each
    device's heads together (`sharding.split_layers`). `forward`, `forward_tree` and `commit_tree` accept every
    layout; `stack_layers` undoes it."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    out = []
    for i in range(n):
        lp = {k: a[i] for k, a in layers.items()}
        if fuse:
            for fused, names in FUSED_PROJECTIONS.items():
                lp[fused] = _fuse([lp.pop(k) for k in names], shards)
        out.append(lp)
    return {**params, "layers": out}


def _fuse(ws: list, shards: int) -> jax.Array:
    """Column-concatenation of [in, out_i] matrices; per shard ([in, shards, sum / shards]) when shards > 1."""
    if shards == 1:
        return jnp.concatenate(ws, -1)
    bad = [w.shape[-1] for w in ws if w.shape[-1] % shards]
    if bad:
        raise ValueError(f"shards={shards} must divide every fused projection's width; got widths {bad}")
    return jnp.concatenate([w.reshape(w.shape[0], shards, -1) for w in ws], -1)


def _shards(w) -> int:
    """The shard count of a fused matrix: 1 for [in, out], S for the per-shard layout [in, S, out / S]."""
    return w.shape[1] if w.ndim == 3 else 1


def _split_columns(x, widths, shards: int) -> list:
    """Parts of the given widths of a fused matrix or of its product, along the columns: the last axis, or with
    shards > 1 the last two ([shards, sum / shards]), each part then merged back to [..., width]."""
    if shards == 1:
        return jnp.split(x, np.cumsum(widths)[:-1], -1)
    parts = jnp.split(x, np.cumsum([c // shards for c in widths])[:-1], -1)
    return [p.reshape(p.shape[:-2] + (-1,)) for p in parts]


def _split_fused(h, w, widths) -> list:
    """h @ w for a fused matrix w (either layout), split into the parts' products."""
    y = _mm(h, w.reshape(w.shape[0], -1))
    return _split_columns(y.reshape(y.shape[:-1] + w.shape[1:]), widths, _shards(w))


def _qkvg_widths(cfg: ModelConfig) -> list:
    """The widths of q, k, v and the gates in the fused `w_qkvg` (and its product)."""
    qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [qd, kd, kd, cfg.n_heads * 3]


def _unfuse(lp: dict, cfg: ModelConfig) -> dict:
    """Per-layer projections from a fused layer dict (no-op on an unfused one)."""
    if "w_qkvg" not in lp:
        return lp
    lp = dict(lp)
    w_qkvg, w_gu = lp.pop("w_qkvg"), lp.pop("w_gu")
    lp["wq"], lp["wk"], lp["wv"], lp["wg"] = _split_columns(w_qkvg, _qkvg_widths(cfg), _shards(w_qkvg))
    lp["w_gate"], lp["w_up"] = _split_columns(w_gu, [cfg.ffn, cfg.ffn], _shards(w_gu))
    return lp


def stack_layers(params: dict, cfg: ModelConfig) -> dict:
    """Inverse of `split_layers`: layer params stacked on a leading L axis, projections unfused."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *[_unfuse(lp, cfg) for lp in layers])}


def _run_layers(layer, carry, layers, flags, unroll):
    """The schedule's layer loop over stacked layer params (static scan segments) or a per-layer list."""
    if isinstance(layers, (list, tuple)):
        return sched.run_layer_list(layer, carry, [(lp, i) for i, lp in enumerate(layers)], flags)
    n = jax.tree.leaves(layers)[0].shape[0]
    return sched.run_layers(layer, carry, (layers, jnp.arange(n)), flags, unroll=unroll)


class NSATransformer(nnx.Module):
    """Flax NNX owner of the target's parameters. Use the pure functions of this module on `params()`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.weights = nnx.data(jax.tree.map(nnx.Param, init_params(cfg, rngs.params(), dtype)))

    def params(self) -> dict:
        """The weights as the plain parameter pytree that the pure functions of this module take."""
        return nnx.state(self, nnx.Param).to_pure_dict()["weights"]


# -- the layer -------------------------------------------------------------------------------------------------
class Ctx(NamedTuple):
    """Static and per-call inputs shared by every layer of one forward."""
    cfg: ModelConfig
    pos: jax.Array  # [B, Q] absolute positions of the queries
    attn: AttnFn
    inv_freq: np.ndarray
    gemv: Callable | None = None  # the backend's fused projection kernel for decode steps (`_projection_kernel`)


def _cmp_params(lp, cfg):
    if cfg.compression == "mean":
        return (None, None), (None, None)
    return (lp["cmp_wk"], lp["cmp_pek"]), (lp["cmp_wv"], lp["cmp_pev"])


QKVG = FUSED_PROJECTIONS["w_qkvg"]  # the q/k/v/gate projections, in `_qkvg_widths` column order


def _qkvg_product(lp, ctx: Ctx, x):
    """rms_norm(x) @ [wq | wk | wv | wg]: the fused product [B, Q, N] in `_qkvg_widths` column order (in one
    launch, norm included, where the backend's projection kernel serves `w_qkvg`); None for a tensor-parallel
    layout (its product's columns are grouped by shard)."""
    cfg = ctx.cfg
    if "w_qkvg" not in lp:
        h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        return jnp.concatenate([_mm(h, lp[n]) for n in QKVG], -1)
    if _shards(lp["w_qkvg"]) > 1:
        return None
    kw = _kernel_projection(ctx, "w_qkvg", x, lp["w_qkvg"])
    if kw is not None:
        return ctx.gemv(x, lp["w_qkvg"], norm=lp["attn_norm"], eps=cfg.norm_eps, **kw)
    return _mm(rms_norm(x, lp["attn_norm"], cfg.norm_eps), lp["w_qkvg"])


def _qkv(lp, ctx: Ctx, x):
    cfg = ctx.cfg
    B, Q, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
    if "w_qkvg" in lp:  # fused decode layout (split_layers)
        q, k, v, g = _split_fused(h, lp["w_qkvg"], _qkvg_widths(cfg))
    else:
        q, k, v, g = (_mm(h, lp[n]) for n in QKVG)
    q = q.reshape(B, Q, cfg.n_heads, cfg.head_dim)
    k = k.reshape(B, Q, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(B, Q, cfg.n_kv_heads, cfg.head_dim)
    g = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, Q, cfg.n_heads, 3)
    return apply_rope(q, ctx.pos, ctx.inv_freq), apply_rope(k, ctx.pos, ctx.inv_freq), v, g


def _kernel_projection(ctx: Ctx, name: str, h, w, swiglu: bool = False) -> dict | None:
    """The launch config of the backend's projection kernel for weight `name` (one launch with its neighbours:
    the RMSNorm before, the SwiGLU or residual add after) when it serves it at these shapes (a decode step's few
    rows), else None: XLA's GEMM and separate fusions."""
    fn = None if ctx.gemv is None else ctx.gemv.func
    if fn is None or name not in fn.projections or not fn.serves(h.shape, w.shape, swiglu=swiglu):
        return None
    return fn.projections[name]


def _finish(lp, ctx: Ctx, x, o):
    cfg = ctx.cfg
    B, Q = x.shape[:2]
    o = o.reshape(B, Q, -1).astype(x.dtype)
    kw = _kernel_projection(ctx, "wo", o, lp["wo"])
    x = x + _mm(o, lp["wo"]) if kw is None else ctx.gemv(o, lp["wo"], residual=x, **kw)
    kw = _kernel_projection(ctx, "w_gu", x, lp["w_gu"], swiglu=True) if "w_gu" in lp else None
    if kw is not None:  # norm, gate/up GEMV and SwiGLU in one launch
        a = ctx.gemv(x, lp["w_gu"], norm=lp["mlp_norm"], eps=cfg.norm_eps, swiglu=True, **kw)
    else:
        h = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
        if "w_gu" in lp:  # fused decode layout (split_layers)
            gate, up = _split_fused(h, lp["w_gu"], [cfg.ffn, cfg.ffn])
        else:
            gate, up = _mm(h, lp["w_gate"]), _mm(h, lp["w_up"])
        a = jax.nn.silu(gate) * up
    kw = _kernel_projection(ctx, "w_down", a, lp["w_down"])
    return x + _mm(a, lp["w_down"]) if kw is None else ctx.gemv(a, lp["w_down"], residual=x, **kw)


def _chunked_attn(ctx: Ctx, q_chunk: int, q, gates, k, v, kc, vc, kv_len, sel):
    """The attention call, mapped over chunks of `q_chunk` queries when Q is larger (prefill)."""
    cfg = ctx.cfg
    Q = q.shape[1]
    if Q <= q_chunk:
        return ctx.attn(q, ctx.pos, gates, k, v, kc, vc, kv_len, cfg, sel=sel)
    if Q % q_chunk:
        raise ValueError(f"prefill chunk Q={Q} is invalid; accepted: a multiple of q_chunk={q_chunk}")
    n = Q // q_chunk

    def split(a):
        return jnp.moveaxis(a.reshape((a.shape[0], n, q_chunk) + a.shape[2:]), 1, 0)

    def one(args):
        qq, pp, gg, ss = args
        return ctx.attn(qq, pp, gg, k, v, kc, vc, kv_len, cfg, sel=ss)

    sel_in = None if sel is None else split(sel)
    o, s = jax.lax.map(one, (split(q), split(ctx.pos), split(gates), sel_in))
    merge = lambda a: jnp.moveaxis(a, 0, 1).reshape((a.shape[1], Q) + a.shape[3:])
    return merge(o), merge(s)


def _layer_view(stack, li, attn, flag: str = "reads_layer_views"):
    """Layer li of a stacked cache: an in-place `nsa.LayerKV` view when the attention function declares (by the
    attribute `flag`) that it reads such views without copying, else the sliced array. The reference reads K/V
    views through gathers ("reads_layer_views"); the Pallas kernels also read the compressed caches in place
    ("reads_compressed_views"), where the reference's dots would copy the slice anyway."""
    if getattr(getattr(attn, "func", attn), flag, False):  # look through functools.partial
        return nsa.LayerKV(stack, li)
    return stack[li]


def _cmp_view(stack, li, attn):
    return _layer_view(stack, li, attn, "reads_compressed_views")


def _backend_kernel(attn, name: str):
    """The kernel an attention function brings as attribute `name` (looking through `functools.partial`), bound
    to the attention's `interpret` setting; None when it brings none."""
    fn = getattr(getattr(attn, "func", attn), name, None)
    return None if fn is None else partial(fn, interpret=getattr(attn, "keywords", {}).get("interpret", False))


def _block_commit(attn, cfg: ModelConfig):
    """The decode-layer prologue an attention function brings (attribute `commit_blocks`, e.g. the Pallas
    kernels': from one new token's fused q/k/v/gate product, RoPE, the scatter of the new K/V rows,
    `cache.append_blocks` and the query in the attention's own layout, in one launch); None when it brings none
    or does not support this config."""
    fn = _backend_kernel(attn, "commit_blocks")
    return fn if fn is not None and fn.func.supports(cfg, cfg.head_dim) else None


def _projection_kernel(attn):
    """The fused projection kernel an attention function brings (attribute `gemv`, e.g. the Pallas kernels'
    `fused_gemv`: residual + h @ w in one launch for a few rows), or None. Its `projections` names the weights
    it serves and their launch configs."""
    return _backend_kernel(attn, "gemv")


def _empty_sel(cfg: ModelConfig, B: int, Q: int):
    return jnp.zeros((B, Q, cfg.n_kv_heads, cfg.n_slc), jnp.int32)


def embed(params, tokens):
    """Token embeddings: ids [...] -> [..., hidden]."""
    return params["embed"][tokens]


def lm_logits(params, cfg: ModelConfig, x):
    """Final RMSNorm and LM head (the tied embedding when `cfg.tie_embeddings`): [..., hidden] -> fp32 logits."""
    h = rms_norm(x, params["norm"], cfg.norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return jnp.einsum("...i,io->...o", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def _features(cfg: ModelConfig, xs_in):
    """EAGLE-3 features: the inputs of the tapped layers, concatenated: [L, B, Q, H] -> [B, Q, 3H]."""
    return jnp.concatenate([xs_in[i] for i in cfg.features], -1)


def validate_tokens(cfg: ModelConfig, tokens) -> None:
    """Host-side check of token ids (call before jitted work)."""
    t = np.asarray(tokens)
    if t.size == 0:
        raise ValueError("prompt is empty; accepted: at least one token id")
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"token ids have dtype {t.dtype}; accepted: an integer dtype (a float id would be truncated)")
    if t.min() < 0 or t.max() >= cfg.vocab_size:
        bad = int(t.min()) if t.min() < 0 else int(t.max())
        raise ValueError(f"token id {bad} is out of vocabulary; accepted: ids in [0, {cfg.vocab_size})")


# -- commit mode: prefill chunks and decode --------------------------------------------------------------------
@partial(jax.jit, static_argnames=("cfg", "schedule", "unroll", "attn", "q_chunk"), donate_argnames=("cache",))
def forward(params, cfg: ModelConfig, tokens, cache: kvc.KVCache, n_valid=None, *, schedule=None, unroll=True,
            attn: AttnFn = nsa.nsa_attention, q_chunk: int = 256):
    """Append `tokens` [B, Q] at `cache.length` and run the model on them.

    `n_valid` [B] (default Q) marks a padded tail: only the first n_valid tokens are committed. The caller must
    ensure length + Q <= capacity (see `prefill`). Returns (logits [B, Q, V] f32, feats [B, Q, 3H], cache)."""
    B, Q = tokens.shape
    flags = sched.parse(schedule, cfg.n_layers)
    prologue = _block_commit(attn, cfg) if (Q == 1 and n_valid is None) else None
    n_valid = jnp.full((B,), Q, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    start = cache.length
    pos = start[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]
    ctx = Ctx(cfg, pos, attn, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
              _projection_kernel(attn) if Q == 1 else None)  # decode steps only: measured there
    kv_len = start + n_valid
    bidx = jnp.arange(B)[:, None]
    rope = tuple(a[:, 0] for a in rope_cos_sin(pos, ctx.inv_freq)) if prologue is not None else None

    def layer(carry, xs, refresh):
        x, K, V, KC, VC, sel = carry
        lp, li = xs
        (wk, pek), (wv, pev) = _cmp_params(lp, cfg)
        y = None if prologue is None else _qkvg_product(lp, ctx, x)
        if y is not None:  # the new K/V rows, the blocks they complete and the query, in one launch
            K, V, KC, VC, q = prologue(nsa.LayerKV(K, li), nsa.LayerKV(V, li), KC, VC, start, cfg, wk, pek, wv,
                                       pev, qkvg=y, rope=rope)
            g = None  # inside q (the backend's own query layout)
        else:
            q, k, v, g = _qkv(lp, ctx, x)
            K = K.at[li, bidx, pos].set(k.astype(K.dtype), mode="drop")
            V = V.at[li, bidx, pos].set(v.astype(V.dtype), mode="drop")
            KC, VC = kvc.append_blocks(nsa.LayerKV(K, li), nsa.LayerKV(V, li), KC, VC, start, cfg, wk, pek, wv,
                                       pev, n_new=n_valid, max_new=Q)
        Kl, Vl = _layer_view(K, li, attn), _layer_view(V, li, attn)
        o, sel = _chunked_attn(ctx, q_chunk, q, g, Kl, Vl, _cmp_view(KC, li, attn), _cmp_view(VC, li, attn), kv_len,
                               None if refresh else sel)
        return (_finish(lp, ctx, x, o), K, V, KC, VC, sel), x

    x0 = embed(params, tokens)
    carry = (x0, cache.k, cache.v, cache.kc, cache.vc, _empty_sel(cfg, B, Q))
    (x, K, V, KC, VC, _), xs_in = _run_layers(layer, carry, params["layers"], flags, unroll)
    new_cache = kvc.KVCache(K, V, KC, VC, kv_len)
    return lm_logits(params, cfg, x), _features(cfg, xs_in), new_cache


def prefill(params, cfg: ModelConfig, prompt, cache: kvc.KVCache, *, chunk: int = 512, schedule=None,
            attn: AttnFn = nsa.nsa_attention, progress: bool = False, on_chunk=None):
    """Chunked prefill of `prompt` [B, P] into `cache` (all rows the same length). Runs rolled layer scans (the
    weight copy is amortised over the chunk). `on_chunk(logits, feats, start, n)` (optional) sees every chunk's
    outputs (padded to `chunk`; the first n are real). Returns (logits of the last prompt token [B, V], its
    features [B, 3H], cache)."""
    prompt = np.asarray(prompt)
    if prompt.ndim == 1:
        prompt = prompt[None]
    validate_tokens(cfg, prompt)
    B, P = prompt.shape
    start = int(np.asarray(cache.length).max())
    n_chunks = -(-P // chunk)
    if start + n_chunks * chunk > cache.capacity:
        raise ValueError(f"prompt of {P} tokens (padded to {n_chunks * chunk}) at length {start} does not fit; "
                         f"accepted: at most {cache.capacity - start - (-P % chunk)} tokens for this cache "
                         f"(capacity {cache.capacity})")
    q_chunk = math.gcd(chunk, 256)
    logits = feats = None
    it = range(n_chunks)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="prefill", unit="chunk")
    for i in it:
        part = prompt[:, i * chunk:(i + 1) * chunk]
        n = part.shape[1]
        padded = np.pad(part, ((0, 0), (0, chunk - n)))
        lg, ft, cache = forward(params, cfg, jnp.asarray(padded, jnp.int32), cache,
                                jnp.full((B,), n, jnp.int32), schedule=schedule, unroll=False, attn=attn,
                                q_chunk=q_chunk)
        if on_chunk is not None:
            on_chunk(lg, ft, start + i * chunk, n)
        logits, feats = lg[:, n - 1], ft[:, n - 1]
    return logits, feats, cache


# -- verify mode -----------------------------------------------------------------------------------------------
class TreeInputs(NamedTuple):
    """A draft tree to verify: node 0 is the root (position T); parents precede children."""
    tokens: jax.Array  # [B, N]
    depth: jax.Array  # [B, N]
    mask: jax.Array  # [B, N, N] ancestor-or-self


def _path_block_plan(cfg: ModelConfig, T, tree: TreeInputs):
    """Where the keys of each node's per-path compressed block come from (DESIGN.md, "How the per-path
    compressed block works out"). Returns (completes [B, N], cidx [B, N], from_cache [B, N, l],
    cache_pos [B, N, l], node_src [B, N, l])."""
    l, d = cfg.cmp_len, cfg.cmp_stride
    B, N = tree.tokens.shape
    p = T[:, None] + tree.depth  # completion position if node a completes a block
    start = p - l + 1
    completes = (start >= 0) & (start % d == 0)
    cidx = jnp.where(completes, start // d, 0)
    s = start[..., None] + jnp.arange(l)  # [B, N, l] positions of the block's keys
    from_cache = s < T[:, None, None]
    # anc[b, a, k] = the ancestor of node a at depth k
    at_depth = tree.mask[:, :, :, None] & (tree.depth[:, None, :, None] == jnp.arange(N)[None, None, None, :])
    anc = jnp.argmax(at_depth, axis=2)  # [B, N(a), N(depth)]
    k_rel = jnp.clip(s - T[:, None, None], 0, N - 1)
    node_src = jnp.take_along_axis(anc, k_rel, axis=2)
    return completes, cidx, from_cache, jnp.clip(s, 0, None), node_src


@partial(jax.jit, static_argnames=("cfg", "schedule", "unroll", "attn", "with_selection"))
def forward_tree(params, cfg: ModelConfig, tree: TreeInputs, cache: kvc.KVCache, *, schedule=None,
                 unroll=True, attn: AttnFn = nsa.nsa_attention, with_selection: bool = False):
    """Verify all tree nodes in one pass (the cache is read only). Every node's logits equal what AR decoding
    computes after appending its root-to-node path (mode A, refresh every layer).

    Returns (logits [B, N, V] f32, feats [B, N, 3H], node_k [L, B, N, Hkv, D], node_v [L, B, N, Hkv, D]), plus
    every layer's selection [L, B, N, Hkv, n] when `with_selection`."""
    B, N = tree.tokens.shape
    flags = sched.parse(schedule, cfg.n_layers)
    T = cache.length
    pos = T[:, None] + tree.depth
    ctx = Ctx(cfg, pos, attn, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
              _projection_kernel(attn))  # where the kernel serves the B * N rows (`fused_gemv.serves`)
    completes, cidx, from_cache, cache_pos, node_src = _path_block_plan(cfg, T, tree)
    cmask = tree.mask & completes[:, None, :]

    hold = from_cache[..., None, None]  # [B, N, l, 1, 1]
    if cfg.compression == "mean":
        # Mean pooling is linear: the committed rows' share of every node's block is summed for all layers at
        # once here (one gather), and each layer adds its nodes' rows, instead of gathering and pooling whole
        # blocks per layer (a gather, a reduction and a cast per layer and per K / V).
        rows = jax.vmap(lambda kl: nsa.gather_rows(kl, cache_pos))  # over the layer axis: [L, B, N, l, Hkv, D]
        share = [jnp.sum(jnp.where(hold, rows(st).astype(jnp.float32), 0.0), axis=3) for st in (cache.k, cache.v)]

    def path_blocks(Kl, k, cp, cache_share):
        if cache_share is not None:  # nsa.compress's mean, as the sum of the two shares
            own = jnp.sum(jnp.where(hold, 0.0, nsa.gather_rows(k, node_src).astype(jnp.float32)), axis=2)
            return ((cache_share + own) / cfg.cmp_len).astype(k.dtype)
        blocks = jnp.where(hold, nsa.gather_rows(Kl, cache_pos), nsa.gather_rows(k, node_src))
        return nsa.compress(blocks, cfg, *cp)

    def layer(carry, xs, refresh):
        x, sel = carry
        lp, li = xs
        q, k, v, g = _qkv(lp, ctx, x)
        Kl, Vl = _layer_view(cache.k, li, attn), _layer_view(cache.v, li, attn)
        cpk, cpv = _cmp_params(lp, cfg)
        sk, sv = (share[0][li], share[1][li]) if cfg.compression == "mean" else (None, None)
        extra = nsa.Extra(k, v, pos, tree.mask, path_blocks(Kl, k, cpk, sk), path_blocks(Vl, v, cpv, sv), cidx,
                          cmask)
        o, sel = attn(q, pos, g, Kl, Vl, _cmp_view(cache.kc, li, attn), _cmp_view(cache.vc, li, attn), T, cfg, extra=extra,
                      sel=None if refresh else sel)
        return (_finish(lp, ctx, x, o), sel), (x, k, v, sel if with_selection else None)

    x0 = embed(params, tree.tokens)
    (x, _), (xs_in, node_k, node_v, sels) = _run_layers(layer, (x0, _empty_sel(cfg, B, N)), params["layers"],
                                                        flags, unroll)
    out = (lm_logits(params, cfg, x), _features(cfg, xs_in), node_k, node_v)
    return out + (sels,) if with_selection else out


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def commit_tree(params, cfg: ModelConfig, cache: kvc.KVCache, node_k, node_v, path, n_acc):
    """Write the accepted path's K/V (`path` [B, A] node ids, root first, -1 padded; `n_acc` [B] >= 1 nodes)
    into the cache at `length` and append the compressed blocks that complete."""
    B, A = path.shape
    start = cache.length
    pos = start[:, None] + jnp.arange(A)
    bidx = jnp.arange(B)[:, None]
    idx = jnp.maximum(path, 0)
    pk = jax.vmap(lambda a, i: a[:, i], in_axes=(1, 0), out_axes=1)(node_k, idx)  # [L, B, A, Hkv, D]
    pv = jax.vmap(lambda a, i: a[:, i], in_axes=(1, 0), out_axes=1)(node_v, idx)
    live = jnp.arange(A)[None, :] < n_acc[:, None]
    pos_w = jnp.where(live, pos, cache.capacity)  # dead rows dropped
    K = cache.k.at[:, bidx, pos_w].set(pk.astype(cache.k.dtype), mode="drop")
    V = cache.v.at[:, bidx, pos_w].set(pv.astype(cache.v.dtype), mode="drop")

    def cmp_layer(Kl, Vl, lp):
        (wk, pek), (wv, pev) = _cmp_params(lp, cfg)
        slot, ck = kvc.completed_blocks(Kl, start, n_acc, A, cfg, wk, pek)
        _, cv = kvc.completed_blocks(Vl, start, n_acc, A, cfg, wv, pev)
        return slot, ck, cv

    lps = stack_layers(params, cfg)["layers"] if cfg.compression == "mlp" else None
    slot, ck, cv = jax.vmap(cmp_layer, in_axes=(0, 0, 0 if lps is not None else None))(K, V, lps)
    lidx = jnp.arange(cfg.n_layers)[:, None, None]
    KC = cache.kc.at[lidx, bidx[None], slot].set(ck.astype(cache.kc.dtype), mode="drop")
    VC = cache.vc.at[lidx, bidx[None], slot].set(cv.astype(cache.vc.dtype), mode="drop")
    return kvc.KVCache(K, V, KC, VC, start + n_acc)


# -- training --------------------------------------------------------------------------------------------------
def forward_train(params, cfg: ModelConfig, tokens, *, schedule=None, remat: bool = True, q_chunk: int = 512,
                  attn: AttnFn = nsa.nsa_attention, with_selection: bool = False):
    """A whole sequence [B, S] from an empty context (differentiable; rolled scans, optional per-layer remat).
    Returns (logits [B, S, V] f32, feats [B, S, 3H]), plus every layer's selection [L, B, S, Hkv, n] when
    `with_selection` (the layout-stability analysis)."""
    B, S = tokens.shape
    flags = sched.parse(schedule, cfg.n_layers)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
    ctx = Ctx(cfg, pos, attn, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    Sp = kvc.cache_capacity(cfg, S)
    kv_len = jnp.full((B,), S, jnp.int32)
    qc = q_chunk if S % q_chunk == 0 else S

    def layer(carry, lp, refresh):
        x, sel = carry
        q, k, v, g = _qkv(lp, ctx, x)
        pad = ((0, 0), (0, Sp - S), (0, 0), (0, 0))
        K, V = jnp.pad(k, pad), jnp.pad(v, pad)
        (wk, pek), (wv, pev) = _cmp_params(lp, cfg)
        KC, VC = nsa.compress_all(K, cfg, wk, pek), nsa.compress_all(V, cfg, wv, pev)
        o, sel = _chunked_attn(ctx, qc, q, g, K, V, KC, VC, kv_len, None if refresh else sel)
        return (_finish(lp, ctx, x, o), sel), ((x, sel) if with_selection else x)

    if remat:
        layer = jax.checkpoint(layer, static_argnums=(2,))
    (x, _), ys = sched.run_layers(layer, (embed(params, tokens), _empty_sel(cfg, B, S)), params["layers"],
                                  flags, unroll=False)
    if with_selection:
        return lm_logits(params, cfg, x), _features(cfg, ys[0]), ys[1]
    return lm_logits(params, cfg, x), _features(cfg, ys)
