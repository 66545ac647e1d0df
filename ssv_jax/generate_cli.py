"""Generate with Sparse Speculative Verification (the project's main job; `scripts/ssv_generate.py` and the
`ssv-generate` console entry run this).

    python scripts/ssv_generate.py                       # bundled ssv-small, a held-out stdlib prompt, CPU ok
    python scripts/ssv_generate.py --prompt "def fib(n):" --max-new-tokens 64
    python scripts/ssv_generate.py --prompt-file x.py --top-k 4 --depth 5 --budget 24 --order dfs
    python scripts/ssv_generate.py --random-preset tiny  # no checkpoint: random weights (token ids only)

Prints the completion, tokens/s, the mean acceptance length tau and the policy; `--compare-ar` also runs plain AR
NSA decoding under the policy's refresh/reuse schedule and checks that greedy outputs agree (or says where they
part, and why that is expected for mode B).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CKPT = os.path.join(REPO, "checkpoints", "ssv-small")


def build_parser() -> argparse.ArgumentParser:
    """The `ssv-generate` command line: model, prompt, generation and policy options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("model")
    src.add_argument("--checkpoint", default=None, help=f"bundle directory (default: {DEFAULT_CKPT} if present)")
    src.add_argument("--random-preset", default=None, help="no checkpoint: a randomly initialised preset "
                     "(tiny, small) with a random EAGLE-3 head; prints token ids")
    add_dtype_arg(src)
    src.add_argument("--draft-window", type=int, default=None,
                     help="the head's attention window when drafting (default: the head's own, DraftConfig.window; "
                          "0: none, attend to every committed slot)")
    p = ap.add_argument_group("prompt")
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="length of the default prompt drawn from held-out stdlib source (default 2048)")
    g = ap.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compare-ar", action="store_true", help="also run AR NSA decoding and compare")
    pol = ap.add_argument_group("policy (default: the planner's choice, or the default policy)")
    pol.add_argument("--top-k", type=int)
    pol.add_argument("--depth", type=int)
    pol.add_argument("--budget", type=int)
    pol.add_argument("--order", choices=["bfs", "dfs"])
    pol.add_argument("--mode", choices=["A", "B"])
    pol.add_argument("--group-size", type=int)
    pol.add_argument("--schedule", default=None, help="refresh period P or an R/U string")
    pol.add_argument("--precision", choices=["exact", "strict", "approx"])
    pol.add_argument("--backend", choices=["reference", "kernel", "naive", "dense"])
    return ap


DTYPES = ("auto", "float32", "bfloat16")


def add_dtype_arg(ap) -> None:
    """`--dtype` of the weights and caches: auto = bfloat16 on a GPU (the kernels' dots then run on tensor
    cores; fp32 kernel dots run at full precision on the CUDA cores), float32 elsewhere."""
    ap.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and caches: auto = bfloat16 on a GPU, float32 on the CPU (default auto)")


def policy_from_args(a):
    """An SSVPolicy from the flags given, or "auto" when none is."""
    from ssv_jax.policy import SSVPolicy

    fields = dict(top_k=a.top_k, depth=a.depth, budget=a.budget, order=a.order, mode=a.mode,
                  group_size=a.group_size, precision=a.precision, backend=a.backend)
    if a.schedule is not None:
        fields["schedule"] = int(a.schedule) if a.schedule.isdigit() else a.schedule
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields:
        return "auto"
    if "schedule" in fields and "precision" not in fields and not _refresh_only(fields["schedule"]):
        fields["precision"] = "strict"
    if fields.get("mode") == "B" and "precision" not in fields:
        fields["precision"] = "approx"
    return SSVPolicy(**fields)


def bench_policy(tree, period: int, backend: str = "kernel"):
    """The benchmarks' fixed policy: the (top_k, depth, budget) `tree` in dfs order, C=4, refresh period `period`
    (class "strict" when it reuses, P > 1, else "exact") on `backend`."""
    from ssv_jax.policy import SSVPolicy

    k, d, b = tree
    return SSVPolicy(top_k=k, depth=d, budget=b, order="dfs", group_size=4, backend=backend,
                     schedule=period if period > 1 else None, precision="strict" if period > 1 else "exact")


def _refresh_only(s) -> bool:
    return s == 1 or (isinstance(s, str) and set(s) == {"R"})


RANDOM_PROMPT = "random tokens"  # the source `prompts` names a prompt it had no held-out file for


def packed_name(files: list[str]) -> str:
    """The source name of a packed prompt: its files, joined by " + ", after "packed: "."""
    return "packed: " + " + ".join(files)


