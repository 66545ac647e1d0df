"""Reuse- and refresh-layer launch variants at the bundled model's own verify shapes (GPU; issue #8).

    python scripts/tune_bundle_layers.py --checkpoint checkpoints/ssv-small --contexts 8192 15712 \
        --out $OUT/bundle_layers_h200.json

`tune_layers.py` tunes at the 8B layer shape (Hkv=8, D=128). The bundled model (Hkv=2, D=64, G=4) verifies a
32-node tree with far fewer programs per launch, and its round is launch-bound, so the variant that wins there
need not win here. For each context this script prefills one held-out prompt, drafts the fixed policy's tree
(`timing.layer_inputs`: layer 0's cache, the tree's positions, ancestor masks and per-path compressed blocks,
random queries / gates / in-tree keys over rotated sets) and times each variant as `--iters` calls in one jitted
`fori_loop`, two ways:
- traced: the GPU busy time and the op count of the loop, minus those of the same loop with an empty body, per
  call (device time, no launch gaps);
- host: the loop's wall clock minus the empty loop's, per call (launch gaps included; what a layer costs inside
  the model's op stream, roughly).
Every variant's output is checked against the reference (`nsa.nsa_attention` with the same selection) first.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels import refresh_layer, reuse_layer
from ssv_jax import nsa, timing
from ssv_jax.generate_cli import add_dtype_arg, load_model, prompts
from ssv_jax.policy import SSVPolicy


def variants(cfg):
    """name -> fn(q, pos, gates, layer, T, extra, sel) -> o for the reuse layer (inherited sel) and the refresh
    layer (routes; sel unused). Off the GPU the kernels run in interpret mode (a smoke run)."""
    out = {}
    ip = jax.default_backend() == "cpu"
    for c in (2, 4, 8):
        for launches in (1, 2):
            for nsplit in ((None, 1, 2, 4, 8) if launches == 1 else (None,)):
                for warps in ((4, 2) if nsplit is None else (4,)):
                    name = f"reuse_L{launches}_C{c}_split{nsplit or 'auto'}_w{warps}"
                    out[name] = (lambda q, t, g, lay, T, ex, s, c=c, n=launches, ns=nsplit, w=warps: reuse_layer(
                        q, t, g, *lay, T, s, cfg, ex, group_size=c, launches=n, nsplit=ns, num_warps=w,
                        interpret=ip)[0])
        for walk in ("mask", "skip"):
            out[f"refresh_C{c}_{walk}"] = (lambda q, t, g, lay, T, ex, s, c=c, w=walk: refresh_layer(
                q, t, g, *lay, T, cfg, ex, group_size=c, walk=w, interpret=ip)[0])
    return out


def _loop(fn, iters: int):
    return timing.attention_loop(lambda li, q, g, ex, s: fn(q, li.pos, g, li.layer, li.T, ex, s), iters)


def _busy(fn, args, trace_dir):
    """(GPU busy µs, op count, {op name: [µs, count]}) of one traced call of fn(*args) on the first GPU."""
    ops = timing.traced_gpu_ops(lambda: fn(*args), trace_dir)
    rows = ops[min(ops)] if ops else {}
    return sum(us for us, _ in rows.values()), sum(n for _, n in rows.values()), rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    add_dtype_arg(ap)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 15712])
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 6, 32], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--iters", type=int, default=32)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated substrings: run only matching variants")
    ap.add_argument("--out", default="bundle_layers.json")
    a = ap.parse_args(argv)
    if a.iters < 1 or a.sets < 1:
        raise SystemExit(f"--iters={a.iters} / --sets={a.sets} are invalid; accepted: integers >= 1")
    m, tok, desc = load_model(argparse.Namespace(random_preset=None, checkpoint=a.checkpoint, seed=0, dtype=a.dtype))
    cfg = m.cfg
    k, d, b = a.tree
    policy = SSVPolicy(top_k=k, depth=d, budget=b, order="dfs", group_size=4, backend="kernel", schedule=4,
                       precision="strict")
    policy.check_for(cfg)
    trace_root = tempfile.mkdtemp(prefix="ssv_bundle_layers_")
    res = dict(benchmark="bundle_layers", model=desc, device=jax.devices()[0].device_kind, jax=jax.__version__,
               policy=policy.describe(), iters=a.iters, sets=a.sets, method=__doc__.split("\n\n")[2], rows=[])
    keep = [s for s in a.only.split(",") if s]
    for ctx in a.contexts:
        name, p = prompts(tok, cfg.vocab_size, ctx, 1)[0]
        st, _ = timing.prefilled_state(m, p, policy, 64)
        li = timing.layer_inputs(m, policy, st, sets=a.sets)
        q0, g0, ex0 = li.rotated(0)
        o_ref, sel = jax.jit(lambda q, g, ex: nsa.nsa_attention(q, li.pos, g, *li.layer, li.T, cfg, extra=ex))(
            q0, g0, ex0)
        empty = _loop(lambda q, *_: q, a.iters)
        host0 = timing.host_time(empty, sel, li)
        busy0, ops0, _ = _busy(empty, (sel, li), os.path.join(trace_root, f"empty{ctx}"))
        for vname, fn in variants(cfg).items():
            if keep and not any(s in vname for s in keep):
                continue
            row = dict(context=ctx, prompt=name, variant=vname)
            try:
                o = jax.jit(lambda q, g, ex, s, fn=fn: fn(q, li.pos, g, li.layer, li.T, ex, s))(q0, g0, ex0, sel)
                err = jnp.sqrt(jnp.mean((o.astype(jnp.float32) - o_ref.astype(jnp.float32)) ** 2)
                               / jnp.mean(o_ref.astype(jnp.float32) ** 2))
                row["rel_rms_vs_reference"] = float(err)
                loop = _loop(fn, a.iters)
                row["host_us"] = round((timing.host_time(loop, sel, li) - host0) * 1e3 / a.iters, 2)
                busy, ops, by_op = _busy(loop, (sel, li), os.path.join(trace_root, f"{vname}{ctx}"))
                row["busy_us"] = round((busy - busy0) / a.iters, 2)
                row["ops"] = round((ops - ops0) / a.iters, 2)
                row["top_ops"] = {n[:60]: round(us / a.iters, 2) for n, (us, _) in
                                  sorted(by_op.items(), key=lambda kv: -kv[1][0])[:6]}
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                row["error"] = repr(e)[:300]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    for ctx in a.contexts:
        for kind in ("reuse", "refresh"):
            rs = [r for r in res["rows"] if r["context"] == ctx and r["variant"].startswith(kind) and "host_us" in r]
            if rs:
                best = min(rs, key=lambda r: r["host_us"])
                print(f"{ctx} best {kind}: {best['variant']} host {best['host_us']} us, busy {best['busy_us']} us, "
                      f"{best['ops']} ops", flush=True)


if __name__ == "__main__":
    main()
