"""Generation: autoregressive NSA decoding (`ar_generate`) and, in `ssv_jax.speculative`, SSV.

Both run their steps inside a jitted `lax.while_loop` over fixed-size buffers, a chunk of steps per call; the host
only shows progress (and, for SSV, runs the planner) between chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax import schedule as sched
from ssv_jax import sharding
from ssv_jax.config import ModelConfig, is_finite_real, is_int


@dataclass
class GenerateResult:
    """Generated token ids [B, n] (n <= max_new_tokens; rows that hit EOS are padded with eos_id) and stats."""

    tokens: np.ndarray
    stats: dict[str, Any] = field(default_factory=dict)


def unpack_target(model) -> tuple[ModelConfig, dict]:
    """Accept an `NSATransformer`, a checkpoint bundle (with .cfg/.params) or a (cfg, params) pair."""
    if isinstance(model, M.NSATransformer):
        return model.cfg, model.params()
    if hasattr(model, "cfg") and hasattr(model, "params"):
        return model.cfg, model.params
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], ModelConfig):
        return model
    raise ValueError(f"model of type {type(model).__name__} is not accepted; accepted: NSATransformer, a "
                     "checkpoint Bundle, or a (ModelConfig, params) pair")


def prepare_prompt(cfg: ModelConfig, prompt_ids, max_new_tokens: int, extra_room: int = 0) -> np.ndarray:
    """Validate a prompt ([P] or [B, P] ints) against the config; returns [B, P] int32."""
    p = np.asarray(prompt_ids)
    if p.ndim == 1:
        p = p[None]
    if p.ndim != 2:
        raise ValueError(f"prompt_ids has shape {p.shape}; accepted: [P] or [B, P]")
    M.validate_tokens(cfg, p)
    if not (is_int(max_new_tokens) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid; accepted: an integer >= 1")
    need = p.shape[1] + max_new_tokens + extra_room
    if need > cfg.max_seq_len:
        raise ValueError(f"prompt ({p.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + working room "
                         f"({extra_room}) = {need} exceeds the cache; accepted: at most "
                         f"cfg.max_seq_len={cfg.max_seq_len} in total")
    return p.astype(np.int32)


def sample(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    """Greedy argmax at temperature 0, else a categorical sample of logits / temperature. logits [..., V]."""
    if temperature == 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, -1).astype(jnp.int32)


def _check_options(cfg: ModelConfig, *, temperature, seed, eos_id, prefill_chunk, cache_dtype, mesh, **flags):
    """The checks `ar_generate` and `ssv_generate` share, before any device work; `flags` must be bools."""
    if not (is_finite_real(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r} is invalid; accepted: a finite float >= 0")
    if not (is_int(seed) and -2 ** 63 <= seed < 2 ** 63):
        raise ValueError(f"seed={seed!r} is invalid; accepted: an integer in [-2**63, 2**63)")
    if eos_id is not None and not (is_int(eos_id) and 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id={eos_id!r} is invalid; accepted: None or an id in [0, {cfg.vocab_size})")
    if not (is_int(prefill_chunk) and prefill_chunk >= 1):
        raise ValueError(f"prefill_chunk={prefill_chunk!r} is invalid; accepted: an integer >= 1")
    if cache_dtype is not None:
        try:
            ok = jnp.issubdtype(jnp.dtype(cache_dtype), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"cache_dtype={cache_dtype!r} is invalid; accepted: None (the weights' dtype) or a "
                             "floating dtype such as jnp.bfloat16 or jnp.float32")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh={mesh!r} is invalid; accepted: None (one device) or a jax.sharding.Mesh with axis "
                         "'tp' (ssv_jax.sharding.make_mesh)")
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name}={value!r} is invalid; accepted: True or False")


def _check_chunk(name: str, value) -> None:
    """A chunk length (steps or rounds per jitted call) must be an integer >= 1."""
    if not (is_int(value) and value >= 1):
        raise ValueError(f"{name}={value!r} is invalid; accepted: an integer >= 1")


@partial(jax.jit, static_argnames=("cfg", "steps", "temperature", "schedule", "attn"), donate_argnames=("cache",))
def _ar_chunk(params, cfg: ModelConfig, cache, token, key, done, eos, start=0, limit=None, *, steps: int,
              temperature: float, schedule, attn):
    """At most `steps` decode steps in one while_loop, fewer when `limit` (traced: the tokens still wanted) is
    smaller, so the last chunk of a generation compiles no shape of its own. token [B] is the last sampled token
    (not yet in the cache). Step i samples with fold_in(fold_in(key, start), i) (`start`: the tokens produced
    before)."""
    B = token.shape[0]
    key = jax.random.fold_in(key, start)
    limit = steps if limit is None else jnp.minimum(steps, limit)

    def cond(c):
        i, _, _, done, _ = c
        return (i < limit) & ~jnp.all(done)

    def body(c):
        i, cache, tok, done, out = c
        logits, _, cache = M.forward(params, cfg, tok[:, None], cache, schedule=schedule, unroll=True, attn=attn)
        nxt = sample(logits[:, 0], temperature, jax.random.fold_in(key, i))
        nxt = jnp.where(done, eos, nxt)
        out = out.at[:, i].set(nxt)
        return i + 1, cache, nxt, done | (nxt == eos), out

    out = jnp.full((B, steps), -1, jnp.int32)
    n, cache, tok, done, out = jax.lax.while_loop(cond, body, (0, cache, token, done, out))
    return cache, tok, done, out, n


def default_decode_attention():
    """The decode attention `ar_generate` uses by default: the Pallas kernels (mode A, one query per group) on a
    GPU, the jnp reference elsewhere."""
    if jax.default_backend() == "gpu":
        from ssv_jax.policy import attention_for

        return attention_for("kernel", "A", 1, False)
    return nsa.nsa_attention


def ar_generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                eos_id: int | None = None, *, schedule=None, attn=None, chunk_steps: int = 128,
                prefill_chunk: int = 512, cache_dtype=None, progress: bool = False, mesh=None,
                split_weights: bool = True) -> GenerateResult:
    """Autoregressive NSA decoding (optionally under a refresh/reuse `schedule`, the SSV model variant).

    `mesh` (a `jax.sharding.Mesh` with axis "tp", see `ssv_jax.sharding`) shards params and cache over KV heads;
    the default runs on one device. `split_weights` (default) decodes on the decode weight layout
    (`model.split_layers`: per-layer buffers, fused projections; a second copy of the weights) instead of slicing
    the stacked weights inside the decode loop (about 3x slower at 8B shapes, docs/RESULTS.md).

    `attn` (signature of `nsa.nsa_attention`) serves prefill and decode. By default prefill uses the jnp reference
    and decode the Pallas kernels on a GPU (faster per step at 8B shapes, docs/RESULTS.md), the reference
    elsewhere.

    `chunk_steps` is the most steps per jitted call; between calls the host reads the results in one transfer.

    Returns the new tokens [B, n] and stats: prefill_s, decode_s, steps, tokens_per_s."""
    cfg, params = unpack_target(model)
    _check_options(cfg, temperature=temperature, seed=seed, eos_id=eos_id, prefill_chunk=prefill_chunk,
                   cache_dtype=cache_dtype, mesh=mesh, progress=progress, split_weights=split_weights)
    _check_chunk("chunk_steps", chunk_steps)
    schedule = sched.canonical(schedule)  # hashable (a jit static argument) whatever form it came in
    prompt = prepare_prompt(cfg, prompt_ids, max_new_tokens, extra_room=prefill_chunk)
    B, P = prompt.shape
    dtype = cache_dtype or jax.tree.leaves(params)[0].dtype
    cache = kvc.init_cache(cfg, B, P + max_new_tokens + prefill_chunk, dtype)
    decode_attn = attn if attn is not None else default_decode_attention()
    attn = attn if attn is not None else nsa.nsa_attention
    if mesh is not None:
        params, cache = sharding.place(params, cfg, cache, mesh)
        attn, decode_attn = sharding.attention_on(attn, mesh), sharding.attention_on(decode_attn, mesh)
    key_first, key = jax.random.split(jax.random.key(seed))
    t0 = time.perf_counter()
    logits, _, cache = M.prefill(params, cfg, prompt, cache, chunk=prefill_chunk, schedule=schedule, attn=attn,
                                 progress=progress)
    tok = sample(logits, temperature, key_first)
    if split_weights:
        params = sharding.split_layers(params, mesh)  # projections fused per shard on a mesh
    jax.block_until_ready((tok, params))
    t1 = time.perf_counter()
    eos = jnp.int32(-2 if eos_id is None else eos_id)
    done = tok == eos
    outs = [np.asarray(tok)[:, None]]
    produced = 1
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens, desc="decode", unit="tok", initial=1)
    steps = min(chunk_steps, max_new_tokens - 1)  # one chunk shape per generation; `limit` stops the last chunk
    while produced < max_new_tokens and not np.all(np.asarray(done)):
        cache, tok, done, out, n = _ar_chunk(params, cfg, cache, tok, key, done, eos, produced,
                                             max_new_tokens - produced, steps=steps, temperature=float(temperature),
                                             schedule=schedule, attn=decode_attn)
        out, n, done = jax.device_get((out, n, done))  # one transfer for all the host reads
        n = int(n)
        outs.append(out[:, :n])
        produced += n
        if bar is not None:
            bar.update(n)
    if bar is not None:
        bar.close()
    t2 = time.perf_counter()
    tokens = np.concatenate(outs, 1)
    stats = dict(prefill_s=t1 - t0, decode_s=t2 - t1, steps=int(tokens.shape[1]),
                 tokens_per_s=(tokens.shape[1] - 1) / max(t2 - t1, 1e-9), method="ar",
                 schedule=None if schedule is None else str(schedule))
    return GenerateResult(tokens, stats)
