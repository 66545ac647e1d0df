#!/usr/bin/env python
"""Evaluate a bundle on held-out stdlib source and write docs/results/small_eval.json.

    python scripts/eval_model.py                                  # checkpoints/ssv-small, CPU-sized defaults
    python scripts/eval_model.py --ppl-windows 0 --contexts 1024,4096,8192,16384 --new-tokens 128   # GPU

* Held-out perplexity: the test split (files never trained on) tokenized with the bundle's tokenizer, cut into
  non-overlapping --seq-len windows in file order; --ppl-windows of them evenly spaced (0 = all). Every position
  but the first of a window is scored.
* tau (mean tokens emitted per verify round: accepted drafts + the bonus token) at temperatures 0 and 1, for
  each context length in --contexts, with a chain policy (top_k=1) and a tree policy (<= 32 nodes), through
  `ssv_jax.speculative.ssv_generate` (imported lazily; skipped with a note when it is unavailable or the bundle
  has no draft head). Prompts: the last `context` tokens of the concatenated held-out test stream (so all
  contexts share that ending), and the first `context` tokens of --tau-files held-out files; `tau_summary` gives
  the mean and spread over them. A context that does not fit max_seq_len with the generation room is clipped to
  the largest that does, and both numbers are recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_target import forward_train_fast  # noqa: E402

from ssv_jax import checkpoint as ckpt  # noqa: E402
from ssv_jax import data as D  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PREFILL_CHUNK = 512


def held_out_tokens(tok, max_files: int | None = None) -> D.TokenizedSplit:
    """The test split, tokenized with the bundle's tokenizer (EOS after each file)."""
    return D.tokenize_split(tok, "test", max_files=max_files)


def perplexity(cfg, params, test: D.TokenizedSplit, seq_len: int, windows: int, progress: bool,
               buckets: int = 1) -> dict:
    """Token-level perplexity over `windows` (0 = all) evenly spaced non-overlapping windows of the test stream,
    and the mean loss in each of `buckets` equal spans of window positions (`loss_by_position`: shows whether the
    model holds up at positions it was or was not trained on)."""
    if not isinstance(buckets, int) or not 1 <= buckets <= seq_len - 1:
        raise ValueError(f"--position-buckets={buckets!r} is invalid; accepted: an integer in [1, {seq_len - 1}]")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len={seq_len} is invalid; accepted: <= max_seq_len={cfg.max_seq_len}")
    if len(test) < seq_len:
        raise ValueError(f"--seq-len={seq_len} exceeds the {len(test)} held-out tokens; accepted: a shorter one")
    starts, n_all = D.evenly_spaced_windows(test, seq_len, windows)
    n = len(starts)

    edges = np.linspace(0, seq_len - 1, buckets + 1).round().astype(int)  # over the seq_len - 1 scored positions

    @jax.jit
    def nll_sums(p, t):
        logits, _ = forward_train_fast(p, cfg, t)
        lp = jax.nn.log_softmax(logits[:, :-1], -1)
        nll = -jnp.take_along_axis(lp, t[:, 1:, None], -1)[0, :, 0]
        return jnp.stack([jnp.sum(nll[a:b]) for a, b in zip(edges[:-1], edges[1:])])

    sums = np.zeros(buckets)
    for s0 in tqdm(starts, desc="perplexity", disable=not progress):
        t = jnp.asarray(test.tokens[s0:s0 + seq_len].astype(np.int32))[None]
        sums += np.asarray(nll_sums(params, t), np.float64)
    count = n * (seq_len - 1)
    loss = float(sums.sum() / count)
    out = {"loss": loss, "perplexity": math.exp(loss), "windows": n, "windows_available": n_all,
           "seq_len": seq_len, "tokens_scored": count}
    if buckets > 1:
        out["loss_by_position"] = [{"positions": [int(a), int(b)], "loss": float(s / (n * (b - a)))}
                                   for a, b, s in zip(edges[:-1], edges[1:], sums)]
    return out


def policies():
    """The chain and the <= 32-node tree policies (exact precision, reference backend)."""
    from ssv_jax.policy import SSVPolicy

    return {"chain": SSVPolicy(top_k=1, depth=6, budget=7), "tree": SSVPolicy(top_k=4, depth=6, budget=32)}


def tau_prompts(tok, vocab_size: int, test: D.TokenizedSplit, ctx: int, files: int) -> list[tuple[str, np.ndarray]]:
    """The prompts of one context: the last `ctx` tokens of the held-out test stream (every context shares its
    ending), then `files` held-out prompts (`generate_cli.prompts`: the first `ctx` tokens of each file long enough,
    then packed windows of shorter files)."""
    from ssv_jax.generate_cli import prompts

    out = [("test stream tail", test.tokens[len(test) - ctx:].astype(np.int32))]
    return out + prompts(tok, vocab_size, ctx, files, fill=False)


