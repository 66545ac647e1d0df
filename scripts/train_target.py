#!/usr/bin/env python
"""Train the NSA target (`small` preset) on the stdlib corpus, and write a bf16 bundle.

    python scripts/train_target.py --out runs/ssv-small --time-budget 330          # GPU: steps sized to the budget
    python scripts/train_target.py --tiny --steps 3 --out /tmp/tiny-bundle          # CPU smoke path (CI)
    python scripts/train_target.py --init-bundle checkpoints/ssv-small --seq-len 16384 --batch 2 \
        --time-budget 200 --out runs/ssv-small-16k                                   # GPU: continue at 16K

* Data: `ssv_jax.data.prepare_data` (tokenizer trained on the train split; cached in --data-dir). Packed
  sequences of --seq-len tokens (default 8192), next-token loss on all positions but the last.
* Precision: fp32 master weights and AdamW state; forward/backward in bf16 (`--compute-dtype`), logits and loss
  in fp32. Per-layer remat (`model.forward_train(remat=True)`).
* Optimiser: optax AdamW (b2=0.95, weight decay on matrices only) under global-norm clipping; the learning rate
  is a linear warmup + cosine decay evaluated on the host each step, so that `--time-budget` can size the total
  step count after timing the first steps.
* Resume: orbax checkpoints of (params, optimizer state) in --ckpt-dir every --ckpt-every steps and at the end;
  a rerun with the same --ckpt-dir continues at the last step with the same schedule (run.json).
* Micro-batching: --micro-batch splits each batch into gradient-accumulated chunks; on an out-of-memory error
  in the first step the micro-batch is halved and the step retried.
* Continued training: --init-bundle starts from a bundle's target (its config and tokenizer), e.g. to extend
  it to a longer --seq-len; the new bundle keeps the first training's record and adds "target_finetune".
* End: validation loss, held-out (test split) perplexity, tokens/s, and a bundle (bf16 by default) with the
  tokenizer and these numbers in its config.json "meta".
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
import optax
from tqdm import tqdm

from ssv_jax import checkpoint as ckpt
from ssv_jax import data as D
from ssv_jax import model as M
from ssv_jax import nsa
from ssv_jax.config import get_config
from ssv_jax.tokenizer import Tokenizer

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


# -- shared with train_eagle3.py ---------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int, final_ratio: float) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to `peak * final_ratio` at `total`."""
    sched = optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1), max(total, warmup + 1),
                                               end_value=peak * final_ratio)
    return float(sched(step))


def make_optimizer(weight_decay: float, clip: float, b2: float = 0.95):
    """AdamW with an injectable learning rate, decaying only matrices (not norms or vectors), under clipping."""
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x.ndim >= 2 and not str(path[-1].key).endswith("norm"), params)

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=b2,
                                                             weight_decay=weight_decay, mask=decay_mask))


def set_lr(opt_state, lr):
    """The optimizer state with the AdamW learning rate replaced by `lr` (a traced scalar is fine)."""
    inner = opt_state[1]
    hp = dict(inner.hyperparams)
    hp["learning_rate"] = jnp.asarray(lr, hp["learning_rate"].dtype)
    return (opt_state[0], inner._replace(hyperparams=hp)) + tuple(opt_state[2:])


