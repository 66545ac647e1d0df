"""The EAGLE-3 draft head (DESIGN.md, "Drafting and acceptance").

One decoder layer over a fused target feature and the embedding of the next token:

    h_in  = fc(concat(target features at the tapped layers))      [.., H]   (first step at a position)
          | the head's own previous pre-norm output                [.., H]   (later tree steps, no fc)
    x     = concat[input_norm(embed(token)), hidden_norm(h_in)]      [.., 2H]
    h_mid = h_in + attn(x) @ wo                                      (RoPE with the head's own base)
    h_out = h_mid + mlp(post_norm(h_mid))                            the "hidden" returned everywhere
    logits = norm(h_out) @ lm_head                                   over the draft vocabulary [.., Vd]
    target id = draft id + d2t[draft id]

Position convention (EAGLE-3): the head entry at position i consumes (the target feature of position i, the token
x_{i+1}) and predicts x_{i+2}. Its KV cache slot is i. So after a prompt x_0..x_{T-1} and a sampled x_T, the draft
cache holds slots 0..T-1 and the hidden of slot T-1 predicts x_{T+1}, the first tree level (see `tree.build_tree`).

Parameters are a plain dict of arrays (`init_draft_params`); `Eagle3Head` is a thin Flax NNX module owning them.
Matmul weights are stored [in, out].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ssv_jax.config import ModelConfig, check_known_fields

WEIGHT_NAMES = ("fc", "hidden_norm", "input_norm", "post_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                "norm", "lm_head")
BUFFER_NAMES = ("d2t", "t2d")


# -- config ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftConfig:
    """Shape of an EAGLE-3 head. Frozen and hashable (a valid `jax.jit` static argument).

    `feature_layers` are the target layers whose *inputs* are fused by `fc` (must equal the target's
    `ModelConfig.features`). `has_embed=False` means the head has no embedding table and the target's is passed
    in. `max_seq_len` is the draft cache length. `rope_theta` is the head's own RoPE base (plain RoPE, no scaling).
    `window`: each entry attends to the committed slots within `window` positions of itself (None: all of them).
    A head trained on sequences of length W has never seen a key further than W back; at longer contexts a window
    keeps it in that range, and its drafting steps read W slots instead of the whole cache.
    """

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    draft_vocab: int
    target_vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    feature_layers: tuple[int, ...] = (2, 16, 29)  # (2, L/2, L-3) for the 32-layer Llama-3.1-8B
    has_embed: bool = False
    max_seq_len: int = 2048
    window: int | None = None

    def __post_init__(self):
        def need(ok: bool, name: str, value, accepted: str):
            if not ok:
                raise ValueError(f"DraftConfig.{name}={value!r} is invalid; accepted: {accepted}")

        if isinstance(self.feature_layers, list):  # from JSON
            object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

        for f in ("hidden", "n_heads", "n_kv_heads", "ffn", "draft_vocab", "target_vocab", "max_seq_len"):
            v = getattr(self, f)
            need(isinstance(v, int) and v >= 1, f, v, "an integer >= 1")
        need(isinstance(self.head_dim, int) and self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim",
             self.head_dim, "an even integer >= 2 (RoPE rotates halves)")
        need(self.n_heads % self.n_kv_heads == 0, "n_heads", self.n_heads,
             f"a multiple of n_kv_heads={self.n_kv_heads}")
        need(self.draft_vocab <= self.target_vocab, "draft_vocab", self.draft_vocab,
             f"an integer in [1, target_vocab={self.target_vocab}]")
        need(self.window is None or (isinstance(self.window, int) and self.window >= 1), "window", self.window,
             "None (attend to every committed slot) or an integer >= 1")
        need(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        need(self.norm_eps > 0, "norm_eps", self.norm_eps, "> 0")
        fl = self.feature_layers
        need(isinstance(fl, tuple) and len(fl) >= 1 and all(isinstance(i, int) and i >= 0 for i in fl),
             "feature_layers", fl, "a non-empty tuple of layer indices >= 0")

    @property
    def n_features(self) -> int:
        """Number of fused target features (fc input is n_features * hidden)."""
        return len(self.feature_layers)

    @classmethod
    def for_target(cls, model_cfg: ModelConfig, draft_vocab: int | None = None, **overrides) -> "DraftConfig":
        """A head matching `model_cfg`: same hidden size, attention shape and FFN, the target's feature taps and
        vocabulary, RoPE base 10000 (the published Llama-3.1 head) and the target's cache length."""
        kw = dict(hidden=model_cfg.hidden, n_heads=model_cfg.n_heads, n_kv_heads=model_cfg.n_kv_heads,
                  head_dim=model_cfg.head_dim, ffn=model_cfg.ffn,
                  draft_vocab=model_cfg.vocab_size if draft_vocab is None else draft_vocab,
                  target_vocab=model_cfg.vocab_size, rope_theta=10000.0, norm_eps=model_cfg.norm_eps,
                  feature_layers=tuple(model_cfg.features), has_embed=False, max_seq_len=model_cfg.max_seq_len)
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **kw) -> "DraftConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """A JSON-ready dict (`from_dict` inverts it)."""
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """Inverse of `to_dict`; unknown keys raise `ValueError`."""
        check_known_fields(cls, d)
        return cls(**d)


def check_compatible(dcfg: DraftConfig, model_cfg: ModelConfig) -> None:
    """Raise `ValueError` if the head cannot draft for `model_cfg` (hidden size, vocabulary or feature taps)."""
    if dcfg.hidden != model_cfg.hidden:
        raise ValueError(f"draft/target mismatch: DraftConfig.hidden={dcfg.hidden} but the target hidden size is "
                         f"{model_cfg.hidden}; accepted: equal hidden sizes")
    if dcfg.target_vocab != model_cfg.vocab_size:
        raise ValueError(f"draft/target mismatch: DraftConfig.target_vocab={dcfg.target_vocab} but the target "
                         f"vocab_size is {model_cfg.vocab_size}; accepted: equal vocabularies")
    if tuple(dcfg.feature_layers) != tuple(model_cfg.features):
        raise ValueError(f"draft/target mismatch: DraftConfig.feature_layers={tuple(dcfg.feature_layers)} but the "
                         f"target taps {tuple(model_cfg.features)}; accepted: the same layer indices")


# -- parameters ------------------------------------------------------------------------------------------------
def _weight_shapes(dcfg: DraftConfig) -> dict:
    H, D, F = dcfg.hidden, dcfg.head_dim, dcfg.ffn
    Hq, Hkv, nF = dcfg.n_heads, dcfg.n_kv_heads, dcfg.n_features
    return {"fc": (nF * H, H), "wq": (2 * H, Hq * D), "wk": (2 * H, Hkv * D), "wv": (2 * H, Hkv * D),
            "wo": (Hq * D, H), "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H), "lm_head": (H, dcfg.draft_vocab)}


@partial(jax.jit, static_argnums=(0, 2))
def _init_weights(dcfg: DraftConfig, key: jax.Array, dtype) -> dict:
    # one normal draw sliced into every matrix: a single compile per config
    shapes = _weight_shapes(dcfg)
    sizes = [math.prod(s) for s in shapes.values()]
    k_w, k_e = jax.random.split(key)
    flat = jax.random.normal(k_w, (sum(sizes),), jnp.float32)
    p, off = {}, 0
    for (name, shp), n in zip(shapes.items(), sizes):
        p[name] = (flat[off:off + n].reshape(shp) / math.sqrt(shp[0])).astype(dtype)
        off += n
    for name in ("hidden_norm", "input_norm", "post_norm", "norm"):
        p[name] = jnp.ones((dcfg.hidden,), dtype)
    if dcfg.has_embed:
        p["embed"] = jax.random.normal(k_e, (dcfg.target_vocab, dcfg.hidden), jnp.float32).astype(dtype)
    return p


def init_draft_params(dcfg: DraftConfig, key: jax.Array, dtype=jnp.float32, d2t: jax.Array | None = None) -> dict:
    """Random head parameters (matrices normal with std 1/sqrt(fan_in), norms ones, embedding std 1).

    `d2t` [Vd] int32 maps draft id i to target id i + d2t[i]; by default the draft vocabulary is the first Vd
    target ids (d2t = 0). `t2d` [V] bool marks the target ids that are in the draft vocabulary.
    An `embed` [V, H] table is created only when `dcfg.has_embed`.
    """
    p = dict(_init_weights(dcfg, key, jnp.dtype(dtype)))
    if d2t is None:
        d2t = jnp.zeros((dcfg.draft_vocab,), jnp.int32)
    d2t = jnp.asarray(d2t, jnp.int32)
    if d2t.shape != (dcfg.draft_vocab,):
        raise ValueError(f"d2t has shape {d2t.shape}; accepted: ({dcfg.draft_vocab},)")
    tgt = jnp.arange(dcfg.draft_vocab) + d2t
    if not isinstance(tgt, jax.core.Tracer) and not bool(jnp.all((tgt >= 0) & (tgt < dcfg.target_vocab))):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary; accepted: 0 <= i + d2t[i] < "
                         f"{dcfg.target_vocab}")
    p["d2t"] = d2t
    p["t2d"] = jnp.zeros((dcfg.target_vocab,), bool).at[tgt].set(True)
    return p


def draft_to_target(params: dict, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target-vocabulary ids (`target = draft + d2t[draft]`)."""
    return draft_ids + params["d2t"][draft_ids]