def prompt_files(source: str) -> list[str]:
    """The held-out files a prompt's source name covers (`packed_name`'s inverse; a whole file names itself)."""
    return source[len("packed: "):].split(" + ") if source.startswith("packed: ") else [source]


def prompts(tok, vocab_size: int, n_tokens: int, count: int, seed: int = 0,
            skip: int = 0, fill: bool = True, pack: bool = True) -> list[tuple[str, np.ndarray]]:
    """`count` prompts of `n_tokens` ids from held-out (test split) stdlib source when there is a tokenizer
    (skipping generated and private modules such as _sysconfigdata), else random ids. [(source, ids)].

    In order: each file long enough on its own (its first `n_tokens` ids); then, with `pack`, packed prompts:
    the shorter files in path order, each followed by the end-of-text id as in training (`data.PackedLoader`),
    cut into windows that each start at a file and hold `n_tokens` ids (a window's trailing remainder is
    dropped; source `packed_name(files)`). `skip`: pass over the first `skip` of that sequence (the planner's
    profile takes prompts disjoint from the benchmark's this way). When too few remain, the rest are random
    ids, and it says so; with `fill=False` the list holds only the held-out prompts found (possibly none)."""
    if skip < 0:
        raise ValueError(f"skip={skip} is invalid; accepted: an integer >= 0")
    out, to_skip = [], skip

    def take(source, ids) -> bool:  # True once `count` prompts are in
        nonlocal to_skip
        if to_skip:
            to_skip -= 1
        else:
            out.append((source, np.asarray(ids[:n_tokens], np.int32)))
        return len(out) == count

    if count <= 0:
        return out
    if tok is not None:
        from ssv_jax import data

        short = []  # (relpath, ids) of the files too short alone, for packing
        for rel, text in data.iter_documents("test"):
            if os.path.basename(rel).startswith("_"):
                continue
            ids = tok.encode(text)
            if len(ids) < n_tokens + 16:
                short.append((rel, ids))
            elif take(rel, ids):
                return out
        files, window = [], []
        for rel, ids in (short if pack else ()):
            files.append(rel)
            window += list(ids) + [tok.eos_id]
            if len(window) >= n_tokens:
                if take(packed_name(files), window):
                    return out
                files, window = [], []
    if not fill:
        return out
    if tok is not None and len(out) < count:
        print(f"only {len(out)} held-out prompts have {n_tokens} tokens (after skipping {skip}); the other "
              f"{count - len(out)} prompt(s) are random tokens")
    rng = np.random.default_rng(seed)
    while len(out) < count:
        out.append((RANDOM_PROMPT, rng.integers(0, vocab_size, n_tokens).astype(np.int32)))
    return out


def default_prompt(tok, n_tokens: int) -> tuple[str, str]:
    """A prompt of about `n_tokens` tokens from held-out stdlib source: (relpath, text)."""
    found = prompts(tok, tok.vocab_size, n_tokens, 1, fill=False, pack=False)
    if not found:
        raise ValueError(f"no held-out file has {n_tokens} tokens; accepted: a smaller --prompt-tokens")
    return found[0][0], tok.decode(found[0][1].tolist())


def load_model(a):
    """(SSVModel, tokenizer or None, description) from parsed flags: `checkpoint`, `random_preset`, `seed` and
    optionally `dtype` (`checkpoint.inference_dtype`, default "auto"; a bundle's weights are cast to it, a random
    preset is made in it)."""
    import jax
    import jax.numpy as jnp

    from ssv_jax import draft as dr
    from ssv_jax import model as M
    from ssv_jax.checkpoint import inference_dtype, load_bundle
    from ssv_jax.config import get_config
    from ssv_jax.speculative import SSVModel

    dt = inference_dtype(getattr(a, "dtype", None) or "auto")
    if a.random_preset:
        cfg = get_config(a.random_preset)
        dcfg = dr.DraftConfig.for_target(cfg)
        m = SSVModel(cfg, M.init_params(cfg, jax.random.key(a.seed), dtype=dt), dcfg,
                     dr.init_draft_params(dcfg, jax.random.key(a.seed + 1), dtype=dt))
        return m, None, f"random-initialised preset {a.random_preset!r} (not a trained model, {jnp.dtype(dt).name})"
    path = a.checkpoint or DEFAULT_CKPT
    if not os.path.isdir(path):
        if a.checkpoint:
            raise SystemExit(f"checkpoint {path!r} does not exist; accepted: a bundle directory, or "
                             "--random-preset tiny|small")
        print(f"note: no bundled checkpoint at {path}; using a randomly initialised 'small' preset with a random "
              "EAGLE-3 head (acceptance will be ~1 token per round)", flush=True)
        a.random_preset = "small"
        return load_model(a)
    b = load_bundle(path, dtype=dt)
    return (SSVModel(b.cfg, b.params, b.draft_cfg, b.draft_params), b.tokenizer,
            f"bundle {path} ({jnp.dtype(dt).name})")