def cast_floats(tree, dtype):
    """Floating leaves cast to `dtype`; others untouched."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def is_oom(e: BaseException) -> bool:
    """True for XLA out-of-memory errors."""
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


def accumulate_grads(loss_fn, params, batch: jax.Array, micro: int):
    """Mean loss/aux and gradients of `loss_fn(params, tokens) -> (loss, aux)` over `batch` [B, ...] split into
    chunks of `micro` rows (a `lax.scan`, so memory is one chunk's)."""
    B = batch.shape[0]
    n = B // micro
    chunks = batch.reshape((n, micro) + batch.shape[1:])
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(acc, tok):
        (l, aux), g = grad_fn(params, tok)
        return jax.tree.map(jnp.add, acc, (l, aux, g)), None

    (l0, aux0), g0 = jax.eval_shape(grad_fn, params, chunks[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (l0, aux0, g0))
    (l, aux, g), _ = jax.lax.scan(body, zeros, chunks)
    return jax.tree.map(lambda x: x / n, (l, aux, g))


def plan_total_steps(args, step_done: int, step_time: float, elapsed: float) -> int:
    """Total steps that fit the time budget after `step_done` steps taking `step_time` s each from now."""
    left = args.time_budget - elapsed - args.reserve
    return max(step_done + 1, step_done + int(left / max(step_time, 1e-6)))


def load_init_bundle(flag: str, path: str, part: str, written_by: str):
    """The bundle at `path` (fp32) for a continued training, or a ValueError naming `flag` when it lacks `part`
    (a Bundle attribute, e.g. "tokenizer" or "draft_cfg")."""
    b = ckpt.load_bundle(path, dtype=jnp.float32)
    if getattr(b, part) is None:
        raise ValueError(f"{flag}={path!r} has no {part}; accepted: a bundle written by {written_by}")
    return b


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Arguments shared by both training scripts."""
    ap.add_argument("--tiny", action="store_true", help="tiny preset, short sequences, few files (CPU smoke)")
    ap.add_argument("--steps", type=int, default=None, help="total optimizer steps (default: fit --time-budget)")
    ap.add_argument("--time-budget", type=float, default=None, help="wall seconds for the whole run")
    ap.add_argument("--reserve", type=float, default=40.0, help="seconds of the budget kept for eval and saving")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of the steps, >= 1)")
    ap.add_argument("--final-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=None, help="validation every N steps (default: 5 times)")
    ap.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    ap.add_argument("--ckpt-dir", default=None, help="orbax training checkpoints (resume from here)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--data-dir", default=None, help="prepared corpus (default runs/data or runs/data-tiny)")
    ap.add_argument("--compute-dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")


def check_args(args) -> None:
    """ValueErrors for out-of-range arguments."""
    if args.steps is None and args.time_budget is None:
        raise ValueError("one of --steps or --time-budget is required; accepted: --steps N (>= 1) or "
                         "--time-budget SECONDS (> 0)")
    for name in ("steps", "batch", "micro_batch", "seq_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} is invalid; accepted: an integer >= 1")
    if args.micro_batch is not None and args.batch % args.micro_batch:
        raise ValueError(f"--micro-batch={args.micro_batch} is invalid; accepted: a divisor of --batch={args.batch}")
    if args.time_budget is not None and args.time_budget <= args.reserve:
        raise ValueError(f"--time-budget={args.time_budget} is invalid; accepted: > --reserve={args.reserve}")


class RunState:
    """run.json next to the orbax checkpoints: the schedule (total steps) and the settings of a run."""

    def __init__(self, directory: Path | None):
        self.path = None if directory is None else Path(directory) / "run.json"

    def load(self) -> dict:
        """The saved run settings, or {}."""
        if self.path is None or not self.path.is_file():
            return {}
        return json.loads(self.path.read_text())

    def save(self, d: dict) -> None:
        """Writes the run settings."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(d, indent=1))


def make_train_step(tx, loss_fn, micro: int, frozen=None):
    """A step (state, tokens, lr) -> (state, loss, grad norm) for `loss_fn(params, tokens, frozen) -> (loss,
    aux)`, with gradient accumulation over chunks of `micro` rows. `frozen` (e.g. the target's weights) is passed
    to the jitted function as an argument, never baked into the program as a constant."""
    @jax.jit
    def step_fn(state, tokens, lr, frozen):
        loss, _, g = accumulate_grads(lambda p, t: loss_fn(p, t, frozen), state["params"], tokens, micro)
        gnorm = optax.global_norm(g)
        upd, opt = tx.update(g, set_lr(state["opt"], lr), state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": opt}, loss, gnorm
    return lambda state, tokens, lr: step_fn(state, tokens, lr, frozen)


def thin(history: list, n: int = 50) -> list:
    """About `n` evenly spaced entries of a history list, the last one included."""
    return history[:: max(1, len(history) // n)] + history[-1:] if history else []


def train_loop(args, name: str, init_state, make_step, loader, eval_fn, val_split, t_start: float,
               run_meta: dict) -> dict:
    """The loop both scripts share: resume from --ckpt-dir, time the first steps and plan the step count for
    --time-budget, warmup+cosine learning rate, OOM fallback to a smaller micro-batch on the first step, a tqdm
    bar with loss/lr/tokens-per-second, periodic validation with `eval_fn(params, batch) -> loss`, checkpoints.

    `init_state()` returns {"params", "opt"}; `make_step(micro)` returns a jitted (state, tokens, lr) ->
    (state, loss, gnorm). Returns a dict: state, step, step0, total, warmup, history, times, t_first, ema,
    last_loss, val_batches."""
    progress = not args.no_progress
    run = RunState(args.ckpt_dir)
    saved = run.load()
    ckm = ckpt.TrainCheckpointer(args.ckpt_dir) if args.ckpt_dir else None
    step0, state = (0, None) if ckm is None else ckm.restore(jax.eval_shape(init_state))
    if state is None:
        state = init_state()
    else:
        print(f"[{name}] resuming at step {step0} of {saved.get('total_steps')}", flush=True)
    total = args.steps or saved.get("total_steps")
    val_b = D.eval_batches(val_split, args.micro_batch, args.seq_len, args.eval_batches)
    step_fn = make_step(args.micro_batch)
    warmup = saved.get("warmup") or args.warmup or (max(1, total // 20) if total else 20)
    history, times, step, t_first, ema, last_loss, bar = [], [], step0, None, None, float("nan"), None
    while total is None or step < total:
        if args.time_budget is not None and total is not None and \
                time.time() - t_start > args.time_budget - args.reserve:
            print(f"[{name}] time budget reached at step {step} of {total}", flush=True)
            break
        tokens = jnp.asarray(loader.batch_at(step))
        # Before the step count is planned only warmup steps run, and the warmup does not depend on the total.
        lr = lr_at(step, total or 10 ** 9, args.lr, warmup, args.final_lr_ratio)
        t0 = time.time()
        try:
            state, loss, gnorm = step_fn(state, tokens, lr)
            loss = float(loss)
        except Exception as e:  # noqa: BLE001 - only an OOM in the first step is handled
            if step == step0 and is_oom(e) and args.micro_batch > 1:
                args.micro_batch //= 2
                print(f"[{name}] out of memory; retrying with micro-batch {args.micro_batch}", flush=True)
                step_fn = make_step(args.micro_batch)
                val_b = D.eval_batches(val_split, args.micro_batch, args.seq_len, args.eval_batches)
                continue
            raise
        dt = time.time() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr (now {args.lr})")
        if t_first is None:
            t_first = dt  # includes compilation
        else:
            times.append(dt)
        step += 1
        last_loss = loss
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        history.append({"step": step, "loss": loss, "lr": lr, "gnorm": float(gnorm)})
        if total is None and len(times) >= 3:
            total = plan_total_steps(args, step, float(np.median(times)), time.time() - t_start)
            print(f"[{name}] step time {np.median(times):.3f}s -> planning {total} steps", flush=True)
        if total is not None and bar is None:
            run.save(dict(run_meta, total_steps=total, warmup=warmup, batch=args.batch, seq_len=args.seq_len,
                          lr=args.lr, seed=args.seed))
            bar = tqdm(total=total, initial=step, desc=name, disable=not progress, mininterval=5.0)
        if bar is not None:
            bar.update(step - bar.n)
            tps = tokens.size / np.median(times) if times else 0.0
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
        every = args.eval_every or max(1, (total or 10 ** 9) // 5)
        if total is not None and step % every == 0 and step < total:
            vl = evaluate(lambda t: eval_fn(state["params"], t), val_b, progress, "val")
            history[-1]["val_loss"] = vl
            print(f"\n[{name}] step {step}: train {ema:.4f} val {vl:.4f}", flush=True)
        if ckm is not None and args.ckpt_every and step % args.ckpt_every == 0:
            ckm.save(step, state)
    if bar is not None:
        bar.close()
    if ckm is not None:
        ckm.save(step, state)
        ckm.close()
    return dict(state=state, step=step, step0=step0, total=total, warmup=warmup, history=history, times=times,
                t_first=t_first, ema=ema, last_loss=last_loss, val_batches=val_b)


# -- the training attention ----------------------------------------------------------------------------------------
def forward_train_fast(params, cfg, tokens):
    """`model.forward_train` with `nsa.nsa_attention_dense` over the whole sequence (one attention call a layer)."""
    return M.forward_train(params, cfg, tokens, attn=nsa.nsa_attention_dense, q_chunk=tokens.shape[1])


# -- target training -----------------------------------------------------------------------------------------------
def training_init(cfg, key) -> dict:
    """`model.init_params` rescaled for training from scratch: the (tied) embedding to std 1/sqrt(H), so initial
    logits are O(1), and the residual output projections (wo, w_down) by 1/sqrt(2L) (GPT-2)."""
    p = M.init_params(cfg, key, jnp.float32)
    p["embed"] = p["embed"] / math.sqrt(cfg.hidden)
    s = 1.0 / math.sqrt(2 * cfg.n_layers)
    p["layers"]["wo"] = p["layers"]["wo"] * s
    p["layers"]["w_down"] = p["layers"]["w_down"] * s
    return p


def lm_loss(params, cfg, tokens, compute_dtype):
    """Mean next-token cross-entropy over positions 0..S-2 (fp32), and the count of scored tokens."""
    logits, _ = forward_train_fast(cast_floats(params, compute_dtype), cfg, tokens)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    return jnp.mean(nll)


def evaluate(eval_fn, batches, progress: bool, desc: str) -> float:
    """Mean loss over `batches` (equal-size batches, so the mean of means is the token mean)."""
    losses = [float(eval_fn(jnp.asarray(b)))
              for b in tqdm(batches, desc=desc, leave=False, disable=not progress, mininterval=5.0)]
    return float(np.mean(losses)) if losses else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--out", default="runs/ssv-small", help="bundle directory to write")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--test-batches", type=int, default=None, help="test windows for perplexity (default all)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N files of each split")
    ap.add_argument("--init-bundle", default=None,
                    help="continue training this bundle's target (e.g. at a longer --seq-len), with its config "
                         "and tokenizer; its training record is kept in the new bundle's meta")
    args = ap.parse_args(argv)
    t_start = time.time()
    tiny = args.tiny
    # Defaults: small on the GPU (8K sequences, 32K tokens a step), tiny on the CPU.
    args.batch = args.batch or (2 if tiny else 4)
    args.seq_len = args.seq_len or (128 if tiny else 8192)
    args.micro_batch = args.micro_batch or args.batch
    args.lr = args.lr or (3e-3 if tiny else 4e-4 if args.init_bundle else 2e-3)
    args.compute_dtype = args.compute_dtype or ("float32" if tiny else "bfloat16")
    max_files = args.max_files if args.max_files is not None else (40 if tiny else None)
    if args.test_batches is None and tiny:
        args.test_batches = 4
    data_dir = Path(args.data_dir or ("runs/data-tiny" if tiny else "runs/data"))
    check_args(args)
    progress = not args.no_progress
    vocab = 512 if tiny else get_config(args.preset).vocab_size

    init = None
    if args.init_bundle is not None:
        init = load_init_bundle("--init-bundle", args.init_bundle, "tokenizer", "train_target.py")
        vocab = init.cfg.vocab_size
    meta = D.prepare_data(data_dir, vocab_size=vocab, max_files=max_files, show_progress=progress,
                          tokenizer=None if init is None else init.tokenizer)
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    train, val, test = (D.load_prepared(data_dir, s) for s in D.SPLITS)
    if init is not None:
        cfg = init.cfg
    else:
        cfg = get_config("tiny", vocab_size=tok.vocab_size) if tiny else get_config(args.preset)
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"tokenizer vocab {tok.vocab_size} != ModelConfig.vocab_size={cfg.vocab_size}; accepted: equal")
    if cfg.max_seq_len < args.seq_len:
        cfg = cfg.replace(max_seq_len=args.seq_len)
    cdt = DTYPES[args.compute_dtype]
    print(f"[target] {cfg.name}: {cfg.param_count() / 1e6:.2f}M params, corpus {meta['splits']}, "
          f"batch {args.batch}x{args.seq_len} (micro {args.micro_batch}), compute {args.compute_dtype}, "
          f"devices {jax.devices()}", flush=True)

    loader = D.PackedLoader(train, args.batch, args.seq_len, seed=args.seed)
    tx = make_optimizer(args.weight_decay, args.clip)

    def init_state():
        p = training_init(cfg, jax.random.key(args.seed)) if init is None else init.params
        return {"params": p, "opt": tx.init(p)}

    loss_fn = lambda p, t, _: (lm_loss(p, cfg, t, cdt), jnp.zeros(()))
    eval_fn = jax.jit(lambda p, t: lm_loss(p, cfg, t, cdt))
    make_step = lambda micro: make_train_step(tx, loss_fn, micro)
    r = train_loop(args, "target", init_state, make_step, loader, eval_fn, val, t_start, {"preset": cfg.name})
    state, step, val_b = r["state"], r["step"], r["val_batches"]

    t_eval = time.time()
    val_loss = evaluate(lambda t: eval_fn(state["params"], t), val_b, progress, "val")
    test_b = D.eval_batches(test, args.micro_batch, args.seq_len, args.test_batches)
    test_loss = evaluate(lambda t: eval_fn(state["params"], t), test_b, progress, "test")
    times = r["times"]
    tps = args.batch * args.seq_len / float(np.median(times)) if times else float("nan")
    results = {
        "preset": cfg.name, "steps": step, "planned_steps": r["total"], "batch": args.batch, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "tokens_seen": int(step * args.batch * args.seq_len),
        "train_loss_last": r["last_loss"], "train_loss_ema": r["ema"], "val_loss": val_loss,
        "test_loss": test_loss, "test_ppl": math.exp(test_loss), "test_tokens": int(sum(b.size for b in test_b)),
        "run_steps": step - r["step0"], "warmup": r["warmup"], "tokens_per_s": tps, "first_step_s": r["t_first"], "median_step_s":
        float(np.median(times)) if times else None, "wall_s": time.time() - t_start,
        "eval_s": time.time() - t_eval, "lr": args.lr, "compute_dtype": args.compute_dtype,
        "device": str(jax.devices()[0].device_kind), "corpus": meta,
        "history": thin(r["history"]),
    }
    if init is None:
        bundle_meta = {"target_training": results}
    else:
        # A continued training: the first training's record stays; the head (if any) is not carried over,
        # since it was fitted to the old target's features.
        old = ckpt.read_bundle_meta(args.init_bundle).get("meta", {})
        results["init_bundle"] = str(args.init_bundle)
        bundle_meta = {k: v for k, v in old.items() if k.startswith("target_")}
        if "target_finetune" in old:  # a continuation of a continuation: the earlier one's record nests inside
            results["previous"] = old["target_finetune"]
        bundle_meta["target_finetune"] = results
    ckpt.save_bundle(args.out, cfg, state["params"], tokenizer=tok, dtype=args.save_dtype, force=True,
                     extra_meta=bundle_meta)
    summary = {k: v for k, v in results.items() if k not in ("history", "corpus")}
    print("[target] " + json.dumps(summary), flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
