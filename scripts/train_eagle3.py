#!/usr/bin/env python
"""Train the EAGLE-3 head on the frozen target's features and add it to the target's bundle.

    python scripts/train_eagle3.py --bundle runs/ssv-small --time-budget 150           # GPU
    python scripts/train_eagle3.py --tiny --bundle /tmp/tiny-bundle --steps 3         # CPU smoke path (CI)
    python scripts/train_eagle3.py --bundle runs/ssv-small-16k --init-draft checkpoints/ssv-small \
        --seq-len 4096 --batch 8 --micro-batch 4 --time-budget 120                     # refit after a continuation

Training-time test (EAGLE-3), unrolled `--ttt-steps` (>= 3) times, with step-k loss weight `--decay`**k (0.8):
  * step 0 (`draft.draft_extend`): the entry at position i fuses the target features f_i with the token x_{i+1}
    and predicts x_{i+2}; entries attend causally to each other — this is the committed draft cache;
  * step k >= 1 (`draft.draft_tree_step`): the chain rooted at i takes the head's own step-(k-1) hidden and the
    token x_{i+k+1} at position i+k, predicts x_{i+k+2}, and attends to the step-0 entries <= i plus its own
    earlier chain entries — exactly what a depth-k draft node sees at inference.
Each prediction is scored by soft cross-entropy against the frozen target's next-token distribution restricted
to the draft vocabulary, on positions whose target argmax is in the draft vocabulary (as EAGLE-3 does).

The draft vocabulary is the `--draft-vocab` most frequent training tokens (EOS forced in), `d2t` maps it back;
`lm_head` starts from the target's (tied) embedding rows of those tokens. The head is kept small so that the
bf16 bundle (target + head + tokenizer) stays under 60 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_target import (DTYPES, add_common_args, cast_floats, check_args, evaluate,  # noqa: E402
                          forward_train_fast, load_init_bundle, make_optimizer, make_train_step, thin,
                          train_loop)

from ssv_jax import checkpoint as ckpt  # noqa: E402
from ssv_jax import data as D  # noqa: E402
from ssv_jax import draft as DR  # noqa: E402


def draft_vocab_ids(train_tokens: np.ndarray, vocab_size: int, n: int, eos_id: int) -> np.ndarray:
    """The `n` most frequent target ids of the training tokens (ties by id), EOS included, sorted ascending."""
    if not isinstance(n, int) or not 1 <= n <= vocab_size:
        raise ValueError(f"--draft-vocab={n!r} is invalid; accepted: an integer in [1, {vocab_size}]")
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size)
    counts[eos_id] = np.iinfo(np.int64).max
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:n]).astype(np.int32)


def ttt_loss(dp, dcfg, tp, cfg, tokens, sel_ids, n_steps: int, decay: float, compute_dtype):
    """EAGLE-3 training-time-test loss of the head `dp` on `tokens` [B, S] (see the module docstring).

    Returns (weighted loss, aux [n_steps, 2]: per-step soft CE and top-1 agreement with the target argmax)."""
    B, S = tokens.shape
    tpc = cast_floats(tp, compute_dtype)
    dpc = cast_floats(dp, compute_dtype)
    logits_t, feats = forward_train_fast(tpc, cfg, tokens)
    logits_t, feats = jax.lax.stop_gradient(logits_t), jax.lax.stop_gradient(feats)
    in_draft = dp["t2d"][jnp.argmax(logits_t, -1)]  # [B, S] the target's choice is draftable
    p_t = jax.nn.softmax(logits_t[..., sel_ids], -1)  # [B, S, Vd] target distribution on the draft vocab
    t_arg = jnp.argmax(logits_t[..., sel_ids], -1)
    embed = tpc["embed"]
    idx = jnp.arange(S)

    def shift(a, k):  # a[:, i + k], zero-padded past the end
        return jnp.pad(a[:, k:], ((0, 0), (0, k)) + ((0, 0),) * (a.ndim - 2))

    def score(logits, k):
        # Entry i at step k predicts x_{i+k+2}: the target distribution at position i+k+1.
        valid = (idx + k + 1 <= S - 1)[None, :] & shift(in_draft, k + 1)
        lp = jax.nn.log_softmax(logits, -1)
        ce = -jnp.sum(shift(p_t, k + 1) * lp, -1)
        acc = (jnp.argmax(logits, -1) == shift(t_arg, k + 1)).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(valid), 1)
        return jnp.sum(jnp.where(valid, ce, 0.0)) / n, jnp.sum(jnp.where(valid, acc, 0.0)) / n

    pos0 = jnp.broadcast_to(idx[None], (B, S))
    cache = DR.init_draft_cache(dcfg, B, compute_dtype, max_len=S)
    hidden, logits, cache = DR.draft_extend(dpc, dcfg, embed, feats, shift(tokens, 1), pos0,
                                            jnp.ones((B, S), bool), cache)
    stats = [score(logits, 0)]
    empty = DR.init_draft_cache(dcfg, B, compute_dtype, max_len=1)
    causal = jnp.broadcast_to((idx[None, :] <= idx[:, None])[None], (B, S, S))
    eye = jnp.broadcast_to(jnp.eye(S, dtype=bool)[None], (B, S, S))
    ext_k, ext_v, masks = [cache.k], [cache.v], [causal]
    for k in range(1, n_steps):
        hidden, logits, kk, vv = DR.draft_tree_step(
            dpc, dcfg, embed, hidden, shift(tokens, k + 1), pos0 + k, empty,
            jnp.concatenate(ext_k, 1), jnp.concatenate(ext_v, 1), jnp.concatenate(masks, 2))
        stats.append(score(logits, k))
        ext_k.append(kk)
        ext_v.append(vv)
        masks.append(eye)
    aux = jnp.array([[ce, acc] for ce, acc in stats])
    w = jnp.array([decay ** k for k in range(n_steps)])
    return jnp.sum(w * aux[:, 0]) / jnp.sum(w), aux


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--bundle", required=True, help="target bundle (from train_target.py); the head is added")
    ap.add_argument("--out", default=None, help="write the combined bundle here instead of updating --bundle")
    ap.add_argument("--ttt-steps", type=int, default=5, help="unrolled training-time-test steps (>= 3)")
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight of step k is decay**k")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--draft-ffn", type=int, default=None)
    ap.add_argument("--draft-heads", type=int, default=None)
    ap.add_argument("--draft-kv-heads", type=int, default=2)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--draft-window", type=int, default=None,
                    help="the head's attention window when drafting (DraftConfig.window); default: --seq-len, the "
                         "longest distance it is trained on; 0: none (attend to every committed slot)")
    ap.add_argument("--init-draft", default=None,
                    help="start from this bundle's head (same draft config), e.g. after continuing the target's "
                         "training; its training record is kept in the new bundle's meta")
    args = ap.parse_args(argv)
    t_start = time.time()
    tiny = args.tiny
    args.batch = args.batch or (2 if tiny else 4)
    args.seq_len = args.seq_len or (128 if tiny else 8192)
    if args.draft_window is not None and args.draft_window < 0:
        raise ValueError(f"--draft-window={args.draft_window} is invalid; accepted: 0 (none) or an integer >= 1")
    args.micro_batch = args.micro_batch or (args.batch if tiny else 2)
    args.lr = args.lr or (5e-4 if args.init_draft else 2e-3)
    args.compute_dtype = args.compute_dtype or ("float32" if tiny else "bfloat16")
    check_args(args)
    if args.ttt_steps < 3:
        raise ValueError(f"--ttt-steps={args.ttt_steps} is invalid; accepted: an integer >= 3")
    if not 0 < args.decay <= 1:
        raise ValueError(f"--decay={args.decay} is invalid; accepted: a number in (0, 1]")
    progress = not args.no_progress
    cdt = DTYPES[args.compute_dtype]

    b = ckpt.load_bundle(args.bundle, dtype=None)
    cfg, tp, tok = b.cfg, b.params, b.tokenizer
    if tok is None:
        raise ValueError(f"bundle {args.bundle!r} has no tokenizer.json; accepted: a bundle from train_target.py")
    data_dir = Path(args.data_dir or ("runs/data-tiny" if tiny else "runs/data"))
    max_files = args.max_files if args.max_files is not None else (40 if tiny else None)
    D.prepare_data(data_dir, vocab_size=cfg.vocab_size, max_files=max_files, show_progress=progress)
    if (data_dir / "tokenizer.json").read_text(encoding="utf-8") != tok.to_str():
        raise ValueError(f"the tokenizer in {str(data_dir)!r} differs from the bundle's; accepted: the data "
                         f"directory the target was trained on")
    train, val = D.load_prepared(data_dir, "train"), D.load_prepared(data_dir, "val")
    if cfg.max_seq_len < args.seq_len:
        raise ValueError(f"--seq-len={args.seq_len} is invalid; accepted: <= the target's max_seq_len "
                         f"{cfg.max_seq_len}")

    vd = args.draft_vocab or (cfg.vocab_size // 2 if tiny else 2048)
    sel = draft_vocab_ids(train.tokens, cfg.vocab_size, vd, tok.eos_id)
    coverage = float(np.isin(val.tokens, sel).mean())
    over = {"ffn": args.draft_ffn or (cfg.ffn if tiny else 256), "n_kv_heads": args.draft_kv_heads}
    if args.draft_heads or not tiny:
        over["n_heads"] = args.draft_heads or 4
    # the head never sees a key further back than its training length: it drafts with that attention window
    over["window"] = args.seq_len if args.draft_window is None else (args.draft_window or None)
    dcfg = DR.DraftConfig.for_target(cfg, draft_vocab=vd, **over)
    DR.check_compatible(dcfg, cfg)
    d2t = sel - np.arange(vd, dtype=np.int32)
    init = None
    if args.init_draft is not None:
        init = load_init_bundle("--init-draft", args.init_draft, "draft_cfg", "train_eagle3.py")
        if init.draft_cfg.replace(window=None) != dcfg.replace(window=None):  # the window is not a weight shape
            raise ValueError(f"--init-draft={args.init_draft!r} has head {init.draft_cfg}; accepted: the head "
                             f"these arguments build, {dcfg}")
        if not np.array_equal(np.asarray(init.draft_params["d2t"]), d2t):
            raise ValueError(f"--init-draft={args.init_draft!r} has another draft vocabulary; accepted: the "
                             f"{vd} most frequent training tokens of this data directory")
    print(f"[eagle3] head {dcfg}, draft vocab covers {coverage:.1%} of validation tokens", flush=True)
    sel_j = jnp.asarray(sel)
    tx = make_optimizer(args.weight_decay, args.clip)

    def init_state():
        if init is not None:
            p = dict(init.draft_params)
        else:
            p = DR.init_draft_params(dcfg, jax.random.key(args.seed + 1), jnp.float32, d2t=jnp.asarray(d2t))
            p["lm_head"] = jnp.asarray(tp["embed"], jnp.float32)[sel_j].T  # the tied target head's rows
        trainable = {k: v for k, v in p.items() if k not in DR.BUFFER_NAMES}
        return {"params": trainable, "opt": tx.init(trainable)}

    buffers = {k: v for k, v in DR.init_draft_params(dcfg, jax.random.key(0), jnp.float32,
                                                     d2t=jnp.asarray(d2t)).items() if k in DR.BUFFER_NAMES}

    frozen = {"target": tp, "buffers": buffers}

    def loss_fn(p, t, fz):
        return ttt_loss({**p, **fz["buffers"]}, dcfg, fz["target"], cfg, t, sel_j, args.ttt_steps, args.decay, cdt)

    eval_j = jax.jit(lambda p, t, fz: loss_fn(p, t, fz))
    eval_fn = lambda p, t: eval_j(p, t, frozen)[0]
    aux_fn = lambda p, t: eval_j(p, t, frozen)[1]
    loader = D.PackedLoader(train, args.batch, args.seq_len, seed=args.seed + 1)
    make_step = lambda micro: make_train_step(tx, loss_fn, micro, frozen)
    r = train_loop(args, "eagle3", init_state, make_step, loader, eval_fn, val, t_start,
                   {"draft_vocab": vd, "ttt_steps": args.ttt_steps})
    state, step, val_b = r["state"], r["step"], r["val_batches"]

    t_eval = time.time()
    val_loss = evaluate(lambda t: eval_fn(state["params"], t), val_b, progress, "val")
    aux = np.mean([np.asarray(aux_fn(state["params"], jnp.asarray(x))) for x in val_b], 0)
    times = r["times"]
    results = {
        "steps": step, "planned_steps": r["total"], "batch": args.batch, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "tokens_seen": int(step * args.batch * args.seq_len),
        "ttt_steps": args.ttt_steps, "decay": args.decay, "draft_vocab": vd, "draft_vocab_val_coverage": coverage,
        "train_loss_last": r["last_loss"], "train_loss_ema": r["ema"], "val_loss": val_loss,
        "val_ce_per_step": aux[:, 0].tolist(), "val_top1_agreement_per_step": aux[:, 1].tolist(),
        "run_steps": step - r["step0"], "warmup": r["warmup"], "first_step_s": r["t_first"],
        "median_step_s": float(np.median(times)) if times else None,
        "tokens_per_s": args.batch * args.seq_len / float(np.median(times)) if times else None,
        "wall_s": time.time() - t_start, "eval_s": time.time() - t_eval, "lr": args.lr,
        "compute_dtype": args.compute_dtype, "device": str(jax.devices()[0].device_kind),
        "history": thin(r["history"]),
    }
    meta = ckpt.read_bundle_meta(args.bundle).get("meta", {})
    if init is None:
        meta["draft_training"] = results
    else:
        results["init_draft"] = str(args.init_draft)
        old = ckpt.read_bundle_meta(args.init_draft).get("meta", {})
        meta.update({k: v for k, v in old.items() if k == "draft_training"})
        if "draft_finetune" in old:  # a refit of a refitted head: the earlier refit's record nests inside
            results["previous"] = old["draft_finetune"]
        meta["draft_finetune"] = results
    draft_params = {**state["params"], **buffers}
    out = ckpt.save_bundle(args.out or args.bundle, cfg, tp, draft_cfg=dcfg, draft_params=draft_params,
                           tokenizer=tok, dtype="bfloat16", force=True, extra_meta=meta)
    size = sum(f.stat().st_size for f in Path(out).iterdir())
    results["bundle_bytes"] = size
    summary = {k: v for k, v in results.items() if k != "history"}
    print("[eagle3] " + json.dumps(summary), flush=True)
    if math.isfinite(size) and size > 60e6:
        print(f"[eagle3] WARNING: the bundle is {size / 1e6:.1f} MB (> 60 MB)", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