def _embedding(params: dict, embed: jax.Array | None) -> jax.Array:
    if "embed" in params:
        return params["embed"]
    if embed is None:
        raise ValueError("the draft head has no embedding (has_embed=False): pass the target's embedding table "
                         "[target_vocab, hidden] as `embed`")
    if embed.ndim != 2 or embed.shape[1] != params["fc"].shape[1]:
        raise ValueError(f"embed has shape {tuple(embed.shape)}; accepted: [target_vocab, "
                         f"{params['fc'].shape[1]}] (the target's embedding table)")
    return embed


# -- cache -----------------------------------------------------------------------------------------------------
class DraftCache(NamedTuple):
    """The head's own dense KV cache. Slot s holds the (post-RoPE) key/value of the head entry at position s;
    the first `length` [B] slots are committed. k, v: [B, S, Hkv, D]."""

    k: jax.Array
    v: jax.Array
    length: jax.Array


def init_draft_cache(dcfg: DraftConfig, batch: int, dtype=jnp.float32, max_len: int | None = None) -> DraftCache:
    """An empty cache of `max_len` (default `dcfg.max_seq_len`) slots."""
    S = dcfg.max_seq_len if max_len is None else max_len
    z = jnp.zeros((batch, S, dcfg.n_kv_heads, dcfg.head_dim), dtype)
    return DraftCache(z, z, jnp.zeros((batch,), jnp.int32))


