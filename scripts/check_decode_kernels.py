"""GPU check of the decode-step kernels at the 8B shape (random bf16 weights and cache):

1. `commit_blocks` writes exactly the completed block (its layer and slot) and nothing when no block completes;
2. a 4-layer decode on the Pallas path (decode refresh layer + in-place block commit) tracks the reference decode
   (jnp attention, XLA compression) over 40 steps: logits, K/V and the compressed caches.

    python scripts/check_decode_kernels.py --out $OUT/decode_kernels_check_h200.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import commit_blocks
from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import get_config
from ssv_jax.policy import attention_for


def rel_rms(x, y) -> float:
    """Relative RMS error of x against y, in fp32."""
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    return float(jnp.sqrt(jnp.mean((x - y) ** 2) / jnp.mean(y ** 2)))


def commit_check(cfg, S: int) -> list:
    """The in-place block commit against the XLA reference at positions around a block boundary: which
    (layer, slot) pairs changed, and the max |difference| of the compressed K/V."""
    L, H, D, l = 4, cfg.n_kv_heads, cfg.head_dim, cfg.cmp_len
    ks = jax.random.split(jax.random.key(7), 8)
    K, V = (jax.random.normal(ks[i], (L, 1, S, H, D), jnp.bfloat16) for i in range(2))
    KC, VC = (jax.random.normal(ks[2 + i], (L, 1, S // cfg.cmp_stride, H, D), jnp.bfloat16) for i in range(2))
    w = [(jax.random.normal(ks[4 + 2 * i], (H, l, D, D), jnp.bfloat16) / 64,
          jax.random.normal(ks[5 + 2 * i], (H, l, D), jnp.bfloat16)) for i in range(2)]
    li = jnp.int32(2)
    run = jax.jit(lambda k, v, kc, vc, pos: commit_blocks(nsa.LayerKV(k, li), nsa.LayerKV(v, li), kc, vc, pos, cfg,
                                                          *w[0], *w[1]))
    rows = []
    for p in (S - 1024 + l - 1, S - 1024 + l, S - 1024 + l + cfg.cmp_stride - 1):
        pos = jnp.array([p], jnp.int32)
        kc, vc = run(K, V, KC, VC, pos)
        slot, _ = kvc.completed_blocks(nsa.LayerKV(K, li), pos, jnp.ones((1,), jnp.int32), 1, cfg, *w[0])
        ref_k, ref_v = kvc.append_blocks(nsa.LayerKV(K, li), nsa.LayerKV(V, li), KC, VC, pos, cfg, *w[0], *w[1])
        changed = np.nonzero(np.asarray(jnp.any(kc != KC, axis=(1, 3, 4))))
        rows.append(dict(position=int(p), expected_slot=int(slot[0, 0]) if int(slot[0, 0]) < KC.shape[2] else None,
                         changed_layer_slot_pairs=[[int(a), int(b)] for a, b in zip(*changed)],
                         max_abs_diff_vs_xla=float(max(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                                                       for x, y in ((kc, ref_k), (vc, ref_v))))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_check(cfg, S: int, T: int, steps: int) -> dict:
    """`steps` decode steps of a 4-layer model with `cfg`'s layer shape from a random cache of `T` tokens,
    on the reference and the kernel path: their logits' and caches' agreement."""
    c4 = cfg.replace(n_layers=4, feature_layers=(0, 2, 3))
    params = M.split_layers(jax.jit(lambda k: M.init_params(c4, k, jnp.bfloat16))(jax.random.key(0)))
    cache0 = kvc.random_cache(c4, 1, S, T, jax.random.key(3))
    out = {}
    for name, attn in (("reference", nsa.nsa_attention), ("kernel", attention_for("kernel", "A", 1, False))):
        c = jax.tree.map(jnp.copy, cache0)
        step = jax.jit(lambda c, t, attn=attn: M.forward(params, c4, t, c, attn=attn))
        lgs = []
        for i in range(steps):
            lg, _, c = step(c, jnp.array([[i + 3]], jnp.int32))
            lgs.append(lg)
        out[name] = (jnp.concatenate(lgs, 1), c)
    (a, ca), (b, cb) = out["reference"], out["kernel"]
    new = slice(T, T + steps)
    cnew = slice(T // cfg.cmp_stride - 2, (T + steps) // cfg.cmp_stride)
    res = dict(layers=4, context=T, capacity=S, steps=steps, logits_rel_rms=rel_rms(b, a),
               greedy_agreement=float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1))),
               new_keys_rel_rms=rel_rms(cb.k[:, :, new], ca.k[:, :, new]),
               new_values_rel_rms=rel_rms(cb.v[:, :, new], ca.v[:, :, new]),
               new_compressed_keys_rel_rms=rel_rms(cb.kc[:, :, cnew], ca.kc[:, :, cnew]),
               new_compressed_values_rel_rms=rel_rms(cb.vc[:, :, cnew], ca.vc[:, :, cnew]))
    print(json.dumps(res), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=9216)
    ap.add_argument("--context", type=int, default=8197)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="docs/results/decode_kernels_check_h200.json")
    a = ap.parse_args(argv)
    cfg = get_config("llama31-8b-nsa")
    res = dict(benchmark="decode_kernels_check", preset="llama31-8b-nsa", device=jax.devices()[0].device_kind,
               jax=jax.__version__, dtype="bfloat16", commit_blocks=commit_check(cfg, a.capacity),
               decode=decode_check(cfg, a.capacity, a.context, a.steps))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