def measure_tau(bundle, test: D.TokenizedSplit, contexts, temperatures, new_tokens: int, seed: int,
                progress: bool, files: int = 3, on_row=None) -> list[dict]:
    """tau for every (context, temperature, policy, prompt); see `tau_prompts`. `on_row(rows)` is called after
    each measurement (the script rewrites its JSON, so partial runs keep data)."""
    from ssv_jax.speculative import ssv_generate

    rows = []
    depth = max(p.depth for p in policies().values())
    # ssv_generate needs room for a padded prefill chunk, the new tokens and two trees past the prompt.
    fit = bundle.cfg.max_seq_len - PREFILL_CHUNK - new_tokens - 2 * (depth + 2)
    for requested in contexts:
        ctx = min(requested, fit, len(test))
        if ctx < 1:
            raise ValueError(f"--new-tokens={new_tokens} leaves no room for a prompt; accepted: fewer tokens")
        if ctx != requested:
            print(f"[eval] context {requested} clipped to {ctx} (max_seq_len {bundle.cfg.max_seq_len})", flush=True)
        for source, prompt in tau_prompts(bundle.tokenizer, bundle.cfg.vocab_size, test, ctx, files):
            for temp in temperatures:
                for name, pol in policies().items():
                    t0 = time.time()
                    res = ssv_generate(bundle, prompt, max_new_tokens=new_tokens, policy=pol, temperature=temp,
                                       seed=seed, progress=progress, prefill_chunk=PREFILL_CHUNK)
                    st = res.stats
                    rows.append({"context_requested": requested, "context": ctx, "prompt": source,
                                 "temperature": temp, "policy_name": name, "policy": st.get("policy"),
                                 "tau": st["tau"], "rounds": st["rounds"], "new_tokens": int(res.tokens.shape[1]),
                                 "tokens_per_s": st.get("tokens_per_s"), "wall_s": time.time() - t0})
                    print(f"[eval] ctx {ctx} {source} T={temp} {name}: tau {st['tau']:.3f} over {st['rounds']} "
                          "rounds", flush=True)
                    if on_row is not None:
                        on_row(rows)
    return rows


def tau_summary(rows: list[dict]) -> list[dict]:
    """Mean tau over the prompts of each (context, temperature, policy), with the per-prompt spread."""
    keys = sorted({(r["context"], r["temperature"], r["policy_name"]) for r in rows})
    out = []
    for ctx, temp, name in keys:
        taus = [r["tau"] for r in rows if (r["context"], r["temperature"], r["policy_name"]) == (ctx, temp, name)]
        out.append({"context": ctx, "temperature": temp, "policy_name": name, "prompts": len(taus),
                    "tau_mean": float(np.mean(taus)), "tau_min": float(min(taus)), "tau_max": float(max(taus))})
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=str(ROOT / "checkpoints" / "ssv-small"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "small_eval.json"))
    ap.add_argument("--seq-len", type=int, default=8192, help="perplexity window")
    ap.add_argument("--ppl-windows", type=int, default=4, help="perplexity windows (0 = the whole test split)")
    ap.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths for tau")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tau-files", type=int, default=3,
                    help="held-out files used as tau prompts, besides the test stream's tail")
    ap.add_argument("--position-buckets", type=int, default=1,
                    help="also report the loss in this many equal spans of window positions")
    ap.add_argument("--no-tau", action="store_true", help="perplexity only")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.ppl_windows < 0:
        raise ValueError(f"--ppl-windows={args.ppl_windows} is invalid; accepted: an integer >= 0 (0 = all)")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens={args.new_tokens} is invalid; accepted: an integer >= 1")
    progress = not args.no_progress
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    b = ckpt.load_bundle(args.bundle, dtype=dtype)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def write(d):
        out_path.write_text(json.dumps(d, indent=1))

    if b.tokenizer is None:
        raise ValueError(f"bundle {args.bundle!r} has no tokenizer; accepted: a bundle from train_target.py")
    test = held_out_tokens(b.tokenizer)
    t0 = time.time()
    try:
        bundle_name = str(Path(args.bundle).resolve().relative_to(ROOT))
    except ValueError:
        bundle_name = str(args.bundle)
    out = {"bundle": bundle_name, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "python": platform.python_version(), "dtype": args.dtype,
           "held_out": {"files": test.n_docs, "tokens": len(test)},
           "perplexity": perplexity(b.cfg, b.params, test, args.seq_len, args.ppl_windows, progress,
                                    args.position_buckets)}
    print(f"[eval] held-out perplexity {out['perplexity']['perplexity']:.3f} "
          f"({out['perplexity']['tokens_scored']} tokens)", flush=True)
    out["training"] = ckpt.read_bundle_meta(args.bundle).get("meta", {})
    for v in out["training"].values():
        if isinstance(v, dict):
            v.pop("history", None)
    write(out)
    if args.no_tau:
        out["tau"] = {"skipped": "--no-tau"}
    elif b.draft_params is None:
        out["tau"] = {"skipped": "the bundle has no draft head"}
    else:
        try:
            import ssv_jax.speculative  # noqa: F401
        except ImportError as e:
            out["tau"] = {"skipped": f"ssv_jax.speculative.ssv_generate is unavailable ({e})"}
        else:
            contexts = [int(c) for c in args.contexts.split(",") if c]
            temps = [float(t) for t in args.temperatures.split(",") if t]
            out["tau_settings"] = {"new_tokens": args.new_tokens, "seed": args.seed,
                                   "prompts": "the last <context> tokens of the held-out test stream, then the "
                                              f"first <context> tokens of {args.tau_files} held-out files"}
            out["tau"] = measure_tau(b, test, contexts, temps, args.new_tokens, args.seed, progress,
                                     files=args.tau_files, on_row=lambda rows: write(dict(out, tau=rows)))
            out["tau_summary"] = tau_summary(out["tau"])
    out["wall_s"] = time.time() - t0
    write(out)
    print(f"[eval] wrote {args.out}", flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