# -- the layer -------------------------------------------------------------------------------------------------
def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(x.dtype)


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE (the HF/EAGLE layout): x [B, M, heads, D] at positions pos [B, M]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    ang = pos.astype(jnp.float32)[..., None] * inv  # [B, M, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., D // 2:], xf[..., :D // 2]], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


def _qkv(params, dcfg: DraftConfig, emb, h, pos):
    B, M, _ = h.shape
    x = jnp.concatenate([_rms(emb, params["input_norm"], dcfg.norm_eps),
                         _rms(h, params["hidden_norm"], dcfg.norm_eps)], axis=-1)
    D = dcfg.head_dim
    q = (x @ params["wq"]).reshape(B, M, dcfg.n_heads, D)
    k = (x @ params["wk"]).reshape(B, M, dcfg.n_kv_heads, D)
    v = (x @ params["wv"]).reshape(B, M, dcfg.n_kv_heads, D)
    return rope(q, pos, dcfg.rope_theta), rope(k, pos, dcfg.rope_theta), v


# Above this many fp32 scores per key set, attention runs over key chunks with an online softmax (lax.scan), so
# long-context prefill of the head stays within memory; below it, one dense pass (the decode-time case).
DENSE_SCORES_MAX = 1 << 27


def _block_stats(qg, k, v, mask):
    """Softmax statistics of one key block: running max m, sum l [B, Hkv, G, M] and weighted values
    acc [B, M, Hkv, G, D], with fully masked rows giving m = -1e30, l = 0, acc = 0. The exponent is masked
    before exp, so a fully masked row has zero (not NaN) gradients: exp(s - (-1e30)) would overflow."""
    s = jnp.einsum("bmhgd,bshd->bhgms", qg, k.astype(jnp.float32))
    mk = mask[:, None, None]
    m = jnp.max(jnp.where(mk, s, -1e30), axis=-1)
    e = jnp.exp(jnp.where(mk, s - m[..., None], -jnp.inf))
    return m, jnp.sum(e, axis=-1), jnp.einsum("bhgms,bshd->bmhgd", e, v.astype(jnp.float32))