def main(argv=None) -> int:
    """Run `ssv-generate` with `argv` (default: sys.argv); returns the exit status.

    A bad value (a flag out of range, a missing prompt file, a directory that is not a bundle) ends the run with
    one line naming it and the accepted range, and exit status 2, as argparse does for a malformed flag."""
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except (ValueError, OSError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")


def _run(a) -> int:
    from ssv_jax.generate import ar_generate
    from ssv_jax.speculative import ssv_generate

    policy = policy_from_args(a)
    m, tok, desc = load_model(a)
    if a.draft_window is not None:
        if a.draft_window < 0:
            raise SystemExit(f"--draft-window={a.draft_window} is invalid; accepted: 0 (none) or an integer >= 1")
        m = m._replace(draft_cfg=m.draft_cfg.replace(window=a.draft_window or None))
    if a.prompt is not None or a.prompt_file is not None:
        if tok is None:
            raise SystemExit("--prompt needs a checkpoint with a tokenizer; accepted: --checkpoint DIR")
        text = a.prompt if a.prompt is not None else open(a.prompt_file, encoding="utf-8").read()
        ids, where = tok.encode(text), "user prompt"
    elif tok is not None:
        where, text = default_prompt(tok, a.prompt_tokens)
        ids, where = tok.encode(text), f"held-out stdlib file {where}"
    else:
        n = min(a.prompt_tokens, m.cfg.max_seq_len - a.max_new_tokens - 1024)
        where, ids = prompts(None, m.cfg.vocab_size, n, 1, seed=a.seed)[0]
        ids = ids.tolist()
    print(f"model: {desc}\nprompt: {len(ids)} tokens ({where})", flush=True)
    res = ssv_generate(m, np.asarray(ids, np.int32), max_new_tokens=a.max_new_tokens, policy=policy,
                       temperature=a.temperature, seed=a.seed, progress=True)
    out = res.tokens[0].tolist()
    print("\n--- completion ---")
    print(tok.decode(out) if tok is not None else out)
    s = res.stats
    print("--- stats ---")
    print(f"policy: {s['policy']}")
    print(f"rounds: {s['rounds']}  tau (tokens per round): {s['tau']:.2f}  switches: {len(s['switches'])}")
    print(f"prefill: {s['prefill_s']:.2f}s  decode: {s['decode_s']:.2f}s  tokens/s: {s['tokens_per_s']:.1f} "
          "(first call includes compilation)")
    if a.compare_ar:
        # greedy SSV == greedy AR under the same schedule (DESIGN.md), so AR runs under the policy's schedule
        schedule = None if policy == "auto" else policy.schedule
        t = time.perf_counter()
        ar = ar_generate((m.cfg, m.params), np.asarray(ids, np.int32), a.max_new_tokens, a.temperature, a.seed,
                         schedule=schedule)
        where = ("" if schedule is None else f" (schedule P={schedule})" if isinstance(schedule, int)
                 else f" (schedule {schedule})")
        print(f"AR NSA{where}: {ar.stats['tokens_per_s']:.1f} tokens/s ({time.perf_counter() - t:.1f}s); "
              + compare_outputs(ar.tokens[0].tolist(), out, a.temperature,
                                approx=policy != "auto" and policy.precision == "approx",
                                dtype=str(m.params["embed"].dtype)))
    return 0


def compare_outputs(ar: list, ssv: list, temperature: float, *, approx: bool, dtype: str) -> str:
    """`--compare-ar`'s verdict: whether greedy SSV emitted greedy AR's tokens, and what a difference means
    (`approx`: the policy is in precision class "approx", mode B)."""
    if temperature > 0:
        return ("sampled outputs are not compared token by token (acceptance is lossless in distribution, and the "
                "two draw different random numbers)")
    n = min(len(ar), len(ssv))
    part = next((i for i in range(n) if ar[i] != ssv[i]), None if len(ar) == len(ssv) else n)
    if part is None:
        return "greedy outputs identical: True"
    why = ("expected: mode B (class approx) is an approximation" if approx else
           "unexpected in float32, where greedy SSV must equal greedy AR" if dtype == "float32" else
           f"possible in {dtype}, where the verify pass and the decode step round differently; exactness is "
           "specified in float32")
    return f"greedy outputs identical: False (they part at token {part}; {why})"


if __name__ == "__main__":
    sys.exit(main())