def _merge(x, y):
    (m1, l1, a1), (m2, l2, a2) = x, y
    m = jnp.maximum(m1, m2)
    c1, c2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    t = lambda c: jnp.transpose(c, (0, 3, 1, 2))[..., None]  # [B, Hkv, G, M] -> [B, M, Hkv, G, 1]
    return m, l1 * c1 + l2 * c2, a1 * t(c1) + a2 * t(c2)


def _chunk(S: int, per_key: int) -> int:
    """The largest divisor of S whose score block fits DENSE_SCORES_MAX (S itself when it all fits)."""
    target = max(1, DENSE_SCORES_MAX // max(per_key, 1))
    if S <= target:
        return S
    return max(c for c in range(1, target + 1) if S % c == 0)


def _attend(q, parts):
    """Joint softmax of q [B, M, Hq, D] over several key sets without concatenating them.

    `parts` is a list of (k [B, S_i, Hkv, D], v [B, S_i, Hkv, D], mask) where mask is [B, M, S_i] bool or a
    function (start, size) -> [B, M, size] (so long caches never materialise a full mask). Returns [B, M, Hq*D].
    """
    B, M, Hq, D = q.shape
    Hkv = parts[0][0].shape[2]
    qg = q.reshape(B, M, Hkv, Hq // Hkv, D).astype(jnp.float32) / math.sqrt(D)
    stats = None
    for k, v, mask in parts:
        S = k.shape[1]
        mfn = mask if callable(mask) else (lambda s0, n, mask=mask: jax.lax.dynamic_slice_in_dim(mask, s0, n, 2))
        c = _chunk(S, B * Hq * M)
        if c == S:
            st = _block_stats(qg, k, v, mfn(0, S))
        else:
            def body(carry, i, k=k, v=v, mfn=mfn, c=c):
                s0 = i * c
                blk = _block_stats(qg, jax.lax.dynamic_slice_in_dim(k, s0, c, 1),
                                   jax.lax.dynamic_slice_in_dim(v, s0, c, 1), mfn(s0, c))
                return _merge(carry, blk), None

            init = (jnp.full((B, Hkv, Hq // Hkv, M), -1e30), jnp.zeros((B, Hkv, Hq // Hkv, M)),
                    jnp.zeros((B, M, Hkv, Hq // Hkv, D)))
            st, _ = jax.lax.scan(body, init, jnp.arange(S // c))
        stats = st if stats is None else _merge(stats, st)
    _, l, acc = stats
    l = jnp.maximum(jnp.transpose(l, (0, 3, 1, 2))[..., None], 1e-30)  # all-masked rows (invalid queries) -> 0
    return (acc / l).reshape(B, M, Hq * D).astype(q.dtype)


def draft_attention(q, k, v, length, positions, window: int | None = None, extra=()):
    """The head's attention, the reference (`pallas_kernels.draft_attention` is the kernel path, same contract).

    q [B, M, Hq, D]: the entries' queries at head positions `positions` [B, M]. k, v [B, S, Hkv, D]: the head
    cache with `length` [B] committed slots; an entry sees the slots s < length with s <= its position and, with
    `window`, s > position - window. `extra`: further key sets (k [B, E, Hkv, D], v, mask [B, M, E] bool), each
    key seen where its mask says. Returns [B, M, Hq * D] in q's dtype; an entry that sees no key gets zeros.

    With a window shorter than the cache, only the slice of `window + M - 1` slots from the first entry's window
    start is read: every visible slot lies in it when a row's positions span at most M - 1 (a tree level's nodes
    share one position; `draft_extend` runs consecutive ones)."""
    B, M = positions.shape
    S = k.shape[1]
    first = jnp.zeros((B,), jnp.int32)
    if window is not None and window + M - 1 < S:
        W = window + M - 1
        first = jnp.clip(jnp.min(positions, 1) - window + 1, 0, S - W).astype(jnp.int32)
        take = jax.vmap(lambda x, f: jax.lax.dynamic_slice_in_dim(x, f, W, 0))
        k, v = take(k, first), take(v, first)

    def mask(s0, n):
        slot = (first[:, None] + s0 + jnp.arange(n)[None, :])[:, None, :]  # [B, 1, n]
        p = positions[:, :, None]
        ok = (slot < length[:, None, None]) & (slot <= p)
        return ok if window is None else ok & (slot > p - window)

    return _attend(q, [(k, v, mask)] + list(extra))


def _finish(params, dcfg: DraftConfig, h, attn):
    h = h + attn @ params["wo"]
    x = _rms(h, params["post_norm"], dcfg.norm_eps)
    h = h + (jax.nn.silu(x @ params["w_gate"]) * (x @ params["w_up"])) @ params["w_down"]
    return h


def draft_logits(params: dict, dcfg: DraftConfig, hidden: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [.., Vd] (fp32) of pre-norm head outputs `hidden` [.., H]."""
    return (_rms(hidden, params["norm"], dcfg.norm_eps) @ params["lm_head"]).astype(jnp.float32)


def draft_extend(params: dict, dcfg: DraftConfig, embed: jax.Array | None, feats: jax.Array,
                 next_tokens: jax.Array, positions: jax.Array, valid: jax.Array, cache: DraftCache, *,
                 attention=None):
    """Run the head on A entries and commit the valid ones into its cache (prefill, and committing accepted
    tokens after verification). `attention`: the attention primitive (default the reference `draft_attention`;
    the GPU rounds pass `pallas_kernels.draft_attention`, same contract).

    Args:
      params, dcfg: the head; `embed` [V, H] the target's embedding (ignored when the head has its own).
      feats: [B, A, n_features*H] concatenated target features (inputs of `dcfg.feature_layers`) at target
        position `positions`.
      next_tokens: [B, A] target ids x_{pos+1}, the token *following* each feature's position.
      positions: [B, A] int; the entry at position i is written to cache slot i. Valid entries of a row must be
        the contiguous positions cache.length, cache.length+1, ...
      valid: [B, A] bool; invalid entries (a padded tail) are not written and their outputs are meaningless.
    Returns:
      hidden [B, A, H] (pre-norm outputs; `hidden[:, j]` is the root hidden for the token `next_tokens[:, j]`),
      logits [B, A, Vd] fp32 (predicting x_{pos+2}), and the updated cache (length = last valid position + 1).
    Each entry attends causally to every committed slot <= its position (the cache after this call's writes).
    """
    want = dcfg.n_features * dcfg.hidden
    if feats.ndim != 3 or feats.shape[-1] != want or feats.shape[:2] != next_tokens.shape:
        raise ValueError(f"feats has shape {tuple(feats.shape)}; accepted: [B, A, {want}] with [B, A] = "
                         f"next_tokens.shape {tuple(next_tokens.shape)}")
    emb = _embedding(params, embed)[next_tokens].astype(params["fc"].dtype)
    h = feats.astype(params["fc"].dtype) @ params["fc"]
    q, k, v = _qkv(params, dcfg, emb, h, positions)
    B, S = cache.k.shape[:2]
    slot = jnp.where(valid, positions, S)  # out of range -> dropped
    bidx = jnp.arange(B)[:, None]
    ck = cache.k.at[bidx, slot].set(k.astype(cache.k.dtype), mode="drop")
    cv = cache.v.at[bidx, slot].set(v.astype(cache.v.dtype), mode="drop")
    new_len = jnp.maximum(cache.length, jnp.max(jnp.where(valid, positions + 1, 0), axis=1)).astype(jnp.int32)
    attn = (attention or draft_attention)(q, ck, cv, new_len, positions, dcfg.window)
    hidden = _finish(params, dcfg, h, attn)
    return hidden, draft_logits(params, dcfg, hidden), DraftCache(ck, cv, new_len)


def draft_tree_step(params: dict, dcfg: DraftConfig, embed: jax.Array | None, hidden: jax.Array,
                    tokens: jax.Array, positions: jax.Array, cache: DraftCache, ext_k: jax.Array,
                    ext_v: jax.Array, ext_mask: jax.Array):
    """One drafting step for M in-flight nodes; nothing is committed.

    Each node attends to the committed cache slots (< cache.length; with `dcfg.window`, those within `window`
    positions of the node), to the in-flight keys `ext_k/ext_v` [B, E, Hkv, D] it may see (`ext_mask`
    [B, M, E], normally its in-tree ancestors' entries), and to itself.

    Args:
      hidden: [B, M, H] the head's own pre-norm output at the node's parent entry (no fc).
      tokens: [B, M] the nodes' target ids; positions: [B, M] head positions (= the node's target position - 1).
    Returns:
      (hidden_out [B, M, H], logits [B, M, Vd] fp32, k [B, M, Hkv, D], v [B, M, Hkv, D]); append k/v to the
      in-flight buffer to let the nodes' descendants see them (or see `draft_tree_level`).
    """
    emb = _embedding(params, embed)[tokens].astype(hidden.dtype)
    q, k, v = _qkv(params, dcfg, emb, hidden, positions)
    B, M = tokens.shape
    extra = [(k, v, jnp.broadcast_to(jnp.eye(M, dtype=bool)[None], (B, M, M)))]
    if ext_k.shape[1] > 0:
        extra.insert(0, (ext_k, ext_v, ext_mask))
    attn = draft_attention(q, cache.k, cache.v, cache.length, positions, dcfg.window, extra)
    out = _finish(params, dcfg, hidden, attn)
    return out, draft_logits(params, dcfg, out), k, v


def draft_tree_level(params: dict, dcfg: DraftConfig, embed: jax.Array | None, hidden: jax.Array,
                     tokens: jax.Array, positions: jax.Array, cache: DraftCache, ext_k: jax.Array,
                     ext_v: jax.Array, ext_mask: jax.Array, slot: int, *, attention=None):
    """`draft_tree_step` as the tree builder runs it: the nodes' own k/v are written into the in-flight buffer
    first, at slots `slot .. slot + M - 1`, so each node sees one in-flight key set (`ext_mask` [B, M, E] must
    mark its own slot as well as its ancestors'). `attention`: as in `draft_extend`.
    Returns (hidden_out [B, M, H], logits [B, M, Vd] fp32, ext_k, ext_v) with the nodes' entries written."""
    emb = _embedding(params, embed)[tokens].astype(hidden.dtype)
    q, k, v = _qkv(params, dcfg, emb, hidden, positions)
    ext_k = jax.lax.dynamic_update_slice_in_dim(ext_k, k.astype(ext_k.dtype), slot, axis=1)
    ext_v = jax.lax.dynamic_update_slice_in_dim(ext_v, v.astype(ext_v.dtype), slot, axis=1)
    attn = (attention or draft_attention)(q, cache.k, cache.v, cache.length, positions, dcfg.window,
                                          [(ext_k, ext_v, ext_mask)])
    out = _finish(params, dcfg, hidden, attn)
    return out, draft_logits(params, dcfg, out), ext_k, ext_v


# -- the NNX module --------------------------------------------------------------------------------------------
class DraftBuffer(nnx.Variable):
    """Non-trainable head state (the d2t offsets and the t2d mask)."""


class Eagle3Head(nnx.Module):
    """Flax NNX owner of the head parameters (`nnx.Param` weights, `DraftBuffer` d2t/t2d), so `nnx.split` /
    `nnx.merge` work. The math lives in the pure functions above; `params()` returns their plain dict."""

    def __init__(self, dcfg: DraftConfig, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 params: dict | None = None):
        if params is None:
            if rngs is None:
                raise ValueError("Eagle3Head needs `rngs` (to initialise) or `params` (to wrap)")
            params = init_draft_params(dcfg, rngs.params(), dtype)
        missing = [n for n in WEIGHT_NAMES + BUFFER_NAMES if n not in params]
        if dcfg.has_embed and "embed" not in params:
            missing.append("embed")
        if missing:
            raise ValueError(f"draft params lack {missing}")
        self.dcfg = dcfg
        for n in WEIGHT_NAMES:
            setattr(self, n, nnx.Param(params[n]))
        for n in BUFFER_NAMES:
            setattr(self, n, DraftBuffer(params[n]))
        if "embed" in params:
            self.embed = nnx.Param(params["embed"])

    def params(self) -> dict:
        """The plain parameter dict used by the pure functions."""
        names = WEIGHT_NAMES + BUFFER_NAMES + (("embed",) if hasattr(self, "embed") else ())
        return {n: getattr(self, n)[...] for n in names}

    def extend(self, embed, feats, next_tokens, positions, valid, cache):
        """`draft_extend` with this head's parameters."""
        return draft_extend(self.params(), self.dcfg, embed, feats, next_tokens, positions, valid, cache)

    def build_tree(self, embed, root_hidden, root_token, root_pos, cache, spec):
        """`tree.build_tree` with this head's parameters."""
        from ssv_jax.tree import build_tree

        return build_tree(self.params(), self.dcfg, embed, root_hidden, root_token, root_pos, cache, spec)

    def tree_step(self, embed, hidden, tokens, positions, cache, ext_k, ext_v, ext_mask):
        """`draft_tree_step` with this head's parameters."""
        return draft_tree_step(self.params(), self.dcfg, embed, hidden, tokens, positions, cache, ext_k, ext_v,
                               ext_mask)
